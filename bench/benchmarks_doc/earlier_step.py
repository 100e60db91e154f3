"""The 57b per-rank step (TP = 4, rank 0) as measured on 2026-11-29 with the engine before its unification: the final
engine of that day on four leases, its kernel-by-kernel profile and numerics, what each change of that session
measured, and the history of the previous engine (baseline against optimized, each step's gain, the init's effect on
numerics). It keeps the evidence behind the kernels the unified engine still runs."""

from __future__ import annotations

from vivant.bench.benchmarks_doc.results import tp4, tune


def _lease_row(name, j, r):
    prof_g = r["optimized_profile"]["ms_per_chunk_by_category"]["gemms"]
    base = f"{r['baseline_ms']:.0f}" if "baseline_ms" in r else "—"
    speed = f"{r['speedup']:.2f}×" if "speedup" in r else "—"
    return (f"| {name} | `{j}` | **{r['optimized_ms']:.1f}** | {r['optimized_p99_ms']:.1f} | {base} | {speed} | "
            f"{r['gemm_ceiling']['fp8_ms_per_layer_pass'] * 1e3:.0f} | {prof_g:.1f} |")


def section() -> str:
    d, rep, post = tp4(), tp4("repeat"), tp4("after-refactor")
    pre_sync, pre_mod, prev = tp4("before-host-sync-fix"), tp4("before-modulation-cache"), tp4("previous-engine")
    lease = {k: tp4(f"final_lease-{k.lower()}") for k in "DEF"}
    lease_g = tp4("prefetch-v1_lease-g")
    fd = lease["D"]
    tune1, tune2, tune3 = tune("first"), tune("second"), tune("third")
    t5, t5w, t6, t6w, t8 = (tune(x) for x in ("fifth", "fifth_cublaslt_ws0", "sixth", "sixth_cublaslt_ws0", "eighth"))
    tl0 = tune("timeline")["timeline"]["median_ms"]
    tl1 = tune("timeline_prefetch")["timeline"]["median_ms"]
    t3s = tune3["step"]
    c, g, bb, n = d["components_ms_per_call"], d["gemm_ceiling"], d["baseline_breakdown_ms"], d["numerics"]
    prof = d["optimized_profile"]["ms_per_chunk_by_category"]
    res_k = d["optimized_profile"]["top_kernels_ms_per_chunk"]["_residual_ln_mod_quant_kernel"]
    busy = sum(prof.values())
    p1 = tune1["step"]["current"]["profile"]["top_kernels_ms_per_chunk"]
    ns, nu = tune2["numerics_scaled"], tune2["numerics_unit"]
    rnd = tune3["rounding"]
    gem = tune3["gemms"]
    lease_rows = "\n".join(
        [_lease_row(k, f"final_lease-{k.lower()}.json", lease[k]) for k in "DEF"]
        + [_lease_row("G (+ a next-chunk prefetch, not kept)", "prefetch-v1_lease-g.json", lease_g)])
    final_ms = sorted(r["optimized_ms"] for r in (*lease.values(), lease_g))
    fprof = fd["optimized_profile"]["ms_per_chunk_by_category"]
    fgaps = fd["optimized_profile"]["gaps"]
    fbusy = sum(fprof.values())
    fn = fd["numerics"]
    st6, st6w, st8 = t6["step"], t6w["step"], t8["step"]
    mem6 = st6["image_fast_accum"]["profile"]["top_kernels_ms_per_chunk"]["Memset (Unknown)"]["calls_per_chunk"]
    mem6w = st6w["image_fast_accum"]["profile"]["top_kernels_ms_per_chunk"]["Memset (Unknown)"]["calls_per_chunk"]
    lu, lw = t5["launch"]["us"], t5w["launch"]["us"]
    sc8 = t8["split_combine"]["us"]
    pdl_pairs = {k: v for k, v in lu.items() if isinstance(v, dict)}
    return f"""## Earlier figures (2026-11-29, the engine before the unification)

The sections below were measured on 2026-11-29 with the classes the engine had then (the separate `FastDiT`;
the kernels are the same). Logs: `bench/results/gpu_run_log_2026-11-29*.txt`.

## DiT chunk step, 57b, one tensor-parallel rank (TP = 4, rank 0) on one H200 — final engine

```
STEPS=tp4,tp1 STEP_ARGS=--fast-accum bash bench/run_gpu.sh $OUT
#   runs: python -m vivant bench step --preset 57b --tp 4 --rank 0 --device cuda --chunks 20 --warmup 8 \\
#             --numerics-chunks 104 --fast-accum --out $OUT/step_57b_tp4_rank0.json
# lease F: NUMERICS_CHUNKS=0 STEPS=tp4 STEP_ARGS="--fast-accum --chunks 40" bash bench/run_gpu.sh $OUT
```

Shard: 16 heads, QKV N=6144, O K=2048, gate+up N=13824, down K=6912; 757 new tokens over a 5,788-slot ring;
4 passes × 60 layers = 240 attention calls per chunk. Random init `{fd['init']}`; attention `{fd['attn_backend']}` (cuDNN over
the ring's bf16 read image) in {fd['attn_kv_splits']} KV parts per call (`attn_kv_splits="auto"`); FP8 fast accumulation on;
cuBLASLt workspace {fd['cublaslt_workspace_kib']} KiB (the benchmark and the worker set it, below); programmatic dependent launch off.
The all-reduce after O and down is left out of both modes (identity) and reported apart (an estimate,
{fd['allreduce_estimate_ms_per_chunk']:.1f} ms per chunk at an assumed 360 GB/s; the two-GPU run below measured 3× that per byte).

The same engine on four H200 leases (each lease is another card; one JSON per run; D and E with the 104-chunk
numerics run, F and G with 40 timed chunks):

| lease | JSON `bench/results/step_57b_tp4_rank0_h200_2026-11-29_…` | optimized median ms | p99 | baseline ms | speedup | FP8 GEMM ceiling, µs per layer-pass | GEMMs in the profile, ms per chunk |
|---|---|---|---|---|---|---|---|
{lease_rows}

**Targets.** ≤ 110 ms per chunk: **met on leases D, E and G ({lease['D']['optimized_ms']:.1f}, {lease['E']['optimized_ms']:.1f}, {lease_g['optimized_ms']:.1f} ms), missed on
lease F ({lease['F']['optimized_ms']:.1f} ms)**; median of the four leases {(final_ms[1] + final_ms[2]) / 2:.1f} ms. Lease F is the slowest card of the
four by its GEMMs ({lease['F']['optimized_profile']['ms_per_chunk_by_category']['gemms']:.1f} ms per chunk in the profile against {lease['E']['optimized_profile']['ms_per_chunk_by_category']['gemms']:.1f}–{lease['D']['optimized_profile']['ms_per_chunk_by_category']['gemms']:.1f} on D and E); its chunk
times also drift upward through the run (108.5 → ~111 ms). The previous session's engine measured 109.3, 111.7 and
112.9 ms on its three leases (history below). ≥ 1.6× the baseline: **met** on every lease ({lease['F']['speedup']:.2f}–{lease['D']['speedup']:.2f}×; the
baseline is eager and host-bound, so it moves with each lease's CPU: {lease['F']['baseline_ms']:.0f}–{lease['D']['baseline_ms']:.0f} ms). Numerics: **met** (below).

Lease D, kernel by kernel (torch.profiler CUDA activity of two graph-replayed chunks, per chunk):

| GEMMs | attention (cuDNN, 4 parts) | fused kernels | other (the split's combine + O quantization, embeddings, final layer, memsets) | device idle | chunk |
|---|---|---|---|---|---|
| {fprof['gemms']:.1f} | {fprof['attention']:.1f} | {fprof['fused_kernels']:.1f} | {fprof['other']:.1f} | {fd['optimized_ms'] - fbusy:.1f} | {fd['optimized_ms']:.1f} |

FP8 throughput {fd['fp8_tflops']:.0f} TFLOP/s, {fd['pct_fp8_ceiling']:.1f}% of this lease's measured rowwise `_scaled_mm` ceiling
({fd['gemm_ceiling']['fp8_ceiling_tflops']:.0f} TFLOP/s, exact accumulation; the step's GEMMs run with fast accumulation, faster than that ceiling).
The idle time splits into {fgaps['under_20us_count_per_chunk']:.0f} gaps under 20 µs between graph nodes ({fgaps['under_20us_ms_per_chunk']:.1f} ms, ~0.9 µs each) and
{fgaps['over_20us_ms_per_chunk']:.1f} ms of longer gaps, all at chunk boundaries: around the host→device copies and the first pass's buffer fills (some of
it between the two profiled chunks, outside a chunk's timed window; the profiler also slows the host, so the timeline probe below measures
this without it).

**Numerics on the GPU** (lease D; 104 chunks, `t_limit` 40, {fn['resets']} position resets; lease E gave the same values to the last digit):
mode only (same FP8 engine, ring + image + split attention + graphs vs the baseline cache mode) max
**{fn['mode_only']['max_rel_rms']*100:.2f}%** per chunk (first quarter {fn['mode_only']['first_quarter_max']*100:.2f}%, last quarter
{fn['mode_only']['last_quarter_max']*100:.2f}%: no growth); against the bf16 baseline on the FP8-dequantized weights
{fn['vs_bf16_gemms']['max_rel_rms']*100:.2f}%; against the bf16 weights {fd['max_rel_rms']*100:.2f}%. Bound 2%: met (the init and the weak spots of
this check are discussed in the history section).

### What this session changed, each measured

| change | measurement | effect |
|---|---|---|
| cuBLASLt workspace 0 (`kernels/fp8_gemm.prefer_static_gemm_schedule`) | `tune_…_fifth*.json`: with torch's default workspace every FP8 GEMM was a memset + a dynamic-schedule kernel; with none, the same tiles with a static schedule (`ssched`), no memset: per GEMM inside graphs QKV {lu['gemm_qkv_fast']:.1f} → {lw['gemm_qkv_fast']:.1f} µs, O {lu['gemm_o_fast']:.1f} → {lw['gemm_o_fast']:.1f}, gate+up {lu['gemm_gate_up_fast']:.1f} → {lw['gemm_gate_up_fast']:.1f}, down {lu['gemm_down_fast']:.1f} → {lw['gemm_down_fast']:.1f}. `tune_…_sixth*.json`, one lease, two processes: memsets per chunk {mem6:.0f} → {mem6w:.0f} (the rest are cuDNN's) | chunk {st6['image_fast_accum']['median_ms']:.1f} / {st6['image_fast_accum_again']['median_ms']:.1f} → {st6w['image_fast_accum']['median_ms']:.1f} / {st6w['image_fast_accum_again']['median_ms']:.1f} ms |
| split-KV attention, 4 parts (`kernels/split_kv.py`) | cuDNN takes the queries as a stride-0 view of q (bit-equal to a copy, {sc8['partial_sdpa_copied_q_p4']:.1f} → {sc8['partial_sdpa_stride0_q_p4']:.1f} µs); one kernel combines the parts and quantizes the O input ({sc8['combine_quant_p4_w8']:.1f} µs at 8 warps, {sc8['combine_quant_p4_w4']:.1f} at 4); whole call {sc8['split_attention_fp8_p4']:.1f} µs against {t5['attention']['us']['image']:.1f} + quant_rows; 2 parts gained nothing | `tune_…_eighth.json`, one process: chunk {st8['image_fast_accum']['median_ms']:.1f} / {st8['image_fast_accum_again']['median_ms']:.1f} ms → {st8['kv_splits_4']['median_ms']:.1f} / {st8['kv_splits_4_again']['median_ms']:.1f} ms (attention {st8['image_fast_accum']['profile']['ms_per_chunk_by_category']['attention']:.1f} → {st8['kv_splits_4']['profile']['ms_per_chunk_by_category']['attention']:.1f} ms, combine +{st8['kv_splits_4']['profile']['ms_per_chunk_by_category']['other'] - st8['image_fast_accum']['profile']['ms_per_chunk_by_category']['other']:.1f} ms); 2 parts: {st8['kv_splits_2']['median_ms']:.1f} ms |
| programmatic dependent launch of the Triton kernels, **not kept** (the engine has no PDL switch now; the kernels keep their `pdl` option for `bench/gpu_probes.py`) | per boundary inside graphs: {", ".join(f"{k} {v['saved_us']:+.1f} µs" for k, v in pdl_pairs.items())} (positive = saved); outputs bit-equal | step within noise: `tune_…_sixth*`, `…_seventh`, `…_eighth` (e.g. {st8['kv_splits_4']['median_ms']:.1f} vs {st8['kv_splits_4_pdl_no_gate_up']['median_ms']:.1f} ms) |
| a persistent residual + norm + FP8 kernel (gate/shift/scale loaded once per program, pipelined row loop), **dropped** | `tune_…_seventh.json`: 24 settings (programs 132–528, stages 1–3, 8/16 warps), best 18.0 µs against the row kernel's 16.2 µs | not kept |

**Chunk-start host work** (`CUBLASLT_WORKSPACE_SIZE=0 STEPS=tune TUNE_PARTS=timeline bash bench/run_gpu.sh $OUT`: CUDA events
around every pass, no profiler; lease F): median per chunk {tl0['wall']:.1f} ms = {tl0['before_first_pass']:.2f} ms with the device idle while the host prepares the chunk (audio features,
positions, noise, host→device copies) + {tl0['passes_sum']:.1f} ms of passes + {tl0['between_passes_sum']:.2f} ms between passes + {tl0['after_last_pass']:.2f} ms at the end
(`tune_…_timeline.json`). Preparing the next chunk's noise and positions while the current one runs (lease G,
`tune_…_timeline_prefetch.json`; another card and host, so the comparison is rough) moved {tl0['before_first_pass'] - tl1['before_first_pass']:.2f} ms out of the chunk start but its pageable host→device copies
then held the chunk's end ({tl1['after_last_pass']:.2f} ms there instead of {tl0['after_last_pass']:.2f}): no net gain, not kept. Pinned, non-blocking
copies are the next step; not measured.

**What is left, by the profile:** GEMMs ({fprof['gemms']:.1f} ms; by its kernel name the QKV GEMM runs 128×128 tiles, 288 for 132 SMs,
2.2 waves), attention ({fprof['attention']:.1f} ms), the residual + norm + FP8 kernel (~20 µs per call in the step, 476 calls, ~2.2 TB/s
for its 43 MB against ~4.3 TB/s of copy bandwidth), ~2.4 ms of launch gaps between ~2,700 graph nodes, ~1.4 ms of host
preparation per chunk, and the spread between cards, which is larger than the margin.

### History: the previous session's engine


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
log-sum-exp; `--attn-kv-splits 2`), built and tested on CPU after that session's GPU time was spent (measured in the
next session: above).

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
"""
