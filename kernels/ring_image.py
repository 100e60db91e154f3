"""The ring's read image: a bf16 copy of the dequantized FP8 ring, refreshed only where the ring changes.

Why: the fastest attention kernel on Hopper that torch reaches (cuDNN SDPA, 85 µs per call at 757
queries × 5,788 slots × 16 heads × 128) takes bf16 keys and values, not FP8 rows with scales. Widening
the whole FP8 ring before every call (the "sdpa" backend of ring_attention) is exactly the per-call
whole-cache work the ring exists to remove: 5,788 rows read and written per call, 240 calls per chunk.
The ring only changes where it is written (757 slots per pass, the sink once) and where keys are
delta-rotated at a position reset, so the image is refreshed at those slots, at the same time:
`dequant_slots(src, scale, slots, dst)` computes dst[slots] = bf16(float32(src[slots]) · scale[slots]),
the same expression and rounding as the whole-cache dequantization, so attention over the image gives
the same result as the "sdpa" backend, bit for bit.

Cost: the image is the cache again in bf16 (2 bytes per element; at 57b TP=4 60 layers × 5,788 × 16 ×
128 × 2 (K, V) × 2 B = 2.8 GB per rank) and each refresh reads n·H·D FP8 and writes n·H·D bf16.

Shapes: src [S, H, D] float8_e4m3fn (or float), scale [S, H] float32, slots [n] int64 (distinct, in
[0, S)), dst [S, H, D] bf16/fp16/fp32. `dequant_slots_ref` is the float32 torch twin.
"""

from __future__ import annotations

import torch
from vivant.kernels.backend import use_triton
from vivant.kernels.cache_write import check_slots

try:
    import triton
    import triton.language as tl
    from vivant.kernels.cache_write import bf16_grid_tl
except ImportError:  # pragma: no cover
    triton = None

IMAGE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def dequant_slots_ref(src: torch.Tensor, scale: torch.Tensor, slots: torch.Tensor, dst: torch.Tensor) -> None:
    dst[slots] = (src[slots].float() * scale[slots].float()[..., None]).to(dst.dtype)


if triton is not None:

    @triton.jit
    def _dequant_slots_kernel(src, sc, slots, dst, n, HD: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr,
                              ROUND_BF16: tl.constexpr, ALL: tl.constexpr):
        # one program per (slot, block of the slot's H·D elements): a slot's H·D values are contiguous.
        # ALL: every slot in order (program i is slot i; `slots` is not read)
        i = tl.program_id(0)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = offs < HD
        if ALL:
            slot = i.to(tl.int64)
        else:
            slot = tl.load(slots + i)
        x = tl.load(src + slot * HD + offs, mask=m, other=0.0).to(tl.float32)
        s = tl.load(sc + slot * (HD // D) + offs // D, mask=m, other=0.0)
        y = x * s
        if ROUND_BF16:  # round to nearest-even first: the interpreter's own bf16 cast truncates
            y = bf16_grid_tl(y)
        tl.store(dst + slot * HD + offs, y.to(dst.dtype.element_ty), mask=m)


def _check(src, scale, dst, name: str) -> None:
    if src.dim() != 3:
        raise ValueError(f"{name}: src must be [S, H, D], got shape {tuple(src.shape)}")
    if dst.shape != src.shape:
        raise ValueError(f"{name}: dst must have src's shape {tuple(src.shape)}, got {tuple(dst.shape)}")
    if dst.dtype not in IMAGE_DTYPES:
        raise TypeError(f"{name}: dst dtype must be one of {IMAGE_DTYPES}, got {dst.dtype}")
    if scale.shape != src.shape[:2] or scale.dtype != torch.float32:
        raise ValueError(f"{name}: scale must be float32 [S, H] = {tuple(src.shape[:2])}, got "
                         f"{scale.dtype} {tuple(scale.shape)}")
    for what, t in (("scale", scale), ("dst", dst)):
        if t.device != src.device:
            raise ValueError(f"{name}: {what} is on {t.device} but src is on {src.device}")
    if not (src.is_contiguous() and dst.is_contiguous() and scale.is_contiguous()):
        raise ValueError(f"{name}: src, scale and dst must be contiguous")


def _launch(src, scale, slots, dst, n: int) -> None:
    _, H, D = src.shape
    hd = H * D
    block = min(triton.next_power_of_2(hd), 2048)
    _dequant_slots_kernel[(n, triton.cdiv(hd, block))](src, scale, slots if slots is not None else src, dst, n, HD=hd,
                                                       D=D, BLOCK=block, ROUND_BF16=dst.dtype == torch.bfloat16,
                                                       ALL=slots is None, num_warps=4)


def dequant_slots(src: torch.Tensor, scale: torch.Tensor, slots: torch.Tensor, dst: torch.Tensor, *,
                  backend: str = "auto") -> None:
    """dst[slots] = dequantized src[slots] (in place). backend: "auto" | "triton" | "torch"."""
    _check(src, scale, dst, "dequant_slots")
    if slots.dim() != 1:
        raise ValueError(f"dequant_slots: slots must be a 1-D int64 tensor, got shape {tuple(slots.shape)}")
    check_slots(slots, slots.shape[0], src.shape[0], src.device)  # dtype, device; range and distinctness on CPU
    if not slots.numel():
        return
    if not use_triton("dequant_slots", backend, src.device):
        dequant_slots_ref(src, scale, slots, dst)
        return
    _launch(src, scale, slots, dst, slots.numel())


def dequant_all(src: torch.Tensor, scale: torch.Tensor, dst: torch.Tensor, *, backend: str = "auto") -> None:
    """dst = dequantized src, every slot (in place): the image's first fill, and the "sdpa" attention backend's
    per-call whole-ring dequantization. Same expression and rounding as dequant_slots."""
    _check(src, scale, dst, "dequant_all")
    if not use_triton("dequant_all", backend, src.device):
        dst.copy_((src.float() * scale.float()[..., None]).to(dst.dtype))
        return
    _launch(src, scale, None, dst, src.shape[0])
