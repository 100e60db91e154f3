"""docs/BENCHMARKS.md's fleet section is built from the result JSONs: every row shows both runs, and each
goal says met or missed from the 'after' figures (not a fixed verdict)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

from vivant.bench.fleet import doc_section

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"


def one_replica() -> dict:
    return json.loads((RESULTS / "fleet_1000.json").read_text())


def test_every_row_shows_both_runs() -> None:
    b = one_replica()
    a = copy.deepcopy(b)
    a["versions"]["git_commit"] = "abc1234"
    a["phases"]["hold"]["operator_cpu_cores"] = 0.123
    rows = doc_section.comparison_rows(b, a, a)
    assert all(r.count(" | ") == 3 for r in rows)
    assert any("`c02f3be`" in r and "`abc1234`" in r for r in rows)
    assert "| hold: operator CPU (cores) | 0.17 | 0.123 | 0.123 |" in rows


def test_goals_follow_the_figures() -> None:
    a = one_replica()
    missed = doc_section.goals(a)
    assert sum("**missed**" in g for g in missed) == 2  # the run's p99 latencies on 2 shared cores (about a minute)
    a["latency"]["burst"]["apply_to_assigned_s"]["p99"] = 1.9
    a["latency"]["burst"]["apply_to_streaming_s"]["p99"] = 4.9
    a["correctness"]["leaked_leases"] = 1
    goals = doc_section.goals(a)
    assert "**met**" in goals[0] and "**met**" in goals[1]
    assert "**missed**" in goals[4]  # one leaked lease misses the correctness goal


def test_section_names_its_files_and_the_failover_run() -> None:
    b = one_replica()
    f = copy.deepcopy(b)
    f["config"].update(operators=2, peering_lifetime_s=15, kill_active_at_s=60.0)
    f["failover"] = {"killed_at": 0.0, "created_after_kill": 60, "after_kill_apply_to_assigned_s": None,
                     "after_kill_apply_to_streaming_s": None, "in_flight_at_kill": 3, "in_flight_streamed": 3,
                     "failed": 0, "never_streamed": 0}
    text = doc_section.section([("before", "fleet_1000.json", b), ("after", "f.json", f)], "why")
    assert "`bench/results/f.json`" in text and "| sessions created after the kill | 60 |" in text
    assert "| | before | after |" in text and "2, the active one killed 60 s into the hold" in text
    assert text.rstrip().endswith("why")
    assert "### Failover" not in doc_section.section([("before", "x.json", b)], "")  # no kill, no failover part
