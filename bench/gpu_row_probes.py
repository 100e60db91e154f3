"""Probes for the two largest costs left in the 57b TP=4 step besides attention, called by bench/gpu_tune.py
(parts `rows`, `gemm_split`).

- `sweep_row_variants`: prototype forms of the residual + LayerNorm + modulation + FP8 row kernel and of the
  SwiGLU + FP8 row kernel, against the production kernels (vivant.kernels.fused_quant) at 757 rows. The
  production kernels hold whole rows in registers with every operand loaded up front, which leaves one program
  per SM (a latency-bound launch: ~2.2 TB/s for residual_ln_mod_quant). The forms tried here keep fewer values
  live across the row reductions: `late` loads shift/scale after the statistics; `reload` re-reads its own
  stored rows for each later pass instead of keeping them; `maxnreg` caps registers per thread. Each is compared
  with the float32 twin (relative error of the dequantized rows) and timed inside a CUDA graph.
- `probe_gemm_split`: the QKV GEMM (M = 757, N = 6144, K = 8192) is 288 tiles of 128×128 on 132 SMs (2.18
  waves). Split by N into a part that fills whole waves and a small rest, written into column slices of one
  output (`out=`), on one stream or two; each split is checked against the unsplit product bit for bit.
"""

from __future__ import annotations

import torch
from vivant.bench.gpu_probes import deq, rel
from vivant.bench.gpu_step import graph_us
from vivant.kernels import fused_quant as fq
from vivant.kernels.fp8 import quantize_rows_ref
from vivant.kernels.fp8_gemm import fp8_linear, quantize_weight

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

DEV = "cuda"


if triton is not None:

    @triton.jit
    def _res_ln_proto(x_ptr, y_ptr, g_ptr, sh_ptr, sc_ptr, xo_ptr, q_ptr, s_ptr, M, K, eps,
                      ROWS: tl.constexpr, BLOCK_K: tl.constexpr, LATE: tl.constexpr, RELOAD: tl.constexpr):
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        cols = tl.arange(0, BLOCK_K)
        cm = cols < K
        m = (rows < M)[:, None] & cm[None, :]
        off = rows[:, None] * K + cols[None, :]
        x = tl.load(x_ptr + off, mask=m, other=0.0).to(tl.float32)
        y = tl.load(y_ptr + off, mask=m, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + cols, mask=cm, other=0.0).to(tl.float32)
        if not LATE:
            sh = tl.load(sh_ptr + cols, mask=cm, other=0.0).to(tl.float32)
            sc = tl.load(sc_ptr + cols, mask=cm, other=0.0).to(tl.float32)
        xn = (x + g[None, :] * y).to(xo_ptr.dtype.element_ty)
        tl.store(xo_ptr + off, xn, mask=m)
        xf = xn.to(tl.float32)
        mean = tl.sum(xf, axis=1) / K
        var = tl.maximum(tl.sum(xf * xf, axis=1) / K - mean * mean, 0.0)
        rstd = 1.0 / tl.sqrt(var + eps)
        if LATE:
            sh = tl.load(sh_ptr + cols, mask=cm, other=0.0).to(tl.float32)
            sc = tl.load(sc_ptr + cols, mask=cm, other=0.0).to(tl.float32)
        if RELOAD:
            tl.debug_barrier()
            xf = tl.load(xo_ptr + off, mask=m, other=0.0).to(tl.float32)
        h = (xf - mean[:, None]) * rstd[:, None] * (1.0 + sc[None, :]) + sh[None, :]
        amax = tl.max(tl.where(m, tl.abs(h), 0.0), axis=1)
        s = tl.maximum(amax, 1e-8) / 448.0
        if RELOAD:
            xf = tl.load(xo_ptr + off, mask=m, other=0.0).to(tl.float32)
            h = (xf - mean[:, None]) * rstd[:, None] * (1.0 + sc[None, :]) + sh[None, :]
        tl.store(q_ptr + off, (h * (1.0 / s)[:, None]).to(tl.float8e4nv), mask=m)
        tl.store(s_ptr + rows, s, mask=rows < M)

    @triton.jit
    def _swiglu_proto(gu_ptr, q_ptr, s_ptr, M, F, ROWS: tl.constexpr, BLOCK_K: tl.constexpr, RELOAD: tl.constexpr):
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        cols = tl.arange(0, BLOCK_K)
        m = (rows < M)[:, None] & (cols < F)[None, :]
        gp = gu_ptr + rows[:, None] * (2 * F) + cols[None, :]
        g = tl.load(gp, mask=m, other=0.0).to(tl.float32)
        u = tl.load(gp + F, mask=m, other=0.0).to(tl.float32)
        y = g / (1.0 + tl.exp(-g)) * u
        s = tl.maximum(tl.max(tl.where(m, tl.abs(y), 0.0), axis=1), 1e-8) / 448.0
        if RELOAD:
            g = tl.load(gp, mask=m, other=0.0).to(tl.float32)
            u = tl.load(gp + F, mask=m, other=0.0).to(tl.float32)
            y = g / (1.0 + tl.exp(-g)) * u
        tl.store(q_ptr + rows[:, None] * F + cols[None, :], (y * (1.0 / s)[:, None]).to(tl.float8e4nv), mask=m)
        tl.store(s_ptr + rows, s, mask=rows < M)


def res_ln_proto(x, y, g, sh, sc, *, rows=1, warps=8, late=True, reload=False, maxnreg=None, eps=1e-6):
    M, K = x.shape
    xo = torch.empty_like(x)
    q = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(M, dtype=torch.float32, device=x.device)
    kw = {"maxnreg": maxnreg} if maxnreg else {}
    _res_ln_proto[(triton.cdiv(M, rows),)](x, y, g, sh, sc, xo, q, s, M, K, eps, ROWS=rows,
                                           BLOCK_K=triton.next_power_of_2(K), LATE=late, RELOAD=reload,
                                           num_warps=warps, **kw)
    return xo, q, s


def swiglu_proto(gu, *, rows=1, warps=16, reload=False, maxnreg=None):
    M, F = gu.shape[0], gu.shape[1] // 2
    q = torch.empty((M, F), dtype=torch.float8_e4m3fn, device=gu.device)
    s = torch.empty(M, dtype=torch.float32, device=gu.device)
    kw = {"maxnreg": maxnreg} if maxnreg else {}
    _swiglu_proto[(triton.cdiv(M, rows),)](gu, q, s, M, F, ROWS=rows, BLOCK_K=triton.next_power_of_2(F),
                                           RELOAD=reload, num_warps=warps, **kw)
    return q, s


def sweep_row_variants(cfg, tp: int = 4) -> dict:
    n, dm, f = cfg.tokens_per_chunk, cfg.d_model, cfg.d_ff // tp
    bf = torch.bfloat16
    out: dict[str, list] = {"residual_ln_mod_quant": [], "swiglu_quant": []}

    def res_inputs():
        x = torch.randn(n, dm, device=DEV, dtype=bf) * 3
        y = torch.randn(n, dm, device=DEV, dtype=bf)
        g, sh, sc = (torch.randn(dm, device=DEV, dtype=bf) * 0.3 for _ in range(3))
        return x, y, g, sh, sc

    res_variants = [("production", None)]
    for late, reload in ((True, False), (False, True), (True, True)):
        for warps in (4, 8, 16):
            for mr in (None, 64, 96, 128):
                for rows in ((1, 2) if warps == 16 else (1,)):
                    res_variants.append((f"late={int(late)} reload={int(reload)} rows={rows} warps={warps} "
                                         f"maxnreg={mr}", dict(rows=rows, warps=warps, late=late, reload=reload,
                                                               maxnreg=mr)))
    nbytes = n * dm * (2 + 2 + 2 + 1) + n * 4
    for name, kw in res_variants:
        x, y, g, sh, sc = res_inputs()
        args = (x, y, g, sh, sc)
        fn = (lambda args=args: fq.residual_ln_mod_quant(*args)) if kw is None else \
            (lambda kw=kw, args=args: res_ln_proto(*args, **kw))
        try:
            xo, q, s = fn()
            rx, rq, rs = fq.residual_ln_mod_quant_ref(x, y, g, sh, sc)
            row = {"variant": name, "x_equal": bool(torch.equal(xo, rx)), "rel_err": rel(deq(q, s), deq(rq, rs))}
            row["us"] = graph_us(fn)
            row["gbps"] = nbytes / row["us"] / 1e3
        except Exception as e:  # one failing variant must not cost the others
            row = {"variant": name, "error": f"{type(e).__name__}: {e}"[:300]}
        out["residual_ln_mod_quant"].append(row)
        print(f"  residual {name:<48} {row.get('us', float('nan')):7.2f} µs  err {row.get('rel_err', float('nan')):.1e}"
              f" {row.get('error', '')}", flush=True)

    sw_variants = [("production", None)]
    for reload in (False, True):
        for warps in (4, 8, 16, 32):
            for mr in (None, 64, 96):
                sw_variants.append((f"reload={int(reload)} warps={warps} maxnreg={mr}",
                                    dict(warps=warps, reload=reload, maxnreg=mr)))
    nbytes = n * 2 * f * 2 + n * f + n * 4
    for name, kw in sw_variants:
        gu = torch.randn(n, 2 * f, device=DEV, dtype=bf)
        fn = (lambda gu=gu: fq.swiglu_quant(gu)) if kw is None else (lambda kw=kw, gu=gu: swiglu_proto(gu, **kw))
        try:
            q, s = fn()
            rq, rs = fq.swiglu_quant_ref(gu)
            row = {"variant": name, "rel_err": rel(deq(q, s), deq(rq, rs))}
            row["us"] = graph_us(fn)
            row["gbps"] = nbytes / row["us"] / 1e3
        except Exception as e:
            row = {"variant": name, "error": f"{type(e).__name__}: {e}"[:300]}
        out["swiglu_quant"].append(row)
        print(f"  swiglu   {name:<48} {row.get('us', float('nan')):7.2f} µs  err {row.get('rel_err', float('nan')):.1e}"
              f" {row.get('error', '')}", flush=True)
    for k in list(out):
        ok = [r for r in out[k] if "us" in r and r["rel_err"] < 2e-2 and r.get("x_equal", True)]
        out[k + "_best"] = min(ok, key=lambda r: r["us"]) if ok else None
    return out


def probe_gemm_split(cfg, tp: int = 4) -> dict:
    """QKV (and, for comparison, the other three GEMMs) unsplit, and split by N into a part of whole 128-wide tile
    waves plus the rest, on one stream and on two (graph branches)."""
    from vivant.worker.model.tp import local_shapes

    m = cfg.tokens_per_chunk
    res: dict = {}
    for name, (n, k) in local_shapes(cfg, tp).items():
        a8, sa = quantize_rows_ref(torch.randn(m, k, device=DEV))
        w8, sw = quantize_weight(torch.randn(n, k, device=DEV) / k ** 0.5)
        full = fp8_linear(a8, sa, w8, sw, fast_accum=True)
        row = {"N": n, "K": k, "unsplit_us": graph_us(lambda a8=a8, sa=sa, w8=w8, sw=sw:
                                                      fp8_linear(a8, sa, w8, sw, fast_accum=True))}
        for n1 in sorted({n - 512, n - 1024, n - 2048, 5632, 5120, 4096, 3072} - {0}):
            if not 0 < n1 < n or n1 % 128:
                continue
            out = torch.empty(m, n, device=DEV, dtype=torch.bfloat16)
            w1, w2, s1, s2 = w8[:n1], w8[n1:], sw[:n1], sw[n1:]

            def one(out=out, w1=w1, w2=w2, s1=s1, s2=s2, n1=n1, a8=a8, sa=sa):
                torch._scaled_mm(a8, w1.t(), scale_a=sa.view(-1, 1), scale_b=s1.view(1, -1), out_dtype=torch.bfloat16,
                                 use_fast_accum=True, out=out[:, :n1])
                torch._scaled_mm(a8, w2.t(), scale_a=sa.view(-1, 1), scale_b=s2.view(1, -1), out_dtype=torch.bfloat16,
                                 use_fast_accum=True, out=out[:, n1:])

            side = torch.cuda.Stream()

            def two(out=out, w1=w1, w2=w2, s1=s1, s2=s2, n1=n1, side=side, a8=a8, sa=sa):
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    torch._scaled_mm(a8, w2.t(), scale_a=sa.view(-1, 1), scale_b=s2.view(1, -1),
                                     out_dtype=torch.bfloat16, use_fast_accum=True, out=out[:, n1:])
                torch._scaled_mm(a8, w1.t(), scale_a=sa.view(-1, 1), scale_b=s1.view(1, -1), out_dtype=torch.bfloat16,
                                 use_fast_accum=True, out=out[:, :n1])
                torch.cuda.current_stream().wait_stream(side)

            entry = {}
            for label, fn in (("one_stream", one), ("two_streams", two)):
                try:
                    out.zero_()
                    fn()
                    torch.cuda.synchronize()
                    entry[label] = {"us": graph_us(fn), "equal": bool(torch.equal(out, full)),
                                    "max_abs_diff": float((out.float() - full.float()).abs().max())}
                except Exception as e:
                    entry[label] = {"error": f"{type(e).__name__}: {e}"[:300]}
            entry["part_us"] = [graph_us(lambda w=w, s=s, a8=a8, sa=sa: fp8_linear(a8, sa, w, s, fast_accum=True))
                                for w, s in ((w1, s1), (w2, s2))]
            row[f"split_{n1}_{n - n1}"] = entry
            print(f"  gemm {name} N={n} split {n1}+{n - n1}: {entry}", flush=True)
        if name == "qkv":
            row.update(_split_k_tail(a8, sa, w8, sw, full))
        print(f"  gemm {name} N={n} unsplit {row['unsplit_us']:.1f} µs", flush=True)
        res[name] = row
    return res


def _split_k_tail(a8, sa, w8, sw, full, n1: int = 5632) -> dict:
    """QKV as a GEMM of whole waves (columns [0, n1)) plus its tail columns as `parts` GEMMs over slices of K on
    side streams (float32 partials, summed into the output's tail): the tail's 24 tiles of full K become
    24·parts tiles of K/parts that run side by side."""
    m, k = a8.shape
    n = w8.shape[0]
    res = {}
    for parts in (2, 4, 8):
        kp = k // parts
        a_parts = [a8[:, i * kp:(i + 1) * kp].contiguous() for i in range(parts)]
        w_tail = [w8[n1:, i * kp:(i + 1) * kp].contiguous() for i in range(parts)]
        partial = torch.empty(parts, m, n - n1, device=DEV, dtype=torch.float32)
        out = torch.empty(m, n, device=DEV, dtype=torch.bfloat16)
        streams = [torch.cuda.Stream() for _ in range(parts)]

        def fn(a_parts=a_parts, w_tail=w_tail, partial=partial, out=out, streams=streams):
            cur = torch.cuda.current_stream()
            for i, st in enumerate(streams):
                st.wait_stream(cur)
                with torch.cuda.stream(st):
                    torch._scaled_mm(a_parts[i], w_tail[i].t(), scale_a=sa.view(-1, 1), scale_b=sw[n1:].view(1, -1),
                                     out_dtype=torch.float32, use_fast_accum=True, out=partial[i])
            torch._scaled_mm(a8, w8[:n1].t(), scale_a=sa.view(-1, 1), scale_b=sw[:n1].view(1, -1),
                             out_dtype=torch.bfloat16, use_fast_accum=True, out=out[:, :n1])
            for st in streams:
                cur.wait_stream(st)
            out[:, n1:].copy_(partial.sum(0))

        try:
            fn()
            torch.cuda.synchronize()
            tail_err = float((out[:, n1:].float() - full[:, n1:].float()).norm() / full[:, n1:].float().norm())
            res[f"split_k_tail_{n1}_{n - n1}x{parts}"] = {
                "us": graph_us(fn), "head_equal": bool(torch.equal(out[:, :n1], full[:, :n1])),
                "tail_rel_err_vs_unsplit": tail_err}
        except Exception as e:
            res[f"split_k_tail_{n1}_{n - n1}x{parts}"] = {"error": f"{type(e).__name__}: {e}"[:300]}
        print(f"  gemm qkv split-K tail x{parts}: {res[f'split_k_tail_{n1}_{n - n1}x{parts}']}", flush=True)
    return res


def probe_attention_shapes(cfg, tp: int = 4) -> dict:
    """The cuDNN call of the split-KV attention (kernels/split_kv.py `_partial_sdpa`) over query lengths (757 rows
    padded to 768, 896, 1024) and KV splits (1, 2, 4 of the 5788 slots; 8 and 16 over 5792 slots, as a padded image
    would hold), µs per call in a CUDA graph and µs per useful query row: whether another shape makes cuDNN pick a
    faster kernel for the same work."""
    from vivant.kernels.split_kv import _partial_sdpa

    n, h, d = cfg.tokens_per_chunk, cfg.shard_heads(tp), cfg.head_dim
    bf = torch.bfloat16
    res = {}
    for slots, splits in ((cfg.cache_slots, (1, 2, 4)), (5792, (8, 16))):
        k, v = (torch.randn(slots, h, d, device=DEV, dtype=bf) for _ in range(2))
        for p in splits:
            kb, vb = (t.view(p, slots // p, h, d).permute(0, 2, 1, 3) for t in (k, v))
            for nq in (n, 768, 896, 1024):
                q = torch.randn(nq, h, d, device=DEV, dtype=bf)
                qb = q.transpose(0, 1).unsqueeze(0).expand(p, h, nq, d)
                name = f"slots{slots}_p{p}_q{nq}"
                try:
                    us = graph_us(lambda qb=qb, kb=kb, vb=vb: _partial_sdpa(qb, kb, vb, d ** -0.5))
                    res[name] = {"us": us, "us_per_757_rows": us * n / nq,
                                 "tflops": 4 * nq * slots * d * h / us / 1e6}
                except Exception as e:
                    res[name] = {"error": f"{type(e).__name__}: {e}"[:300]}
                print(f"  attention {name}: {res[name]}", flush=True)
    return res


def probe_fast_accum_ab(cfg, tp: int = 4, rounds: int = 4) -> dict:
    """Each FP8 GEMM shape with and without cuBLASLt fast accumulation, alternated `rounds` times in one process
    (exact, fast, exact, fast, …; fresh inputs per round), µs per call inside a CUDA graph: whether the exact
    kernel cuBLASLt picks for a shape is faster than the fast-accumulation one on this card, beyond lease noise."""
    from vivant.worker.model.tp import local_shapes

    m = cfg.tokens_per_chunk
    res = {}
    for name, (n, k) in local_shapes(cfg, tp).items():
        w8, sw = quantize_weight(torch.randn(n, k, device=DEV) / k ** 0.5)
        times = {"exact": [], "fast": []}
        for _ in range(rounds):
            a8, sa = quantize_rows_ref(torch.randn(m, k, device=DEV))
            for label, fast in (("exact", False), ("fast", True)):
                times[label].append(graph_us(lambda a8=a8, sa=sa, fast=fast, w8=w8, sw=sw:
                                             fp8_linear(a8, sa, w8, sw, fast_accum=fast)))
        res[name] = {"N": n, "K": k, **times,
                     "exact_median": float(torch.tensor(times["exact"]).median()),
                     "fast_median": float(torch.tensor(times["fast"]).median())}
        print(f"  fast-accum A/B {name}: exact {[round(t, 1) for t in times['exact']]} fast "
              f"{[round(t, 1) for t in times['fast']]}", flush=True)
    return res


def probe_gemm_rows(cfg, tp: int = 4, rounds: int = 3) -> dict:
    """Each FP8 GEMM (fast accumulation) at the chunk's 757 rows and at padded row counts (768, 896, 1024),
    alternated `rounds` times in one process, µs per call inside a CUDA graph: whether cuBLASLt picks a better
    kernel when M is a multiple of the tile height."""
    from vivant.worker.model.tp import local_shapes

    res = {}
    for name, (n, k) in local_shapes(cfg, tp).items():
        w8, sw = quantize_weight(torch.randn(n, k, device=DEV) / k ** 0.5)
        times: dict[int, list] = {m: [] for m in (cfg.tokens_per_chunk, 768, 896, 1024)}
        for _ in range(rounds):
            for m in times:
                a8, sa = quantize_rows_ref(torch.randn(m, k, device=DEV))
                times[m].append(graph_us(lambda a8=a8, sa=sa, w8=w8, sw=sw: fp8_linear(a8, sa, w8, sw, fast_accum=True)))
        res[name] = {"N": n, "K": k, "us": {str(m): t for m, t in times.items()},
                     "median_us": {str(m): float(torch.tensor(t).median()) for m, t in times.items()}}
        print(f"  gemm rows {name}: {res[name]['median_us']}", flush=True)
    return res
