"""A prototype FP8 GEMM for the QKV projection's shape (M = 757, N = 6144, K = 8192 at the 57b TP = 4 rank), to see
whether a hybrid data-parallel + stream-K schedule beats cuBLASLt there (gpu_tune part `streamk`).

Why: 128 × 128 tiles give 6 × 48 = 288 tiles on 132 SMs, 2.18 waves, so cuBLASLt's kernel runs three tile-times
with most SMs idle in the third. Here the first ⌊288 / 132⌋ · 132 = 264 tiles run data-parallel (each program owns
whole tiles, full K), and the last 24 tiles' K iterations are spread evenly over all programs (stream-K): each
program adds its float32 partial product into a workspace with atomics and counts its iterations into the tile's
counter; the program that completes a tile's count applies the row/column scales, writes bf16 and zeroes the
workspace and counter for the next call (CUDA graph replays). Reference: `fp8_linear_ref` (float32), and
`torch._scaled_mm` (cuBLASLt) for time.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None


if triton is not None:

    @triton.jit
    def _coords(t, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
        """Tile t → (pid_m, pid_n), grouped along M so programs running together share weight tiles in L2."""
        group = GROUP_M * num_pid_n
        first_m = (t // group) * GROUP_M
        size_m = tl.minimum(num_pid_m - first_m, GROUP_M)
        return first_m + (t % group) % size_m, (t % group) // size_m

    @triton.jit
    def _mac(a_ptr, w_ptr, off_m, off_n, k_lo, k_hi, M, N, K, stride_am, stride_wn, acc,
             BK: tl.constexpr, STAGES: tl.constexpr, FAST: tl.constexpr, TMA: tl.constexpr = False,
             BM: tl.constexpr = 128, BN: tl.constexpr = 128):
        """acc += a[rm, k] · w[rn, k]ᵀ over K iterations [k_lo, k_hi) of BK columns. FAST: the tensor cores'
        fast accumulation (Triton's default for FP8); otherwise partial sums are promoted to float32 every BK.
        TMA: a_ptr / w_ptr are tensor descriptors (Hopper TMA loads; rows past M or N read as zeros)."""
        rk = tl.arange(0, BK)
        rm = off_m + tl.arange(0, BM)
        rn = off_n + tl.arange(0, BN)
        for ki in tl.range(k_lo, k_hi, num_stages=STAGES):
            if TMA:
                a = a_ptr.load([off_m, ki * BK])
                w = w_ptr.load([off_n, ki * BK])
            else:
                k = ki * BK + rk
                a = tl.load(a_ptr + rm[:, None] * stride_am + k[None, :], mask=(rm < M)[:, None] & (k < K)[None, :],
                            other=0.0)
                w = tl.load(w_ptr + rn[:, None] * stride_wn + k[None, :], mask=(rn < N)[:, None] & (k < K)[None, :],
                            other=0.0)
            acc = tl.dot(a, tl.trans(w), acc, max_num_imprecise_acc=None if FAST else BK)
        return acc

    @triton.jit
    def _epilogue(acc, c_ptr, sa_ptr, sw_ptr, rm, rn, M, N, stride_cm):
        sa = tl.load(sa_ptr + rm, mask=rm < M, other=0.0)
        sw = tl.load(sw_ptr + rn, mask=rn < N, other=0.0)
        out = acc * sa[:, None] * sw[None, :]
        tl.store(c_ptr + rm[:, None] * stride_cm + rn[None, :], out.to(c_ptr.dtype.element_ty),
                 mask=(rm < M)[:, None] & (rn < N)[None, :])

    @triton.jit
    def _fp8_gemm_streamk(a_ptr, w_ptr, sa_ptr, sw_ptr, c_ptr, ws_ptr, cnt_ptr, M, N, K, stride_am, stride_wn,
                          stride_cm, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
                          PROGRAMS: tl.constexpr, STREAM_K: tl.constexpr, STAGES: tl.constexpr, FAST: tl.constexpr,
                          TMA: tl.constexpr = False):
        pid = tl.program_id(0)
        num_pid_m = tl.cdiv(M, BM)
        num_pid_n = tl.cdiv(N, BN)
        tiles = num_pid_m * num_pid_n
        k_iters = tl.cdiv(K, BK)
        dp_tiles = (tiles // PROGRAMS) * PROGRAMS if STREAM_K else tiles
        for t in range(pid, dp_tiles, PROGRAMS):  # data-parallel tiles, whole K each
            pm, pn = _coords(t, num_pid_m, num_pid_n, GROUP_M)
            rm = pm * BM + tl.arange(0, BM)
            rn = pn * BN + tl.arange(0, BN)
            acc = _mac(a_ptr, w_ptr, pm * BM, pn * BN, 0, k_iters, M, N, K, stride_am, stride_wn,
                       tl.zeros([BM, BN], dtype=tl.float32), BK, STAGES, FAST, TMA, BM, BN)
            _epilogue(acc, c_ptr, sa_ptr, sw_ptr, rm, rn, M, N, stride_cm)
        if STREAM_K:
            total = (tiles - dp_tiles) * k_iters
            per = tl.cdiv(total, PROGRAMS)
            it = pid * per
            end = tl.minimum(it + per, total)
            offs = tl.arange(0, BM)[:, None] * BN + tl.arange(0, BN)[None, :]
            while it < end:
                s = it // k_iters  # stream-K tile index (0 … tiles − dp_tiles − 1)
                k_lo = it % k_iters
                k_hi = tl.minimum(k_iters, k_lo + (end - it))
                pm, pn = _coords(dp_tiles + s, num_pid_m, num_pid_n, GROUP_M)
                rm = pm * BM + tl.arange(0, BM)
                rn = pn * BN + tl.arange(0, BN)
                acc = _mac(a_ptr, w_ptr, pm * BM, pn * BN, k_lo, k_hi, M, N, K, stride_am, stride_wn,
                           tl.zeros([BM, BN], dtype=tl.float32), BK, STAGES, FAST, TMA, BM, BN)
                tl.atomic_add(ws_ptr + s * BM * BN + offs, acc, sem="relaxed")
                tl.debug_barrier()  # every thread's partial is added before the count says so
                done = tl.atomic_add(cnt_ptr + s, k_hi - k_lo, sem="acq_rel") + (k_hi - k_lo)
                if done == k_iters:  # this program completed the tile: scale, store, clean up for the next call
                    tl.debug_barrier()
                    total_acc = tl.load(ws_ptr + s * BM * BN + offs, cache_modifier=".cg")
                    _epilogue(total_acc, c_ptr, sa_ptr, sw_ptr, rm, rn, M, N, stride_cm)
                    tl.store(ws_ptr + s * BM * BN + offs, tl.zeros([BM, BN], dtype=tl.float32))
                    tl.atomic_xchg(cnt_ptr + s, 0, sem="relaxed")
                it += k_hi - k_lo


class StreamKGemm:
    """y[M, N] = (a·sa) @ (w·sw)ᵀ in bf16 for fixed (M, N, K): the workspace and counters are allocated once."""

    def __init__(self, m: int, n: int, k: int, device, *, bm=128, bn=128, bk=128, group_m=8, programs=None,
                 stream_k=True, stages=4, warps=8, fast=True, tma=False):
        self.m, self.n, self.k, self.tma = m, n, k, tma
        self.bm, self.bn, self.bk, self.group_m, self.stages, self.warps, self.fast = bm, bn, bk, group_m, stages, warps, fast
        dev = torch.device(device)
        self.programs = programs or (torch.cuda.get_device_properties(dev).multi_processor_count
                                     if dev.type == "cuda" else 4)
        tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
        self.stream_k = bool(stream_k and tiles % self.programs)
        sk = tiles - (tiles // self.programs) * self.programs if self.stream_k else 1
        self.ws = torch.zeros(sk, bm, bn, device=dev, dtype=torch.float32)
        self.cnt = torch.zeros(sk, device=dev, dtype=torch.int32)

    def __call__(self, a, sa, w, sw, out=None):
        out = out if out is not None else torch.empty(self.m, self.n, device=a.device, dtype=torch.bfloat16)
        grid = (self.programs,)
        if self.tma:
            from triton.tools.tensor_descriptor import TensorDescriptor

            a_in = TensorDescriptor.from_tensor(a, [self.bm, self.bk])
            w_in = TensorDescriptor.from_tensor(w, [self.bn, self.bk])
        else:
            a_in, w_in = a, w
        _fp8_gemm_streamk[grid](a_in, w_in, sa, sw, out, self.ws, self.cnt, self.m, self.n, self.k, a.stride(0),
                                w.stride(0), out.stride(0), BM=self.bm, BN=self.bn, BK=self.bk, GROUP_M=self.group_m,
                                PROGRAMS=self.programs, STREAM_K=self.stream_k, STAGES=self.stages, FAST=self.fast, TMA=self.tma,
                                num_warps=self.warps)
        return out


def probe_streamk(cfg, tp: int = 4) -> dict:
    """The QKV shape (and the three other GEMMs) through StreamKGemm variants against torch._scaled_mm, fresh inputs
    per variant, relative error against the float32 reference, µs inside a CUDA graph."""
    from vivant.bench.gpu_step import graph_us
    from vivant.kernels.fp8 import quantize_rows_ref
    from vivant.kernels.fp8_gemm import fp8_linear, fp8_linear_ref, quantize_weight
    from vivant.worker.model.tp import local_shapes

    m = cfg.tokens_per_chunk
    res = {}
    for name, (n, k) in local_shapes(cfg, tp).items():
        a8, sa = quantize_rows_ref(torch.randn(m, k, device="cuda"))
        w8, sw = quantize_weight(torch.randn(n, k, device="cuda") / k ** 0.5)
        ref = fp8_linear_ref(a8, sa, w8, sw)
        ops = (a8, sa, w8, sw)
        row = {"cublas_us": graph_us(lambda ops=ops: fp8_linear(*ops, fast_accum=True))}
        variants = [dict(), dict(stream_k=False), dict(tma=True), dict(tma=True, stream_k=False), dict(tma=True, stages=3),
                    dict(tma=True, stages=5), dict(tma=True, group_m=4), dict(tma=True, bm=64, warps=4),
                    dict(tma=True, bn=256, stages=3), dict(fast=False)] if name == "qkv" else [dict(), dict(tma=True)]
        for kw in variants:
            label = ",".join(f"{a}={b}" for a, b in kw.items()) or "default"
            try:
                g = StreamKGemm(m, n, k, "cuda", **kw)
                y = g(*ops)
                y2 = g(*ops)  # the workspace must come back clean
                err = float((y.float() - ref).norm() / ref.norm())
                row[label] = {"us": graph_us(lambda g=g, ops=ops: g(*ops)), "rel_err": err,
                              "repeat_equal": bool(torch.equal(y, y2)), "stream_k": g.stream_k}
            except Exception as e:
                row[label] = {"error": f"{type(e).__name__}: {e}"[:400]}
            print(f"  streamk {name} {label}: {row[label]} (cuBLASLt {row['cublas_us']:.1f} µs)", flush=True)
        res[name] = row
    return res
