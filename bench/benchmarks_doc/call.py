"""Whole LiveKit calls measured at each receiving participant (`vivant bench call`, bench/livekit_call.py): received
fps per minute, freezes, turn latency and the A/V offset of what a user in the room got, one call or N at once.
docs/livekit.md defines each figure."""

from __future__ import annotations

from vivant.bench.benchmarks_doc.results import RESULTS, day, load


def _files() -> list[str]:
    return sorted(f.name for f in RESULTS.glob("livekit_call_*.json"))


def _where(d: dict) -> str:
    gpu = d["machine"].get("gpu")
    if d["device"] == "cuda" and gpu:
        return f"{gpu.split(',')[0]}, {d['machine']['cores']} cores"
    return f"{d['machine']['cores']} shared CPU cores"


def _headline(s: dict) -> str:
    return (f"{s['calls']} call(s): fps min {s['minute_fps_min']} per minute, {s['freezes_total']} freezes, "
            f"turn p50/p99 {s['turn_latency_p50_s']}/{s['turn_latency_p99_s']} s")


def suite_rows() -> list[tuple[str, str, str, str, str]]:
    """(benchmark, command, result file, its headline figure, date) for the page's table of the suite."""
    rows = []
    for name in _files():
        d = load(name)
        pad = f", chunks padded to {d['step_ms']:g} ms" if d.get("step_ms") else ""
        rows.append((f"LiveKit calls at the receiver, `{d['preset']}` on {d['device']} ({_where(d)}{pad})",
                     d["command"], name, _headline(d["rounds"][-1]["summary"]), day(d)))
    return rows


def _round_row(r: dict) -> str:
    s, st = r["summary"], r.get("stages", {})
    return (f"| {s['calls']} | {s['calls_holding']} | {s['minute_fps_min']} | {s['freezes_total']} | "
            f"{s['longest_gap_ms_max']} | {s['turn_latency_p50_s']} / {s['turn_latency_p99_s']} | "
            f"{s['av_offset_ms_range']} ({s['av_offset_r_min']}) | {r.get('cpu_cores_used', '')} | "
            f"{st.get('diffuse_ms_p50', '')} |")


def section() -> str:
    parts = []
    for name in _files():
        d = load(name)
        v = d["versions"]
        pad = f"; every chunk's diffusion padded to {d['step_ms']:g} ms" if d.get("step_ms") else ""
        rows = "\n".join(_round_row(r) for r in d["rounds"])
        note = f"\n\n{d['note']}" if d.get("note") else ""
        parts.append(f"""`{name}` ({day(d)}): `{d['command']}` — `{d['preset']}` on {d['device']} ({_where(d)}){pad};
livekit-server {v.get('livekit-server')}, livekit-agents {v.get('livekit-agents')}, torch {v.get('torch')}.

| calls | holding every target | fps, worst minute | freezes | longest gap ms | turn latency p50 / p99 s | A/V offset ms (r min) | CPU cores used | DiT ms/chunk p50 |
|---|---|---|---|---|---|---|---|---|
{rows}{note}""")
    body = "\n\n".join(parts) if parts else "No call result is committed yet."
    return f"""## Whole calls, measured at the receiver (`vivant bench call`)

A livekit-server on loopback, `vivant api --local`, `vivant worker --runner livekit` (one per call), the example voice
agent and one recording "user" process per call, each call in its own room; every figure is taken where a user would
see it, on one clock. Targets per call: every minute ≥ 23.5 fps, 0 freezes (gaps > 83 ms), |A/V offset| ≤ 45 ms,
turn latency p50 ≤ 0.35 s and p99 ≤ 0.5 s (docs/livekit.md, section 6).

{body}
"""
