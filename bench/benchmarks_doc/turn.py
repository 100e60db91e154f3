"""Turn latency by stage (`vivant bench turn`): for every committed `turn_*.json`, the stages from a turn's first
sample to its first frame (rewind, diffusion, decode, the share), stalls, the fitted lead and the A/V offset after
rewinds. It shows whether a turn start is answered within the goals, on the CPU and on the H200."""

from __future__ import annotations

import json

from vivant.bench.benchmarks_doc.results import RESULTS


def _ms(s: dict, k: str = "p50") -> str:
    return "—" if not s or s.get("n", 0) == 0 or s.get(k) is None else f"{s[k]:.0f}"


def _turn_row(name: str, r: dict) -> str:
    st = r["stages_ms"]
    step = f"{r['step_ms']:g} ms (padded)" if r["step_padded"] else "as is"
    av = r["max_abs_av_offset_after_rewind_ms"]
    stages = " | ".join(f"{_ms(st[k])} / {_ms(st[k], 'p99')}" for k in ("rewound", "diffused", "decoded"))
    model = f"{r['preset']} on {r['device']}" + ("" if r.get("rewind", True) else ", **no rewind**")
    return (f"| `{name}` | {model} | {step} | {r['turns']} ({r['turns_rewound']}) | {stages} | "
            f"**{_ms(r['share_ms'])}** / {_ms(r['share_ms'], 'p99')} | **{r['stalls']}** | {r['lead_chunks']} "
            f"(changes {len(r['lead_changes']) - 1}) | {'—' if av is None else f'{av:.1f}'} | {r['delivered_fps']:.1f} |")


def suite_rows() -> list[tuple[str, str, str, str, str]]:
    """(benchmark, command, result file, its headline figure, date) for the page's table of the suite."""
    rows = []
    for f in sorted(RESULTS.glob("turn_*.json")):
        d = json.loads(f.read_text())
        step = f", diffusion padded to {d['step_ms']:g} ms" if d["step_padded"] else ""
        where = d["machine"].get("gpu") or f"{d['machine']['cores']} CPU cores"
        rows.append((f"turn latency, `{d['preset']}`, {where}{step}", d["command"], f.name,
                     f"audio in → first frame **{_ms(d['share_ms'])}** / {_ms(d['share_ms'], 'p99')} ms (p50 / p99), "
                     f"{d['stalls']} stalls", d["date"][:10]))
    return rows


def section() -> str:
    files = sorted(RESULTS.glob("turn_*.json"))
    docs = [json.loads(f.read_text()) for f in files]
    rows = "\n".join(_turn_row(f.name, d) for f, d in zip(files, docs, strict=True))
    cpu = next((d for d in docs if d["device"] == "cpu"), None)
    machine = f"{cpu['machine']['cores']} cores, torch {cpu['machine']['torch']}" if cpu else "none yet"
    return f"""## Turn latency by stage (`vivant bench turn`)

The streaming loop on the wall clock (`bench/turn.py`): ≥ 20 turns of a synthetic voiced signal, each after the
previous turn played out and a silence of varying length, one of them interrupted by `clear_buffer`. Each turn
splices at a frame (docs/ARCHITECTURE.md, "Turns: rewind and lead"): frames due after the keep horizon are dropped,
and the generator, the audio input and the decoder rewind to the chunk holding the first dropped frame. Stages are ms
from the turn's first sample pushed, p50 / p99 over turns; the share is audio in → the first frame carrying the
turn's first sample published. Goals: share ≤ 350 ms at the 57b per-rank step time, ≤ 100 ms with `ref` on one GPU;
0 stalls; |A/V| ≤ one frame (41.7 ms). CPU row: {machine} (`ref` is slower than real time on 2 shared cores: it shows
the mechanism, not the goals). The padded row holds each chunk's diffusion to the 57b per-rank step time.

| JSON | model | diffusion step | turns (rewound) | rewound ms | diffused ms | decoded ms | **share ms** | stalls | lead (chunks) | max \\|A/V\\| after rewinds, ms | fps |
|---|---|---|---|---|---|---|---|---|---|---|---|
{rows}
"""
