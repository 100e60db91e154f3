"""The Prometheus rules file (charts/vivant/files/rules.yaml) under the real promtool (Debian `prometheus`).

What is checked:
- `promtool check rules` accepts the file;
- every promtool unit-test file next to this one passes (`promtool test rules`): each alert fires on
  synthetic series that breach it and stays silent on series that do not;
- every alert has such a firing case and a silent case in those files, `for`, a severity, a summary, a
  description and a runbook_url naming docs/runbooks/<alert>.md, which exists;
- the tests can fail: with a threshold of the rules nudged (14.4x -> 15x, 23.5 -> 23.4 fps, ...), promtool
  reports a failure;
- the SLO numbers in the rules agree with the worker's `SessionFpsObjective`.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from vivant.worker.serving.metrics import REFERENCE_OBJECTIVE

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "charts" / "vivant" / "files" / "rules.yaml"
HERE = Path(__file__).resolve().parent
TEST_FILES = sorted(HERE.glob("*_test.yaml"))
RUNBOOK_PREFIX = "https://github.com/vivant-dev/vivant/blob/main/docs/runbooks/"

PROMTOOL = shutil.which("promtool")
pytestmark = pytest.mark.skipif(PROMTOOL is None, reason="promtool missing: run `make sysdeps` (Debian prometheus)")


def promtool(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([PROMTOOL, *args], cwd=cwd, capture_output=True, text=True, timeout=120)


def rules_doc() -> dict:
    return yaml.safe_load(RULES.read_text())


def alerts() -> list[dict]:
    return [r for g in rules_doc()["groups"] for r in g["rules"] if "alert" in r]


def test_rules_file_passes_promtool_check():
    out = promtool("check", "rules", str(RULES))
    assert out.returncode == 0, f"promtool check rules failed:\n{out.stdout}\n{out.stderr}"


def test_there_are_promtool_unit_test_files():
    assert {p.name for p in TEST_FILES} >= {"slo_test.yaml", "latency_test.yaml", "capacity_test.yaml"}


@pytest.mark.parametrize("test_file", TEST_FILES, ids=lambda p: p.name)
def test_promtool_unit_tests_pass(test_file: Path):
    out = promtool("test", "rules", str(test_file))
    assert out.returncode == 0, f"promtool test rules {test_file.name} failed:\n{out.stdout}\n{out.stderr}"


def _alert_checks() -> list[tuple[dict, dict]]:
    """(test, alert_rule_test) pairs from every promtool test file."""
    pairs = []
    for path in TEST_FILES:
        for test in yaml.safe_load(path.read_text())["tests"]:
            pairs.extend((test, check) for check in test.get("alert_rule_test", []))
    return pairs


def _input_pools(test: dict) -> set[str]:
    return set(re.findall(r'pool="([^"]+)"', " ".join(s["series"] for s in test.get("input_series", []))))


@pytest.mark.parametrize("name", [a["alert"] for a in alerts()])
def test_each_alert_has_a_firing_and_a_silent_case(name: str):
    checks = [(t, c) for t, c in _alert_checks() if c["alertname"] == name]
    firing = [c for _, c in checks if c.get("exp_alerts")]
    # Silent: nothing expected at some time, or some pool in the input series is absent from what fires.
    silent = [
        c for t, c in checks
        if not c.get("exp_alerts")
        or _input_pools(t) - {a["exp_labels"].get("pool") for a in c["exp_alerts"]}
    ]
    assert firing, f"{name}: no promtool case where it fires (tests/alerts/*_test.yaml)"
    assert silent, f"{name}: no promtool case where it stays silent (tests/alerts/*_test.yaml)"


@pytest.mark.parametrize("alert", alerts(), ids=lambda a: a["alert"])
def test_alert_is_documented_and_routable(alert: dict):
    name = alert["alert"]
    assert alert.get("for"), f"{name}: missing `for`"
    assert alert.get("labels", {}).get("severity") in {"critical", "warning"}, (
        f"{name}: severity {alert.get('labels', {}).get('severity')!r}, expected critical or warning"
    )
    ann = alert.get("annotations", {})
    for key in ("summary", "description", "runbook_url"):
        assert ann.get(key), f"{name}: missing annotation {key}"
    assert ann["runbook_url"] == f"{RUNBOOK_PREFIX}{name}.md", f"{name}: runbook_url {ann['runbook_url']!r}"
    runbook = ROOT / "docs" / "runbooks" / f"{name}.md"
    assert runbook.is_file(), f"{name}: runbook {runbook.relative_to(ROOT)} does not exist"
    assert name in runbook.read_text(), f"{runbook.relative_to(ROOT)} does not name the alert {name}"


# Nudges of the rules' thresholds that the promtool tests must catch.
MUTATIONS = [
    ("> (14.4 * 0.005)", "> (15 * 0.005)"),
    ("> (6 * 0.005)", "> (6 * 0.0052)"),
    (">= bool 23.5", ">= bool 23.4"),
    ("streamed_seconds >= 1)", "streamed_seconds > 1)"),
    ("{stage=\"total\"} > 0.1667", "{stage=\"total\"} > 0.18"),
    ("p50_rate15m > 0.49", "p50_rate15m >= 0.49"),
    ('{state="idle"}) == 0', '{state="idle"}) <= 1'),
    ("absent(vivant_operator_build_info)", "absent(vivant_operator_build_info{version=\"x\"})"),
    ("count by (pool) (vivant_worker_build_info)", "count by (pool) (vivant_worker_build_info{pod=\"x\"})"),
    ("\n          and vivant:sessions_fps_missed:ratio_rate5m", "\n          or vivant:sessions_fps_missed:ratio_rate5m"),
    ("\n          and vivant:sessions_fps_missed:ratio_rate30m", "\n          or vivant:sessions_fps_missed:ratio_rate30m"),
    ('{handler=~"session_sweep|assign"} > 1', '{handler=~"session_sweep|assign"} > 1.25'),
    ('{handler=~"session_sweep|assign"} > 1', '{handler=~"session_sweep|assign|release"} > 1'),
    ("p99_rate10m > 2", "p99_rate10m > 2.5"),
    ('{state="idle"})[10m:1m]) > 0', '{state="idle"})[10m:1m]) >= 0'),
    ('{queue="waiting_for_worker"}) > 0', '{queue="waiting_for_worker"}) > 4'),
    ('and on (pool) sum by (pool) (vivant_operator_pool_workers{state="idle"}) > 0',
     'and on (pool) sum by (pool) (vivant_operator_pool_workers{state="idle"}) >= 0'),
    ("numerical_faults_total[15m])) > 0", "numerical_faults_total[15m])) > 5"),
    ("numerical_faults_total[15m])) > 0", "numerical_faults_total[15m])) >= 0"),
    ("numerical_faults_total[15m])) > 0", "numerical_faults_total[5m])) > 0"),
    ("worker_failures_total[30m])) > 2", "worker_failures_total[30m])) > 3"),
    ("dead_letters_total[15m])) > 0", "dead_letters_total[15m])) > 1"),
    ("dead_letters_total[15m])) > 0", "dead_letters_total[5m])) > 0"),
    ("worker_failures_total[30m])) > 2", "worker_failures_total[30m])) > 0"),
    ("worker_failures_total[30m])) > 2", "worker_failures_total[15m])) > 2"),
]


@pytest.mark.parametrize(("old", "new"), MUTATIONS, ids=[m[1].strip() for m in MUTATIONS])
def test_promtool_tests_catch_a_nudged_threshold(tmp_path: Path, old: str, new: str):
    text = RULES.read_text()
    assert text.count(old) >= 1, f"mutation anchor {old!r} not found in {RULES.name}: update MUTATIONS"
    mutated = tmp_path / "charts" / "vivant" / "files" / "rules.yaml"
    mutated.parent.mkdir(parents=True)
    mutated.write_text(text.replace(old, new))
    tests_dir = tmp_path / "tests" / "alerts"
    tests_dir.mkdir(parents=True)
    for path in TEST_FILES:
        shutil.copy(path, tests_dir / path.name)
    out = promtool("test", "rules", *sorted(p.name for p in tests_dir.glob("*.yaml")), cwd=tests_dir)
    assert out.returncode != 0, f"promtool tests still pass with {old!r} -> {new!r}: they do not pin that threshold"


def test_rules_use_the_worker_slo_numbers():
    text = RULES.read_text()
    fps = float(re.search(r">= bool ([0-9.]+)", text).group(1))
    min_seconds = float(re.search(r"streamed_seconds >= ([0-9.]+)\)", text).group(1))
    budgets = {float(b) for b in re.findall(r"\* ([0-9.]+)\)", text)}
    assert fps == REFERENCE_OBJECTIVE.min_fps, f"rules use {fps} fps, worker classifies at {REFERENCE_OBJECTIVE.min_fps}"
    assert min_seconds == REFERENCE_OBJECTIVE.min_streamed_seconds, (
        f"rules qualify at {min_seconds} s, worker at {REFERENCE_OBJECTIVE.min_streamed_seconds} s"
    )
    assert budgets == {round(1 - REFERENCE_OBJECTIVE.objective, 6)}, (
        f"burn-rate budgets {budgets} differ from 1 - objective = {1 - REFERENCE_OBJECTIVE.objective}"
    )
