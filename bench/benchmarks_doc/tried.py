"""Tried, and why not: what was measured against the served choices and not kept, one row each, with the result file
that measured it. Those files, the probes that wrote them and the page that discussed them at length are archived at
the git tag ARCHIVE_TAG, not in the tree; the figures here are quoted from them."""

from __future__ import annotations

from vivant.bench.benchmarks_doc.results import ARCHIVE_TAG

STEP = "step_57b_tp4_rank0_h200"  # the per-rank step's files at the tag
TUNE = "tune_57b_tp4_rank0_h200"  # the probes' files at the tag

# (what was tried, what it measured, why it is not served, its result files at the tag)
ROWS = (
    ("an FP8 ring (K/V stored as e4m3 codes + row scales)",
     "on the trained `ref`: served engine vs float32 latent max 36.0 % (bf16 ring 30.9 %); 57b step 110.11 vs 109.95 ms",
     "its K/V rounding is a large share of the error and buys no speed: attention reads bf16 either way",
     "quality_ref_cuda_h200_2026-12-02{,_bf16-ring}.json, " + STEP + "_2026-12-02_ring-{fp8,bf16}.json"),
    ("serving a checkpoint as trained (its weights rounded by the engine)", "the four projections' weights in float32 "
     "instead: median 9.0 → 4.5 %, max 36.0 → 24.2 % (H200, FP8 ring): the weights' rounding is the largest single "
     "cause", "an FP8-native checkpoint (weights on the e4m3 grid) removes it for free",
     "fp8_sensitivity_ref_cuda_h200_2026-12-02.json"),
    ("an FP8-native checkpoint without the QAT fine-tune",
     "latent max 19.6 %, 41.6 dB (FP8-QAT: 7.3 %, 42.0 dB)", "the fine-tune under the served rounding halves the worst "
     "chunk (docs/reference_model.md)", "quality_ref_cuda_h200_2026-12-02_fp8-native.json, "
     "quality_compare_ref_cuda_h200_2026-12-02_fp8-qat.json"),
    ("the O projection in bf16 (attention's output unquantized)",
     "worst chunk 19.6 → 10.6 % on the FP8-native checkpoint; 9.7 → 8.8 % on a 120 s QAT run, its last quarter higher",
     "no gain on the shipped checkpoint",
     "fp8_sensitivity_ref_cuda_h200_2026-12-02_activations-fp8-native.json"),
    ("finer FP8 weight scales (one per 32 inputs)", "e4m3 weight rounding 2.4 % against 2.6 % per output channel",
     "e4m3's 3 mantissa bits set the error at any scale granularity", "fp8_sensitivity_ref_cpu_2026-12-02.json"),
    ("FP8 attention (cuDNN `sdpa_fp8`)", "56.6 against 71.6 µs per call at 4 KV parts (≈ 3.6 ms per chunk); error "
     "5.9 % against 0.37 % in bf16", "adds the rounding of q, P and O to the trained model's; its quality cost is "
     "unmeasured", TUNE + "_2026-12-02_fp8-attention.json"),
    ("the Triton FP8 ring attention kernel; dequantize + SDPA", "290 and 105 µs per call against 83 for cuDNN over the "
     "bf16 image", "slower", STEP + "_2026-11-29.json"),
    ("every cuDNN plan for the attention call", "the fastest correct plan is the one torch takes (70.0 µs); the next "
     "127.3", "nothing to gain", TUNE + "_2026-12-02_cudnn-plans.json"),
    ("other KV splits, padded query rows", "1 / 2 / 4 parts 82.8 / 87.9 / 70.6 µs; 8 / 16 parts 74.7 / 83.1; 1,024 rows "
     "85.4", "4 parts (`kv_splits = auto`) is the fastest shape", TUNE + "_2026-12-02_attention-shapes.json"),
    ("cuDNN's FP8 GEMM for QKV", "103.5 against cuBLASLt's 66.6 µs", "slower", TUNE + "_2026-12-02_cudnn-gemm.json"),
    ("a stream-K FP8 GEMM in Triton for QKV", "68.1 against cuBLASLt's 66.7 µs", "Triton's tile loop is slower per "
     "tile by about what stream-K saves", TUNE + "_2026-12-02_streamk.json"),
    ("the QKV GEMM split by N, or its tail over K", "67.0–87.4 µs (N) and 74.0–80.1 (K) against 66.8 / 71.9 unsplit",
     "slower", TUNE + "_2026-12-02_probes-first.json"),
    ("GEMMs padded to 768 / 896 / 1,024 rows", "qkv 78.8 (757 rows) / 70.7 / 73.7 / 81.3 µs, the card's clock moving "
     "more than the shape", "not reliably faster", TUNE + "_2026-12-02_gemm-rows.json"),
    ("exact FP8 accumulation", "slower for every GEMM (qkv 76.2 against 72.4 µs fast)", "fast accumulation is served",
     TUNE + "_2026-12-02_fast-accum-ab.json"),
    ("persistent row kernels", "residual 13.0 against 13.7 µs in one configuration, its neighbours slower; SwiGLU 8.3 "
     "against 7.3", "one lease's evidence, no consistent gain", TUNE + "_2026-12-02_persistent-rows.json"),
    ("programmatic dependent launch of the Triton kernels", "step 108.9 against 108.2 ms", "within noise",
     TUNE + "_2026-11-29_eighth.json"),
    ("the next chunk's inputs prepared early, copied from pageable memory", "0.30 ms out of the chunk start, 0.55 ms "
     "more at its end", "no net gain", TUNE + "_2026-11-29_timeline_prefetch.json"),
    ("`Tensor.pin_memory()` per chunk", "device idle before the first pass / after the last 2.25 / 0.38 ms against "
     "1.92 / 0.18", "two pinned staging sets, reused, are served",
     TUNE + "_2026-12-02_{probes-first,row-kernels}.json"),
    ("the residual fold with a separate output", "0.7 ms per chunk gained against 2.7 ms in place",
     "in place (C = D = x) is served", "residual_ab_57b_tp4_rank0_h200_2026-12-03_{separate-output,in-place}.json"),
    ("fused GEMM + all-reduce at TP = 2 (two H200s)", "120.9 / 123.8 ms per chunk against 115.8 unfused; the "
     "all-reduce of 757 × 8192 bf16 took 98 µs",
     "slower at two ranks; the `fusedGemmAllReduce` flag stays off", "tp2_57b_shapes_h200x2_2026-11-29.json"),
    ("random weights at unit gain", "ring vs baseline 3.06 % (scaled init: 0.51 %), as large as a one-bf16-step change "
     "of the input (3.11 %)", "a 60-layer random network amplifies rounding; the benchmarks use `--init scaled`",
     TUNE + "_2026-11-29_second.json, floor_57b_tp4_rank0_h200_2026-11-29.json"),
    ("a 1 s timer per session in the operator", "1,000 sessions held: 0.41 core, 433 MiB, 47 API requests/s, 517 "
     "Redis commands/s; a burst's apply → Streaming p99 352 s", "sweeps and a status queue are served", "fleet_before_1000.json"),
    ("a Kubernetes API client per call", "170 of 1,133 profile samples in TLS handshakes", "one shared client",
     "fleet_operator_profile_1000.json"),
    ("splicing a turn at a chunk boundary", "share p50 129 ms (`ref`, H200) against 62 ms at a frame",
     "the frame splice is served", "gpu_run_log_2026-12-02_ablation-turn.txt"),
)


def section() -> str:
    rows = "\n".join(f"| {what} | {measured} | {why} | `{files}` |" for what, measured, why, files in ROWS)
    return f"""## Tried, and why not

Measured against the served choices and not kept. The probes that measured them (`bench/gpu_tune.py` and the
`bench/gpu_*probe*.py` family, `bench/fp8_sensitivity.py`, `bench/gpu_floor.py`, `bench/gpu_tp2.py`), their results,
the raw GPU run logs and the long discussion of each are archived at the git tag `{ARCHIVE_TAG}`:
`git show {ARCHIVE_TAG}:bench/results/FILE` prints a result, `git show {ARCHIVE_TAG}:docs/BENCHMARKS.md` the page
of that date.

| tried | measured | why not | `bench/results/` at the tag |
|---|---|---|---|
{rows}
"""
