"""Write docs/BENCHMARKS.md from the committed JSON under bench/results/ (so every figure in the doc is one
of those files' numbers). Usage: python bench/benchmarks_md.py > docs/BENCHMARKS.md"""

import json
from pathlib import Path

R = Path(__file__).resolve().parent / "results"


def load(name: str) -> dict:
    return json.loads((R / name).read_text())


d = load("step_57b_tp4_rank0_h200_2026-11-29.json")
rep = load("step_57b_tp4_rank0_h200_2026-11-29_repeat.json")
post = load("step_57b_tp4_rank0_h200_2026-11-29_after-refactor.json")
pre_sync = load("step_57b_tp4_rank0_h200_2026-11-29_before-host-sync-fix.json")
pre_mod = load("step_57b_tp4_rank0_h200_2026-11-29_before-modulation-cache.json")
prev = load("step_57b_tp4_rank0_h200_2026-11-29_previous-engine.json")
t1 = load("step_57b_tp1_h200_2026-11-29.json")
t1_prev = load("step_57b_tp1_h200_2026-11-29_previous-engine.json")
dec = load("decode_57b_h200_2026-11-29.json")
tp2 = load("tp2_57b_shapes_h200x2_2026-11-29.json")
tune1 = load("tune_57b_tp4_rank0_h200_2026-11-29_first.json")
tune2 = load("tune_57b_tp4_rank0_h200_2026-11-29_second.json")
tune3 = load("tune_57b_tp4_rank0_h200_2026-11-29_third.json")
t3s = tune3["step"]
t2a, t2b = tp2["ranks"]
c, g, bb, n = d["components_ms_per_call"], d["gemm_ceiling"], d["baseline_breakdown_ms"], d["numerics"]
prof = d["optimized_profile"]["ms_per_chunk_by_category"]
res_k = d["optimized_profile"]["top_kernels_ms_per_chunk"]["_residual_ln_mod_quant_kernel"]
busy = sum(prof.values())
p1 = tune1["step"]["current"]["profile"]["top_kernels_ms_per_chunk"]
ns, nu = tune2["numerics_scaled"], tune2["numerics_unit"]
rnd = tune3["rounding"]
att = tune3["attention"]["us"]
gem = tune3["gemms"]
ts = dec["two_stage"]
print(f"""# Benchmarks

Every figure here comes from a command in `bench/`, run as written, with its JSON committed under
`bench/results/` (this page is generated from those files by `python bench/benchmarks_md.py`).
GPU: one NVIDIA H200 (driver 580.159.04, clocks as found, never changed), torch {d['torch']}, triton {d['triton']},
Python 3.12, date {d['date']}. Logs: `bench/results/gpu_run_log_2026-11-29*.txt`. Random weights of the exact shapes
(DESIGN.md §1). Timings are CUDA-event medians after warm-up; kernel timings are replays of CUDA graphs (the way
the engine runs them); per-kernel profiles are torch.profiler CUDA activity over two graph-replayed chunks.

The GPU runs were made with `bash bench/run_gpu.sh $OUT` (it assembles the `vivant` namespace from symlinks,
since nothing installs on the GPU machine, then runs the smoke check `bench/gpu_smoke.py`,
`pytest -m gpu tests/kernels tests/stream/test_decode_gpu.py` (all 44 passed on the final kernels) and the commands below).

## DiT chunk step, 57b, one tensor-parallel rank (TP = 4, rank 0) on one H200

```
python -m vivant bench step --preset 57b --tp 4 --rank 0 --device cuda --chunks 20 --warmup 8 \\
    --numerics-chunks 104 --fast-accum --out bench/results/step_57b_tp4_rank0_h200_2026-11-29.json
```

Shard: 16 heads, QKV N=6144, O K=2048, gate+up N=13824, down K=6912; 757 new tokens over a 5,788-slot ring;
4 passes × 60 layers = 240 attention calls per chunk. Random init `{d['init']}` (below), attention backend
`{d['attn_backend']}` (picked by measurement in the run), FP8 fast accumulation `{d['fast_accum']}`. The all-reduce
after O and down is left out of both modes (identity) and reported apart (an estimate:
{d['allreduce_estimate_ms_per_chunk']:.1f} ms per chunk at an assumed 360 GB/s; a two-GPU run measured 3× that per byte, below).

| | baseline | optimized |
|---|---|---|
| median ms per chunk | {d['baseline_ms']:.1f} | **{d['optimized_ms']:.1f}** |
| p99 ms per chunk | {d['baseline_p99_ms']:.1f} | {d['optimized_p99_ms']:.1f} |
| speedup | | **{d['speedup']:.2f}×** |
| GEMMs | {bb['gemms']:.1f} (bf16, component timing × 240) | {prof['gemms']:.1f} (FP8 rowwise, cuBLASLt, profiled) |
| attention | {bb['attention']:.1f} (cuDNN bf16) | {prof['attention']:.1f} (cuDNN over the ring's read image, profiled) |
| cache work | {bb['cache_work']:.1f} (cat + rotate + quantize, every call) | inside the QKV→ring kernel |
| fused quant / norm / RoPE / ring-write kernels | — | {prof['fused_kernels']:.1f} (profiled) |
| other kernels | {bb['other']:.1f} (measured − components: eager launches, casts) | {prof['other']:.1f} (memsets, embeddings, final layer) |
| GPU idle (wall − kernel time) | | {d['optimized_ms'] - busy:.1f} |
| achieved FP8 TFLOP/s (GEMM FLOPs / chunk time) | | {d['fp8_tflops']:.0f} |
| % of the measured FP8 GEMM ceiling ({g['fp8_ceiling_tflops']:.0f} TFLOP/s at these shapes) | | {d['pct_fp8_ceiling']:.1f}% |

**Repeat and spread.** Lease A (this run): **{d['optimized_ms']:.1f} ms**, and again with 40 timed chunks
(`…_repeat.json`, no numerics): **{rep['optimized_ms']:.1f} ms**. Lease B, the code one commit before (the host read a
device tensor before each pass): {pre_sync['optimized_ms']:.1f} ms. Lease C, the final code after a refactor that shares the
row kernels' jit helpers (`…_after-refactor.json`, no numerics): **{post['optimized_ms']:.1f} ms**. The leases differ by
more than the code does: lease C's FP8 GEMM ceiling measured {post['gemm_ceiling']['fp8_ms_per_layer_pass']*1e3:.0f} µs per layer-pass against
{g['fp8_ms_per_layer_pass']*1e3:.0f} µs on lease A, its baseline {post['baseline_ms']:.0f} ms against {d['baseline_ms']:.0f} ms, and its profile has every kernel
class 1.5–4% slower (GEMMs {post['optimized_profile']['ms_per_chunk_by_category']['gemms']:.1f} vs {prof['gemms']:.1f} ms, fused kernels
{post['optimized_profile']['ms_per_chunk_by_category']['fused_kernels']:.1f} vs {prof['fused_kernels']:.1f} ms).

**Where the time went, and what changed** (each step measured; JSON under `bench/results/`):

| engine | ms per chunk | what changed |
|---|---|---|
| previous session's engine | {prev['optimized_ms']:.1f} | FP8 GEMMs, fused row kernels, per-call dequantization + SDPA, CUDA graphs |
| + profiled (`tune_…_first.json`) | — | the ring write took {p1['_write_kv_kernel']['ms']:.1f} ms per chunk ({p1['_write_kv_kernel']['ms'] / 240 * 1e3:.0f} µs per call: sin/cos per (token, head, pair), FP8 bytes stored at a stride of two); the whole-ring dequantization {p1['_dequant_kernel']['ms']:.1f} ms |
| one QKV→ring kernel + read image + HW e4m3 cast + fast accumulation | {pre_mod['optimized_ms']:.1f} | `kernels/qkv_ring.py` replaces q/k-norm + RoPE, ring write and image refresh (3 kernels, 79 µs → 1 kernel, 7 µs); attention reads a bf16 image of the ring kept current at write time (`kernels/ring_image.py`) |
| + modulation computed once per noise level | {pre_sync['optimized_ms']:.1f} | the d×6d modulation projection (805 MB bf16) was re-read every pass |
| + position key read on the host | **{d['optimized_ms']:.1f}** | the host no longer waits for each pass before launching the next |

The last three rows were measured on three different leases, so each step mixes the change with the lease: the
profile attributes ~1.3 ms per chunk to the modulation GEMVs that step removed; fast accumulation was measured on
one lease against its absence ({t3s['image']['median_ms']:.1f} → {t3s['image_fast_accum']['median_ms']:.1f} ms, `tune_…_third.json`).

Per call, inside CUDA graphs, same run: FP8 `_scaled_mm` rowwise (exact accumulation) QKV {g['qkv']['fp8_ms']*1e3:.0f} µs,
O {g['o']['fp8_ms']*1e3:.0f} µs, gate+up {g['gate_up']['fp8_ms']*1e3:.0f} µs, down {g['down']['fp8_ms']*1e3:.0f} µs = {g['fp8_ms_per_layer_pass']:.3f} ms per layer-pass
({g['fp8_ms_per_layer_pass']*240:.1f} ms per chunk); bf16 {g['bf16_ms_per_layer_pass']:.3f} ms. Fast accumulation
(`tune_…_third.json`): QKV {gem['qkv']['exact']['us']:.0f} → {gem['qkv']['fast']['us']:.0f} µs, O {gem['o']['exact']['us']:.0f} → {gem['o']['fast']['us']:.0f},
gate+up {gem['gate_up']['exact']['us']:.0f} → {gem['gate_up']['fast']['us']:.0f}, down {gem['down']['exact']['us']:.0f} → {gem['down']['fast']['us']:.0f}; relative error against float32
{gem['qkv']['exact']['rel_err']:.1e} → {gem['qkv']['fast']['rel_err']:.1e}. Attention: image {c['attn_image']*1e3:.0f} µs, dequantize + SDPA
{c['attn_sdpa_dequant']*1e3:.0f} µs, Triton FP8 kernel {c['attn_triton_fp8_ring']*1e3:.0f} µs, cuDNN bf16 on an unquantized cache
{c['attn_sdpa_bf16']*1e3:.0f} µs (the image backend is at that floor; its output equals the dequantize + SDPA backend's
bit for bit). The image costs memory: the ring again in bf16, 2.8 GB per rank at 57b. Fused kernels: QKV→ring
{c['qkv_ring_write']*1e3:.1f} µs, residual + norm + modulation + FP8 {c['residual_ln_mod_quant']*1e3:.1f} µs,
SwiGLU + FP8 {c['swiglu_quant']*1e3:.1f} µs, row FP8 {c['quant_rows_o']*1e3:.1f} µs. On the GPU these quantize with y·(1/s) and the
hardware e4m3 conversion: {rnd['residual_ln_mod_quant']['exact_us']:.1f} → {rnd['residual_ln_mod_quant']['hw_us']:.1f} µs (residual),
{rnd['swiglu_quant']['exact_us']:.1f} → {rnd['swiglu_quant']['hw_us']:.1f} µs (SwiGLU), with FP8 codes identical to the exact twin arithmetic on
these inputs (fraction differing: {rnd['residual_ln_mod_quant']['codes_differ_fraction']:.0f}). Launch configurations of the row kernels come from a 17-way sweep
(`tune_…_first.json`); the looped (tiled) forms never won at 757 rows.

**Targets.** Optimized ≥ 1.6× baseline: **met** ({d['speedup']:.2f}× here, {post['speedup']:.2f}× on lease C). Optimized ≤ 110 ms per chunk:
**met on lease A ({d['optimized_ms']:.1f} and {rep['optimized_ms']:.1f} ms), not on lease C ({post['optimized_ms']:.1f} ms)** — not robust: the margin
is smaller than the spread between H200 leases (the issue's own GEMM figure, 77.6 ms per chunk, matches the slower
lease: {post['gemm_ceiling']['fp8_ms_per_layer_pass']*240:.1f} ms there, {g['fp8_ms_per_layer_pass']*240:.1f} ms on lease A). What is left, by the profile:
GEMMs {prof['gemms']:.1f} ms (cuBLASLt at {g['fp8_ceiling_tflops']:.0f} TFLOP/s; by its kernel name the QKV GEMM runs 128×128 tiles, 288 of them
for 132 SMs, 2.2 waves), attention {prof['attention']:.1f} ms (by its name cuDNN's kernel takes 64-query tiles: 12 × 16 heads = 192
CTAs, 1.45 waves), the residual kernel {res_k['ms']:.1f} ms ({res_k['ms'] / res_k['calls_per_chunk'] * 1e3:.1f} µs per call in the
step: {757 * 8192 * 7 / (res_k['ms'] / res_k['calls_per_chunk'] * 1e-3) / 1e12:.1f} TB/s for its 43 MB against ~4.3 TB/s of copy bandwidth), 1,200 memsets per chunk
issued inside library calls (source not identified), and {d['optimized_ms'] - busy:.1f} ms of idle between graph nodes. For the attention's
wave tail there is a split-KV option (`kernels/split_kv.py`: the slots in parts batched into one cuDNN call, combined by
log-sum-exp; `--attn-kv-splits 2`), built and tested on CPU after this session's GPU time was spent: **not measured**.

**Numerics on the GPU** (same run: 104 chunks, `t_limit` 40, {n['resets']} position resets):
- *mode only* — the same FP8 engine with the ring, its image and graphs vs. the baseline cache mode (per-call
  concatenate, rotate, quantize): per-chunk relative RMS of the latents max **{n['mode_only']['max_rel_rms']*100:.2f}%**
  (first quarter {n['mode_only']['first_quarter_max']*100:.2f}%, last quarter {n['mode_only']['last_quarter_max']*100:.2f}%: no growth);
- *vs the bf16 baseline on the FP8-dequantized weights* (adds FP8 activation quantization and fast accumulation):
  max {n['vs_bf16_gemms']['max_rel_rms']*100:.2f}% (first quarter {n['vs_bf16_gemms']['first_quarter_max']*100:.2f}%, last {n['vs_bf16_gemms']['last_quarter_max']*100:.2f}%);
- vs the bf16 baseline on the bf16 weights (`max_rel_rms`, the timed chunks): {d['max_rel_rms']*100:.2f}%.

The bound is 2% per chunk: **met** at this init. The init matters and is stated: `scaled` draws every matrix from
N(0, 1/fan_in) and divides the two residual-writing projections (attention O, MLP down) by sqrt(2·60), the
standard depth-scaled initialization of deep transformers (GPT-2, Megatron-LM). The previous session's `unit`
init (no depth scaling) makes this 60-layer random network amplify any rounding: probes of 24 chunks with 3 resets
(`bench/gpu_tune.py`, `tune_…_second.json`; the previous session's 40-chunk floor run at `unit` init,
`floor_57b_tp4_rank0_h200_2026-11-29.json`, agrees: 2.9–3.1%) give

| init | mode only (max) | floor: same engine, input noise perturbed by one bf16 step (max) | ablation: no delta rotation at resets (max) |
|---|---|---|---|
| scaled | {ns['mode_only_max']*100:.2f}% | {ns['floor_max']*100:.2f}% | {ns['ablation_no_delta_rotation_max']*100:.2f}% |
| unit | {nu['mode_only_max']*100:.2f}% | {nu['floor_max']*100:.2f}% | {nu['ablation_no_delta_rotation_max']*100:.2f}% |

At both inits the ring-vs-baseline difference is below the one-bf16-step floor of the same weights. **Weak
spot:** on random weights this end-to-end comparison is a poor detector of position bugs — dropping the delta
rotation entirely moves it only to {ns['ablation_no_delta_rotation_max']*100:.2f}% (scaled), still under 2%, because random attention barely depends on
position. Position handling is checked where it is observable: tests/core (ring vs baseline with FP8 off to
< 1e-5, and the same ablation caught) and the trained `ref` character's quality gate (docs/reference_model.md).

## The whole 57b model on one H200 (TP = 1, FP8)

```
python -m vivant bench step --preset 57b --tp 1 --device cuda --mode optimized --chunks 20 --warmup 3 \\
    --fast-accum --out bench/results/step_57b_tp1_h200_2026-11-29.json
```

{t1['weights_gb']:.1f} GB on the GPU (FP8 block weights, bf16 embeddings/modulation, the ring and its image).
Optimized **{t1['optimized_ms']:.1f} ms per chunk** (median; previous engine {t1_prev['optimized_ms']:.1f}; {t1['fp8_tflops']:.0f} FP8 TFLOP/s,
{t1['pct_fp8_ceiling']:.1f}% of the ceiling at the TP=1 shapes). With 3 warm-up chunks the ring becomes fully valid inside
the timed chunks: chunks 3–6 run masked attention (~420 ms) and chunk 7 captures the all-valid graph
({max(t1['optimized_per_chunk_ms']):.1f} ms, the p99 of {t1['optimized_p99_ms']:.1f} ms); the steady state is ~390–398 ms. Not real time on
one GPU (166.7 ms budget), which is why a session uses 4 DiT GPUs. The bf16 baseline does not fit beside the
FP8 copy at TP=1 and was not run.

## VAE decoder, 57b (704×1088), one H200

```
python -m vivant bench decode --preset 57b --device cuda --chunks 20 --json --out bench/results/decode_57b_h200_2026-11-29.json
```

Decoder median **{dec['decode_ms']['median']:.1f} ms per chunk** (p99 {dec['decode_ms']['p99']:.1f}; 4 RGB frames of 704×1088 from one latent frame;
random weights). Target ≤ 60 ms: **met**. Two-stage timing in the same JSON, both stages on this machine's one GPU
(tiny DiT + 57b decoder): serial {ts['serial_ms_per_chunk']:.1f} ms vs pipelined {ts['pipelined_ms_per_chunk']:.1f} ms per chunk, with
{ts['overlap_next_fraction_mean']*100:.0f}% of each decode overlapping the next diffusion — the overlap is there, but on one GPU the stages
contend; the decoder's own GPU is the multi-GPU issue's run.

## Two H200s of one host (NCCL): TP = 2, unfused vs fused GEMM + all-reduce

```
STEPS=tp2 bash bench/run_gpu.sh $OUT      # python bench/gpu_tp2.py --out $OUT/tp2_57b_shapes.json
```

A 2-GPU machine was lent late in the session (the multi-GPU issue's runs need 4 + 1 GPUs). One process per GPU,
NCCL, NVLink multicast off; the 57b block shapes at TP = 2 with {tp2['layers']} layers (random weights), the FP8
engine with CUDA graphs, {tp2['chunks']} chunks ({tp2['warmup']} warm-up). `bench/results/tp2_57b_shapes_h200x2_2026-11-29.json`:

| | rank 0 | rank 1 |
|---|---|---|
| all-reduce of 757×8192 bf16 (12.4 MB), median | {t2a['allreduce_757x8192_bf16_ms']*1e3:.0f} µs | {t2b['allreduce_757x8192_bf16_ms']*1e3:.0f} µs |
| chunk, GEMM then all-reduce | {t2a['unfused_ms']:.1f} ms | {t2b['unfused_ms']:.1f} ms |
| chunk, fused (symmetric-memory scaled matmul + reduce-scatter, all-gather) | {t2a['auto_ms']:.1f} ms | {t2b['auto_ms']:.1f} ms |
| chunk, fused (chunked overlap) | {t2a['chunked_overlap_ms']:.1f} ms | {t2b['chunked_overlap_ms']:.1f} ms |
| fused latents vs unfused (max relative RMS) | {t2a['auto_rel_rms_vs_unfused_max']:.1e} / {t2a['chunked_overlap_rel_rms_vs_unfused_max']:.1e} | {t2b['auto_rel_rms_vs_unfused_max']:.1e} / {t2b['chunked_overlap_rel_rms_vs_unfused_max']:.1e} |

Both fused paths ran on the GPUs and gave latents bitwise equal to the unfused path (with two ranks every
reduction is one addition, whatever the order), but they were **slower** than GEMM then all-reduce here (+4 %
and +7 %). The all-reduce measured {t2a['allreduce_757x8192_bf16_ms']*1e3:.0f} µs for 12.4 MB, about 3× what the bytes-at-360 GB/s model
used for the TP = 4 estimate above gives at TP = 2 ({12.4e6/360e9*1e6:.0f} µs): that estimate (24.8 ms per chunk) is
optimistic, and at these message sizes the TP all-reduce would add roughly 2 × 240 × 0.1 ms ≈ 50 ms per chunk unless
it is overlapped with compute — which is what the fused path exists for, and why it has to get faster than it is here.
Not understood yet: the unfused chunk
time itself (≈ {t2a['unfused_ms']/ (tp2['layers']*4):.2f} ms per layer-pass against ≈ 1.1 ms expected from the one-GPU component timings at twice the
TP = 4 widths) — to be profiled on the next multi-GPU lease. The 1 DiT + 1 decoder layout over NCCL
(`STEPS=layout`) did not finish inside the call's time limit and has no result.

## CPU (correctness harness, not a performance claim)

```
vivant bench step --preset tiny --chunks 30
```
On the 2-core development machine the two modes run within a few percent of each other (the tiny cache is 91
slots; whole-cache work is negligible there) and agree to < 0.1% relative RMS.""")
