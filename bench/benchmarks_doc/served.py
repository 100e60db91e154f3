"""What a user of a worker gets: a 60 s session through the served runtime (worker, decoder rank, pacer, Redis, the
operator's claim and release) with delivered fps, stalls and per-stage latency, and the quality gate on the trained
`ref` character (the served engine against the float32 model). Speed alone says nothing about whether the served
engine still looks and lip-syncs like the model it serves."""

from __future__ import annotations

import numpy as np
from vivant.bench.benchmarks_doc.results import day, load, pct

SESSION = "session_ref_tp1_h200.json"
QUALITY = "quality_ref_cuda_h200.json"
SESSION_COMMAND = ("python bench/gpu_session.py --seconds 60 --tp 1 --decoder-device shared --preset ref "
                   "--device cuda")
QUALITY_COMMAND = "vivant eval quality --device cuda --wav weights/ref/data/held_out.wav --seconds 60 --json"


def suite_rows() -> list[tuple[str, str, str, str, str]]:
    """(benchmark, command, result file, its headline figure, date) for the page's table of the suite."""
    s, q = load(SESSION), load(QUALITY)
    p = s["playout"]
    return [
        ("a 60 s session through the served runtime, `ref`, H200", s.get("command", SESSION_COMMAND), SESSION,
         f"**{p['delivered_fps']:.2f} fps** delivered, **{p['stalls']} stalls**", day(s)),
        ("the quality gate: served engine vs float32, `ref`, H200", q.get("command", QUALITY_COMMAND), QUALITY,
         f"latent max **{pct(q['latent_rel_rms_max'], 1)}**, frames {q['psnr_reference_vs_optimized_db']:.1f} dB, "
         f"lip-sync drop {pct(q['lip_sync_relative_drop'])}", day(q)),
    ]


def section() -> str:
    s, q = load(SESSION), load(QUALITY)
    p, st, dm = s["playout"], s["session"], s["diffuse_ms"]
    stages = p["stages_ms"]
    per = np.array(q["latent_rel_rms_per_chunk"])
    quarters = " / ".join(f"{100 * float(np.mean(x)):.2f}" for x in np.array_split(per, 4))
    gate = q["gate"]
    return f"""## A served session and the quality gate (`ref`, one H200)

**A 60 s session** (`{SESSION}`, {day(s)}): a real `redis-server`, `vivant worker --runner pipeline --tensor-parallel 1
--decoder-device shared` (rank 0: the DiT with the served engine; rank 1: the VAE decoder, the 24 fps pacer, the MP4)
and the operator's claim → assignment → end at max duration → release, driven by `bench/gpu_session.py`.

| delivered fps | stalls | repeated frames | the worker's report in Redis: fps / stalls | diffusion ms p50 / p99 / max | decode ms p50 / max | end to end ms p50 | max A/V offset ms |
|---:|---:|---:|---|---|---|---:|---:|
| **{p['delivered_fps']:.2f}** | **{p['stalls']}** | {p['repeated_frames']} | {st['fps']:.2f} / {st['stalls']} | {dm['p50']:.2f} / {dm['p99']:.2f} / {dm['max']:.0f} | {stages['decode']['p50']:.2f} / {stages['decode']['max']:.0f} | {stages['end_to_end']['p50']:.0f} | {p['max_abs_av_offset_ms']:.3f} |

{p['frames_published']} frames in {p['playout_seconds']:.2f} s against the target of ≥ 23.5 fps with 0 stalls. End to end
is the pacer's fixed lead ({stages['lead_wait']['p50']:.0f} ms) and three-chunk buffer ({stages['buffer']['p50']:.0f} ms), not
compute: the busiest stage needs {p['real_time_factor']:.2f} s of compute per second of video.

**The quality gate** (`{QUALITY}`, {day(q)}): the served engine (FP8 GEMMs with fast accumulation, the bf16 ring, CUDA
graphs) against the float32 model with a float cache, on the shipped FP8-QAT checkpoint (`weights/ref`,
docs/reference_model.md), over {q['seconds']:.0f} s of held-out speech ({q['chunks']} chunks, {q['position_resets']} position
resets). Latent relative RMS max **{pct(q['latent_rel_rms_max'], 1)}**, median {pct(float(np.median(per)), 1)}, quarter
means {quarters} % (no growth); frames **{q['psnr_reference_vs_optimized_db']:.1f} dB** PSNR against the float32 path;
lip-sync r served / float32 {q['lip_sync_optimized']:.4f} / {q['lip_sync_reference']:.4f} (drop
{pct(q['lip_sync_relative_drop'])}, the gate allows {pct(gate['max_lipsync_drop'], 0)}; ground truth
{q['lip_sync_ground_truth']:.4f}). The gate {'passed' if gate['passed'] else 'failed'} (drift limit {pct(gate['drift_limit'], 1)}).
The goals: latent max ≤ 10 %, ≥ 38 dB, lip-sync drop ≤ 1 %.
"""
