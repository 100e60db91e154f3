"""The fleet benchmark's section of docs/BENCHMARKS.md, from its result JSONs (bench/results/fleet_*.json):
one side-by-side table of the run before and after the scaling changes, the failover run's figures, and
which goals were met. `bench/benchmarks_md.py` prints it; every number is one of those files' numbers."""

from __future__ import annotations

from typing import Any

# the goals at 1,000 sessions (docs/ARCHITECTURE.md, "The control plane at fleet scale")
GOAL_ASSIGNED_P99_S = 2.0
GOAL_STREAMING_P99_S = 5.0
GOAL_CPU_CORES = 0.5
GOAL_RSS_MIB = 500.0


def _pct(d: dict[str, Any] | None) -> str:
    """'p50 / p99 / max' in seconds, or — when nothing was observed."""
    return "—" if not d else f"{d['p50']:.1f} / {d['p99']:.1f} / {d['max']:.1f}"


def _num(v: float | None, fmt: str = ".3g") -> str:
    return "—" if v is None else format(v, fmt)


def _load(res: dict[str, Any], phase: str | None = None) -> str:
    ld = res["phases"][phase]["load"] if phase else res["machine"]["load_during_run"]
    return "—" if not ld else f"{ld['mean_1m']:.1f} (min {ld['min_1m']:.1f}, max {ld['max_1m']:.1f})"


def _row(name: str, before: str, after: str) -> str:
    return f"| {name} | {before} | {after} |"


def comparison_rows(b: dict[str, Any], a: dict[str, Any]) -> list[str]:
    """The table's rows, each 'what | before | after'."""
    def lat(res: dict[str, Any], wave: str, key: str) -> str:
        return _pct(res["latency"].get(wave, {}).get(key))

    def ph(res: dict[str, Any], phase: str, key: str, fmt: str = ".3g") -> str:
        return _num(res["phases"][phase].get(key), fmt)

    def ok(res: dict[str, Any]) -> str:
        c = res["correctness"]
        return f"{c['double_assignments']} / {c['leaked_leases']} / {c['sessions_failed']}"

    rows = [
        _row("operator commit (source sha256)", *(f"`{r['versions']['git_commit']}` "
                                                    f"({r['versions'].get('operator_source_sha256', '—')})"
                                                    for r in (b, a))),
        _row("date (UTC)", b["date"], a["date"]),
        _row("operator replicas", str(b["config"].get("operators", 1)), str(a["config"].get("operators", 1))),
        _row("load average (1 min) during the run, mean", _load(b), _load(a)),
        _row("sessions in the burst (created / through the session API)",
             *(f"{r['latency']['burst']['sessions']} / {(r['latency']['burst']['by_path']['api'] or {}).get('n', 0)}"
               for r in (b, a))),
        _row("burst: apply → Assigned p50 / p99 / max (s)", lat(b, "burst", "apply_to_assigned_s"),
             lat(a, "burst", "apply_to_assigned_s")),
        _row("burst: apply → Streaming p50 / p99 / max (s)", lat(b, "burst", "apply_to_streaming_s"),
             lat(a, "burst", "apply_to_streaming_s")),
        _row("burst: worker reports Streaming → on the object p50 / p99 / max (s)",
             lat(b, "burst", "worker_streaming_to_visible_s"), lat(a, "burst", "worker_streaming_to_visible_s")),
        _row("churn: sessions created during the hold", *(str(r["latency"].get("churn", {}).get("sessions", 0))
                                                           for r in (b, a))),
        _row("churn: apply → Assigned p50 / p99 / max (s)", lat(b, "churn", "apply_to_assigned_s"),
             lat(a, "churn", "apply_to_assigned_s")),
        _row("churn: apply → Streaming p50 / p99 / max (s)", lat(b, "churn", "apply_to_streaming_s"),
             lat(a, "churn", "apply_to_streaming_s")),
        _row("delete → object gone p50 / p99 / max (s)", _pct(b["latency"]["delete_to_gone_s"]),
             _pct(a["latency"]["delete_to_gone_s"])),
        _row("burst phase: seconds until every session streamed", ph(b, "burst", "seconds", ".0f"),
             ph(a, "burst", "seconds", ".0f")),
    ]
    for phase in ("burst", "hold", "delete"):
        rows += [
            _row(f"{phase}: operator CPU (cores)", ph(b, phase, "operator_cpu_cores"),
                 ph(a, phase, "operator_cpu_cores")),
            _row(f"{phase}: operator CPU s per session-minute", ph(b, phase, "operator_cpu_s_per_session_minute"),
                 ph(a, phase, "operator_cpu_s_per_session_minute")),
            _row(f"{phase}: operator API requests/s (API server's count)", ph(b, phase, "operator_api_requests_per_s"),
                 ph(a, phase, "operator_api_requests_per_s")),
            _row(f"{phase}: Redis commands/s sent by the operator", ph(b, phase, "redis_commands_per_s_operator"),
                 ph(a, phase, "redis_commands_per_s_operator")),
            _row(f"{phase}: operator log lines/s", ph(b, phase, "operator_log_lines_per_s"),
                 ph(a, phase, "operator_log_lines_per_s")),
        ]
    rows += [
        _row("hold: load average (1 min), mean", _load(b, "hold"), _load(a, "hold")),
        _row("operator peak RSS (MiB)", str(b["operator"]["peak_rss_mib"]), str(a["operator"]["peak_rss_mib"])),
        _row("double assignments / leaked leases / sessions failed", ok(b), ok(a)),
        _row("session API requests that failed (driver errors)", str(b["correctness"]["driver_errors"]),
             str(a["correctness"]["driver_errors"])),
    ]
    return rows


def goals(a: dict[str, Any]) -> list[str]:
    """Each goal of the issue with the 'after' figure and met / missed."""
    burst = a["latency"]["burst"]
    hold = a["phases"]["hold"]
    c = a["correctness"]

    def verdict(ok: bool) -> str:
        return "**met**" if ok else "**missed**"

    asg, stm = burst["apply_to_assigned_s"]["p99"], burst["apply_to_streaming_s"]["p99"]
    return [
        f"- p99 apply → Assigned ≤ {GOAL_ASSIGNED_P99_S:g} s: {asg:.1f} s, {verdict(asg <= GOAL_ASSIGNED_P99_S)}",
        f"- p99 apply → Streaming ≤ {GOAL_STREAMING_P99_S:g} s: {stm:.1f} s, {verdict(stm <= GOAL_STREAMING_P99_S)}",
        f"- operator ≤ {GOAL_CPU_CORES:g} core at steady state (the hold): {hold['operator_cpu_cores']:.2f}, "
        f"{verdict(hold['operator_cpu_cores'] <= GOAL_CPU_CORES)}",
        f"- operator ≤ {GOAL_RSS_MIB:g} MiB: peak {a['operator']['peak_rss_mib']:.0f} MiB, "
        f"{verdict(a['operator']['peak_rss_mib'] <= GOAL_RSS_MIB)}",
        f"- 0 double assignments, 0 leaked leases: {c['double_assignments']} / {c['leaked_leases']}, "
        f"{verdict(c['double_assignments'] == 0 and c['leaked_leases'] == 0)}",
    ]


def failover_rows(f: dict[str, Any]) -> list[str]:
    """The failover run: sessions created while the standby took over, and the invariants."""
    fo, c = f["failover"], f["correctness"]
    return [
        "| | |",
        "|---|---|",
        f"| replicas, peering lifetime | {f['config']['operators']}, {f['config']['peering_lifetime_s']} s |",
        f"| active replica SIGKILLed | {f['config']['kill_active_at_s']:.0f} s into the hold |",
        f"| sessions created after the kill | {fo['created_after_kill']} |",
        f"| … apply → Assigned p50 / p99 / max (s) | {_pct(fo['after_kill_apply_to_assigned_s'])} |",
        f"| … apply → Streaming p50 / p99 / max (s) | {_pct(fo['after_kill_apply_to_streaming_s'])} |",
        f"| sessions in flight at the kill (not yet streaming) / of them streamed | {fo['in_flight_at_kill']} / "
        f"{fo['in_flight_streamed']} |",
        f"| sessions failed / never streamed | {fo['failed']} / {fo['never_streamed']} |",
        f"| double assignments / leaked leases (whole run) | {c['double_assignments']} / {c['leaked_leases']} |",
        f"| load average (1 min) during the run, mean | {_load(f)} |",
    ]


def section(before: dict[str, Any], after: dict[str, Any], failover: dict[str, Any] | None,
            files: tuple[str, str, str | None], notes: str) -> str:
    """The whole markdown section. `files` names the three JSONs under bench/results/; `notes` is the
    measured explanation (profile, load) written beside the figures."""
    v = after["versions"]
    out = [
        "## The control plane at fleet scale: 1,000 sessions (CPU, local cluster)",
        "",
        "```",
        before["command"],
        after["command"],
    ]
    if failover is not None:
        out.append(failover["command"])
    out += [
        "```",
        "",
        f"Machine: {after['machine']['cpus']} CPU cores ({after['machine']['platform']}), **shared** with other "
        f"jobs (tests and builds of other branches ran beside every run: the load average is in the table; "
        f"the benchmark itself runs at niceness {after['machine']['niceness']}). Real etcd, kube-apiserver "
        f"{v['kube_apiserver']}, controller-manager and scheduler; {after['setup']['nodes']} kwok H200 nodes × "
        f"{after['config']['gpus_per_node']} GPUs; {after['config']['pools']} WorkerPools of "
        f"{after['setup']['workers'] // after['config']['pools']} simulated workers (5 GPUs each) that speak the "
        f"registry's protocol in Redis {v['redis']}; the chart's operator and session API as host processes under "
        f"their ServiceAccounts. Python {v['python']}, kopf {v['kopf']}, kubernetes client "
        f"{v['kubernetes_client']}, redis-py {v['redis_py']}. The run: {after['config']['sessions']} sessions in "
        f"bursts of {after['config']['burst']} every {after['config']['burst_gap_s']:g} s "
        f"({after['config']['api_share']:.0%} through the session API), held {after['config']['hold_s']:.0f} s "
        f"with {after['config']['churn']:.0%} a minute ended and replaced, then all deleted. JSON: "
        + ", ".join(f"`bench/results/{x}`" for x in files if x) + ".",
        "",
        "| | before (one 1 s timer per session) | after (one sweep per pool, status queue) |",
        "|---|---|---|",
        *comparison_rows(before, after),
        "",
        "Goals at 1,000 sessions (after):",
        "",
        *goals(after),
        "",
    ]
    if failover is not None:
        out += ["### Failover: two operator replicas, the active one killed mid-churn", "",
                *failover_rows(failover), ""]
    out += [notes.strip(), ""]
    return "\n".join(out)
