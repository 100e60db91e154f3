"""Quality of the served engine on the trained `ref` character: the quality gate (latent drift, PSNR and lip-sync
of the served engine against the float32 model) for each served configuration (ring precision, FP8-native and FP8-QAT
checkpoints), the paths that isolate each rounding, and which FP8 rounding moves the trained model. Speed alone says
nothing about whether the served engine still looks and lip-syncs like the model it serves."""

from __future__ import annotations

import numpy as np
from vivant.bench.benchmarks_doc.results import load


def _q_row(name: str, q: dict) -> str:
    per = q["latent_rel_rms_per_chunk"]
    return (f"| {name} | **{100 * q['latent_rel_rms_max']:.1f} %** | {100 * float(np.median(per)):.1f} % | "
            f"{100 * float(np.percentile(per, 95)):.1f} % | {100 * q['latent_rel_rms_first_quarter']:.1f} % → "
            f"{100 * q['latent_rel_rms_last_quarter']:.1f} % | **{q['psnr_reference_vs_optimized_db']:.1f} dB** | "
            f"{q['lip_sync_optimized']:.4f} / {q['lip_sync_reference']:.4f} ({100 * q['lip_sync_relative_drop']:+.2f} %) | "
            f"{q['psnr_vs_procedural_db']['reference']:.2f} / {q['psnr_vs_procedural_db']['optimized']:.2f} dB |")


def _pct(v: dict) -> str:
    return f"{100 * v['max']:.1f} % | {100 * v['median']:.1f} % | {100 * v['last_quarter_mean']:.1f} %"


def _quarters(q: dict) -> str:
    return " / ".join(f"{100 * float(np.mean(x)):.2f}" for x in np.array_split(np.array(q["latent_rel_rms_per_chunk"]), 4))


def _sens_cells(v: dict | None) -> str:
    if v is None:
        return "— | — | —"
    return f"{100 * v['max']:.1f} % | {100 * v['median']:.1f} % | {100 * v['last_quarter_mean']:.1f} %"


def section() -> str:
    qual = load("quality_ref_cuda_h200_2026-12-02.json")  # FP8 ring, the checkpoint as trained
    qual_bf16 = load("quality_ref_cuda_h200_2026-12-02_bf16-ring.json")  # bf16 ring, the checkpoint as trained
    qual_nat = load("quality_ref_cuda_h200_2026-12-02_fp8-native.json")  # bf16 ring, the FP8-native checkpoint
    qual_qat1 = load("quality_ref_cuda_h200_2026-12-02_fp8-qat-120s.json")  # bf16 ring, FP8-QAT 120 s (not shipped)
    qual_qat = load("quality_ref_cuda_h200_2026-12-02_fp8-qat.json")  # bf16 ring, FP8-QAT 240 s (shipped, served)
    qat_cmp = load("quality_compare_ref_cuda_h200_2026-12-02_fp8-qat.json")
    sens_act = load("fp8_sensitivity_ref_cuda_h200_2026-12-02_activations-fp8-native.json")
    sens_qat = {v["variant"]: v for v in load("fp8_sensitivity_ref_cuda_h200_2026-12-02_fp8-qat.json")["variants"]}
    ring_fp8 = load("step_57b_tp4_rank0_h200_2026-12-02_ring-fp8.json")
    ring_bf16 = load("step_57b_tp4_rank0_h200_2026-12-02_ring-bf16.json")
    qual_rows = "\n".join([
        _q_row("FP8 ring, checkpoint as trained (before)", qual),
        _q_row("bf16 ring, checkpoint as trained", qual_bf16),
        _q_row("bf16 ring, FP8-native checkpoint", qual_nat),
        _q_row("bf16 ring, FP8-QAT checkpoint, 120 s fine-tune (not shipped)", qual_qat1),
        _q_row("**bf16 ring, FP8-QAT checkpoint (served now)**", qual_qat)])
    sens_act_rows = "\n".join(f"| {v['variant']} | {100 * v['max']:.1f} % | {100 * v['median']:.1f} % | "
                               f"{100 * v['last_quarter_mean']:.1f} % |" for v in sens_act["variants"])
    sens = load("fp8_sensitivity_ref_cpu_2026-12-02.json")
    sens_gpu = load("fp8_sensitivity_ref_cuda_h200_2026-12-02.json")
    sens_cpu_by = {v["variant"]: v for v in sens["variants"]}
    sens_gpu_by = {v["variant"]: v for v in sens_gpu["variants"]}
    sens_rows = "\n".join(f"| {name} | {_sens_cells(sens_cpu_by.get(name))} | {_sens_cells(sens_gpu_by.get(name))} |"
                          for name in [*sens_cpu_by, *(n for n in sens_gpu_by if n not in sens_cpu_by)])
    wr = sens["weight_rounding_rel_rms"]
    wr_rows = "\n".join(f"| {k} | {100 * e['per_channel']:.2f} % | {100 * e['per_32_block']:.2f} % |" for k, e in wr.items())
    return f"""### The quality gate on the served engine (`ref`, trained weights)

```
STEPS=quality bash bench/run_gpu.sh $OUT
#   runs: python -m vivant eval quality --device cuda --wav weights/ref/data/held_out.wav --seconds 60 --json
STEPS=native bash bench/run_gpu.sh $OUT    # vivant train fp8-native on the machine, then the same gate on it
STEPS=qat QAT_ARGS="--seconds 240 --steps 4000" bash bench/run_gpu.sh $OUT   # vivant train fp8-qat, then the gate
STEPS=tp4 STEP_ARGS="--fast-accum --ring fp8|bf16" STEP_TAG=... bash bench/run_gpu.sh $OUT   # the 57b step, both rings
```

The served engine (FP8 GEMMs, fast accumulation, CUDA graphs) against the float32 model with a float cache, over
60 s of held-out speech ({qual['chunks']} chunks, {qual['position_resets']} position resets), one H200, torch 2.11, 2026-12-02. Three changes, each
measured: the ring stores K/V in bf16 instead of FP8 (`EngineOptions.ring`, the served default on CUDA: attention
reads bf16 either way); the checkpoint is FP8-native (`vivant train fp8-native`: the four projections' weights
rounded once to the e4m3 grid the served GEMMs use, so the float32 model and the engine multiply the same weights);
and the checkpoint is fine-tuned under the served rounding (`vivant train fp8-qat`, docs/reference_model.md: the
activations' per-row e4m3 rounding in the training forward, straight-through gradients, written FP8-native again),
so the model's rollout no longer amplifies what the rounding leaves. Last column: PSNR of the float32 path / the
served engine against the procedural frames (lip-sync r of the ground truth {qual_qat['lip_sync_ground_truth']:.4f}).

| served configuration | latent max | median | p95 | first → last quarter | PSNR vs float32 | lip-sync r served / float32 (drop) | vs ground truth float32 / served |
|---|---|---|---|---|---|---|---|
{qual_rows}

The goals of the quality work: latent max ≤ 10 %, ≥ 38 dB, lip-sync drop ≤ 1 %, no growth. With the shipped FP8-QAT
checkpoint: latent max **{100 * qual_qat['latent_rel_rms_max']:.1f} %**, frames **{qual_qat['psnr_reference_vs_optimized_db']:.1f} dB**, lip-sync drop {100 * qual_qat['lip_sync_relative_drop']:.2f} %, and `vivant eval quality`'s drift rule
passed (limit {100 * qual_qat['gate']['drift_limit']:.1f} %). The quarter means of the latent difference are {_quarters(qual_qat)} % (first to
last): no trend, but the last quarter is the highest — the last 40 chunks of this minute of speech are where every
path differs most from the float32 one (the FP8-native checkpoint's 19.6 % excursion was there too, and the bf16
model alone rises there as well), so that rise is the speech, not an accumulating rollout error (next table). The float32 model itself, against the ground truth: lip-sync r {qat_cmp['float32_ground_truth']['lip_sync']['shipped']:.4f} → {qat_cmp['float32_ground_truth']['lip_sync']['candidate']:.4f}, PSNR vs the procedural frames
{qat_cmp['float32_ground_truth']['psnr_vs_procedural_db']['shipped']:.2f} → {qat_cmp['float32_ground_truth']['psnr_vs_procedural_db']['candidate']:.2f} dB (FP8-native → FP8-QAT). The fix is in the weights: the served engine runs the same kernels, so
the 57b step — which runs random weights at the 57b shapes — is the same program with it as without it. The 57b step
with the bf16 ring, same lease, one process each: **{ring_bf16['optimized_ms']:.2f} ms** median (p99 {ring_bf16['optimized_p99_ms']:.2f}) against {ring_fp8['optimized_ms']:.2f} ms (p99 {ring_fp8['optimized_p99_ms']:.2f}) with the FP8 ring ({100 * (ring_bf16['optimized_ms'] / ring_fp8['optimized_ms'] - 1):+.1f} %;
numerics vs the baseline cache {100 * ring_bf16['numerics']['mode_only']['max_rel_rms']:.2f} % over {ring_bf16['numerics']['chunks']} chunks, {ring_bf16['numerics']['resets']} resets). JSON: `quality_ref_cuda_h200_2026-12-02*.json`,
`step_57b_tp4_rank0_h200_2026-12-02_ring-*.json`.

**The paths of the quality issue's table, re-measured on the shipped FP8-QAT checkpoint** (`STEPS=sensitivity
SENSITIVITY_SECONDS=60 SENSITIVITY_ARGS="--only served --only bfloat16 --only fast --only activations"`, H200, 360
chunks, each against the float32 model on a float cache; JSON `fp8_sensitivity_ref_cuda_h200_2026-12-02_fp8-qat.json`;
the frames' PSNR and lip-sync of the served row are the gate's, above):

| path | latent max | median | last quarter |
|---|---|---|---|
| bf16 model alone (float parts, bf16, float ring) | {_pct(sens_qat['float parts bfloat16, float ring'])} |
| FP8 ring alone (float parts, bf16, FP8 ring) | {_pct(sens_qat['float parts bfloat16, FP8 ring'])} |
| served engine, no fast accumulation (bf16 ring) | {_pct(sens_qat['FP8 parts, no fast accumulation'])} |
| **served engine (FP8 GEMMs with fast accumulation, bf16 ring, graphs)** | {_pct(sens_qat['FP8 parts (as served)'])} |

The bf16 model alone, which has no FP8 in it at all, also rises in the last quarter ({100 * sens_qat['float parts bfloat16, float ring']['last_quarter_mean']:.1f} % against a median of
{100 * sens_qat['float parts bfloat16, float ring']['median']:.1f} %, a larger rise than the served engine's {100 * sens_qat['FP8 parts (as served)']['last_quarter_mean']:.1f} % against {100 * sens_qat['FP8 parts (as served)']['median']:.1f} %): the last quarter of this speech is where any rounding
moves the rollout most.

**Which activations' rounding matters** (`STEPS=sensitivity SENSITIVITY_SECONDS=60 SENSITIVITY_ARGS="--only served
--only activations --only bf16"`, the FP8-native checkpoint, H200, {sens_act['chunks']} chunks): one GEMM at a time takes unquantized
rows (a bf16 GEMM on the checkpoint's weights; for O this run patched in what the option `EngineOptions.o_gemm =
"bf16"` now does, `vivant bench step --o-gemm / --compare-o-gemm`). JSON: `fp8_sensitivity_ref_cuda_h200_2026-12-02_activations-fp8-native.json`.

| variant | max | median | last quarter |
|---|---|---|---|
{sens_act_rows}

The inputs of the QKV and gate/up GEMMs (the fused LayerNorm-modulation's rows) matter most, and those are the two
largest GEMMs (bf16 for them would add about a third to the 57b step, bench step's `gemm_ceiling`). The O GEMM alone in
bf16 (about +2.4 ms per 57b chunk by the same per-GEMM figures, within the 3 % allowed) took the FP8-native
checkpoint's worst chunk from 19.6 % to 10.6 %; on the FP8-QAT checkpoint it did not help (a 120 s fine-tune: 9.7 %
as served, 8.8 % with it, its last quarter higher), so it stays an option, off in the served engine.

### Which FP8 rounding moves the trained model

```
python bench/fp8_sensitivity.py --seconds 20 --out bench/results/fp8_sensitivity_ref_cpu_2026-12-02.json
STEPS=sensitivity SENSITIVITY_SECONDS=60 bash bench/run_gpu.sh $OUT   # the same with --device cuda
```

The served engine's parts undone one at a time (`bench/fp8_sensitivity.py`), each variant against the float32 model
on a float cache, `ref`, held-out speech, same seed. On a CPU the FP8 parts run their float32 twins, which round to
e4m3 exactly as the GPU kernels do (only the accumulation order differs, and the model runs in float32, not bf16):
{sens['chunks']} chunks, torch {sens['torch']}, a 2-core x86 machine shared with other jobs. On the H200 they are the
served engine's own parts (cuBLASLt FP8 GEMMs with fast accumulation, bf16 model, CUDA graphs): {sens_gpu['chunks']} chunks
(60 s), torch {sens_gpu["torch"]}, on the checkpoint as trained; its "as served" row is the engine before the two changes above (the table's first row). Both {sens["date"]}.

| variant | CPU max | CPU median | CPU last quarter | H200 max | H200 median | H200 last quarter |
|---|---|---|---|---|---|---|
{sens_rows}

| e4m3 weight rounding, relative RMS | one scale per output channel (served) | one scale per 32 inputs |
|---|---|---|
{wr_rows}

Reading: the weights' rounding is the largest single cause. With all four projections' weights in float32
(activations still FP8 rows, the FP8 ring kept) the median falls from {100 * sens_gpu_by['FP8 parts (as served)']['median']:.1f} % to {100 * sens_gpu_by['FP8 parts, all weights float32']['median']:.1f} % on the H200 and from
{100 * sens_cpu_by['FP8 parts (as served)']['median']:.1f} % to {100 * sens_cpu_by['FP8 parts, all weights float32']['median']:.1f} % on the CPU; on the H200 the worst chunk stays at {100 * sens_gpu_by['FP8 parts, all weights float32']['max']:.1f} % (the FP8 ring alone: {100 * sens_gpu_by['float parts, FP8 ring']['max']:.1f} %).
The rest splits as follows on the H200. Fast accumulation is not the cause (without it: {100 * sens_gpu_by['FP8 parts, no fast accumulation']['max']:.1f} % max). The ring's
rounding is: attention reading the bf16 of the exact rotated K/V instead of the bf16 of their FP8 codes (what a bf16
ring would give; at 57b the attention already reads a bf16 image, so this costs no GEMM time) takes the worst chunk
from {100 * sens_gpu_by['FP8 parts (as served)']['max']:.1f} % to {100 * sens_gpu_by['FP8 parts, image unquantized']['max']:.1f} %, and with float32 weights as well to {100 * sens_gpu_by['FP8 parts, image unquantized, all weights float32']['max']:.1f} % (median {100 * sens_gpu_by['FP8 parts, image unquantized, all weights float32']['median']:.1f} %) — what is left there is the FP8
rounding of the activations (and of attention's output) with the bf16 model; the bf16 model alone gives {100 * sens_gpu_by['float parts bfloat16, float ring']['max']:.1f} %.
With the served bf16 ring (`EngineOptions.ring = "bf16"`) and the four projections' weights in float32, the worst
chunk is {100 * sens_gpu_by['FP8 parts, bf16 ring, all weights float32']['max']:.1f} % (median {100 * sens_gpu_by['FP8 parts, bf16 ring, all weights float32']['median']:.1f} %): the two together are what moves this model. Weights in float32 would double the
GEMMs' time at 57b; a checkpoint whose weights already lie on the FP8 grid removes their rounding for free, which is
what `vivant train fp8-native` ships (previous section; there the served GEMMs' fast accumulation, the bf16 model and
the FP8 activations remain, and one excursion reaches {100 * qual_nat['latent_rel_rms_max']:.1f} %). A finer scale cannot replace it — e4m3 keeps 3
mantissa bits, so rounding costs about 2.6 % per value at any scale granularity (weights at 1×32 blocks: 2.4 %).
What is left would take the activations out of FP8 (bf16 GEMMs: the ablation's bf16 row gives their cost at 57b)
or a model trained with the rounding in the loop, so that its rollout does not amplify it.
"""
