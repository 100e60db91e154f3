"""The control plane at fleet scale (CPU, `vivant bench fleet`): the table and goals come from
bench/fleet/doc_section.py; this module adds the notes that read those runs (where the time goes, the fixed cost at
20 sessions). It tells how large a fleet one operator serves and what limits it."""

from __future__ import annotations

from vivant.bench.benchmarks_doc.results import day, load
from vivant.bench.fleet.doc_section import section as fleet_section

FLEET_FILES = ("fleet_1000.json", "fleet_1000_failover.json")
FLEET_COLUMNS = ("one replica", "two replicas, the active one killed")
SMALL = "fleet_20.json"


def suite_rows() -> list[tuple[str, str, str, str, str]]:
    """(benchmark, command, result file, its headline figure, date) for the page's table of the suite."""
    rows = []
    for name in (*FLEET_FILES, SMALL):
        d = load(name)
        burst, hold = d["latency"]["burst"], d["phases"]["hold"]
        kill = ", the active of 2 replicas killed" if d["config"].get("kill_active_at_s") is not None else ""
        rows.append((f"the control plane, {d['config']['sessions']:,} sessions{kill} (2 CPU cores)", d["command"], name,
                     f"apply → Streaming p99 {burst['apply_to_streaming_s']['p99']:.1f} s; operator "
                     f"{hold['operator_cpu_cores']:.2f} core, {d['operator']['peak_rss_mib']:.0f} MiB", day(d)))
    return rows


def section() -> str:
    runs = [load(x) for x in FLEET_FILES]
    one, final = runs
    small = load(SMALL)
    burst = final["phases"]["burst"]
    cores = burst["cores_by_process"]
    bench_cores = sum(v for v in cores.values() if v > 0)
    requests = burst["operator_api_requests_per_s"] * burst["seconds"] / final["latency"]["burst"]["sessions"]
    notes = f"""**Where the time goes.** The machine was saturated: in the failover run's burst
{burst['machine_busy_cores']:.1f} of 2 cores were busy, {bench_cores:.2f} of them the benchmark's own processes
(kube-apiserver {cores.get('kube-apiserver', 0):.2f}, the simulated workers {cores.get('sim-workers', 0):.2f}, the operator
{cores.get('operator-0', 0):.2f}), the rest other jobs. The operator is not the bottleneck
({one['phases']['hold']['operator_cpu_cores']:.2f} core while holding 1,000 sessions); the API server is: it served the
operator ≈ {burst['operator_api_requests_per_s']:.0f} requests/s in the burst, ≈ {requests:.1f} per new session (kopf's
finalizer and annotation patches, the token Secret, status writes). On a dedicated control plane these rates are
well inside what one API server serves; on 2 shared cores the latency goals need fewer API writes per session.

**The fixed cost** (`{SMALL}`, `{small['command']}`): at 20 sessions the operator's peak RSS was
{small['operator']['peak_rss_mib']:.0f} MiB and it used {small['phases']['hold']['operator_cpu_cores']:.3f} core while
holding; p99 apply → Streaming {small['latency']['burst']['apply_to_streaming_s']['p99']:.1f} s. docs/ARCHITECTURE.md
takes the per-session costs (and the largest fleet one replica serves) from the difference between this run and the
1,000-session ones."""
    return fleet_section(list(zip(FLEET_COLUMNS, FLEET_FILES, runs, strict=True)), notes)
