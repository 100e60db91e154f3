"""From the fused QKV projection to the ring in one pass: q/k RMSNorm, RoPE of q and k, FP8 + ring write of
k and v, and (optionally) the ring's read image.

Why: between the QKV GEMM and attention the engine used to run three kernels — q/k-norm + RoPE(q)
(kernels/qk_norm_rope.py, writing q_rot and a normalized k), the ring write (kernels/cache_write.py:
RoPE(k) at the token's position, FP8, scatter) and the image refresh (kernels/ring_image.py). Profiled on
an H200 at 57b TP=4 the ring write alone took 65 µs per call (15.6 ms of a 134 ms chunk): it computes
sin/cos per (token, head, pair) and stores FP8 bytes at a stride of two (even/odd halves). Here one
program per token reads its q, k, v rows once as contiguous [heads, D] tiles, splits the adjacent pairs
in registers, rotates q and k with the chunk's cos/sin (computed once per chunk, shared with q), and
writes each head row of the ring contiguously.

Shapes: qkv [N, 3·H·D] (q heads | k heads | v heads, bf16/fp32, contiguous rows); q_weight, k_weight [D];
cos, sin [N, D/2] float32 (adjacent-pair convention of vivant.kernels.rope); slots [N] int64 (distinct);
ring k_cache, v_cache [S, H, D] float8_e4m3fn, k_scale, v_scale [S, H] float32, contiguous; images
[S, H, D] bf16 (or None). Returns q_rot [N, H, D] in qkv's dtype. A bf16 ring (k_cache, v_cache bf16, no images:
the ring is its own read image) stores the rotated k and v rows rounded to bf16, with scale 1.
Per token: reads 3·H·D values, writes H·D (q_rot) + 2·H·D bytes (FP8) + 4·H·D bytes (images).

FP8 rows follow vivant.kernels.fp8 (scale = max(amax, 1e-8)/448, IEEE division, round to nearest even; a
NaN in a row gives a NaN scale); image = bf16(fp8 value · scale), the same value ring_image writes.
`qkv_ring_write_ref` is the float32 twin. Differences from the three-kernel path: k stays float32 between
its norm and its rotation (no bf16 rounding in between), and k uses the torch-computed cos/sin of q.
"""

from __future__ import annotations

import torch
from vivant.kernels.backend import pdl_launch, use_triton
from vivant.kernels.cache_write import check_cache, check_slots
from vivant.kernels.fp8 import FP8_DTYPE, quantize_rows_ref

try:
    import triton
    import triton.language as tl
    from triton.language.extra.cuda import gdc_wait
    from vivant.kernels.cache_write import bf16_grid_tl
    from vivant.kernels.fp8 import e4m3_grid_tl, to_e4m3_tl
    from vivant.kernels.qk_norm_rope import rms_heads_tl, rope_pairs_tl
except ImportError:  # pragma: no cover
    triton = None


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    a, b = x[..., 0::2], x[..., 1::2]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.stack([a * c - b * s, a * s + b * c], dim=-1).flatten(-2)


def qkv_ring_write_ref(qkv, q_weight, k_weight, cos, sin, slots, k_cache, v_cache, k_scale, v_scale, heads: int,
                       eps: float = 1e-6, *, k_image=None, v_image=None) -> torch.Tensor:
    n, d = qkv.shape[0], q_weight.shape[0]
    q, k, v = qkv.float().view(n, 3, heads, d).unbind(1)
    c, s = cos.float(), sin.float()
    q_rot = _rotate(_rms(q, q_weight.float(), eps), c, s)
    k_rot = _rotate(_rms(k, k_weight.float(), eps), c, s)
    for rows, cache, scale, image in ((k_rot, k_cache, k_scale, k_image), (v, v_cache, v_scale, v_image)):
        if cache.dtype != FP8_DTYPE:
            cache[slots] = rows.to(cache.dtype)
            scale[slots] = 1.0
            continue
        codes, sc = quantize_rows_ref(rows)
        cache.view(torch.uint8)[slots] = codes.view(torch.uint8)  # index_put on float8 is not implemented everywhere
        scale[slots] = sc
        if image is not None:
            image[slots] = (codes.float() * sc[..., None]).to(image.dtype)
    return q_rot.to(qkv.dtype)


if triton is not None:

    @triton.jit
    def _fp8_head_rows(x, row_ptrs, scale_ptrs, img_ptrs, hm, IMAGE: tl.constexpr, HW_CAST: tl.constexpr,
                       FP8: tl.constexpr = True):
        """Quantize [BLOCK_H, D] float32 rows (one scale per head row), store codes, scales and the image.
        HW_CAST: x·(1/scale) and the hardware e4m3 / bf16 conversions (compiled GPU code); otherwise the
        twin's IEEE division and float32 grid rounding (the interpreter's own casts are wrong).
        FP8 off (a bf16 ring): store the rows in the ring's dtype with scale 1 (round to nearest even)."""
        if not FP8:
            tl.store(scale_ptrs, tl.full(hm.shape, 1.0, tl.float32), mask=hm)
            if HW_CAST:
                tl.store(row_ptrs, x.to(row_ptrs.dtype.element_ty), mask=hm[:, None])
            else:
                tl.store(row_ptrs, bf16_grid_tl(x).to(row_ptrs.dtype.element_ty), mask=hm[:, None])
            return
        amax = tl.max(tl.abs(x), axis=1)
        nans = tl.sum((x != x).to(tl.int32), axis=1)
        amax = tl.where(nans > 0, float("nan"), tl.maximum(amax, 1e-8))
        scale = tl.div_rn(amax, tl.full(amax.shape, 448.0, tl.float32))
        tl.store(scale_ptrs, scale, mask=hm)
        if HW_CAST:
            codes = (x * (1.0 / scale)[:, None]).to(tl.float8e4nv)
            tl.store(row_ptrs, codes, mask=hm[:, None])
            if IMAGE:
                img = codes.to(tl.float32) * scale[:, None]
                tl.store(img_ptrs, img.to(img_ptrs.dtype.element_ty), mask=hm[:, None])
        else:
            y = tl.div_rn(x, scale[:, None])
            tl.store(row_ptrs, to_e4m3_tl(y), mask=hm[:, None])
            if IMAGE:
                img = bf16_grid_tl(e4m3_grid_tl(y) * scale[:, None])  # round to nearest even, then an exact cast
                tl.store(img_ptrs, img.to(img_ptrs.dtype.element_ty), mask=hm[:, None])

    @triton.jit
    def _qkv_ring_kernel(qkv_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, slot_ptr, q_out, kc_ptr, vc_ptr, ks_ptr, vs_ptr,
                         ki_ptr, vi_ptr, stride_tok, H, eps, D: tl.constexpr, BLOCK_H: tl.constexpr,
                         IMAGE: tl.constexpr, HW_CAST: tl.constexpr, PDL: tl.constexpr = False,
                         FP8: tl.constexpr = True):
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
        _fp8_head_rows(k_rot, kc_ptr + ring, ks_ptr + slot * H + hh, ki_ptr + ring, hm, IMAGE, HW_CAST, FP8)
        _fp8_head_rows(v, vc_ptr + ring, vs_ptr + slot * H + hh, vi_ptr + ring, hm, IMAGE, HW_CAST, FP8)


def _check(qkv, q_weight, k_weight, cos, sin, slots, k_cache, v_cache, k_scale, v_scale, heads, k_image, v_image):
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
    if k_cache.dtype not in (FP8_DTYPE, torch.bfloat16) or v_cache.dtype != k_cache.dtype:
        raise TypeError(f"qkv_ring_write: the ring must be {FP8_DTYPE} or torch.bfloat16 (both alike), got "
                        f"{k_cache.dtype}/{v_cache.dtype}")
    if k_cache.dtype != FP8_DTYPE and k_image is not None:
        raise ValueError("qkv_ring_write: a bf16 ring is its own read image: pass no k_image/v_image")
    check_cache(k_cache, v_cache, k_scale, v_scale)  # shapes, dtypes, devices of the ring (as write_kv checks)
    if k_cache.shape[1:] != (heads, d):
        raise ValueError(f"qkv_ring_write: k_cache must be [S, {heads}, {d}], got {tuple(k_cache.shape)}")
    if (k_image is None) != (v_image is None):
        raise ValueError("qkv_ring_write: pass both k_image and v_image, or neither")
    for name, img in (("k_image", k_image), ("v_image", v_image)):
        if img is not None and (img.shape != k_cache.shape or img.dtype != torch.bfloat16 or not img.is_contiguous()):
            raise ValueError(f"qkv_ring_write: {name} must be contiguous bf16 {tuple(k_cache.shape)}, got {img.dtype} "
                             f"{tuple(img.shape)}")
    tensors = [cos, sin, k_cache, q_weight, k_weight] + [t for t in (k_image, v_image) if t is not None]
    if any(t.device != qkv.device for t in tensors):
        raise ValueError(f"qkv_ring_write: every tensor must be on qkv's device {qkv.device}")
    check_slots(slots, n, k_cache.shape[0], k_cache.device)  # dtype, shape; range and distinctness on CPU


def qkv_ring_write(qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor, slots: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   k_scale: torch.Tensor, v_scale: torch.Tensor, heads: int, eps: float = 1e-6, *,
                   k_image: torch.Tensor | None = None, v_image: torch.Tensor | None = None,
                   backend: str = "auto", exact_rounding: bool = False, pdl: bool = False) -> torch.Tensor:
    """Normalize and rotate q and k, write k and v into the ring at `slots` (FP8 and the image, or bf16); returns q_rot.
    exact_rounding: on a GPU, quantize with the twin's IEEE division + grid rounding instead of x·(1/scale) and
    the hardware conversion (codes then differ by at most one e4m3 step, where the two straddle a midpoint).
    pdl: programmatic dependent launch on a Hopper GPU (vivant.kernels.backend.pdl_launch); ignored elsewhere."""
    _check(qkv, q_weight, k_weight, cos, sin, slots, k_cache, v_cache, k_scale, v_scale, heads, k_image, v_image)
    d = q_weight.shape[0]
    if d & (d - 1) and backend == "triton":
        raise ValueError(f"qkv_ring_write: the Triton kernel needs a power-of-two head_dim, got {d}")
    if d & (d - 1) or not use_triton("qkv_ring_write", backend, qkv.device):
        return qkv_ring_write_ref(qkv, q_weight, k_weight, cos, sin, slots, k_cache, v_cache, k_scale, v_scale, heads,
                                  eps, k_image=k_image, v_image=v_image)
    if not all(t.is_contiguous() for t in (k_cache, v_cache, k_scale, v_scale)):
        raise ValueError("qkv_ring_write: the ring and its scales must be contiguous")
    n = qkv.shape[0]
    q_out = torch.empty(n, heads, d, dtype=qkv.dtype, device=qkv.device)
    if n == 0:
        return q_out
    image = k_image is not None
    ki, vi = (k_image, v_image) if image else (k_cache, v_cache)  # unused pointers when IMAGE is off
    extra = dict(PDL=True, launch_pdl=True) if pdl_launch(pdl, qkv.device) else {}
    _qkv_ring_kernel[(n,)](qkv, q_weight, k_weight, cos.contiguous().float(), sin.contiguous().float(), slots, q_out,
                           k_cache, v_cache, k_scale, v_scale, ki, vi, qkv.stride(0), heads, eps, D=d,
                           BLOCK_H=triton.next_power_of_2(heads), IMAGE=image,
                           HW_CAST=qkv.is_cuda and not exact_rounding, FP8=k_cache.dtype == FP8_DTYPE, num_warps=4,
                           **extra)
    return q_out
