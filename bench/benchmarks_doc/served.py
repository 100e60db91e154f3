"""The engine as served: the unified engine's 57b per-rank step (TP = 4, rank 0) on three runs with its numerics,
and a 60 s session through the served runtime (worker, decoder rank, pacer, Redis, the operator's claim and release)
with delivered fps, stalls and per-stage latency. These are the figures the real-time goals are judged on."""

from __future__ import annotations

from vivant.bench.benchmarks_doc.results import load


def _u_row(name, r):
    nm = r["numerics"]
    return (f"| {name} | {r['date']} | **{r['optimized_ms']:.1f}** | {r['optimized_p99_ms']:.1f} | {r['baseline_ms']:.0f} | "
            f"{100 * r['max_rel_rms']:.2f} % | {100 * nm['mode_only']['max_rel_rms']:.2f} % over {nm['chunks']} chunks, "
            f"{nm['resets']} resets | {r['fp8_tflops']:.0f} |")


def _s_row(name, r):
    p, st, dm = r["playout"], r["session"], r["diffuse_ms"]
    e2e = p["stages_ms"]["end_to_end"]
    return (f"| {name} | {st['chunks']} | **{p['delivered_fps']:.2f}** | **{p['stalls']}** | {p['repeated_frames']} | "
            f"{st['fps']:.2f} / {st['stalls']} | {dm['p50']:.2f} / {dm['p99']:.2f} / {dm['max']:.0f} | "
            f"{p['stages_ms']['decode']['p50']:.2f} / {p['stages_ms']['decode']['max']:.0f} | {e2e['p50']:.0f} / {e2e['max']:.0f} | "
            f"{p['max_abs_av_offset_ms']:.3f} |")


def section() -> str:
    u = [load(f) for f in ("step_57b_tp4_rank0_h200_2026-12-01_unified-1.json",
                            "step_57b_tp4_rank0_h200_2026-12-01_unified-2.json",
                            "step_57b_tp4_rank0_h200_2026-12-02_unified-3.json")]
    u_tp1 = load("step_57b_tp1_h200_2026-12-01_unified.json")
    sess = {k: load(f"session_ref_tp1_h200_{k}.json") for k in ("2026-12-01_before-warm-up", "2026-12-02_graphs-warmed",
                                                               "2026-12-02_final")}
    u_ms = sorted(r["optimized_ms"] for r in u)
    u_rows = "\n".join(_u_row(n, r) for n, r in zip(("1", "2 (same machine as 1)", "3 (another machine)"), u, strict=True))
    s_rows = "\n".join(_s_row(n, sess[k]) for n, k in (
        ("before: graphs captured in the session, loop-estimated stalls", "2026-12-01_before-warm-up"),
        ("graphs captured at warm-up", "2026-12-02_graphs-warmed"),
        ("final: warm-up also runs the first position reset", "2026-12-02_final")))
    fs = sess["2026-12-02_final"]
    fst = fs["playout"]["stages_ms"]
    return f"""## The unified engine and the served runtime (2026-12-01/02)

The engine as served today: the FP8 parts of the one `VideoDiT` forward (`worker/model/fast_parts.py`, one frozen
`EngineOptions`), chunk 0's sink through the same fused QKV → ring kernel as every later chunk, and the worker
serving through its own ranks (`vivant worker --tensor-parallel N`, `worker/serving/`, docs/multi_gpu.md).
Logs: `bench/results/gpu_run_log_2026-12-01_unified-engine.txt`.

### 57b per-rank step (TP = 4, rank 0), three runs

```
STEPS=smoke,tests,tp4,tp1 STEP_ARGS=--fast-accum bash bench/run_gpu.sh $OUT
#   tp4 runs: python -m vivant bench step --preset 57b --tp 4 --rank 0 --device cuda --chunks 20 --warmup 8 \\
#             --numerics-chunks 104 --fast-accum --out $OUT/step_57b_tp4_rank0.json
```

| run | date | optimized ms (median) | p99 ms | eager baseline ms | timed chunks vs bf16 GEMMs, max rel RMS | numerics, ring vs baseline cache, max rel RMS | FP8 TFLOP/s |
|---|---|---|---|---|---|---|---|
{u_rows}

Median of the three runs: **{u_ms[1]:.1f} ms** (range {u_ms[0]:.1f}–{u_ms[2]:.1f}), under the 110 ms figure; numerics
{100 * max(r['numerics']['mode_only']['max_rel_rms'] for r in u):.2f} % at most over 104 chunks with two position resets (the bound is 2 %), no growth
(first-quarter max {100 * u[0]['numerics']['mode_only']['first_quarter_max']:.2f} %, last-quarter max {100 * u[0]['numerics']['mode_only']['last_quarter_max']:.2f} %). The smoke check
(`bench/gpu_smoke.py`, tiny preset: the served engine with FP8 parts and CUDA graphs against the float parts over
30 chunks) kept every chunk under 0.76 % relative RMS, with 116 graph replays and 4 eager passes. The whole 57b
model on one H200 (TP = 1, `step_57b_tp1_h200_2026-12-01_unified.json`): {u_tp1['optimized_ms']:.1f} ms per chunk.
Files: `step_57b_tp4_rank0_h200_2026-12-0*_unified-*.json`.

### A 60 s session through the served runtime (`ref`, TP = 1, the decoder rank on the same H200)

```
STEPS=session bash bench/run_gpu.sh $OUT
#   runs: python bench/gpu_session.py --seconds 60 --tp 1 --decoder-device shared --preset ref --device cuda \\
#             --redis-server /tmp/redis-server --out $OUT/session_ref_tp1.json
```

A real `redis-server`, `vivant worker --runner pipeline --tensor-parallel 1 --decoder-device shared` (rank 0: the
session, the DiT with the served engine; rank 1: the VAE decoder, the 24 fps pacer, the MP4), the operator's
claim → assignment → end at max duration → release, as `bench/gpu_session.py` drives them. Delivered fps and
stalls are the decoder rank's pacer count; "session fps / stalls" is what the worker reported in Redis (what
`kubectl get chs` shows).

| run | chunks | delivered fps | stalls | repeated frames | session fps / stalls | diffusion ms p50 / p99 / max | decode ms p50 / max | end-to-end ms p50 / max | max A/V offset ms |
|---|---|---|---|---|---|---|---|---|---|
{s_rows}

Final run: {fs['playout']['frames_published']} frames in {fs['playout']['playout_seconds']:.2f} s, **{fs['playout']['delivered_fps']:.2f} fps delivered with
{fs['playout']['stalls']} stalls** (the target: ≥ 23.5 fps, 0 stalls); per chunk: lead wait {fst['lead_wait']['p50']:.0f} ms, decode {fst['decode']['p50']:.1f} ms,
pacer push wait {fst['pacer_push_wait']['p50']:.0f} ms, buffer residency {fst['buffer']['p50']:.0f} ms, publish {fst['publish_frame']['p50']:.2f} ms per frame,
end to end {fst['end_to_end']['p50']:.0f} ms (the pacer's fixed lead and three-chunk buffer); real-time factor
{fs['playout']['real_time_factor']:.2f} (the busiest stage's compute seconds per second of video). What the three runs changed:

- **Before** (the first run): the first session captured the engine's two CUDA graphs (slowest chunk {sess['2026-12-01_before-warm-up']['diffuse_ms']['max'] / 1e3:.1f} s).
  The pacer still delivered 24.00 fps with 0 stalls, but the worker's own count said 351 stalls: its loop measured
  every chunk against a clock that started at the assignment. Now the playout clock starts when the first chunk
  exists, and the decoder rank's count, sent back at the session's end, replaces the loop's estimate (tests:
  `tests/worker/test_service.py::TestPacing`).
- **Graphs warmed**: every DiT rank captures its graphs before the worker says warm (`ChunkGenerator.warm_up`),
  and the decoder rank decodes two throw-away chunks. One chunk still took {sess['2026-12-02_graphs-warmed']['diffuse_ms']['max']:.0f} ms: the first position reset,
  whose delta-rotation kernels were compiled inside the session, gave 1 stall.
- **Final**: the warm-up also runs the first position reset; the slowest chunk took {fs['diffuse_ms']['max']:.0f} ms.
"""
