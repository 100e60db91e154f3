"""Launch and layout probes for the 57b TP=4 step on one GPU, called by bench/gpu_tune.py (parts `split`,
`launch`, `launch_gemms`).

- `probe_launch`: which library calls put memset nodes into the engine's graph (device events per eager call of
  each FP8 GEMM and of the attention), what the GEMMs cost inside CUDA graphs, and what programmatic dependent
  launch saves at a library kernel → Triton kernel boundary (graphs of 20 pairs, outputs compared bit for bit).
  gpu_tune runs the GEMM part again in a child process with CUBLASLT_WORKSPACE_SIZE=0 (torch reads it once).
- `sweep_split_combine`: the split-KV attention's combine + O quantization over warps, and whether cuDNN takes the
  replicated queries as a stride-0 view with the same result.
"""

from __future__ import annotations

import math
import os

import torch
from vivant.bench.gpu_step import graph_us
from vivant.kernels import fused_quant as fq
from vivant.kernels.fp8 import quantize_rows_ref
from vivant.kernels.fp8_gemm import fp8_linear, quantize_weight
from vivant.kernels.ring_attention import ring_attention
from vivant.worker.model.tp import local_shapes

DEV = "cuda"


def deq(q, s):
    """FP8 codes × their row scales → float32."""
    return q.float() * s.float()[..., None]


def rel(a, b) -> float:
    """Relative RMS error ‖a − b‖ / ‖b‖ in float64."""
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def sweep_split_combine(cfg) -> dict:
    """The fused combine + O quantization over warps, and whether cuDNN takes the replicated queries as a
    stride-0 view (no copy at all) with the same result."""
    from vivant.kernels.split_kv import _partial_sdpa, combine_quant, split_kv_attention_fp8

    n, h, d, S = cfg.tokens_per_chunk, cfg.shard_heads(4), cfg.head_dim, cfg.cache_slots
    bf = torch.bfloat16
    res = {"us": {}}
    q = torch.randn(n, h, d, device=DEV, dtype=bf)
    k, v = (torch.randn(S, h, d, device=DEV, dtype=bf) for _ in range(2))
    for p in (2, 4):
        qc = q.transpose(0, 1).unsqueeze(0).repeat(p, 1, 1, 1)
        o, lse = _partial_sdpa(qc, k.view(p, S // p, h, d).permute(0, 2, 1, 3),
                               v.view(p, S // p, h, d).permute(0, 2, 1, 3), d ** -0.5)
        for w in (4, 8, 16):
            res["us"][f"combine_quant_p{p}_w{w}"] = graph_us(lambda o=o, lse=lse, w=w: combine_quant(o, lse, bf, num_warps=w))
        res["us"][f"split_attention_fp8_p{p}"] = graph_us(lambda qc=qc: split_kv_attention_fp8(qc, k, v))
        qv = q.transpose(0, 1).unsqueeze(0).expand(p, h, n, d)
        try:
            kb, vb = (t.view(p, S // p, h, d).permute(0, 2, 1, 3) for t in (k, v))
            ov, lv = _partial_sdpa(qv, kb, vb, d ** -0.5)
            res[f"stride0_q_p{p}_equal"] = bool(torch.equal(ov, o) and torch.equal(lv, lse))
            res["us"][f"partial_sdpa_stride0_q_p{p}"] = graph_us(lambda qv=qv, kb=kb, vb=vb: _partial_sdpa(qv, kb, vb, d ** -0.5))
            res["us"][f"partial_sdpa_copied_q_p{p}"] = graph_us(lambda qc=qc, kb=kb, vb=vb: _partial_sdpa(qc, kb, vb, d ** -0.5))
        except Exception as e:
            res[f"stride0_q_p{p}"] = f"failed: {type(e).__name__}: {str(e)[:200]}"
    for k_, v_ in res.items():
        print(f"  split {k_}: {v_}")
    return res


# ---- 1b. launch overheads ----------------------------------------------------------------------------------
def _device_events_per_call(fn, calls=3) -> dict:
    from torch.profiler import ProfilerActivity, profile

    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    names: dict[str, float] = {}
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            names[ev.name[:70]] = names.get(ev.name[:70], 0) + 1 / calls
    return names


def probe_launch(cfg, gemms_only=False) -> dict:
    """Which library calls put the step's memset nodes into the graph (device events per eager call), and what
    programmatic dependent launch saves at a library kernel → Triton kernel boundary (graphs of 20 pairs)."""
    n, h, d, S = cfg.tokens_per_chunk, cfg.shard_heads(4), cfg.head_dim, cfg.cache_slots
    bf = torch.bfloat16
    res = {"CUBLASLT_WORKSPACE_SIZE": os.environ.get("CUBLASLT_WORKSPACE_SIZE"), "events_per_call": {}, "us": {}}
    w = {}
    for name, (N, K) in local_shapes(cfg, 4).items():
        a8, sa = quantize_rows_ref(torch.randn(n, K, device=DEV))
        w8, sw = quantize_weight(torch.randn(N, K, device=DEV) / math.sqrt(K))
        w[name] = (a8, sa, w8, sw)
        for fast in (False, True):
            key = f"gemm_{name}_{'fast' if fast else 'exact'}"
            def fn(a8=a8, sa=sa, w8=w8, sw=sw, fast=fast):
                return fp8_linear(a8, sa, w8, sw, fast_accum=fast)
            res["events_per_call"][key] = _device_events_per_call(fn)
            res["us"][key] = graph_us(fn)
    for k_, v_ in res["events_per_call"].items():
        print(f"  {k_:<20} {res['us'][k_]:6.1f} µs  events/call {v_}")
    if gemms_only:
        return res
    q = torch.randn(n, h, d, device=DEV, dtype=bf)
    k8, ks = quantize_rows_ref(torch.randn(S, h, d, device=DEV))
    v8, vs = quantize_rows_ref(torch.randn(S, h, d, device=DEV))
    kimg, vimg = deq(k8, ks).to(bf), deq(v8, vs).to(bf)
    valid = torch.ones(S, dtype=torch.bool, device=DEV)

    def attn(splits=1):
        return ring_attention(q, k8, v8, ks, vs, valid, backend="image", all_valid=True, k_image=kimg, v_image=vimg,
                              kv_splits=splits)

    for key, fn in (("attn_image", attn), ("attn_image_kv_splits_2", lambda: attn(2))):
        res["events_per_call"][key] = _device_events_per_call(fn)
        print(f"  {key:<20} events/call {res['events_per_call'][key]}")
    x = torch.randn(n, cfg.d_model, device=DEV, dtype=bf)
    sh, sc, g = (torch.randn(cfg.d_model, device=DEV, dtype=bf) * 0.3 for _ in range(3))
    a8, sa, w8, sw = w["o"]
    ga8, gsa, gw8, gsw = w["gate_up"]
    pairs = {
        "o_gemm→residual_ln_mod_quant": lambda p: fq.residual_ln_mod_quant(
            x, fp8_linear(a8, sa, w8, sw, fast_accum=True), g, sh, sc, pdl=p),
        "gate_up_gemm→swiglu_quant": lambda p: fq.swiglu_quant(fp8_linear(ga8, gsa, gw8, gsw, fast_accum=True), pdl=p),
        "attn_image→quant_rows": lambda p: fq.quant_rows(attn().reshape(n, h * d), pdl=p),
        "quant_rows_small_chain": lambda p: fq.quant_rows(x[:8], pdl=p),
    }
    for key, fn in pairs.items():
        ref = fn(False)
        got = fn(True)
        same = all(torch.equal(a_, b_) for a_, b_ in zip(ref, got, strict=True))
        row = {"plain": graph_us(lambda fn=fn: fn(False)), "pdl": graph_us(lambda fn=fn: fn(True)), "pdl_equal": same}
        row["saved_us"] = row["plain"] - row["pdl"]
        res["us"][key] = row
        print(f"  {key:<30} plain {row['plain']:7.2f} µs  pdl {row['pdl']:7.2f} µs  saved {row['saved_us']:5.2f}"
              f"  equal {same}")
    return res
