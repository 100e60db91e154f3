"""Probe: persistent forms of the step's two largest row kernels, with the next row's loads issued before the
current row is reduced — against the production kernels (kernels/fused_quant.py) in one process.

Why: residual + LayerNorm + modulation + FP8 (476 calls per chunk, ≈ 7.8 ms) and SwiGLU + FP8 (240 calls,
≈ 2.4 ms) are memory-bound and reach ≈ 2.6–3.0 TB/s at 757 rows, against ≈ 4.3 TB/s of copy bandwidth on the
H200. One program per row holds the whole row in registers, so an SM runs two or three rows at a time, and while
those sit in their two row reductions (LayerNorm statistics, then the FP8 absmax) nothing is loading. Here a grid of
`programs` (a multiple of the 132 SMs) walks the rows r = pid, pid + programs, …; with PREFETCH the loads of row
r + programs are issued at the top of the iteration for row r, so the memory system works while row r reduces
(the loads only block where their values are first used, one iteration later). Without PREFETCH the same loop is
left to Triton's software pipeliner (`tl.range(num_stages=…)`).

Semantics are the production kernels' (their float32 twins `residual_ln_mod_quant_ref` / `swiglu_quant_ref`),
compiled arithmetic: x·(1/s) and the hardware e4m3 conversion. `tests/kernels/test_persistent_rows_probe.py`
runs both in Triton's interpreter against the twins. Run by `STEPS=tune TUNE_PARTS=persist`.
"""

from __future__ import annotations

from functools import partial

import torch
from vivant.bench.gpu_probes import deq, rel

try:
    import triton
    import triton.language as tl
    from vivant.kernels.fp8 import e4m3_grid_tl
    from vivant.kernels.fused_quant import _nan_max
except ImportError:  # pragma: no cover
    triton = None

DEV = "cuda"

if triton is not None:

    @triton.jit
    def _scale(absmax):
        """The row's FP8 scale from its elementwise |values| (NaN kept, one reduction, as the production kernels)."""
        amax = tl.reduce(absmax, 0, _nan_max)
        return tl.where(amax != amax, amax, tl.maximum(amax, 1e-8) / 448.0)

    @triton.jit
    def _store_row_fp8(v, q_ptr, s_ptr, r, cols, cm, W, HW_CAST: tl.constexpr):
        """Row r's float32 values v [BLOCK_K] → FP8 codes at q_ptr + r·W and the row's scale at s_ptr + r."""
        s = _scale(tl.where(cm, tl.abs(v), 0.0))
        if HW_CAST:
            q = (v * (1.0 / s)).to(tl.float8e4nv)
        else:
            q = e4m3_grid_tl(v / s).to(tl.float8e4nv)
        tl.store(q_ptr + r * W + cols, q, mask=cm)
        tl.store(s_ptr + r, s)

    @triton.jit
    def _res_row(x, y, g, sh_ptr, sc_ptr, xo_ptr, q_ptr, s_ptr, r, cols, cm, K, eps, HW_CAST: tl.constexpr):
        """One row: x + g·y stored (x's dtype), LayerNorm, modulation, FP8 codes and the row's scale stored."""
        xn = (x.to(tl.float32) + g * y.to(tl.float32)).to(xo_ptr.dtype.element_ty)
        tl.store(xo_ptr + r * K + cols, xn, mask=cm)
        xf = xn.to(tl.float32)
        mean = tl.sum(xf, axis=0) / K
        var = tl.maximum(tl.sum(xf * xf, axis=0) / K - mean * mean, 0.0)
        rstd = 1.0 / tl.sqrt(var + eps)
        sh = tl.load(sh_ptr + cols, mask=cm, other=0.0).to(tl.float32)
        sc = tl.load(sc_ptr + cols, mask=cm, other=0.0).to(tl.float32)
        _store_row_fp8((xf - mean) * rstd * (1.0 + sc) + sh, q_ptr, s_ptr, r, cols, cm, K, HW_CAST)

    @triton.jit
    def _res_ln_persist(x_ptr, y_ptr, g_ptr, sh_ptr, sc_ptr, xo_ptr, q_ptr, s_ptr, M, K, eps,
                        BLOCK_K: tl.constexpr, PREFETCH: tl.constexpr, STAGES: tl.constexpr,
                        HW_CAST: tl.constexpr):
        pid = tl.program_id(0)
        nprog = tl.num_programs(0)
        cols = tl.arange(0, BLOCK_K)
        cm = cols < K
        g = tl.load(g_ptr + cols, mask=cm, other=0.0).to(tl.float32)
        if PREFETCH:
            xn = tl.load(x_ptr + pid * K + cols, mask=cm & (pid < M), other=0.0)
            yn = tl.load(y_ptr + pid * K + cols, mask=cm & (pid < M), other=0.0)
            for r in range(pid, M, nprog):
                x, y = xn, yn
                nxt = r + nprog
                xn = tl.load(x_ptr + nxt * K + cols, mask=cm & (nxt < M), other=0.0)
                yn = tl.load(y_ptr + nxt * K + cols, mask=cm & (nxt < M), other=0.0)
                _res_row(x, y, g, sh_ptr, sc_ptr, xo_ptr, q_ptr, s_ptr, r, cols, cm, K, eps, HW_CAST)
        else:
            for r in tl.range(pid, M, nprog, num_stages=STAGES):
                x = tl.load(x_ptr + r * K + cols, mask=cm, other=0.0)
                y = tl.load(y_ptr + r * K + cols, mask=cm, other=0.0)
                _res_row(x, y, g, sh_ptr, sc_ptr, xo_ptr, q_ptr, s_ptr, r, cols, cm, K, eps, HW_CAST)

    @triton.jit
    def _swiglu_row(ga, u, q_ptr, s_ptr, r, cols, cm, F, HW_CAST: tl.constexpr):
        gf = ga.to(tl.float32)
        _store_row_fp8(gf / (1.0 + tl.exp(-gf)) * u.to(tl.float32), q_ptr, s_ptr, r, cols, cm, F, HW_CAST)

    @triton.jit
    def _swiglu_persist(gu_ptr, q_ptr, s_ptr, M, F, BLOCK_K: tl.constexpr, PREFETCH: tl.constexpr,
                        STAGES: tl.constexpr, HW_CAST: tl.constexpr):
        pid = tl.program_id(0)
        nprog = tl.num_programs(0)
        cols = tl.arange(0, BLOCK_K)
        cm = cols < F
        if PREFETCH:
            gn = tl.load(gu_ptr + pid * 2 * F + cols, mask=cm & (pid < M), other=0.0)
            un = tl.load(gu_ptr + pid * 2 * F + F + cols, mask=cm & (pid < M), other=0.0)
            for r in range(pid, M, nprog):
                ga, u = gn, un
                nxt = r + nprog
                gn = tl.load(gu_ptr + nxt * 2 * F + cols, mask=cm & (nxt < M), other=0.0)
                un = tl.load(gu_ptr + nxt * 2 * F + F + cols, mask=cm & (nxt < M), other=0.0)
                _swiglu_row(ga, u, q_ptr, s_ptr, r, cols, cm, F, HW_CAST)
        else:
            for r in tl.range(pid, M, nprog, num_stages=STAGES):
                ga = tl.load(gu_ptr + r * 2 * F + cols, mask=cm, other=0.0)
                u = tl.load(gu_ptr + r * 2 * F + F + cols, mask=cm, other=0.0)
                _swiglu_row(ga, u, q_ptr, s_ptr, r, cols, cm, F, HW_CAST)


def res_ln_persist(x, y, g, sh, sc, *, programs: int, warps: int = 8, prefetch: bool = True, stages: int = 1,
                   eps: float = 1e-6):
    """x, y [M, K] (contiguous); g, sh, sc [K] → (x + g·y, FP8 [M, K], float32 scales [M]) by `programs`
    persistent programs."""
    M, K = x.shape
    xo = torch.empty_like(x)
    q = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(M, dtype=torch.float32, device=x.device)
    _res_ln_persist[(min(programs, M),)](x, y, g, sh, sc, xo, q, s, M, K, eps, BLOCK_K=triton.next_power_of_2(K),
                                         PREFETCH=prefetch, STAGES=stages, HW_CAST=x.is_cuda, num_warps=warps)
    return xo, q, s


def swiglu_persist(gu, *, programs: int, warps: int = 8, prefetch: bool = True, stages: int = 1):
    """gu [M, 2F] = [gate | up] → (FP8 silu(gate)·up [M, F], float32 scales [M]) by `programs` persistent programs."""
    M, F = gu.shape[0], gu.shape[1] // 2
    q = torch.empty((M, F), dtype=torch.float8_e4m3fn, device=gu.device)
    s = torch.empty(M, dtype=torch.float32, device=gu.device)
    _swiglu_persist[(min(programs, M),)](gu, q, s, M, F, BLOCK_K=triton.next_power_of_2(F), PREFETCH=prefetch,
                                         STAGES=stages, HW_CAST=gu.is_cuda, num_warps=warps)
    return q, s


def probe_persistent_rows(cfg, tp: int = 4) -> dict:
    """The production residual and SwiGLU kernels against their persistent forms over (programs per SM, warps,
    prefetch or the pipeliner's stages), alternated twice in one process on fresh inputs: µs per call in a CUDA
    graph, GB/s, and the error against the float32 twin (x + g·y must be bit-equal)."""
    from vivant.bench.gpu_step import graph_us
    from vivant.kernels import fused_quant as fq

    n, dm, f = cfg.tokens_per_chunk, cfg.d_model, cfg.d_ff // tp
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    bf = torch.bfloat16
    variants = [("production", None)]
    for per_sm in (1, 2, 3, 4):
        for warps in (4, 8, 16):
            variants.append((f"persist {per_sm}/SM warps={warps} prefetch", dict(programs=per_sm * sms, warps=warps)))
            variants.append((f"persist {per_sm}/SM warps={warps} stages=2",
                             dict(programs=per_sm * sms, warps=warps, prefetch=False, stages=2)))
    res = {"sms": sms, "residual_ln_mod_quant": {}, "swiglu_quant": {}}
    res_bytes, sw_bytes = n * dm * 7 + n * 4, n * f * 5 + n * 4
    for rnd in range(2):
        for name, kw in variants:
            x = torch.randn(n, dm, device=DEV, dtype=bf) * 3
            y = torch.randn(n, dm, device=DEV, dtype=bf)
            g, sh, sc = (torch.randn(dm, device=DEV, dtype=bf) * 0.3 for _ in range(3))
            gu = torch.randn(n, 2 * f, device=DEV, dtype=bf)
            args = (x, y, g, sh, sc)
            cases = (("residual_ln_mod_quant", partial(fq.residual_ln_mod_quant, *args) if kw is None else
                      partial(res_ln_persist, *args, **kw), partial(fq.residual_ln_mod_quant_ref, *args), res_bytes),
                     ("swiglu_quant", partial(fq.swiglu_quant, gu) if kw is None else partial(swiglu_persist, gu, **kw),
                      partial(fq.swiglu_quant_ref, gu), sw_bytes))
            for kernel, fn, ref, nbytes in cases:
                row = res[kernel].setdefault(name, {"us": []})
                try:
                    got, want = fn(), ref()
                    if kernel == "residual_ln_mod_quant":
                        row["x_equal"] = bool(torch.equal(got[0], want[0]))
                        got, want = got[1:], want[1:]
                    row["rel_err"] = rel(deq(*got), deq(*want))
                    row["us"].append(graph_us(fn))
                    row["gbps"] = nbytes / min(row["us"]) / 1e3
                except Exception as e:  # a variant that does not compile or fit: recorded, not fatal
                    row["error"] = f"{type(e).__name__}: {e}"[:300]
                if rnd == 1:
                    print(f"  {kernel[:8]} {name:<36} {row['us']} µs err {row.get('rel_err', float('nan')):.1e} "
                          f"{row.get('error', '')}", flush=True)
    for kernel in ("residual_ln_mod_quant", "swiglu_quant"):
        ok = {k: v for k, v in res[kernel].items() if v["us"] and v.get("rel_err", 1) < 2e-2 and v.get("x_equal", True)}
        res[kernel + "_best"] = min(ok.items(), key=lambda kv: min(kv[1]["us"]))[0] if ok else None
    return res
