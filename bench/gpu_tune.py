"""Where the optimized 57b chunk step spends its time, and which variants make it faster (one GPU call).

python bench/gpu_tune.py --out OUT/tune.json [--parts kernels,small,split,launch,rows,gemm_split,cublaslt,step,timeline,numerics]

1. Kernel sweeps at the TP=4 rank-0 shapes (757 tokens), each variant checked against its float32 twin on
   fresh random inputs, then timed inside a CUDA graph (20 launches per graph, median of 30 replays — the
   way the engine runs them; an eager do_bench of a few-µs kernel also times its cold L2):
   - the fused FP8 row kernels over (rows per program, tile width, warps) configurations;
   - q/k-norm + RoPE over warps;
   - attention: "sdpa" (whole-ring dequantization + cuDNN), "image" (cuDNN over the read image) plus the
     image refresh of one pass's 757 slots, the Triton FP8 kernel; the image output must equal "sdpa";
   - the four FP8 GEMMs with and without cuBLASLt fast accumulation (time and error vs float32).
   Parts `split` and `launch` (bench/gpu_probes.py): the split-KV combine over warps, memsets per library call,
   programmatic dependent launch at library → Triton boundaries (kernel pairs only: measured within noise, the
   engine does not use it), the GEMMs with no cuBLASLt workspace. Parts `rows` and `gemm_split`
   (bench/gpu_row_probes.py): prototype forms of the residual/SwiGLU row kernels, and the QKV GEMM split by N.
   Part `fp8_attn` (bench/gpu_cudnn_probe.py): cuDNN's FP8 flash attention against the bf16 call;
   `cudnn_plans` / `cudnn_gemm`: every cuDNN plan and knob for the bf16 attention call and the QKV FP8 GEMM.
   Part `persist` (bench/gpu_persistent_rows_probe.py): persistent residual/SwiGLU row kernels with prefetch.
   Part `fold` (bench/gpu_residual_fold_probe.py): the gated residual add in the O/down GEMM's epilogue.
2. The whole step, several engine variants (EngineOptions) on the same FP8 weights (A/B/A order in one process):
   median ms per chunk,
   and a CUDA-kernel profile (torch.profiler) grouped into GEMMs / attention / fused kernels / other, with the
   device's idle gaps. Part `timeline`: CUDA events around every pass, no profiler (host work between passes
   and before a chunk's first pass).
3. Numerics probes on a short run with resets: mode-only (ring vs baseline cache, same FP8 engine) and the
   floor (a one-bf16-step input perturbation) for the "unit" and "scaled" random inits, plus an ablation
   (no delta rotation at resets) that the ≤ 2 % check must catch.
Bytes and FLOPs are counted before timing; GB/s is (bytes read + written) / time.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
import traceback

import numpy as np
import torch
from vivant.bench.gpu_probes import deq, probe_launch, rel, sweep_split_combine
from vivant.bench.gpu_step import _audio, build_rank, graph_us, profile_chunks
from vivant.kernels import fused_quant as fq
from vivant.kernels.fp8 import quantize_rows_ref
from vivant.kernels.fp8_gemm import fp8_linear, fp8_linear_ref, quantize_weight
from vivant.kernels.qk_norm_rope import _qk_norm_rope_kernel, qk_norm_rope_ref
from vivant.kernels.ring_attention import ring_attention, ring_attention_ref
from vivant.kernels.ring_image import dequant_slots
from vivant.worker.model.config import ModelConfig
from vivant.worker.model.engine import Engine
from vivant.worker.model.generator import ChunkGenerator
from vivant.worker.model.options import AttentionBackend, CacheMode, EngineOptions
from vivant.worker.model.tp import local_shapes

DEV = "cuda"
FUSED_CONFIGS = [None, (1, 0, 4), (1, 0, 8), (1, 0, 16), (1, 0, 32), (2, 0, 16), (2, 0, 32), (1, 1024, 4),
                 (2, 1024, 4), (2, 1024, 8), (4, 1024, 8), (4, 512, 4), (1, 2048, 8), (2, 2048, 8), (4, 2048, 16),
                 (8, 256, 4), (8, 512, 8)]


def section(name, fn, res):
    print(f"=== {name}", flush=True)
    t0 = time.time()
    try:
        res[name] = fn()
    except Exception as e:  # one broken section must not cost the others
        traceback.print_exc()
        res[name] = {"error": f"{type(e).__name__}: {e}"}
    print(f"    ({time.time() - t0:.0f} s)", flush=True)


# ---- 1. kernels ------------------------------------------------------------------------------------------
def sweep_fused(cfg) -> dict:
    n, dm, f = cfg.tokens_per_chunk, cfg.d_model, cfg.d_ff // 4
    hd = cfg.shard_heads(4) * cfg.head_dim
    bf = torch.bfloat16
    out = {}

    def cases():
        x = torch.randn(n, dm, device=DEV, dtype=bf) * 3
        y = torch.randn(n, dm, device=DEV, dtype=bf)
        sh, sc, g = (torch.randn(dm, device=DEV, dtype=bf) * 0.3 for _ in range(3))
        gu = torch.randn(n, 2 * f, device=DEV, dtype=bf)
        att = torch.randn(n, hd, device=DEV, dtype=bf)
        return {
            # name: (fn(config), reference, bytes moved)
            "ln_mod_quant": (lambda c: fq.ln_mod_quant(x, sh, sc, config=c), lambda: fq.ln_mod_quant_ref(x, sh, sc),
                             n * dm * 3 + n * 4),
            "residual_ln_mod_quant": (lambda c: fq.residual_ln_mod_quant(x, y, g, sh, sc, config=c)[1:],
                                      lambda: fq.residual_ln_mod_quant_ref(x, y, g, sh, sc)[1:],
                                      n * dm * (2 + 2 + 2 + 1) + n * 4),
            "swiglu_quant": (lambda c: fq.swiglu_quant(gu, config=c), lambda: fq.swiglu_quant_ref(gu),
                             n * 2 * f * 2 + n * f + n * 4),
            "quant_rows": (lambda c: fq.quant_rows(att, config=c), lambda: fq.quant_rows_ref(att),
                           n * hd * 3 + n * 4),
        }

    for name in ("ln_mod_quant", "residual_ln_mod_quant", "swiglu_quant", "quant_rows"):
        rows = []
        for c in FUSED_CONFIGS:
            fn, ref, nbytes = cases()[name]  # fresh random inputs per variant
            try:
                q, s = fn(c)
                rq, rs = ref()
                err = rel(deq(q, s), deq(rq, rs))
                us = graph_us(lambda fn=fn, c=c: fn(c))
                rows.append({"config": c, "us": us, "gbps": nbytes / us / 1e3, "rel_err_vs_ref": err})
                print(f"  {name:<22} {str(c):<16} {us:7.2f} µs {nbytes / us / 1e3:7.0f} GB/s  err {err:.1e}")
            except Exception as e:
                rows.append({"config": c, "error": f"{type(e).__name__}: {e}"[:300]})
                print(f"  {name:<22} {str(c):<16} FAILED {type(e).__name__}: {str(e)[:120]}")
        ok = [r for r in rows if "us" in r and r["rel_err_vs_ref"] < 2e-2]
        out[name] = {"bytes": cases()[name][2], "variants": rows,
                     "best": min(ok, key=lambda r: r["us"]) if ok else None}
    return out


def sweep_qk_norm_rope(cfg) -> dict:
    import triton

    n, h, d = cfg.tokens_per_chunk, cfg.shard_heads(4), cfg.head_dim
    qkv = torch.randn(n, 3 * h * d, device=DEV, dtype=torch.bfloat16)
    w = torch.rand(d, device=DEV, dtype=torch.bfloat16) + 0.5
    ang = torch.rand(n, d // 2, device=DEV) * 6
    cos, sin = ang.cos(), ang.sin()
    qo = torch.empty(n, h, d, device=DEV, dtype=torch.bfloat16)
    ko = torch.empty_like(qo)
    rq, rk = qk_norm_rope_ref(qkv, w, w, cos, sin, h)
    rows = []
    for warps in (1, 2, 4, 8, 16):
        def fn(warps=warps):
            _qk_norm_rope_kernel[(n,)](qkv, w, w, cos, sin, qo, ko, qkv.stride(0), h, 1e-6, D=d,
                                       BLOCK_H=triton.next_power_of_2(h), num_warps=warps)
        fn()
        err = max(rel(qo, rq), rel(ko, rk))
        us = graph_us(fn)
        nbytes = n * h * d * 2 * 4
        rows.append({"num_warps": warps, "us": us, "gbps": nbytes / us / 1e3, "rel_err_vs_ref": err})
        print(f"  qk_norm_rope warps={warps:<3} {us:7.2f} µs {nbytes / us / 1e3:7.0f} GB/s err {err:.1e}")
    return {"variants": rows}


def sweep_attention(cfg) -> dict:
    n, h, d, S = cfg.tokens_per_chunk, cfg.shard_heads(4), cfg.head_dim, cfg.cache_slots
    q = torch.randn(n, h, d, device=DEV, dtype=torch.bfloat16)
    k8, ks = quantize_rows_ref(torch.randn(S, h, d, device=DEV) * 2)
    v8, vs = quantize_rows_ref(torch.randn(S, h, d, device=DEV))
    valid = torch.ones(S, dtype=torch.bool, device=DEV)
    kimg = torch.empty(S, h, d, device=DEV, dtype=torch.bfloat16)
    vimg = torch.empty_like(kimg)
    every = torch.arange(S, device=DEV)
    dequant_slots(k8, ks, every, kimg)
    dequant_slots(v8, vs, every, vimg)
    ref = ring_attention_ref(q, k8, v8, ks, vs, valid)
    res = {"flops_per_call": 4 * n * S * d * h}
    o_sdpa = ring_attention(q, k8, v8, ks, vs, valid, backend="sdpa", all_valid=True)
    o_img = ring_attention(q, k8, v8, ks, vs, valid, backend="image", all_valid=True, k_image=kimg, v_image=vimg)
    res["image_equals_sdpa_bitwise"] = bool(torch.equal(o_sdpa, o_img))
    res["rel_err"] = {"sdpa": rel(o_sdpa, ref), "image": rel(o_img, ref)}
    res["us"] = {
        "sdpa_dequant": graph_us(lambda: ring_attention(q, k8, v8, ks, vs, valid, backend="sdpa", all_valid=True)),
        "image": graph_us(lambda: ring_attention(q, k8, v8, ks, vs, valid, backend="image", all_valid=True,
                                                 k_image=kimg, v_image=vimg)),
        "image_masked": graph_us(lambda: ring_attention(q, k8, v8, ks, vs, valid, backend="image", all_valid=False,
                                                        k_image=kimg, v_image=vimg)),
    }
    for splits in (2, 4):
        o_sp = ring_attention(q, k8, v8, ks, vs, valid, backend="image", all_valid=True, k_image=kimg,
                              v_image=vimg, kv_splits=splits)
        res["rel_err"][f"image_kv_splits_{splits}_vs_image"] = rel(o_sp, o_img)
        res["us"][f"image_kv_splits_{splits}"] = graph_us(
            lambda splits=splits: ring_attention(q, k8, v8, ks, vs, valid, backend="image", all_valid=True,
                                                 k_image=kimg, v_image=vimg, kv_splits=splits))
    slots = torch.randperm(S, device=DEV)[:n]
    res["us"]["image_refresh_757_slots_k_and_v"] = graph_us(
        lambda: (dequant_slots(k8, ks, slots, kimg), dequant_slots(v8, vs, slots, vimg)))
    o_tr = ring_attention(q, k8, v8, ks, vs, valid, backend="triton")
    res["rel_err"]["triton"] = rel(o_tr, ref)
    res["us"]["triton_fp8"] = graph_us(lambda: ring_attention(q, k8, v8, ks, vs, valid, backend="triton"))
    from torch.nn.attention import SDPBackend, sdpa_kernel

    qt, kt, vt = q.transpose(0, 1)[None], kimg.transpose(0, 1)[None], vimg.transpose(0, 1)[None]
    for name, be in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION),
                     ("efficient", SDPBackend.EFFICIENT_ATTENTION)):
        try:
            with sdpa_kernel([be]):
                res["us"][f"bf16_{name}"] = graph_us(lambda: torch.nn.functional.scaled_dot_product_attention(qt, kt, vt))
        except Exception as e:
            res["us"][f"bf16_{name}"] = f"failed: {type(e).__name__}: {str(e)[:100]}"
    for k_, v_ in res["us"].items():
        print(f"  attention {k_:<34} {v_ if isinstance(v_, str) else f'{v_:8.1f} µs'}")
    print(f"  image == sdpa bitwise: {res['image_equals_sdpa_bitwise']}; errors {res['rel_err']}")
    return res


def time_qkv_ring(cfg) -> dict:
    """One pass's QKV → ring work: the three kernels (q/k norm + RoPE(q), ring write, image refresh) vs the
    fused kernel, each inside a CUDA graph, and the fused kernel checked against its twin."""
    from vivant.kernels.cache_write import write_kv
    from vivant.kernels.qk_norm_rope import qk_norm_rope
    from vivant.kernels.qkv_ring import qkv_ring_write, qkv_ring_write_ref
    from vivant.kernels.rope import rope_angles

    n, h, d, S = cfg.tokens_per_chunk, cfg.shard_heads(4), cfg.head_dim, cfg.cache_slots
    qkv = torch.randn(n, 3 * h * d, device=DEV, dtype=torch.bfloat16) * 2
    w = torch.rand(d, device=DEV, dtype=torch.bfloat16) + 0.5
    pos = torch.stack([torch.randint(0, 40, (n,)), torch.randint(0, 22, (n,)), torch.randint(0, 34, (n,))], 1).to(DEV)
    ang = rope_angles(pos, cfg.rope_dims, cfg.rope_theta)
    cos, sin = ang.cos(), ang.sin()
    slots = torch.randperm(S, device=DEV)[:n]
    ring = [torch.zeros(S, h, d, device=DEV, dtype=torch.float8_e4m3fn) for _ in range(2)]
    scales = [torch.ones(S, h, device=DEV) for _ in range(2)]
    imgs = [torch.zeros(S, h, d, device=DEV, dtype=torch.bfloat16) for _ in range(2)]

    def three():
        q_rot, k = qk_norm_rope(qkv, w, w, cos, sin, h)
        write_kv(k, qkv.view(n, 3, h, d)[:, 2], pos, slots, ring[0], ring[1], scales[0], scales[1],
                 rope_dims=cfg.rope_dims, theta=cfg.rope_theta)
        dequant_slots(ring[0], scales[0], slots, imgs[0])
        dequant_slots(ring[1], scales[1], slots, imgs[1])

    def fused(image=True):
        qkv_ring_write(qkv, w, w, cos, sin, slots, ring[0], ring[1], scales[0], scales[1], h,
                       k_image=imgs[0] if image else None, v_image=imgs[1] if image else None)

    q_t = qkv_ring_write(qkv, w, w, cos, sin, slots, ring[0], ring[1], scales[0], scales[1], h, k_image=imgs[0],
                         v_image=imgs[1])
    got = [t[slots].float() * sc[slots][..., None] for t, sc in zip(ring, scales, strict=True)]
    ref_ring = [torch.zeros_like(t) for t in ring]
    ref_sc = [torch.ones_like(t) for t in scales]
    q_r = qkv_ring_write_ref(qkv, w, w, cos, sin, slots, ref_ring[0], ref_ring[1], ref_sc[0], ref_sc[1], h)
    want = [t[slots].float() * sc[slots][..., None] for t, sc in zip(ref_ring, ref_sc, strict=True)]
    res = {"us": {"three_kernels": graph_us(three), "fused_with_image": graph_us(fused),
                  "fused_no_image": graph_us(lambda: fused(False))},
           "rel_err_vs_twin": {"q_rot": rel(q_t, q_r), "k": rel(got[0], want[0]), "v": rel(got[1], want[1])},
           "bytes_fused_with_image": n * h * d * (3 * 2 + 2 + 2 * 1 + 2 * 2)}
    print(f"  qkv→ring {res['us']}  errors {res['rel_err_vs_twin']}")
    return res


def time_rounding(cfg) -> dict:
    """The fused FP8 kernels with the hardware e4m3 conversion (default on GPU) vs the twin's exact arithmetic
    (`exact_rounding=True`): time inside CUDA graphs and the fraction of codes that differ."""
    from vivant.kernels.qkv_ring import qkv_ring_write

    n, dm, f = cfg.tokens_per_chunk, cfg.d_model, cfg.d_ff // 4
    h, d, S = cfg.shard_heads(4), cfg.head_dim, cfg.cache_slots
    bf = torch.bfloat16
    x, y = torch.randn(n, dm, device=DEV, dtype=bf) * 3, torch.randn(n, dm, device=DEV, dtype=bf)
    sh, sc, g = (torch.randn(dm, device=DEV, dtype=bf) * 0.3 for _ in range(3))
    gu = torch.randn(n, 2 * f, device=DEV, dtype=bf)
    att = torch.randn(n, h * d, device=DEV, dtype=bf)
    qkv = torch.randn(n, 3 * h * d, device=DEV, dtype=bf) * 2
    w = torch.rand(d, device=DEV, dtype=bf) + 0.5
    ang = torch.rand(n, d // 2, device=DEV) * 6
    slots = torch.randperm(S, device=DEV)[:n]
    ring = [torch.zeros(S, h, d, device=DEV, dtype=torch.float8_e4m3fn) for _ in range(2)]
    scs = [torch.ones(S, h, device=DEV) for _ in range(2)]
    imgs = [torch.zeros(S, h, d, device=DEV, dtype=bf) for _ in range(2)]

    def qkv_fn(exact):
        qkv_ring_write(qkv, w, w, ang.cos(), ang.sin(), slots, ring[0], ring[1], scs[0], scs[1], h,
                       k_image=imgs[0], v_image=imgs[1], exact_rounding=exact)
        return ring[0][slots].clone(), scs[0][slots].clone()

    fns = {
        "ln_mod_quant": lambda e: fq.ln_mod_quant(x, sh, sc, exact_rounding=e),
        "residual_ln_mod_quant": lambda e: fq.residual_ln_mod_quant(x, y, g, sh, sc, exact_rounding=e)[1:],
        "swiglu_quant": lambda e: fq.swiglu_quant(gu, exact_rounding=e),
        "quant_rows": lambda e: fq.quant_rows(att, exact_rounding=e),
        "qkv_ring_write": qkv_fn,
    }
    out = {}
    for name, fn in fns.items():
        (qa, sa_), (qb, sb) = fn(False), fn(True)
        differ = float((qa.view(torch.uint8) != qb.view(torch.uint8)).float().mean())
        row = {"hw_us": graph_us(lambda fn=fn: fn(False)), "exact_us": graph_us(lambda fn=fn: fn(True)),
               "codes_differ_fraction": differ, "scales_equal": bool(torch.equal(sa_, sb))}
        out[name] = row
        print(f"  {name:<22} hw {row['hw_us']:6.2f} µs  exact {row['exact_us']:6.2f} µs  codes differ {differ:.2e}"
              f"  scales equal {row['scales_equal']}")
    return out


def sweep_gemms(cfg) -> dict:
    m = cfg.tokens_per_chunk
    out = {}
    for name, (n, k) in local_shapes(cfg, 4).items():
        a8, sa = quantize_rows_ref(torch.randn(m, k, device=DEV))
        w8, sw = quantize_weight(torch.randn(n, k, device=DEV) / math.sqrt(k))
        ref = fp8_linear_ref(a8, sa, w8, sw)
        row = {"N": n, "K": k}
        for fast in (False, True):
            y = fp8_linear(a8, sa, w8, sw, fast_accum=fast)
            us = graph_us(lambda fast=fast, a8=a8, sa=sa, w8=w8, sw=sw: fp8_linear(a8, sa, w8, sw, fast_accum=fast))
            row["fast" if fast else "exact"] = {"us": us, "tflops": 2 * m * n * k / us / 1e6, "rel_err": rel(y, ref)}
        out[name] = row
        print(f"  gemm {name:<8} exact {row['exact']['us']:6.1f} µs ({row['exact']['tflops']:5.0f} TF/s, "
              f"err {row['exact']['rel_err']:.1e})  fast {row['fast']['us']:6.1f} µs "
              f"({row['fast']['tflops']:5.0f} TF/s, err {row['fast']['rel_err']:.1e})")
    return out


# ---- 2. the whole step
def chunk_events(gen, cfg, count):
    """Generate `count` chunks; yield (index, start event, end event) of each once it has finished."""
    for i in range(count):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        gen.generate_chunk(_audio(cfg, i), cfg.audio_sample_rate)
        b.record()
        torch.cuda.synchronize()
        yield i, a, b


def engine(model, backend, *, fast_accum=True, kv_splits=1, graphs=True) -> Engine:
    """An engine over the FP8 rank `model` (build_rank keep_bf16=False) with these options; engines built from one
    model share its FP8 weights."""
    return Engine.build(model, EngineOptions(fp8=True, attention=backend, kv_splits=kv_splits, fast_accum=fast_accum,
                                             cuda_graphs=graphs))


def time_variant(model, cfg, backend, fast_accum, configs, warmup=8, chunks=10, prof=False, kv_splits=1) -> dict:
    saved = dict(fq.DEFAULT_CONFIGS)
    if configs:
        fq.DEFAULT_CONFIGS.update(configs)
    try:
        eng = engine(model, backend, fast_accum=fast_accum, kv_splits=kv_splits)
        gen = ChunkGenerator(cfg, mode=CacheMode.OPTIMIZED, device=DEV, dtype=torch.bfloat16, engine=eng, seed=0)
        ts = [a.elapsed_time(b) for i, a, b in chunk_events(gen, cfg, warmup + chunks) if i >= warmup]
        out = {"backend": backend, "fast_accum": fast_accum, "kv_splits": kv_splits,
               "configs": configs, "cublaslt_workspace": os.environ.get("CUBLASLT_WORKSPACE_SIZE", "default"),
               "median_ms": float(np.median(ts)),
               "ms": [round(t, 2) for t in ts], "graph_replays": eng.graph_replays}
        if prof:
            out["profile"] = profile_chunks(gen, cfg, warmup + chunks)
        print(f"  step ws={out['cublaslt_workspace']:<7} kv_splits={kv_splits} "
              f"configs={'tuned' if configs else 'default'}"
              f" → {out['median_ms']:.1f} ms/chunk")
        if prof:
            print("   ", {k: round(v, 2) for k, v in out["profile"]["ms_per_chunk_by_category"].items()})
        del gen, eng
        torch.cuda.empty_cache()
        return out
    finally:
        fq.DEFAULT_CONFIGS.clear()
        fq.DEFAULT_CONFIGS.update(saved)


def timeline(model, cfg, chunks=12, warmup=6) -> dict:
    """Where a chunk's wall time goes outside the graphs: CUDA events at the chunk's start, around each pass
    (engine call) and at its end, so host preparation before the first pass, the gaps between passes and the
    tail after the last one are measured without a profiler (which slows the host)."""
    eng = engine(model, AttentionBackend.IMAGE)
    gen = ChunkGenerator(cfg, mode=CacheMode.OPTIMIZED, device=DEV, dtype=torch.bfloat16, engine=eng, seed=0)
    marks: list = []
    real_call = type(eng).__call__

    def call(self, *a, **k):
        e0 = torch.cuda.Event(enable_timing=True)
        e0.record()
        out = real_call(self, *a, **k)
        e1 = torch.cuda.Event(enable_timing=True)
        e1.record()
        marks.append((e0, e1))
        return out

    type(eng).__call__ = call
    rows = []
    try:
        for i, a, b in chunk_events(gen, cfg, warmup + chunks):
            if i >= warmup:
                passes = [e0.elapsed_time(e1) for e0, e1 in marks]
                between = [marks[j][1].elapsed_time(marks[j + 1][0]) for j in range(len(marks) - 1)]
                rows.append({"wall": a.elapsed_time(b), "before_first_pass": a.elapsed_time(marks[0][0]),
                             "passes": passes, "between_passes": between, "after_last_pass": marks[-1][1].elapsed_time(b)})
            marks.clear()
    finally:
        type(eng).__call__ = real_call
    med = {k: float(np.median([r[k] for r in rows])) for k in ("wall", "before_first_pass", "after_last_pass")}
    med["passes_sum"] = float(np.median([sum(r["passes"]) for r in rows]))
    med["between_passes_sum"] = float(np.median([sum(r["between_passes"]) for r in rows]))
    print(f"  timeline (median ms per chunk): {med}")
    return {"median_ms": med, "chunks": rows}


# ---- 3. numerics probes -----------------------------------------------------------------------------------
def numerics_probe(init: str, chunks: int, backend: str) -> dict:

    cfg = ModelConfig.from_name("57b", t_limit=12)
    model = build_rank(cfg, 4, 0, keep_bf16=False, init=init)
    fo = engine(model, backend, fast_accum=False)
    fb = engine(model, backend, fast_accum=False, graphs=False)  # baseline mode: eager
    fp = engine(model, backend, fast_accum=False)
    fa = engine(model, backend, fast_accum=False)
    kw = dict(device=DEV, dtype=torch.bfloat16, seed=7)
    g_o = ChunkGenerator(cfg, mode=CacheMode.OPTIMIZED, engine=fo, **kw)
    g_b = ChunkGenerator(cfg, mode=CacheMode.BASELINE, engine=fb, **kw)
    g_p = ChunkGenerator(cfg, mode=CacheMode.OPTIMIZED, engine=fp, **kw)  # floor: perturbed input noise
    g_a = ChunkGenerator(cfg, mode=CacheMode.OPTIMIZED, engine=fa, **kw)  # ablation: no delta rotation at resets
    g_a.cache.shift_positions = lambda delta, slots, c=g_a.cache: setattr(c, "_offset_chunks", c._offset_chunks + delta)
    base_noise = g_p.noise

    def perturbed(chunk):
        x = base_noise(chunk)
        g = torch.Generator(device="cpu").manual_seed(10_000 + chunk)
        return x * (1 + 2.0**-8 * torch.randn(x.shape, generator=g).to(x.device))

    g_p.noise = perturbed
    e_mode, e_floor, e_abl, resets = [], [], [], 0
    for n in range(chunks):
        a = _audio(cfg, n)
        oo, ob = g_o.generate_chunk(a, cfg.audio_sample_rate), g_b.generate_chunk(a, cfg.audio_sample_rate)
        op, oa = g_p.generate_chunk(a, cfg.audio_sample_rate), g_a.generate_chunk(a, cfg.audio_sample_rate)
        resets += oo.reset
        e_mode.append(rel(oo.latents, ob.latents))
        e_floor.append(rel(op.latents, oo.latents))
        e_abl.append(rel(oa.latents, ob.latents))
    out = {"init": init, "chunks": chunks, "t_limit": 12, "resets": resets,
           "mode_only_max": max(e_mode), "floor_max": max(e_floor), "ablation_no_delta_rotation_max": max(e_abl),
           "mode_only": [round(e, 5) for e in e_mode], "floor": [round(e, 5) for e in e_floor],
           "ablation": [round(e, 5) for e in e_abl]}
    print(f"  init={init}: mode-only max {max(e_mode):.4f}, floor max {max(e_floor):.4f}, "
          f"ablation max {max(e_abl):.4f} ({resets} resets)")
    del g_o, g_b, g_p, g_a, model
    torch.cuda.empty_cache()
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--parts", default="kernels,step,numerics")
    p.add_argument("--numerics-chunks", type=int, default=24)
    args = p.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    import triton

    cfg = ModelConfig.from_name("57b")
    res = {"bench": "tune", "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
           "triton": triton.__version__, "date": time.strftime("%Y-%m-%d")}
    parts = args.parts.split(",")

    def save():
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1, default=str)

    if "kernels" in parts:
        section("fused", lambda: sweep_fused(cfg), res)
        save()
    if "kernels" in parts or "small" in parts:
        section("qk_norm_rope", lambda: sweep_qk_norm_rope(cfg), res)
        section("qkv_ring", lambda: time_qkv_ring(cfg), res)
        section("rounding", lambda: time_rounding(cfg), res)
        section("attention", lambda: sweep_attention(cfg), res)
        section("gemms", lambda: sweep_gemms(cfg), res)
        save()
    from vivant.bench import gpu_cublaslt_probe as cublaslt_probe
    from vivant.bench import gpu_cudnn_probe as cudnn_probe
    from vivant.bench import gpu_gemm_probe as gemm_probe
    from vivant.bench import gpu_persistent_rows_probe as prp
    from vivant.bench import gpu_residual_fold_probe as fold_probe
    from vivant.bench import gpu_row_probes as rp

    for part, name, probe in (("persist", "persistent_rows", prp.probe_persistent_rows),
                              ("rows", "row_variants", rp.sweep_row_variants),
                              ("attn_shapes", "attention_shapes", rp.probe_attention_shapes),
                              ("fast_accum_ab", "fast_accum_ab", rp.probe_fast_accum_ab),
                              ("gemm_rows", "gemm_rows", rp.probe_gemm_rows),
                              ("gemm_split", "gemm_split", rp.probe_gemm_split),
                              ("streamk", "streamk", gemm_probe.probe_streamk),
                              ("fp8_attn", "fp8_attention", cudnn_probe.probe_fp8_attention),
                              ("cudnn_plans", "cudnn_plans", cudnn_probe.probe_cudnn_plans),
                              ("cudnn_gemm", "cudnn_gemm", cudnn_probe.probe_cudnn_gemm),
                              ("cublaslt", "cublaslt_algorithms", cublaslt_probe.probe_cublaslt),
                              ("fold", "residual_fold", fold_probe.probe_residual_fold)):
        if part in parts:
            section(name, lambda probe=probe: probe(cfg), res)
            save()
    if "split" in parts:
        section("split_combine", lambda: sweep_split_combine(cfg), res)
        save()
    if "launch" in parts or "launch_gemms" in parts:
        section("launch", lambda: probe_launch(cfg, gemms_only="launch" not in parts), res)
        save()
    if "launch" in parts:  # the same GEMMs with no cuBLASLt workspace, in a child process (read at start)
        def no_workspace():
            import subprocess
            import sys

            child = args.out + ".ws0.json"
            env = dict(os.environ, CUBLASLT_WORKSPACE_SIZE="0")
            subprocess.run([sys.executable, __file__, "--out", child, "--parts", "launch_gemms"], env=env, check=True)
            with open(child) as f:
                return json.load(f).get("launch")
        section("launch_no_cublaslt_workspace", no_workspace, res)
        save()
    if "step" in parts:
        def step():
            model = build_rank(cfg, 4, 0, keep_bf16=False)
            best = {}  # the module's DEFAULT_CONFIGS unless this run swept the fused kernels
            for name, r in (res.get("fused") or {}).items():
                if isinstance(r, dict) and r.get("best") and r["best"]["config"] is not None:
                    best[name] = tuple(r["best"]["config"])
            out = {"tuned_configs": best, "note": "engine with the fused QKV → ring kernel (kernels/qkv_ring.py)"}
            if "all_variants" in parts:
                out["sdpa"] = time_variant(model, cfg, AttentionBackend.SDPA, False, {}, prof=True)
            # A/B/A order on one lease: the repeated first variant shows the drift between runs
            variants = [("image_fast_accum", {}), ("kv_splits_4", {"kv_splits": 4}), ("kv_splits_2", {"kv_splits": 2}),
                        ("image_fast_accum_again", {}), ("kv_splits_4_again", {"kv_splits": 4})]
            for name, kw in variants:
                out[name] = time_variant(model, cfg, AttentionBackend.IMAGE, True, best, prof=True, **kw)
            return out
        section("step", step, res)
        save()
    if "timeline" in parts:
        def tl():
            return timeline(build_rank(cfg, 4, 0, keep_bf16=False), cfg)
        section("timeline", tl, res)
        save()
    if "numerics" in parts:
        section("numerics_scaled", lambda: numerics_probe("scaled", args.numerics_chunks, AttentionBackend.IMAGE), res)
        save()
        section("numerics_unit", lambda: numerics_probe("unit", args.numerics_chunks, AttentionBackend.IMAGE), res)
        save()
    save()
    print("wrote", args.out)


if __name__ == "__main__":
    main()
