"""The whole LiveKit call measured at the receiving participant (`vivant bench call`, bench/livekit_call.py): received
fps, freezes, turn latency and the A/V offset of what a user in the room got. docs/livekit.md defines each figure."""

from __future__ import annotations

import numpy as np
from vivant.bench.benchmarks_doc.results import RESULTS, day, load


def _files() -> list[str]:
    return sorted(f.name for f in RESULTS.glob("livekit_call_*.json"))


def suite_rows() -> list[tuple[str, str, str, str, str]]:
    """(benchmark, command, result file, its headline figure, date) for the page's table of the suite."""
    rows = []
    for name in _files():
        d = load(name)
        m = d["measurement"]
        rows.append((f"the LiveKit call at the receiver, `{d['preset']}`, {d['machine']['cores']} CPU cores",
                     d["command"], name, f"{m['received_fps']:.2f} fps received, {m['freezes']} freezes", day(d)))
    return rows


def section() -> str:
    parts = []
    for name in _files():
        d = load(name)
        m, st, v = d["measurement"], d["stages"], d["versions"]
        lat = np.array(m["turn_latency_s"])
        parts.append(f"""`{name}` ({day(d)}): `ref` with 1 DiT rank + the decoder rank on {d['machine']['cores']} shared CPU
cores, livekit-server {v['livekit-server']}, livekit-agents {v['livekit-agents']}, torch {v['torch']}. Received:
{m['frames_received']} frames in {m['span_s']:.1f} s, **{m['received_fps']:.2f} fps** (goal ≥ 23.5), {m['freezes']} freezes
({m['frozen_s']:.1f} s frozen, the longest {m['longest_gap_ms'] / 1e3:.2f} s); turn latency p50 {np.median(lat):.2f} s over
{len(lat)} turns; A/V offset {m['av_offset_ms']:.0f} ms (r {m['av_offset_r']:.2f}). Not real time on this machine: a chunk
took {st['worker_cpu_ms_per_chunk']:.0f} ms of worker CPU, {st['cores_for_24fps']:.2f} cores for 24 fps against the
{st['worker_cores_given']:.2f} it got.""")
    body = "\n\n".join(parts) if parts else "No call result is committed yet."
    return f"""## The whole call, measured at the receiver (`vivant bench call`)

A livekit-server on loopback, `vivant api --local`, one `vivant worker --runner livekit`, the example voice agent and
a recording "user" participant (`bench/call_recorder.py`) in one room; every figure is taken where a user would see
it, on one clock (docs/livekit.md, section 6).

{body}
"""
