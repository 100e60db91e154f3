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


def section() -> str:
    files = sorted(RESULTS.glob("turn_*.json"))
    docs = [json.loads(f.read_text()) for f in files]
    rows = "\n".join(_turn_row(f.name, d) for f, d in zip(files, docs, strict=True))
    cpu = next((d for d in docs if d["device"] == "cpu"), None)
    cmds = "\n".join(d["command"] for d in docs)
    machine = f"{cpu['machine']['cores']} cores, torch {cpu['machine']['torch']}" if cpu else "none yet"
    by_name = {f.name: d for f, d in zip(files, docs, strict=True)}
    ref_gpu = by_name["turn_ref_cuda_h200_2026-12-02.json"]
    gpu57 = by_name["turn_ref_cuda_h200_2026-12-02_57b-step.json"]
    return f"""## Turn latency by stage: rewind at a turn start, the fitted lead (`vivant bench turn`)

```
{cmds}
```
The streaming loop on the wall clock (`bench/turn.py`): ≥ 20 turns of a synthetic voiced signal, each after the
previous turn played out and a silence of varying length (turns start at varying phases of the chunk clock), one of
them interrupted by `clear_buffer` and followed by a turn. Each turn splices at a frame (docs/ARCHITECTURE.md,
"Rewind at a turn start", "Turns: rewind and lead"): f* = the first frame due after now + the keep horizon (p99 of
diffuse + decode plus the lead's margin), and after which the next chunk is due later than the horizon plus one
more p99 diffuse; frames from f* on are dropped, and the generator, the audio input and the decoder rewind to its
chunk m, which is made again and shown from frame k. An interrupt is the same cut with silence from frame k.
Stages are ms from the turn's first sample pushed, p50 / p99 over turns; the share is audio in → first frame
carrying the turn's first sample published. Goals: share ≤ 350 ms at the 57b per-rank step time, ≤ 100 ms with
`ref` on one GPU; 0 stalls; |A/V| ≤ one frame (41.7 ms). CPU rows: {machine} (the shared development machine;
`ref` on its 2 cores is slower than real time, so they show the mechanism and its stalls, not the goals). A row
marked **no rewind** is the same script with `--no-rewind`: each turn's speech waits behind the chunks already made.
H200 rows: one H200, torch 2.11.0+cu130, 2026-12-02, `STEPS=turn bash bench/run_gpu.sh $OUT` (log
`gpu_run_log_2026-12-02_splice-turn-sensitivity.txt`).

| JSON | model | diffusion step | turns (rewound) | rewound ms | diffused ms | decoded ms | **share ms** | stalls | lead (chunks) | max \\|A/V\\| after rewinds, ms | fps |
|---|---|---|---|---|---|---|---|---|---|---|---|
{rows}

Reading the H200 rows. With `ref` on the GPU a turn's first chunk is diffused and decoded in about 13 ms; the rest of
the share is the keep horizon and the wait for frame k's slot. Before the frame splice a chunk with a frame shown
played to its end, and the share was p50 129 ms (`gpu_run_log_2026-12-02_ablation-turn.txt`); with it, p50
{_ms(ref_gpu['share_ms'])} / p99 {_ms(ref_gpu['share_ms'], 'p99')} ms ({sum(1 for p in ref_gpu['rewind_points'] if p[1] > 0)} of {len(ref_gpu['rewind_points'])} cuts inside a chunk). At the 57b step time (diffusion padded to {gpu57['step_ms']:g} ms)
the first measurement with the splice had 11 late stalls, one per cut at a chunk's last frame: the remade chunk
showed one frame, and the chunk after it, due 42 ms later, needed a whole 110 ms step. The cut now also leaves the
next chunk its time (`next_chunk_s`, tests/stream/test_turn_splice.py); the row above is after that rule: share p50
{_ms(gpu57['share_ms'])} / p99 {_ms(gpu57['share_ms'], 'p99')} ms, {gpu57['stalls']} stalls. The `ref` row was measured before the rule, which cannot change a cut when a chunk
is diffused in less than a frame period (the next chunk is always at least one frame period later).
"""
