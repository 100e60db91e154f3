"""The fleet benchmark's section of docs/BENCHMARKS.md, from its result JSONs (bench/results/fleet_*.json):
one side-by-side table of the runs (before the scaling changes, then after), the failover figures of the
last run, and which goals it met. `bench/benchmarks_md.py` prints it; every number is one of those files'."""

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


def _row(name: str, *cells: str) -> str:
    return f"| {name} | {' | '.join(cells)} |"


def comparison_rows(*runs: dict[str, Any]) -> list[str]:
    """The table's rows, each 'what | run 1 | run 2 | ...'."""
    def lat(res: dict[str, Any], wave: str, key: str) -> str:
        return _pct(res["latency"].get(wave, {}).get(key))

    def ph(res: dict[str, Any], phase: str, key: str, fmt: str = ".3g") -> str:
        return _num(res["phases"][phase].get(key), fmt)

    def ok(res: dict[str, Any]) -> str:
        c = res["correctness"]
        return f"{c['double_assignments']} / {c['leaked_leases']} / {c['sessions_failed']}"

    def each(fn: Any) -> list[str]:
        return [fn(r) for r in runs]

    rows = [
        _row("operator commit (source sha256)", *each(lambda r: f"`{r['versions']['git_commit']}` "
                                                                f"({r['versions'].get('operator_source_sha256', '—')})")),
        _row("date (UTC)", *each(lambda r: r["date"])),
        _row("operator replicas", *each(lambda r: str(r["config"].get("operators", 1))
                                        + (f", the active one killed {r['config']['kill_active_at_s']:.0f} s into the hold"
                                           if r["config"].get("kill_active_at_s") is not None else ""))),
        _row("load average (1 min) when the benchmark started, after its cluster was up",
             *each(lambda r: f"{r['machine']['load_samples'][0][1]:.1f}" if r["machine"].get("load_samples") else "—")),
        _row("load average (1 min) during the run, mean", *each(_load)),
        _row("sessions in the burst (created / through the session API)",
             *each(lambda r: f"{r['latency']['burst']['sessions']} / "
                             f"{(r['latency']['burst']['by_path']['api'] or {}).get('n', 0)}")),
        _row("burst: apply → Assigned p50 / p99 / max (s)", *each(lambda r: lat(r, "burst", "apply_to_assigned_s"))),
        _row("burst: apply → Streaming p50 / p99 / max (s)", *each(lambda r: lat(r, "burst", "apply_to_streaming_s"))),
        _row("burst: worker reports Streaming → on the object p50 / p99 / max (s)",
             *each(lambda r: lat(r, "burst", "worker_streaming_to_visible_s"))),
        _row("churn: sessions created during the hold", *each(lambda r: str(r["latency"].get("churn", {}).get("sessions", 0)))),
        _row("churn: apply → Assigned p50 / p99 / max (s)", *each(lambda r: lat(r, "churn", "apply_to_assigned_s"))),
        _row("churn: apply → Streaming p50 / p99 / max (s)", *each(lambda r: lat(r, "churn", "apply_to_streaming_s"))),
        _row("delete → object gone p50 / p99 / max (s)", *each(lambda r: _pct(r["latency"]["delete_to_gone_s"]))),
        _row("burst phase: seconds until every session streamed", *each(lambda r: ph(r, "burst", "seconds", ".0f"))),
    ]
    for phase in ("burst", "hold", "delete"):
        for key, name in (("operator_cpu_cores", "operator CPU (cores)"),
                          ("operator_cpu_s_per_session_minute", "operator CPU s per session-minute"),
                          ("operator_api_requests_per_s", "operator API requests/s (API server's count)"),
                          ("redis_commands_per_s_operator", "Redis commands/s sent by the operator"),
                          ("operator_log_lines_per_s", "operator log lines/s")):
            rows.append(_row(f"{phase}: {name}", *each(lambda r, k=key, p=phase: ph(r, p, k))))
    rows += [
        _row("hold: load average (1 min), mean", *each(lambda r: _load(r, "hold"))),
        _row("operator peak RSS (MiB)", *each(lambda r: str(r["operator"]["peak_rss_mib"]))),
        _row("double assignments / leaked leases / sessions failed", *each(ok)),
        _row("session API requests that failed (driver errors)", *each(lambda r: str(r["correctness"]["driver_errors"]))),
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


def section(runs: list[tuple[str, str, dict[str, Any]]], notes: str) -> str:
    """The whole markdown section. `runs`: (column title, JSON file under bench/results/, result), the
    before run first and the final run last (its goals and, if it has one, its failover are shown);
    `notes` is the measured explanation (profile, load) written beside the figures."""
    after = runs[-1][2]
    failover = after if "failover" in after else None
    v = after["versions"]
    out = [
        "## The control plane at fleet scale: 1,000 sessions (CPU, local cluster)",
        "",
        "```",
        *(r["command"] for _, _, r in runs),
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
        + ", ".join(f"`bench/results/{f}`" for _, f, _ in runs) + ".",
        "",
        "| | " + " | ".join(title for title, _, _ in runs) + " |",
        "|---" * (len(runs) + 1) + "|",
        *comparison_rows(*(r for _, _, r in runs)),
        "",
        "Goals at 1,000 sessions (the last column's run):",
        "",
        *goals(after),
        "",
    ]
    if failover is not None:
        out += [f"### Failover: {failover['config']['operators']} operator replicas, the active one killed mid-churn "
                "(the last column's run)", "",
                *failover_rows(failover), ""]
    out += [notes.strip(), ""]
    return "\n".join(out)
