"""Write docs/BENCHMARKS.md from the committed JSON under bench/results/ (so every figure in the doc is one
of those files' numbers). Usage: python bench/benchmarks_md.py > docs/BENCHMARKS.md"""

import json
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
from vivant.bench.ablation_md import head_section as ablation_head_section
from vivant.bench.fleet.doc_section import section as fleet_section

R = Path(__file__).resolve().parent / "results"


def load(name: str) -> dict:
    return json.loads((R / name).read_text())


def tp4(tag: str = "") -> dict:
    return load(f"step_57b_tp4_rank0_h200_2026-11-29{'_' + tag if tag else ''}.json")


def tune(tag: str) -> dict:
    return load(f"tune_57b_tp4_rank0_h200_2026-11-29_{tag}.json")


d, rep, post = tp4(), tp4("repeat"), tp4("after-refactor")
pre_sync, pre_mod, prev = tp4("before-host-sync-fix"), tp4("before-modulation-cache"), tp4("previous-engine")
t1_old = load("step_57b_tp1_h200_2026-11-29.json")
t1 = load("step_57b_tp1_h200_2026-11-29_final.json")
t1_prev = load("step_57b_tp1_h200_2026-11-29_previous-engine.json")
lease = {k: tp4(f"final_lease-{k.lower()}") for k in "DEF"}
lease_g = tp4("prefetch-v1_lease-g")
fd = lease["D"]
tune1, tune2, tune3 = tune("first"), tune("second"), tune("third")
t5, t5w, t6, t6w, t8 = (tune(x) for x in ("fifth", "fifth_cublaslt_ws0", "sixth", "sixth_cublaslt_ws0", "eighth"))
tl0 = tune("timeline")["timeline"]["median_ms"]
tl1 = tune("timeline_prefetch")["timeline"]["median_ms"]
dec = load("decode_57b_h200_2026-11-29.json")
tp2 = load("tp2_57b_shapes_h200x2_2026-11-29.json")
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

def _lease_row(name, j, r):
    prof_g = r["optimized_profile"]["ms_per_chunk_by_category"]["gemms"]
    base = f"{r['baseline_ms']:.0f}" if "baseline_ms" in r else "—"
    speed = f"{r['speedup']:.2f}×" if "speedup" in r else "—"
    return (f"| {name} | `{j}` | **{r['optimized_ms']:.1f}** | {r['optimized_p99_ms']:.1f} | {base} | {speed} | "
            f"{r['gemm_ceiling']['fp8_ms_per_layer_pass'] * 1e3:.0f} | {prof_g:.1f} |")


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
gem_fast = ("qkv", "o", "gate_up", "down")
sc8 = t8["split_combine"]["us"]
pdl_pairs = {k: v for k, v in lu.items() if isinstance(v, dict)}

u = [load(f) for f in ("step_57b_tp4_rank0_h200_2026-12-01_unified-1.json",
                        "step_57b_tp4_rank0_h200_2026-12-01_unified-2.json",
                        "step_57b_tp4_rank0_h200_2026-12-02_unified-3.json")]
u_tp1 = load("step_57b_tp1_h200_2026-12-01_unified.json")
sess = {k: load(f"session_ref_tp1_h200_{k}.json") for k in ("2026-12-01_before-warm-up", "2026-12-02_graphs-warmed",
                                                           "2026-12-02_final")}
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


def _q_row(name: str, q: dict) -> str:
    per = q["latent_rel_rms_per_chunk"]
    return (f"| {name} | **{100 * q['latent_rel_rms_max']:.1f} %** | {100 * float(np.median(per)):.1f} % | "
            f"{100 * float(np.percentile(per, 95)):.1f} % | {100 * q['latent_rel_rms_first_quarter']:.1f} % → "
            f"{100 * q['latent_rel_rms_last_quarter']:.1f} % | **{q['psnr_reference_vs_optimized_db']:.1f} dB** | "
            f"{q['lip_sync_optimized']:.4f} / {q['lip_sync_reference']:.4f} ({100 * q['lip_sync_relative_drop']:+.2f} %) | "
            f"{q['psnr_vs_procedural_db']['reference']:.2f} / {q['psnr_vs_procedural_db']['optimized']:.2f} dB |")


qual_rows = "\n".join([
    _q_row("FP8 ring, checkpoint as trained (before)", qual),
    _q_row("bf16 ring, checkpoint as trained", qual_bf16),
    _q_row("bf16 ring, FP8-native checkpoint", qual_nat),
    _q_row("bf16 ring, FP8-QAT checkpoint, 120 s fine-tune (not shipped)", qual_qat1),
    _q_row("**bf16 ring, FP8-QAT checkpoint (served now)**", qual_qat)])


def _pct(v: dict) -> str:
    return f"{100 * v['max']:.1f} % | {100 * v['median']:.1f} % | {100 * v['last_quarter_mean']:.1f} %"


def _quarters(q: dict) -> str:
    return " / ".join(f"{100 * float(np.mean(x)):.2f}" for x in np.array_split(np.array(q["latent_rel_rms_per_chunk"]), 4))


sens_act_rows = "\n".join(f"| {v['variant']} | {100 * v['max']:.1f} % | {100 * v['median']:.1f} % | "
                           f"{100 * v['last_quarter_mean']:.1f} % |" for v in sens_act["variants"])
u_ms = sorted(r["optimized_ms"] for r in u)
sens = load("fp8_sensitivity_ref_cpu_2026-12-02.json")
sens_gpu = load("fp8_sensitivity_ref_cuda_h200_2026-12-02.json")
def _sens_cells(v: dict | None) -> str:
    if v is None:
        return "— | — | —"
    return f"{100 * v['max']:.1f} % | {100 * v['median']:.1f} % | {100 * v['last_quarter_mean']:.1f} %"


sens_cpu_by = {v["variant"]: v for v in sens["variants"]}
sens_gpu_by = {v["variant"]: v for v in sens_gpu["variants"]}
sens_rows = "\n".join(f"| {name} | {_sens_cells(sens_cpu_by.get(name))} | {_sens_cells(sens_gpu_by.get(name))} |"
                      for name in [*sens_cpu_by, *(n for n in sens_gpu_by if n not in sens_cpu_by)])
wr = sens["weight_rounding_rel_rms"]
wr_rows = "\n".join(f"| {k} | {100 * e['per_channel']:.2f} % | {100 * e['per_32_block']:.2f} % |" for k, e in wr.items())


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


u_rows = "\n".join(_u_row(n, r) for n, r in zip(("1", "2 (same machine as 1)", "3 (another machine)"), u, strict=True))
s_rows = "\n".join(_s_row(n, sess[k]) for n, k in (
    ("before: graphs captured in the session, loop-estimated stalls", "2026-12-01_before-warm-up"),
    ("graphs captured at warm-up", "2026-12-02_graphs-warmed"),
    ("final: warm-up also runs the first position reset", "2026-12-02_final")))
fs = sess["2026-12-02_final"]
fst = fs["playout"]["stages_ms"]

ablation_head = ablation_head_section(R)

# ---- 2026-12-02: the row kernels, the host path, three leases ------------------------------------------------
rk = {k: load(f"step_57b_tp4_rank0_h200_2026-12-02_row-kernels-lease-{k.lower()}.json") for k in "ABC"}
rk_tune = load("tune_57b_tp4_rank0_h200_2026-12-02_row-kernels.json")
rk_first = load("tune_57b_tp4_rank0_h200_2026-12-02_probes-first.json")
rk_attn = load("tune_57b_tp4_rank0_h200_2026-12-02_attention-shapes.json")["attention_shapes"]
rk_before = load("step_57b_tp4_rank0_h200_2026-12-02_ring-bf16.json")


def _per_call(st: dict, kernel: str) -> float:
    k = st["optimized_profile"]["top_kernels_ms_per_chunk"][kernel]
    return k["ms"] / k["calls_per_chunk"] * 1e3


def _rk_row(name: str, st: dict, note: str) -> str:
    c = st["optimized_profile"]["ms_per_chunk_by_category"]
    g = st["optimized_profile"]["gaps"]
    return (f"| {name} | **{st['optimized_ms']:.1f}** | {st['optimized_p99_ms']:.1f} | {c['gemms']:.1f} | "
            f"{c['attention']:.1f} | {c['fused_kernels']:.1f} | {c['other']:.1f} | {g['under_20us_ms_per_chunk']:.2f} / "
            f"{g['over_20us_ms_per_chunk']:.2f} | {note} |")


rk_rows = "\n".join([_rk_row("before (`…_ring-bf16.json`, the previous session)", rk_before, "the kernels as they were")]
                    + [_rk_row(f"lease {k} (`…_row-kernels-lease-{k.lower()}.json`)", rk[k], n) for k, n in (
                        ("A", "numerics below; the ablation ran in the same call"), ("B", "same code as A"),
                        ("C", "+ the undo log's word copies; GPU tests 62 of 62"))])
rk_ms = sorted(rk[k]["optimized_ms"] for k in "ABC")
rk_num = rk["A"]["numerics"]["mode_only"]
rk_res_us = {k: _per_call(st, "_residual_ln_mod_quant_kernel") for k, st in (("before", rk_before), ("after", rk["A"]))}
rk_sw_us = {k: _per_call(st, "_swiglu_quant_kernel") for k, st in (("before", rk_before), ("after", rk["A"]))}
_fu = rk_tune["fused"]
rk_default = {n: next(v["us"] for v in _fu[n]["variants"] if v["config"] is None) for n in _fu}
_gs = rk_first["gemm_split"]["qkv"]
_gs2 = rk_tune["gemm_split"]["qkv"]
rk_split = ", ".join(f"{k[6:].replace('_', ' + ')}: {v['one_stream']['us']:.1f} / {v['two_streams']['us']:.1f}"
                     for k, v in _gs.items() if k.startswith("split_"))
rk_tail = ", ".join(f"×{k.rsplit('x', 1)[1]}: {v['us']:.1f}" for k, v in _gs2.items() if k.startswith("split_k_tail"))
_at = {k: v["us"] for k, v in rk_attn.items() if "us" in v}
rk_tl = rk_tune["timeline"]["median_ms"]
rk_ab = load("tune_57b_tp4_rank0_h200_2026-12-02_fast-accum-ab.json")["fast_accum_ab"]
rk_rows_m = load("tune_57b_tp4_rank0_h200_2026-12-02_gemm-rows.json")["gemm_rows"]
rk_rows_txt = "; ".join(f"{n} " + " / ".join(f"{v['median_us'][m]:.1f}" for m in ("757", "768", "896", "1024"))
                        for n, v in rk_rows_m.items())
rk_sk = load("tune_57b_tp4_rank0_h200_2026-12-02_streamk.json")["streamk"]["qkv"]
rk_sk_best = min(((k, v) for k, v in rk_sk.items() if isinstance(v, dict) and "us" in v and v["rel_err"] < 0.01),
                 key=lambda kv: kv[1]["us"])
rk_ab_txt = "; ".join(f"{n} {v['exact_median']:.1f} / {v['fast_median']:.1f}" for n, v in rk_ab.items())
rk_tl_old = load("tune_57b_tp4_rank0_h200_2026-11-29_timeline.json")["timeline"]["median_ms"]
rk_section = f"""## The step's row kernels and host path (2026-12-02, three leases)

The step measured as served (`--fast-accum`: the served engine's GEMMs) after this session's changes: every FP8 row
kernel computes its row scale in one NaN-propagating max reduction (the NaN count was a second reduction with its own
barrier), the LayerNorm kernels load shift/scale after the row statistics (fewer registers held across the
reductions), SwiGLU runs 8 warps per row, the next chunk's positions, slots, valid mask and noise are built in pinned
memory while the device runs the current chunk (`ChunkGenerator.host_inputs`), and the rewind undo log copies its
slot slices as 8-byte words. Log: `bench/results/gpu_run_log_2026-12-02_row-kernels.txt`.

```
STEPS=tp4,ablation STEP_ARGS=--fast-accum NUMERICS_CHUNKS=104 bash bench/run_gpu.sh $OUT      # lease A
STEPS=tp4 STEP_ARGS="--fast-accum --mode optimized" bash bench/run_gpu.sh $OUT             # leases B, C (C: STEPS=tests,tp4)
#   python -m vivant bench step --preset 57b --tp 4 --rank 0 --device cuda --chunks 20 --warmup 8 --fast-accum ...
```

| run | median ms | p99 | GEMMs | attention | row/fused kernels | other | device idle < 20 µs / > 20 µs | |
|---|---:|---:|---:|---:|---:|---:|---:|---|
{rk_rows}

Profile columns are ms per chunk (torch.profiler over two chunks). Median of the three leases **{rk_ms[1]:.1f} ms**
(range {rk_ms[0]:.1f}–{rk_ms[2]:.1f}): **the 100 ms goal is not met**. Numerics on lease A (ring vs baseline cache, same
FP8 engine): {100 * rk_num['max_rel_rms']:.2f} % max over {rk['A']['numerics']['chunks']} chunks with {rk['A']['numerics']['resets']} position resets (first quarter
{100 * rk_num['first_quarter_max']:.2f} %, last {100 * rk_num['last_quarter_max']:.2f} %). Memory per rank is in the ablation section above.

- **Row kernels** (in the step's profile, µs per call): residual + LayerNorm + modulation + FP8
  {rk_res_us['before']:.1f} → {rk_res_us['after']:.1f}, SwiGLU + FP8 {rk_sw_us['before']:.1f} → {rk_sw_us['after']:.1f} (476 and 240 calls per chunk).
  The prototypes that led there, timed in one process against the production kernels as they were
  (`bench/gpu_row_probes.py`, call 1 of the log): residual 16.3 µs → 14.6–14.9 µs without the second reduction and
  with late shift/scale loads; SwiGLU 8.7 → 7.1–7.4 µs; capping registers (`maxnreg` 64–128) never helped. The
  production kernels' configuration sweep after the change (`tune_…_2026-12-02_row-kernels.json`, default
  configurations): residual {rk_default['residual_ln_mod_quant']:.1f} µs, SwiGLU {rk_default['swiglu_quant']:.1f} µs (16 warps; 8 warps
  {next(v['us'] for v in _fu['swiglu_quant']['variants'] if v['config'] == [1, 0, 8]):.1f} µs, now the default), ln_mod_quant {rk_default['ln_mod_quant']:.1f}, quant_rows {rk_default['quant_rows']:.1f}.
- **Host path**: the device idles {rk_before['optimized_profile']['gaps']['over_20us_ms_per_chunk']:.2f} ms per chunk in gaps over 20 µs before, {rk['A']['optimized_profile']['gaps']['over_20us_ms_per_chunk']:.2f}–{rk['C']['optimized_profile']['gaps']['over_20us_ms_per_chunk']:.2f} after
  (mostly the chunk start). Timeline probe (`gpu_tune.py --parts timeline`, no profiler): {rk_tl['before_first_pass']:.2f} ms
  before the first pass, {rk_tl['after_last_pass']:.2f} ms after the last ({rk_tl_old['before_first_pass']:.2f} / {rk_tl_old['after_last_pass']:.2f} on 2026-11-29, before the
  rewind undo log, whose per-chunk save runs at the chunk start). A first try with `Tensor.pin_memory()` per chunk
  was slower ({rk_first['timeline']['median_ms']['before_first_pass']:.2f} / {rk_first['timeline']['median_ms']['after_last_pass']:.2f} ms); the generator keeps two pinned staging sets instead.
- **Tried, not kept.** The QKV GEMM (M = 757, N = 6144, K = 8192: 288 tiles of 128 × 128 on 132 SMs, 2.18 waves),
  unsplit {_gs['unsplit_us']:.1f} µs: split by N into column slices of one output, µs on one stream / two streams:
  {rk_split}; its 512-column tail split over K on side streams (float32 partials summed;
  unsplit {_gs2['unsplit_us']:.1f} µs on that lease): {rk_tail}. The split-KV attention's cuDNN call
  (`tune_…_attention-shapes.json`, µs): 757 queries over 1 / 2 / 4 parts {_at['slots5788_p1_q757']:.1f} / {_at['slots5788_p2_q757']:.1f} / {_at['slots5788_p4_q757']:.1f}; padded to
  768 rows {_at['slots5788_p4_q768']:.1f}; 8 / 16 parts of a 5,792-slot image {_at['slots5792_p8_q757']:.1f} / {_at['slots5792_p16_q757']:.1f}. One part with 1,024 query rows takes
  {_at['slots5788_p1_q1024']:.1f} µs against {_at['slots5788_p1_q757']:.1f} for 757: the call is one wave of 128-row query tiles either way, so the attention is
  bound by how its work divides over 132 SMs, not by its FLOPs; no shape the engine can pass does better than 4 parts.
  Exact (no fast accumulation) GEMMs per shape, in case cuBLASLt's exact kernel were faster for one of them (one sweep
  showed gate/up {rk_tune['gemms']['gate_up']['exact']['us']:.1f} exact against {rk_tune['gemms']['gate_up']['fast']['us']:.1f} fast): alternated 4 times in one process (`tune_…_fast-accum-ab.json`),
  medians exact / fast µs: {rk_ab_txt}: fast accumulation is faster for every GEMM; the one-sweep figure was noise
  (gate/up ranged {min(rk_ab['gate_up']['exact'] + rk_ab['gate_up']['fast']):.0f}–{max(rk_ab['gate_up']['exact'] + rk_ab['gate_up']['fast']):.0f} µs within that process). The GEMMs at 757 rows against 768, 896 and 1,024 (a padded
  activation; `tune_…_gemm-rows.json`, medians of 3 alternated rounds, µs): {rk_rows_txt}: 768 rows are not
  reliably faster (QKV's rounds: {" / ".join(f"{t:.1f}" for t in rk_rows_m['qkv']['us']['757'])} at 757,
  {" / ".join(f"{t:.1f}" for t in rk_rows_m['qkv']['us']['768'])} at 768: the card's clock moves more than the shape does).
- **A stream-K FP8 GEMM for QKV** (`bench/gpu_gemm_probe.py`, Triton: the first 264 tiles data-parallel, the last
  24 tiles' K iterations spread over all 132 programs with float32 atomics and a per-tile counter; checked against
  the float32 reference and for a clean workspace on repeat; `tune_…_streamk.json`): the schedule does what it should
  (with TMA loads {rk_sk['tma=True']['us']:.1f} µs against {rk_sk['tma=True,stream_k=False']['us']:.1f} µs data-parallel only), but its best variant ({rk_sk_best[0]},
  {rk_sk_best[1]['us']:.1f} µs) does not beat cuBLASLt ({rk_sk['cublas_us']:.1f} µs in the same process): the Triton tile loop is slower per tile
  than cuBLASLt's by about what stream-K saves. Not used.
"""

fa = load("tune_57b_tp4_rank0_h200_2026-12-02_fp8-attention.json")["fp8_attention"]
fa_ring = [next(v for v in t["variants"] if v["variant"] == "float parts, FP8 ring")["median"]
           for t in (load("fp8_sensitivity_ref_cpu_2026-12-02.json"), load("fp8_sensitivity_ref_cuda_h200_2026-12-02.json"))]
fa_rows = "\n".join(
    f"| {p[1:]} | {r.get('padded_slots', 5788)} | {r['bf16_us']:.1f} | {r['fp8_us']:.1f} | {r['speedup']:.2f} | "
    + (f"{100 * r['bf16_rel_err']:.2f} / {100 * r['fp8_rel_err']:.2f} |" if "fp8_rel_err" in r else "(padded: timing only) |")
    for p, r in fa.items() if p.startswith("p") and "fp8_us" in r)
fa_section = f"""## FP8 attention with cuDNN (2026-12-02, probe; not in the served engine)

The issue's first attention candidate: attention in FP8. cuDNN's FP8 flash attention (the cuDNN frontend's
`sdpa_fp8`, frontend {fa['cudnn_frontend']}, cuDNN backend {fa['cudnn_backend']}) at the step's shape: 757 queries × 16 heads over 5,788 slots, head_dim
128, the slots in P parts batched into one call as the served split-KV does, Q, K, V in e4m3 with one scale per
tensor, P and O in e4m3 as cuDNN does on Hopper (O scaled by V's scale: |o| ≤ max|v|), the parts combined by their
log-sum-exp. Against the bf16 cuDNN call the engine makes, on the same random inputs (q, k, v standard normal),
µs per call in a CUDA graph and the relative RMS error of the combined output against float32 attention:

```
STEPS=tune TUNE_PARTS=fp8_attn bash bench/run_gpu.sh $OUT          # bench/gpu_cudnn_probe.py
```

| parts | slots | bf16 µs | FP8 µs | speed-up | error bf16 / FP8 % |
|---:|---:|---:|---:|---:|---|
{fa_rows}

FP8 is {fa['p4']['speedup']:.2f}× faster at the served 4 parts ({fa['p4']['bf16_us']:.1f} → {fa['p4']['fp8_us']:.1f} µs, {fa['p4']['fp8_tflops']:.0f} TFLOP/s): about
{240 * (fa['p4']['bf16_us'] - fa['p4']['fp8_us']) / 1e3:.1f} ms per chunk over 240 calls. Its error is {100 * fa['p4']['fp8_rel_err']:.1f} % against {100 * fa['p4']['bf16_rel_err']:.2f} % for bf16; the FP8 inputs alone
(float32 attention over the e4m3-rounded q, k, v) account for {100 * fa['inputs_only_rel_err']:.1f} %. **Not built into the engine this session**: on the
trained `ref` model the FP8 ring's rounding of K and V alone moves the output {100 * fa_ring[0]:.1f} % (CPU) / {100 * fa_ring[1]:.1f} % (H200) median from
the float32 path ("Which FP8 rounding moves the trained model" below), which is why the served engine keeps a bf16 ring; FP8
attention adds the rounding of q, P and O to that, and its {240 * (fa['p4']['bf16_us'] - fa['p4']['fp8_us']) / 1e3:.1f} ms do not reach the 100 ms goal alone. Its quality
cost on `ref` would have to be measured before it could be served. More parts
(6, 8, 12 over a padded image) are slower in FP8 as in bf16.

"""

pr = load("tune_57b_tp4_rank0_h200_2026-12-02_persistent-rows.json")["persistent_rows"]
cp = load("tune_57b_tp4_rank0_h200_2026-12-02_cudnn-plans.json")["cudnn_plans"]
cg = load("tune_57b_tp4_rank0_h200_2026-12-02_cudnn-gemm.json")["cudnn_gemm"]
ht = load("step_57b_tp4_rank0_h200_2026-12-02_host-trims-lease-a.json")
ht_b = load("step_57b_tp4_rank0_h200_2026-12-02_host-trims-lease-b.json")
ht_c = load("step_57b_tp4_rank0_h200_2026-12-02_row-kernels-lease-c.json")


def _pr_row(kernel):
    rows = pr[kernel]
    best = min(((k, v) for k, v in rows.items() if k != "production" and v["us"] and v.get("rel_err", 1) < 2e-2
                and v.get("x_equal", True)), key=lambda kv: min(kv[1]["us"]))
    prod = rows["production"]["us"]
    return (f"production {' / '.join(f'{t:.1f}' for t in prod)} µs; best persistent form ({best[0]}) "
            f"{' / '.join(f'{t:.1f}' for t in best[1]['us'])} µs")


def _plan_stats(plans):
    ok = [v for v in plans.values() if "us" in v and v["rel_err"] < 0.01]
    wrong = [v for v in plans.values() if "us" in v and v["rel_err"] >= 0.01]
    return ok, wrong, min(ok, key=lambda v: v["us"])


cp_ok, cp_wrong, cp_best = _plan_stats(cp["p4"]["plans"])
cp_other = min((v for v in cp_ok if v["plan"] != cp_best["plan"]), key=lambda v: v["us"])
cg_ok, cg_wrong, cg_best = _plan_stats(cg["plans"])


def ht_gap(d) -> float:
    """The chunk boundary's device idle (µs): the gap after the finite flag's device-to-host copy."""
    return next(g["us"] for g in d["optimized_profile"]["gaps"]["largest"] if g["after"].startswith("Memcpy DtoH"))


ht_rows = "\n".join(
    f"| {name} | {d['optimized_ms']:.1f} | {d['optimized_p99_ms']:.1f} | "
    + " | ".join(f"{d['optimized_profile']['ms_per_chunk_by_category'][k]:.1f}" for k in ("gemms", "attention", "fused_kernels"))
    + f" | {d['optimized_profile']['gaps']['over_20us_ms_per_chunk']:.2f} | {ht_gap(d):.0f} |"
    for name, d in (("C (last stop, before the host changes)", ht_c), ("A", ht), ("B", ht_b)))
probe_section = f"""## What cuDNN and persistent row kernels offer (2026-12-02, probes; none served)

Three more candidates for the step, each measured against what the engine runs, in one process per call
(`bench/results/gpu_run_log_2026-12-02_cudnn-probes.txt`, calls 16–22):

```
STEPS=tune TUNE_PARTS=persist,cudnn_plans,cudnn_gemm bash bench/run_gpu.sh $OUT
#   bench/gpu_persistent_rows_probe.py, bench/gpu_cudnn_probe.py (probe_cudnn_plans, probe_cudnn_gemm)
```

- **Persistent row kernels** (`tune_…_persistent-rows.json`; a grid of 1–4 programs per SM walking the rows, the
  next row's loads issued before the current row's reductions, or the loop left to Triton's pipeliner; two rounds
  each, µs per call in a CUDA graph). Residual + LayerNorm + modulation + FP8: {_pr_row('residual_ln_mod_quant')}.
  SwiGLU + FP8: {_pr_row('swiglu_quant')}. The pipeliner's form is slower everywhere. One residual configuration
  gains about {min(pr['residual_ln_mod_quant']['production']['us']) - min(min(v['us']) for k, v in pr['residual_ln_mod_quant'].items() if k != 'production' and v['us']):.1f} µs in isolation and its neighbours lose; not taken into the engine on one lease's evidence.
- **Every cuDNN plan for the attention call** (`tune_…_cudnn-plans.json`; the cuDNN frontend graph of the same
  bf16 split-KV call, heuristic modes A, B and fallback with every plan built, then each engine's kernel
  configurations): torch's op {cp['p4']['torch_op_us']:.1f} µs at 4 parts; the fastest correct plan is the one torch already takes
  ({cp_best['plan']}, {cp_best['us']:.1f} µs); the next best is {cp_other['plan']} at {cp_other['us']:.1f} µs. {len(cp_wrong)} of the plans that built returned
  wrong results (relative error above 1 %, up to {100 * max(v['rel_err'] for v in cp_wrong):.0f} %) and are excluded. Nothing to gain from cuDNN's plan choice.
- **cuDNN's own FP8 GEMMs for QKV** (`tune_…_cudnn-gemm.json`; matmul with the row and column scales fused as its
  epilogue, {len(cg['plans'])} plans and knob values tried, {len(cg_ok)} correct): the fastest, {cg_best['plan']}, takes {cg_best['us']:.1f} µs against
  cuBLASLt's {cg['cublas_us']:.1f} µs in the same process. cuBLASLt stays.

**The step on this session's final code** (calls 20 and 22, two leases, `step_57b_tp4_rank0_h200_2026-12-02_host-trims-lease-{{a,b}}.json`,
the command of lease C above; GPU tests 62 of 62 in call 20):

| lease | median ms | p99 | GEMMs | attention | row kernels | device idle in gaps > 20 µs | chunk-boundary gap µs |
|---|---:|---:|---:|---:|---:|---:|---:|
{ht_rows}

The host changes between lease C and these (the undo log's save reuses its word views; a numpy finite check of the
audio) cut host time on the CPU twin, but on the H200 the idle time at the chunk boundary moved with the lease (lease A
lower, lease B as before): no gain is shown on the device. **The 100 ms goal is still not met.**

"""

tg = {k: load(f"step_57b_tp4_rank0_h200_2026-12-02_tuned-gemms-{k}.json")
      for k in ("lease-a", "lease-a-numerics", "lease-b", "lease-c")}
tg_probe = load("tune_57b_tp4_rank0_h200_2026-12-02_cublaslt.json")["cublaslt_algorithms"]
_QKV_TUNED = "nvjet_sm90_qqtst_96x128_128x7_2x1_v_ssched_bz_ovscale_TNN"
_QKV_HEUR = "nvjet_sm90_qqtst_128x128_128x6_4x2_h_ssched_bz_ovscale_TNT"
_REST = "nvjet_sm90_qqtst_128x128_128x6_1x2_h_ssched_bz_ovscale_TNT"


def _tg_row(name: str, d: dict, note: str) -> str:
    c, g = d["optimized_profile"]["ms_per_chunk_by_category"], d["optimized_profile"]["gaps"]
    top = d["optimized_profile"]["top_kernels_ms_per_chunk"]
    qkv = _per_call(d, _QKV_TUNED if _QKV_TUNED in top else _QKV_HEUR)
    return (f"| {name} | **{d['optimized_ms']:.1f}** | {d['optimized_p99_ms']:.1f} | {c['gemms']:.1f} | {qkv:.1f} | "
            f"{_per_call(d, _REST):.1f} | {c['attention']:.1f} | {c['fused_kernels']:.1f} | "
            f"{g['over_20us_ms_per_chunk']:.2f} | {ht_gap(d):.0f} | {note} |")


def _tg_probe_row(name: str, e: dict) -> str:
    best = min(e["finalists"], key=lambda r: r["median_us"])
    kern = best.get("kernels", ["?"])[-1]
    return (f"| {name} ({e['M']} × {e['N']} × {e['K']}) | {e['torch_median_us']:.1f} ({', '.join(f'{t:.1f}' for t in e['torch_us'])}) | "
            f"{best['median_us']:.1f} ({', '.join(f'{t:.1f}' for t in best['us'])}) | `{kern}` | {e['screened_count']} |")


tg_rows = "\n".join([_tg_row("last stop, lease A (`…_host-trims-lease-a.json`)", ht, "heuristic GEMMs, torch FFT"),
                      _tg_row("last stop, lease B (`…_host-trims-lease-b.json`)", ht_b, "heuristic GEMMs, torch FFT"),
                      _tg_row("A (`…_tuned-gemms-lease-a.json`)", tg["lease-a"], "GPU tests 75 of 75 in the same call"),
                      _tg_row("A again (`…_lease-a-numerics.json`)", tg["lease-a-numerics"],
                              "same card, modes both + numerics"),
                      _tg_row("B (`…_tuned-gemms-lease-b.json`)", tg["lease-b"], ""),
                      _tg_row("C (`…_tuned-gemms-lease-c.json`)", tg["lease-c"], "")])
tg_ms = sorted(tg[k]["optimized_ms"] for k in ("lease-a", "lease-a-numerics", "lease-b", "lease-c"))
tg_num = tg["lease-a-numerics"]["numerics"]
tg_probe_rows = "\n".join(_tg_probe_row(n, tg_probe[n]) for n in ("qkv", "o", "gate_up", "down"))
tg_section = f"""## Tuned cuBLASLt algorithms and a shorter chunk start (2026-12-02, three leases)

cuBLASLt's heuristic gives every FP8 GEMM of the step one answer, and torch takes it: 128 × 128 tiles, which leave
the QKV GEMM (M = 757, N = 6144: 288 tiles on 132 SMs) a third idle in its last wave. `kernels/cublaslt.py` reaches
the libcublasLt torch loaded (ctypes) and lists every configuration cuBLASLt accepts for a shape (tiles × cluster
shapes × custom options, each checked with `cublasLtMatmulAlgoCheck`); run with no workspace, cuBLASLt gives each a
static tile schedule with no memset node. `EngineOptions.gemm_algorithms = tuned` (served on CUDA) times them when
the parts are installed, on six layers' weights, and keeps the fastest per shape if it beats the heuristic's answer by
3 % (`fast_parts.tune_gemms`; the choice is in each step JSON's `gemm_plans`). The probe, one process, every
variant screened once, the 12 fastest timed again in 3 rounds alternated with torch's call (µs per call in a CUDA
graph cycling six weights; log `bench/results/gpu_run_log_2026-12-02_cublaslt.txt`):

```
STEPS=tune TUNE_PARTS=cublaslt bash bench/run_gpu.sh $OUT          # tune_…_2026-12-02_cublaslt.json
STEPS=tests,tp4 STEP_ARGS="--fast-accum --mode optimized" bash bench/run_gpu.sh $OUT   # leases A, B, C
STEPS=tp4 STEP_ARGS=--fast-accum NUMERICS_CHUNKS=104 bash bench/run_gpu.sh $OUT        # lease A again: numerics
```

| GEMM | torch._scaled_mm µs (rounds) | fastest configuration µs (rounds) | its kernel | variants screened |
|---|---:|---:|---|---:|
{tg_probe_rows}

Only QKV gains: a 96 × 128 tile (384 tiles, 2.91 waves) takes 55 µs against 64–80 µs for torch's kernel in the same
rounds; for O, gate/up and down the fastest configuration is within a few percent of torch's, so tuning keeps the
heuristic there. The same rounds show how much the card's clock moves under load (torch's QKV: {', '.join(f'{t:.1f}' for t in tg_probe['qkv']['torch_us'])} µs).

The chunk start also lost host work: the audio features are computed in numpy instead of torch's CPU ops, and the
next chunk's rotary angles are computed with its other host
inputs while the current chunk runs, then copied from pinned memory (`ChunkGenerator.host_inputs`).

The step, `python -m vivant bench step --preset 57b --tp 4 --rank 0 --device cuda --chunks 20 --warmup 8
--fast-accum [--mode optimized]` (profile columns: ms per chunk; QKV and "other GEMMs" are µs per call):

| run | median ms | p99 | GEMMs | QKV µs | other GEMMs µs | attention | row kernels | idle in gaps > 20 µs | chunk-boundary gap µs | |
|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|
{tg_rows}

Median of the four runs {tg_ms[1]:.1f}–{tg_ms[2]:.1f} ms (range {tg_ms[0]:.1f}–{tg_ms[-1]:.1f}), against 106.5 / 107.5 ms for the
last stop's final code: about 1.5 ms. In the step the QKV GEMM went from about 74 to 59 µs per call (−3.5 ms per
chunk), but the other GEMMs' kernel ran 1.5–2.5 µs slower per call on these leases than on the last stop's. A likely
cause is the card's clock under sustained FP8 load (time saved in one kernel partly returned as a lower clock in the
others), but these runs do not separate it from lease-to-lease variation. The device's idle time at the chunk boundary went
from 1317 / 1731 µs to 527–1037 µs. **The 100 ms goal is still not met.** Numerics on the final code (lease A again,
ring vs baseline cache in the same FP8 engine, tuned GEMMs): {100 * tg_num['mode_only']['max_rel_rms']:.2f} % max over
{tg_num['chunks']} chunks with {tg_num['resets']} position resets (first quarter {100 * tg_num['mode_only']['first_quarter_max']:.2f} %, last
{100 * tg_num['mode_only']['last_quarter_max']:.2f} %): no growth. The ablation table above was measured before the
tuning (its optimized row runs the heuristic's GEMMs); `vivant bench step --ablation` now also times a
`heuristic_gemm` row (the tuned algorithms undone), not yet run on a GPU.

"""

print(f"""# Benchmarks

Every figure here comes from a command in `bench/`, run as written, with its JSON committed under
`bench/results/` (this page is generated from those files by `python bench/benchmarks_md.py`). The last section, the
control plane at fleet scale, runs on CPU only (a local cluster on the shared 2-core development machine).
GPU: one NVIDIA H200 (driver 580.159.04, clocks as found, never changed), torch {u[0]['torch']}, triton {u[0]['triton']},
Python 3.12. Random weights of the exact shapes for the 57b figures (docs/ARCHITECTURE.md); the trained `ref`
character for the session and quality figures. Timings are CUDA-event medians after warm-up; kernel timings are
replays of CUDA graphs (the way the engine runs them); per-kernel profiles are torch.profiler CUDA activity over
two graph-replayed chunks.

The GPU runs are made with `bash bench/run_gpu.sh $OUT` on the GPU machine: it assembles the `vivant` namespace
from symlinks (nothing installs there), installs the wheels carried in `.whl/` (redis, pydantic, av at
requirements/worker.txt's pins) and unpacks a Debian `redis-server` carried in `.deb/`, then runs the steps
`STEPS` names. The GPU tests (`pytest -m gpu tests/kernels tests/stream/test_decode_gpu.py tests/core/test_warm_up.py`)
passed: 50 of 50 on 2026-12-01, and 51 of 51 (with the warm-up test) twice on 2026-12-02. Later on 2026-12-02, with
the bf16 ring: 52 of 52 (the bf16-ring kernel test added); then with the ablation's and the rewind's GPU tests
(`tests/core/test_ablation_parts_gpu.py`, `tests/core/test_rewind.py`) 60 of 61 — the memory-report test expected a
separate read image, which the bf16 ring no longer has; fixed, it passed alone on the next lease
(`bench/results/gpu_run_log_2026-12-02_*.txt`). With the new row kernels: 62 of 62 (call 2 of
`gpu_run_log_2026-12-02_row-kernels.txt`), and 62 of 62 again on the final code (call 5: + SwiGLU at 8 warps and
the undo log's word copies).

{ablation_head}
{tg_section}{rk_section}
{fa_section}{probe_section}## The unified engine and the served runtime (2026-12-01/02)

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

### The quality gate on the served engine (`ref`, trained weights)

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

## Earlier figures (2026-11-29, the engine before the unification)

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

## The whole 57b model on one H200 (TP = 1, FP8)

```
python -m vivant bench step --preset 57b --tp 1 --device cuda --mode optimized --chunks 20 --warmup 3 \\
    --fast-accum --out bench/results/step_57b_tp1_h200_2026-11-29_final.json
```

{t1['weights_gb']:.1f} GB on the GPU (FP8 block weights, bf16 embeddings/modulation, the ring and its image).
Optimized **{t1['optimized_ms']:.1f} ms per chunk** (median; the previous session's engine {t1_old['optimized_ms']:.1f}, the one before it {t1_prev['optimized_ms']:.1f}; {t1['fp8_tflops']:.0f} FP8 TFLOP/s,
{t1['pct_fp8_ceiling']:.1f}% of the ceiling at the TP=1 shapes). With 3 warm-up chunks the ring becomes fully valid inside
the timed chunks: chunks 3–6 run masked attention (~420 ms) and chunk 7 captures the all-valid graph
({max(t1['optimized_per_chunk_ms']):.1f} ms, the p99 of {t1['optimized_p99_ms']:.1f} ms); the steady state is ~388–399 ms. Not real time on
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
(`STEPS=layout`, the separate layout program the served runtime replaced) did not finish inside the call's time
limit and has no result.

## CPU (correctness harness, not a performance claim)

```
vivant bench step --preset tiny --chunks 30
```
On the 2-core development machine the two modes run within a few percent of each other (the tiny cache is 91
slots; whole-cache work is negligible there) and agree to < 0.1% relative RMS.""")


# ------------------------------------------------------------------ turn latency by stage (vivant bench turn)
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


def turn_section() -> str:
    files = sorted(R.glob("turn_*.json"))
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
is diffused in less than a frame period (the next chunk is always at least one frame period later)."""


print()
print(turn_section())


# ------------------------------------------------------------------ the control plane at fleet scale (CPU)
FLEET_FILES = ("fleet_before_1000.json", "fleet_after_1000.json", "fleet_after-failover_1000.json")
fb, fa, ff = (load(x) for x in FLEET_FILES)
FLEET_COLUMNS = ("before (a 1 s timer per session)", "after (sweeps, status queue, one API client)",
                 "after, final (+ phase writes first; 2 replicas)")
f_old = load("fleet_after-failover-ef7d919_1000.json")
f_small = load("fleet_small_20.json")
prof = load("fleet_operator_profile_1000.json")["runs"]
p_old, p_new = prof["after-failover-ef7d919 (before the shared API client)"], prof["after (c02f3be, shared API client)"]
fah, fab = fa["phases"]["hold"], fa["phases"]["burst"]  # the first 'after' run: one replica, no kill
ffh, ffb = ff["phases"]["hold"], ff["phases"]["burst"]  # the final run (its hold has the kill in it)
fcores = ffb["cores_by_process"]
bench_cores = sum(v for v in fcores.values() if v > 0)


def _requests_per_session(res: dict) -> float:
    burst = res["phases"]["burst"]
    return burst["operator_api_requests_per_s"] * burst["seconds"] / res["latency"]["burst"]["sessions"]


ffo, ffc = ff["failover"], ff["correctness"]
peer = ff["operator"]["peering"]
killed_utc = datetime.fromtimestamp(ffo["killed_at"], tz=UTC).strftime("%H:%M:%S")


def _load1(res: dict) -> str:
    ld = res["machine"]["load_during_run"]
    return f"{ld['mean_1m']:.1f} mean (min {ld['min_1m']:.1f}, max {ld['max_1m']:.1f})"


fleet_notes = f"""The commits in the table are the `fleet` branch's before it was rebased onto main (the rebase changed their ids);
the operator's source digest beside each identifies the code measured. After these runs the branch was merged with
the fault-hardening work (docs/reliability.md), which adds to the operator: end requests to the status's worker and
the lease's holder at delete, `restore_lease` for a lease Redis lost, orphan-lease release in the pool tick, and the
reap grace. Those were not measured at 1,000 sessions.

**Where the time goes (why the latency goals are missed on this machine).** The machine was saturated: in the
final run's burst {ffb['machine_busy_cores']:.1f} of 2 cores were busy, {bench_cores:.2f} of them the benchmark's own processes
(kube-apiserver {fcores.get('kube-apiserver', 0):.2f}, the simulated workers {fcores.get('sim-workers', 0):.2f}, the operator
{fcores.get('operator-0', 0):.2f}, controller-manager {fcores.get('kube-controller-manager', 0):.2f}, etcd {fcores.get('etcd', 0):.2f},
Redis {fcores.get('redis-server', 0):.2f}), the rest other jobs (tests and benchmarks of other branches); load average
{_load1(ff)}. The operator is not the bottleneck — {ffb['operator_cpu_cores']:.2f} core in the burst,
{fah['operator_cpu_cores']:.2f} while holding 1,000 sessions (first 'after' run, no kill) — the API server is: it served the
operator ≈ {ffb['operator_api_requests_per_s']:.0f} requests/s in the burst (mean API Priority and Fairness queue wait
{ffb['operator_api_mean_apf_wait_s'] * 1e3:.0f} ms, {ffb['operator_api_rejected_429']} rejections: not throttled, slow on starved
cores), ≈ {_requests_per_session(ff):.1f} requests per session over the burst (kopf's finalizer and annotation patches,
the token Secret, the status writes including the 30 s stats refreshes; {_requests_per_session(fb):.0f} before, when a
1 s timer per session wrote status). The assignment handler took {ff['operator']['handlers']['assign']['mean_s']:.2f} s on
average, most of it waiting for the token Secret's create: py-spy of the active replica in the burst of the first
failover run (`bench/results/fleet_operator_profile_1000.json`) put {p_old['assign_by_step']['put_token_secret']} of the
{sum(p_old['assign_by_step'].values())} samples under `_assign` in `put_token_secret`, and {p_old['samples_in_tls_handshakes']}
of all {p_old['samples']} samples in TLS handshakes: every `kubernetes.client.XxxApi()` built a new client and connection.
The first 'after' run (`{FLEET_FILES[1]}`) already had one shared client ({p_new['samples_in_tls_handshakes']} handshake
samples in its profile) but its churn sessions (created during the hold) waited p50
{fa['latency']['churn']['apply_to_assigned_s']['p50']:.0f} s for Assigned: their first status write queued behind the stats
refresh of every session (one write per session per 30 s, ≈ 33/s, more than the ≈ {fah['operator_api_requests_per_s']:.0f}/s
the API server gave the operator while holding). Phase changes go first since (operator/status_writer.py): in the
final run the churn sessions were Streaming after p50 {ff['latency']['churn']['apply_to_streaming_s']['p50']:.1f} s. On a
dedicated control plane (an API server with its own cores) these request rates are well inside what one API server
serves; on 2 shared cores the latency goals need fewer API writes per session (the stats refresh rarer or gone from the
object, kopf's bookkeeping patches merged), not a faster operator.

**The failover** (final run, commit `{ff['versions']['git_commit']}`): two replicas (priorities 1000 and 999, peering lifetime
{ff['config']['peering_lifetime_s']} s), operator-0 SIGKILLed {ff['config']['kill_active_at_s']:.0f} s into the hold (at
{killed_utc} UTC); operator-1 resumed at {', '.join(t[11:19] for t in peer['operator-1']['resumed_at'][:6])} UTC and paused
{peer['operator-1']['pauses']} time(s) before, at the start. {ffo['created_after_kill']} sessions were created after the kill:
all streamed (never streamed {ffo['never_streamed']}, failed {ffo['failed']}), apply → Streaming p99
{ffo['after_kill_apply_to_streaming_s']['p99']:.0f} s; double assignments {ffc['double_assignments']}, leaked leases
{ffc['leaked_leases']}, assignments dropped by a busy worker {ffc['assignments_dropped_busy_worker']}, re-sent (harmless,
dropped by the worker) assignments {ff['sim_workers']['counters'].get('duplicate_assignments', 0)}. The operator CPU of the
final run's hold is the two replicas together (the standby's take-over resumes every object).
The first failover run (`fleet_after-failover-ef7d919_1000.json`, before the shared client, the overlay fix and the
status priority) showed why the overlay fix was needed: the standby resumed twice during a peering flap 5 minutes before
the kill (the active replica's keepalive arrived late on the loaded machine), re-assigned sessions whose Streaming
status was still queued (to the same workers: {f_old['sim_workers']['counters'].get('duplicate_assignments', 0)} re-sent
assignments, 0 double) and wrote Assigned over Streaming (126 objects Assigned and 871 Streaming at one count, while all
997 streamed); the active replica, trusting its own last write over the index, put them right only at their next stats
refresh. It had {f_old['correctness']['double_assignments']} double assignments, {f_old['correctness']['leaked_leases']} leaks,
{f_old['correctness']['sessions_failed']} failed sessions, but {f_old['failover']['never_streamed']} of the
{f_old['failover']['created_after_kill']} sessions created after its kill never streamed before the run deleted them.

**The fixed cost** (`fleet_small_20.json`: `{f_small['command']}`, commit `{f_small['versions']['git_commit']}`, load average
{_load1(f_small)}): at 20 sessions the operator's peak RSS was {f_small['operator']['peak_rss_mib']:.0f} MiB and it used
{f_small['phases']['hold']['operator_cpu_cores']:.3f} core while holding; p99 apply → Streaming
{f_small['latency']['burst']['apply_to_streaming_s']['p99']:.1f} s. docs/ARCHITECTURE.md takes the per-session costs (and the
largest fleet one replica serves) from the difference between this run and the 1,000-session ones.
"""


print()
print(fleet_section(list(zip(FLEET_COLUMNS, FLEET_FILES, (fb, fa, ff), strict=True)), fleet_notes))

