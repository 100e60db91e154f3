"""Write docs/BENCHMARKS.md from the committed JSON under bench/results/ (so every figure in the doc is one
of those files' numbers). Usage: python bench/benchmarks_md.py > docs/BENCHMARKS.md"""

import json
from pathlib import Path

R = Path(__file__).resolve().parent / "results"
d = json.loads((R / "step_57b_tp4_rank0_h200_2026-11-29.json").read_text())
t1 = json.loads((R / "step_57b_tp1_h200_2026-11-29.json").read_text())
dec = json.loads((R / "decode_57b_h200_2026-11-29.json").read_text())
first = json.loads((R / "step_57b_tp4_rank0_h200_2026-11-29_first-run.json").read_text())
second = json.loads((R / "step_57b_tp4_rank0_h200_2026-11-29_second-run.json").read_text())
third = json.loads((R / "step_57b_tp4_rank0_h200_2026-11-29_third-run.json").read_text())
floor = json.loads((R / "floor_57b_tp4_rank0_h200_2026-11-29.json").read_text())
tp2 = json.loads((R / "tp2_57b_shapes_h200x2_2026-11-29.json").read_text())
t2a, t2b = tp2["ranks"]
c, g, ob, bb, n = (d["components_ms_per_call"], d["gemm_ceiling"], d["optimized_breakdown_ms"],
                   d["baseline_breakdown_ms"], d["numerics"])
ts = dec["two_stage"]
print(f"""# Benchmarks

Every figure here comes from a command in `bench/`, run as written, with its JSON committed under
`bench/results/` (this page is generated from those files by `python bench/benchmarks_md.py`).
GPU: one NVIDIA H200 (driver 580.159.04, clocks as found, never changed), {d['torch']}, triton {d['triton']},
Python 3.12, date {d['date']}. Logs: `bench/results/gpu_run_log_2026-11-29*.txt`. Random weights of the exact shapes (DESIGN.md §1). Timings are CUDA-event
medians after warm-up.

The GPU runs were made with `bash bench/run_gpu.sh $OUT` (it assembles the `vivant` namespace from symlinks,
since nothing installs on the GPU machine, then runs the smoke check `bench/gpu_smoke.py`,
`pytest -m gpu tests/kernels` (all passed) and the commands below). Log: `bench/results/gpu_run_log_2026-11-29.txt`.

## DiT chunk step, 57b, one tensor-parallel rank (TP = 4, rank 0) on one H200

```
python -m vivant bench step --preset 57b --tp 4 --rank 0 --device cuda --chunks 20 --warmup 8 \\
    --numerics-chunks 104 --out bench/results/step_57b_tp4_rank0_h200_2026-11-29.json
```

Shard: 16 heads, QKV N=6144, O K=2048, gate+up N=13824, down K=6912; 757 new tokens over a 5,788-slot ring;
4 passes × 60 layers = 240 attention calls per chunk. The all-reduce after O and down is left out of both
modes (identity) and estimated apart: {d['allreduce_estimate_ms_per_chunk']:.1f} ms per chunk from its bytes at an
assumed 360 GB/s NVLink bus bandwidth — an estimate, not a measurement (multi-GPU machines are withheld).

| | baseline | optimized |
|---|---|---|
| median ms per chunk | {d['baseline_ms']:.1f} | **{d['optimized_ms']:.1f}** |
| p99 ms per chunk | {d['baseline_p99_ms']:.1f} | {d['optimized_p99_ms']:.1f} |
| speedup | | **{d['speedup']:.2f}×** |
| GEMMs (component timing × 240) | {bb['gemms']:.1f} (bf16) | {ob['gemms']:.1f} (FP8 rowwise, cuBLASLt) |
| attention | {bb['attention']:.1f} (cuDNN bf16) | {ob['attention']:.1f} (`{d['attn_backend']}`: fused FP8 dequant + SDPA) |
| cache work | {bb['cache_work']:.1f} (cat + rotate + quantize, every call) | in the ring write (inside "other") |
| fused quant / norm / RoPE kernels | — | {ob['fused_quant_elementwise']:.1f} |
| other (measured − components) | {bb['other']:.1f} (eager launches, casts) | {ob['other']:.1f} |
| achieved FP8 TFLOP/s (GEMM FLOPs / chunk time) | | {d['fp8_tflops']:.0f} |
| % of the measured FP8 GEMM ceiling ({g['fp8_ceiling_tflops']:.0f} TFLOP/s at these shapes) | | {d['pct_fp8_ceiling']:.1f}% |

Ceilings measured in the same run (per call): FP8 `_scaled_mm` rowwise QKV {g['qkv']['fp8_ms']*1e3:.0f} µs, O {g['o']['fp8_ms']*1e3:.0f} µs,
gate+up {g['gate_up']['fp8_ms']*1e3:.0f} µs, down {g['down']['fp8_ms']*1e3:.0f} µs = {g['fp8_ms_per_layer_pass']:.3f} ms per layer-pass
({g['fp8_ms_per_layer_pass']*240:.1f} ms per chunk); bf16 {g['bf16_ms_per_layer_pass']:.3f} ms per layer-pass. Attention per call: Triton
FP8 ring kernel {c['attn_triton_fp8_ring']*1e3:.0f} µs, fused dequant + SDPA {c['attn_sdpa_dequant']*1e3:.0f} µs (picked: faster), cuDNN bf16
on an unquantized cache {c['attn_sdpa_bf16']*1e3:.0f} µs. Fused kernels per call: ln_mod_quant {c['ln_mod_quant']*1e3:.1f} µs,
swiglu_quant {c['swiglu_quant']*1e3:.1f} µs, quant_rows {c['quant_rows_o']*1e3:.1f} µs, qk_norm_rope {c['qk_norm_rope']*1e3:.1f} µs.
Baseline cache work per call {c['baseline_cache_work']*1e3:.0f} µs.

**Targets.** Optimized ≥ 1.6× baseline: **met** ({d['speedup']:.2f}×). Optimized ≤ 110 ms per chunk: **missed**
({d['optimized_ms']:.1f} ms). Next steps the breakdown points to: (1) attention ({ob['attention']:.1f} ms vs the
{c['attn_sdpa_bf16']*240:.1f} ms cuDNN floor): the Triton kernel that reads the FP8 ring directly stays at
{c['attn_triton_fp8_ring']*1e3:.0f} µs/call even with split-KV configurations, far from cuDNN's {c['attn_sdpa_bf16']*1e3:.0f} µs — its tiles
need pipelining work (FP8→bf16 conversion on the critical path, no warp specialization); until then the
per-call dequantization of the sdpa backend remains; (2) the fused elementwise kernels ({ob['fused_quant_elementwise']:.1f} ms)
run at a fraction of copy bandwidth (one program per 757 rows, three dependent reductions each) — several rows
per program and the gated residual in the GEMM epilogue are the remaining savings; (3) GEMMs are already at
{g['fp8_ceiling_tflops']:.0f} TFLOP/s on these 757-row problems, so 110 ms needs everything else under ~33 ms.

**Numerics on the GPU** (same run: 104 chunks with `t_limit` 40, so the run crosses {n['resets']} position resets):
- *mode only* — the same FP8 engine (same FP8 weights and activations) with the ring cache and graphs vs. the
  baseline cache mode (per-call concatenate, rotate, quantize): per-chunk relative RMS of the latents max
  {n['mode_only']['max_rel_rms']*100:.2f}% (first quarter {n['mode_only']['first_quarter_max']*100:.2f}%, last quarter {n['mode_only']['last_quarter_max']*100:.2f}%: no growth);
- *vs the bf16 baseline on the FP8-dequantized weights* (adds FP8 activation quantization): max
  {n['vs_bf16_gemms']['max_rel_rms']*100:.2f}% (first quarter {n['vs_bf16_gemms']['first_quarter_max']*100:.2f}%, last {n['vs_bf16_gemms']['last_quarter_max']*100:.2f}%);
- vs the bf16 baseline on the bf16 weights (`max_rel_rms`, the timed chunks): {d['max_rel_rms']*100:.1f}%.

The issue's bound is 2% per chunk: **missed** ({n['mode_only']['max_rel_rms']*100:.2f}% / {n['vs_bf16_gemms']['max_rel_rms']*100:.2f}%). The errors are flat from
chunk 0 — before any cache reuse or reset — and do not grow, so they are not cache drift; both paths differ only by
bf16/FP8 rounding inside 60 random-weight layers, which this random network amplifies to a few percent. The same
comparison on CPU with the `tiny` preset stays under 2% (tests/core/test_fast_dit_cpu.py,
tests/core/test_numerics_ring_vs_baseline.py).

*The floor under these comparisons* (`python bench/gpu_floor.py --chunks 40`, run through `STEPS=floor bash
bench/run_gpu.sh`, `bench/results/floor_57b_tp4_rank0_h200_2026-11-29.json`): the same optimized engine run twice,
the second time with each chunk's input noise perturbed by a relative {floor['input_rel_perturbation']:.1e} (one bf16 rounding
step), gives latents {floor['median_rel_rms']*100:.2f}% apart (median; max {floor['max_rel_rms']*100:.2f}%). So this random-weight 57b
shard turns any rounding-sized difference into ~3% at its output: the mode-only difference
({n['mode_only']['max_rel_rms']*100:.2f}%) is at that floor, and 2% is not reachable by any two paths that round
differently on these weights. The trained `ref` model (docs/reference_model.md) is where the quality gate
compares the paths meaningfully.
The FP8 engine with the baseline cache takes {n['fp8_engine_baseline_cache_ms_median']:.0f} ms per chunk (eager), which attributes
most of the speedup to the ring cache + graphs rather than to FP8 GEMMs.

Earlier runs of the same command, same day: first {first['optimized_ms']:.1f} ms optimized / {first['baseline_ms']:.1f} ms baseline
(a local all-reduce stand-in inside the step, unfused q/k norm + RoPE); second {second['optimized_ms']:.1f} / {second['baseline_ms']:.1f} ms
(stand-in removed; q/k norm + RoPE fused); third {third['optimized_ms']:.1f} / {third['baseline_ms']:.1f} ms (q/k norm + RoPE vectorized).
This run adds the gated residual fused with the next norm + modulation + quantization and split-KV configurations
for the Triton attention (which still lost to dequant + SDPA at these shapes). Component timings are taken alone
and vary by ±30% between runs on this machine (e.g. dequant + SDPA 109 µs in the third run, {c['attn_sdpa_dequant']*1e3:.0f} µs here),
so "other" can come out near zero or slightly negative.

## The whole 57b model on one H200 (TP = 1, FP8)

```
python -m vivant bench step --preset 57b --tp 1 --device cuda --mode optimized --chunks 20 --warmup 3 \\
    --out bench/results/step_57b_tp1_h200_2026-11-29.json
```

{t1['weights_gb']:.1f} GB on the GPU (FP8 block weights + bf16 embeddings/modulation). Optimized **{t1['optimized_ms']:.1f} ms per chunk**
(median; p99 {t1['optimized_p99_ms']:.1f}; {t1['fp8_tflops']:.0f} FP8 TFLOP/s, {t1['pct_fp8_ceiling']:.1f}% of the ceiling measured at the TP=1 shapes).
Not real time on one GPU (166.7 ms budget), which is why a session uses 4 DiT GPUs. The bf16 baseline does not fit
beside the FP8 copy at TP=1 and was not run.

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
