"""`vivant bench fleet` end to end at a small size: its own local cluster (no pod runner), the chart's
operator (two replicas with kopf peering) and session API as host processes, simulated workers, 30
sessions burst, churned and deleted, and the active operator killed mid-churn. (The 1,000-session run is
`vivant bench fleet`, never part of `make test`.)

Checks the benchmark measures what it says (every session timed, the operator's CPU, API requests and
Redis commands counted) and that the control plane kept its invariants through the failover: no
session on two workers, no lease left in Redis, no session lost. Speed is not asserted here (figures live in bench/results/).
"""

from __future__ import annotations

import json
import sys

from vivant.bench.fleet import report
from vivant.bench.fleet.run import FleetBenchConfig, run_bench


def test_fleet_bench_small_run_with_a_failover_keeps_the_invariants(tmp_path) -> None:
    cfg = FleetBenchConfig(sessions=30, pools=2, burst=15, burst_gap_s=0.5, hold_s=12, churn=1.0, churn_tick_s=3,
                           api_share=0.1, warmup_s=0.2, converge_timeout_s=120, delete_timeout_s=120,
                           operators=2, kill_active_at_s=2, peering_lifetime_s=5, label="smoke")
    res = run_bench(cfg, tmp_path, log=lambda m: print(m, file=sys.stderr, flush=True))
    json.dumps(res)  # the result is plain JSON

    lat, ok, hold = res["latency"], res["correctness"], res["phases"]["hold"]
    assert lat["burst"]["sessions"] == 30
    assert lat["burst"]["apply_to_streaming_s"]["n"] == 30 and lat["burst"]["never_streamed"] == 0
    assert lat["burst"]["by_path"]["api"]["n"] == 3  # every tenth through the session API
    assert lat["churn"]["sessions"] >= 5 and lat["churn"]["never_streamed"] == 0
    assert lat["delete_to_gone_s"]["n"] == 30 + lat["churn"]["sessions"] and lat["not_gone"] == 0
    assert lat["burst"]["worker_streaming_to_visible_s"]["n"] == 30

    assert ok["double_assignments"] == 0, ok["sessions_on_two_workers"] + ok["sessions_whose_worker_changed"]
    assert ok["leaked_leases"] == 0, ok["leaks"]
    assert ok["sessions_failed"] == 0, ok["failed_examples"]
    assert ok["repeated_assignments"] == 0, ok["sessions_on_two_workers"]  # no session handed out twice
    assert res["operator"]["create_handler_runs_per_session"] >= 1.0, res["operator"]["event_handler_runs"]
    assert ok["driver_errors"] == 0, ok["driver_error_examples"]

    assert hold["operator_cpu_s"] > 0 and res["operator"]["peak_rss_mib"] > 0
    assert hold["operator_api_requests_per_s"] > 0  # counted by the API server's FlowSchema
    assert hold["redis_commands_per_s_operator"] > 0 and hold["redis_commands_per_s_sim_workers"] > 0
    assert res["machine"]["load_during_run"] is not None
    assert hold["machine_busy_cores"] > 0 and hold["cores_by_process"].get("kube-apiserver", 0) > 0
    assert res["phases"]["burst"]["cores_by_process"].get("operator-0", 0) > 0  # the active replica worked

    # two replicas with kopf peering; the active one was SIGKILLed 2 s into the hold: the standby took
    # over, and no session was lost or assigned twice
    fo = res["failover"]
    assert fo["created_after_kill"] >= 4 and fo["never_streamed"] == 0 and fo["failed"] == 0, fo
    assert fo["after_kill_apply_to_assigned_s"]["n"] == fo["created_after_kill"]
    assert res["operator"]["peering"]["operator-1"]["resumes"] >= 1  # the standby took over
    assert "apply -> Streaming" in report.table(res)
