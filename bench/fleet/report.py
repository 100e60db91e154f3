"""The fleet benchmark's result: latency distributions from the session records, the phases' rates,
the correctness counts (double assignments, leaked leases, sessions lost), and a short table."""

from __future__ import annotations

from typing import Any

import numpy as np
from vivant.bench.fleet.driver import SessionRecord

ASSIGNED_OR_LATER = ("Assigned", "Connecting", "Streaming")


def dist(values: list[float]) -> dict[str, float | int] | None:
    """n, p50, p99, max (seconds) of what was observed; None when nothing was."""
    if not values:
        return None
    a = np.asarray(values, dtype=float)
    return {"n": int(a.size), "p50": round(float(np.percentile(a, 50)), 3),
            "p99": round(float(np.percentile(a, 99)), 3), "max": round(float(a.max()), 3)}


def _assigned(rec: SessionRecord) -> float | None:
    seen = [rec.phases[p] for p in ASSIGNED_OR_LATER if p in rec.phases]
    return min(seen) - rec.sent_at if seen else None


def latencies(records: list[SessionRecord], streaming_at: dict[str, float], namespace: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for wave in ("burst", "churn"):
        recs = [x for x in records if x.wave == wave]
        if not recs:
            continue
        visible = [x.phases["Streaming"] - streaming_at[f"{namespace}/{x.name}"] for x in recs
                   if "Streaming" in x.phases and f"{namespace}/{x.name}" in streaming_at]
        out[wave] = {
            "sessions": len(recs),
            "apply_to_assigned_s": dist([v for x in recs if (v := _assigned(x)) is not None]),
            "apply_to_streaming_s": dist([v for x in recs if (v := x.after("Streaming")) is not None]),
            "worker_streaming_to_visible_s": dist(visible),
            "never_streamed": sum(1 for x in recs if "Streaming" not in x.phases),
            "by_path": {via: dist([v for x in recs if x.via == via and (v := x.after("Streaming")) is not None])
                        for via in ("kube", "api")},
        }
    ended = [x for x in records if x.delete_sent_at is not None]
    out["delete_to_gone_s"] = dist([x.gone_at - x.delete_sent_at for x in ended if x.gone_at is not None])
    out["not_gone"] = sum(1 for x in ended if x.gone_at is None)
    return out


def build(*, cfg: dict[str, Any], records: list[SessionRecord], fleet: dict[str, Any], phases: dict[str, Any],
          leaks: dict[str, Any], errors: list[str], namespace: str) -> dict[str, Any]:
    moved = [{"session": x.name, "workers": x.workers} for x in records if len(set(x.workers)) > 1]
    failed = [x for x in records if "Failed" in x.phases]
    counters = fleet.get("counters", {})
    return {
        "config": cfg,
        "latency": latencies(records, fleet.get("streaming_at", {}), namespace),
        "phases": phases,
        "correctness": {
            "double_assignments": int(counters.get("double_assignments", 0)) + len(moved),
            "sessions_on_two_workers": fleet.get("double_assignments", []),
            "sessions_whose_worker_changed": moved,
            "assignments_dropped_busy_worker": int(counters.get("assignments_while_busy", 0)),
            # the operator sent a session's assignment again to the worker streaming it (must be 0)
            "repeated_assignments": int(counters.get("repeated_assignments", 0)),
            "leaked_leases": int(leaks["busy_leases"]) + int(leaks["session_worker_entries"]),
            "leaks": leaks,
            "sessions_failed": len(failed),
            "failed_examples": [{"session": x.name, "reason": x.failed_reason} for x in failed[:10]],
            "driver_errors": len(errors),
            "driver_error_examples": errors[:10],
        },
        "sim_workers": {k: fleet.get(k) for k in ("workers", "states", "counters", "registry_calls")},
    }


def _d(x: dict[str, Any] | None, key: str) -> str:
    return "—" if not x else f"{x[key]:.2f}"


def table(res: dict[str, Any]) -> str:
    lat, ph, ok = res["latency"], res["phases"], res["correctness"]
    rows = [f"fleet benchmark '{res['label']}': {res['config']['sessions']} sessions, "
            f"{res['setup']['workers']} simulated workers on {res['setup']['nodes']} kwok nodes "
            f"(load avg 1m during the run: {res['machine']['load_during_run']})",
            f"{'':44s} {'p50':>8s} {'p99':>8s} {'max':>8s}"]
    for wave in ("burst", "churn"):
        if wave not in lat:
            continue
        for key, name in (("apply_to_assigned_s", "apply -> Assigned"), ("apply_to_streaming_s", "apply -> Streaming"),
                          ("worker_streaming_to_visible_s", "worker reports Streaming -> on the CR")):
            d = lat[wave][key]
            rows.append(f"{wave + ': ' + name + ' (s)':44s} {_d(d, 'p50'):>8s} {_d(d, 'p99'):>8s} {_d(d, 'max'):>8s}")
    d = lat["delete_to_gone_s"]
    rows.append(f"{'delete -> object gone (s)':44s} {_d(d, 'p50'):>8s} {_d(d, 'p99'):>8s} {_d(d, 'max'):>8s}")
    rows.append(f"{'':44s} {'burst':>8s} {'hold':>8s} {'delete':>8s}")
    for key, name in (("operator_cpu_cores", "operator CPU (cores)"),
                      ("operator_cpu_s_per_session_minute", "operator CPU s per session-minute"),
                      ("operator_api_requests_per_s", "operator API requests/s"),
                      ("redis_commands_per_s_operator", "Redis commands/s sent by the operator"),
                      ("redis_commands_per_s_all", "Redis commands/s (all, incl. Lua-internal)"),
                      ("operator_log_lines_per_s", "operator log lines/s")):
        vals = [ph[p].get(key) for p in ("burst", "hold", "delete")]
        rows.append(f"{name:44s} " + " ".join(f"{'—' if v is None else f'{v:.3g}':>8s}" for v in vals))
    rows.append(f"create handler runs per session {res['operator'].get('create_handler_runs_per_session', '—')}; "
                f"assignments repeated to the worker streaming them {ok.get('repeated_assignments', '—')}")
    rows.append(f"operator peak RSS {res['operator']['peak_rss_mib']} MiB; double assignments "
                f"{ok['double_assignments']}; leaked leases {ok['leaked_leases']}; sessions failed "
                f"{ok['sessions_failed']}; assignments dropped by a busy worker {ok['assignments_dropped_busy_worker']}")
    if "failover" in res:
        f = res["failover"]
        rows.append(f"failover: {f['created_after_kill']} sessions created after the active operator was killed, "
                    f"apply -> Assigned max {_d(f['after_kill_apply_to_assigned_s'], 'max')} s; failed "
                    f"{f['failed']}, never streamed {f['never_streamed']}")
    return "\n".join(rows)


def failover(records: list[SessionRecord], killed_at: float) -> dict[str, Any]:
    """What the sessions saw of the active operator's death at `killed_at` (wall clock): those created
    after it wait for the standby to take over; none may fail, none may be assigned twice."""
    after = [x for x in records if x.sent_at >= killed_at]
    around = [x for x in records if x.sent_at < killed_at and (x.after("Streaming") is None
                                                               or x.phases["Streaming"] >= killed_at)]
    return {
        "killed_at": killed_at,
        "created_after_kill": len(after),
        "after_kill_apply_to_assigned_s": dist([v for x in after if (v := _assigned(x)) is not None]),
        "after_kill_apply_to_streaming_s": dist([v for x in after if (v := x.after("Streaming")) is not None]),
        "in_flight_at_kill": len(around),
        "in_flight_streamed": sum(1 for x in around if "Streaming" in x.phases),
        "failed": sum(1 for x in after + around if "Failed" in x.phases),
        "never_streamed": sum(1 for x in after if "Streaming" not in x.phases),
    }
