"""From the fused QKV projection to the ring in one pass: q/k RMSNorm, RoPE of q and k, and the rotated k and
v rows into the ring at the chunk's slots. The one kernel that writes the served ring; `qkv_ring_write_ref` is
its float32 twin.

Why one pass: between the QKV GEMM and attention the work is per token and per head row — normalize, rotate,
store — so one program per token reads its q, k, v rows once as contiguous [heads, D] tiles, splits the
adjacent pairs in registers, rotates q and k with the chunk's cos/sin (computed once per chunk, shared by q and
k) and writes each head row of the ring contiguously. Why a bf16 ring: attention (cuDNN SDPA) reads bf16 keys
and values, so a bf16 ring is its own read image — nothing is dequantized or refreshed — and K/V are rounded
once, to bf16 (docs/ARCHITECTURE.md, "The ring KV cache").

Shapes: qkv [N, 3·H·D] (q heads | k heads | v heads, bf16/fp32, contiguous rows); q_weight, k_weight [D];
cos, sin [N, D/2] float32 (adjacent-pair convention of vivant.kernels.rope); slots [N] int64 (distinct);
ring k_cache, v_cache [S, H, D] bfloat16, contiguous. Returns q_rot [N, H, D] in qkv's dtype. Per token: reads 3·H·D values, writes H·D (q_rot) +
2·H·D bf16 values. The twin keeps k in float32 between its norm and its rotation and rounds to bf16 once.
"""

from __future__ import annotations

import torch
from vivant.kernels.backend import pdl_launch, use_triton
from vivant.kernels.ring_checks import check_cache, check_slots

try:
    import triton
    import triton.language as tl
    from triton.language.extra.cuda import gdc_wait
    from vivant.kernels.qk_norm_rope import rms_heads_tl, rope_pairs_tl
    from vivant.kernels.ring_checks import bf16_grid_tl
except ImportError:  # pragma: no cover
    triton = None

RING_DTYPE = torch.bfloat16


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    a, b = x[..., 0::2], x[..., 1::2]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.stack([a * c - b * s, a * s + b * c], dim=-1).flatten(-2)


def qkv_ring_write_ref(qkv, q_weight, k_weight, cos, sin, slots, k_cache, v_cache, heads: int,
                       eps: float = 1e-6) -> torch.Tensor:
    """Float32 twin of `qkv_ring_write`: the rotated k and the v rows rounded once to the ring's dtype."""
    n, d = qkv.shape[0], q_weight.shape[0]
    q, k, v = qkv.float().view(n, 3, heads, d).unbind(1)
    c, s = cos.float(), sin.float()
    q_rot = _rotate(_rms(q, q_weight.float(), eps), c, s)
    k_rot = _rotate(_rms(k, k_weight.float(), eps), c, s)
    k_cache[slots] = k_rot.to(k_cache.dtype)
    v_cache[slots] = v.to(v_cache.dtype)
    return q_rot.to(qkv.dtype)


if triton is not None:

    @triton.jit
    def _store_head_rows(x, row_ptrs, hm, HW_CAST: tl.constexpr):
        """Store [BLOCK_H, D] float32 rows in the ring's dtype (round to nearest even). HW_CAST: the hardware
        conversion (compiled GPU code); otherwise round on the bf16 grid first (the interpreter's own cast
        truncates)."""
        if HW_CAST:
            tl.store(row_ptrs, x.to(row_ptrs.dtype.element_ty), mask=hm[:, None])
        else:
            tl.store(row_ptrs, bf16_grid_tl(x).to(row_ptrs.dtype.element_ty), mask=hm[:, None])

    @triton.jit
    def _qkv_ring_kernel(qkv_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, slot_ptr, q_out, kc_ptr, vc_ptr, stride_tok, H,
                         eps, D: tl.constexpr, BLOCK_H: tl.constexpr, HW_CAST: tl.constexpr,
                         PDL: tl.constexpr = False):
        if PDL:  # programmatic dependent launch: nothing is read or written before the predecessor is done
            gdc_wait()
        tok = tl.program_id(0)
        hh = tl.arange(0, BLOCK_H)
        dd = tl.arange(0, D)
        hm = hh < H
        offs = hh[:, None] * D + dd[None, :]
        base = qkv_ptr + tok.to(tl.int64) * stride_tok
        q = tl.load(base + offs, mask=hm[:, None], other=0.0).to(tl.float32)
        k = tl.load(base + H * D + offs, mask=hm[:, None], other=0.0).to(tl.float32)
        v = tl.load(base + 2 * H * D + offs, mask=hm[:, None], other=0.0).to(tl.float32)
        slot = tl.load(slot_ptr + tok).to(tl.int64)
        qw = tl.load(qw_ptr + dd).to(tl.float32)
        kw = tl.load(kw_ptr + dd).to(tl.float32)
        j = tl.arange(0, D // 2)
        c = tl.load(cos_ptr + tok * (D // 2) + j)[None, :]
        s = tl.load(sin_ptr + tok * (D // 2) + j)[None, :]
        q_rot = rope_pairs_tl(rms_heads_tl(q, qw, D, eps), c, s, BLOCK_H, D)
        tl.store(q_out + tok * H * D + offs, q_rot.to(q_out.dtype.element_ty), mask=hm[:, None])
        k_rot = rope_pairs_tl(rms_heads_tl(k, kw, D, eps), c, s, BLOCK_H, D)
        ring = slot * H * D + offs  # [S, H, D] contiguous: the slot's H·D values are one run
        _store_head_rows(k_rot, kc_ptr + ring, hm, HW_CAST)
        _store_head_rows(v, vc_ptr + ring, hm, HW_CAST)


def _check(qkv, q_weight, k_weight, cos, sin, slots, k_cache, v_cache, heads):
    d = q_weight.shape[0] if q_weight.dim() == 1 else -1
    if q_weight.dim() != 1 or k_weight.shape != q_weight.shape:
        raise ValueError(f"qkv_ring_write: q_weight and k_weight must be [D], got {tuple(q_weight.shape)} and "
                         f"{tuple(k_weight.shape)}")
    n = qkv.shape[0]
    if qkv.dim() != 2 or qkv.shape[1] != 3 * heads * d or qkv.stride(1) != 1:
        raise ValueError(f"qkv_ring_write: qkv must be [N, 3·{heads}·{d}] with contiguous rows, got "
                         f"{tuple(qkv.shape)} strides {tuple(qkv.stride())}")
    if cos.shape != (n, d // 2) or sin.shape != (n, d // 2):
        raise ValueError(f"qkv_ring_write: cos/sin must be [{n}, {d // 2}], got {tuple(cos.shape)}/{tuple(sin.shape)}")
    if k_cache.dtype != RING_DTYPE or v_cache.dtype != RING_DTYPE:
        raise TypeError(f"qkv_ring_write: the ring must be {RING_DTYPE} (k_cache and v_cache), got "
                        f"{k_cache.dtype}/{v_cache.dtype}")
    check_cache(k_cache, v_cache)  # shapes, dtypes, devices of the ring
    if k_cache.shape[1:] != (heads, d):
        raise ValueError(f"qkv_ring_write: k_cache must be [S, {heads}, {d}], got {tuple(k_cache.shape)}")
    if any(t.device != qkv.device for t in (cos, sin, k_cache, q_weight, k_weight)):
        raise ValueError(f"qkv_ring_write: every tensor must be on qkv's device {qkv.device}")
    check_slots(slots, n, k_cache.shape[0], k_cache.device)  # dtype, shape; range and distinctness on CPU


def qkv_ring_write(qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor, slots: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, heads: int, eps: float = 1e-6, *,
                   backend: str = "auto", pdl: bool = False) -> torch.Tensor:
    """Normalize and rotate q and k, write the rotated k and v into the bf16 ring at `slots`; returns q_rot.
    pdl: programmatic dependent launch on a Hopper GPU (vivant.kernels.backend.pdl_launch); ignored elsewhere."""
    _check(qkv, q_weight, k_weight, cos, sin, slots, k_cache, v_cache, heads)
    d = q_weight.shape[0]
    if d & (d - 1) and backend == "triton":
        raise ValueError(f"qkv_ring_write: the Triton kernel needs a power-of-two head_dim, got {d}")
    if d & (d - 1) or not use_triton("qkv_ring_write", backend, qkv.device):
        return qkv_ring_write_ref(qkv, q_weight, k_weight, cos, sin, slots, k_cache, v_cache, heads,
                                  eps)
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("qkv_ring_write: the ring must be contiguous")
    n = qkv.shape[0]
    q_out = torch.empty(n, heads, d, dtype=qkv.dtype, device=qkv.device)
    if n == 0:
        return q_out
    extra = dict(PDL=True, launch_pdl=True) if pdl_launch(pdl, qkv.device) else {}
    _qkv_ring_kernel[(n,)](qkv, q_weight, k_weight, cos.contiguous().float(), sin.contiguous().float(), slots, q_out,
                           k_cache, v_cache, qkv.stride(0), heads, eps, D=d,
                           BLOCK_H=triton.next_power_of_2(heads), HW_CAST=qkv.is_cuda, num_warps=4, **extra)
    return q_out
