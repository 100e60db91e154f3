"""Delta rotation of cached keys' temporal RoPE band, in place (the position reset).

Why: positions grow without bound in a long session. When the window's temporal index passes a
limit, the model shifts positions back by Δ and rotates the keys already in the cache by -Δ in the
t band only, once, instead of recomputing them: dequantize -> rotate the t band by
``delta_t * inv_freq_t`` -> re-quantize with a fresh per-row scale (FP8 cache) or store (float
cache). Because RoPE angles add, a key written at temporal position t and rotated by -Δ equals the
key written at t - Δ (to float rounding; within FP8 re-quantization error in FP8 mode).

Shapes: ``k_cache[S, H, D]`` (float8_e4m3fn, float32, bfloat16 or float16), ``k_scale[S, H]``
float32, ``slots[M]`` int64 distinct in ``[0, S)``, ``delta_t`` a Python int (radians are
``delta_t * inv_freq``; the model passes ``-Δ``). The h and w bands are not rotated; in FP8 mode
they are re-quantized with the row's new scale.
"""

from __future__ import annotations

import torch
from vivant.kernels.backend import use_triton
from vivant.kernels.cache_write import check_cache, check_slots, store_rows
from vivant.kernels.fp8 import FP8_DTYPE, dequantize_rows
from vivant.kernels.rope import DEFAULT_THETA, band_inv_freq, check_rope_dims, rotate_t_band_ref

try:
    import triton
    import triton.language as tl
    from vivant.kernels.cache_write import store_row_block_tl
except ImportError:  # pragma: no cover - installs without the kernels extra
    triton = None
    tl = None


def _check_args(k_cache, k_scale, slots, delta_t, rope_dims) -> None:
    check_cache(k_cache, k_cache, k_scale, k_scale)
    if slots.dim() != 1:
        raise ValueError(f"slots must have shape [M] (one slot per cached key row), got {tuple(slots.shape)}")
    check_slots(slots, slots.shape[0], k_cache.shape[0], k_cache.device)
    check_rope_dims(rope_dims, k_cache.shape[-1])
    if isinstance(delta_t, bool) or not isinstance(delta_t, int):
        raise TypeError(f"delta_t must be a Python int (temporal position shift), got {type(delta_t).__name__}")
    if abs(delta_t) >= 2**24:
        raise ValueError(f"delta_t must satisfy |delta_t| < 2**24 (exact in float32), got {delta_t}")


def delta_rotate_ref(
    k_cache: torch.Tensor,
    k_scale: torch.Tensor,
    slots: torch.Tensor,
    delta_t: int,
    *,
    rope_dims: tuple[int, int, int],
    theta: float = DEFAULT_THETA,
) -> None:
    """Float32 torch twin of ``delta_rotate``: in place on ``k_cache[slots]`` / ``k_scale[slots]``."""
    _check_args(k_cache, k_scale, slots, delta_t, rope_dims)
    if slots.numel() == 0:
        return
    if k_cache.dtype == FP8_DTYPE:
        rows = dequantize_rows(k_cache.view(torch.uint8)[slots].view(FP8_DTYPE), k_scale[slots])
    else:
        rows = dequantize_rows(k_cache[slots], k_scale[slots])
    store_rows(k_cache, k_scale, slots, rotate_t_band_ref(rows, delta_t, rope_dims, theta))


if triton is not None:

    @triton.jit
    def _delta_rotate_kernel(
        kc_ptr,
        ks_ptr,
        slot_ptr,
        inv_t_ptr,
        delta,
        M,
        s_cs,
        s_ch,
        s_cd,
        s_ss,
        s_sh,
        HALF: tl.constexpr,
        DT2: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_P: tl.constexpr,
        FP8: tl.constexpr,
    ):
        """One program per (block of BLOCK_M slots, head): dequantize, rotate t-band pairs, re-quantize."""
        pid = tl.program_id(0)
        h = tl.program_id(1)
        rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
        pairs = tl.arange(0, BLOCK_P)
        rmask = rows < M
        mask2 = rmask[:, None] & (pairs < HALF)[None, :]
        slot = tl.load(slot_ptr + rows.to(tl.int64), mask=rmask, other=0)

        even = kc_ptr + slot[:, None] * s_cs + h * s_ch + (2 * pairs[None, :]) * s_cd
        sc = tl.load(ks_ptr + slot * s_ss + h * s_sh, mask=rmask, other=1.0)
        a = tl.load(even, mask=mask2, other=0.0).to(tl.float32) * sc[:, None]
        b = tl.load(even + s_cd, mask=mask2, other=0.0).to(tl.float32) * sc[:, None]

        in_t = pairs < DT2
        inv = tl.load(inv_t_ptr + pairs, mask=in_t, other=0.0)
        ang = delta * inv
        c = tl.cos(ang)[None, :]
        s = tl.sin(ang)[None, :]
        ra = tl.where(in_t[None, :], a * c - b * s, a)
        rb = tl.where(in_t[None, :], a * s + b * c, b)
        store_row_block_tl(ra, rb, slot, h, pairs, kc_ptr, ks_ptr, s_cs, s_ch, s_cd, s_ss, s_sh, mask2, rmask, FP8)


def _delta_rotate_triton(k_cache, k_scale, slots, delta_t, rope_dims, theta) -> None:
    m = slots.shape[0]
    _, h, d = k_cache.shape
    dt = rope_dims[0]
    if m == 0:
        return
    inv_t = band_inv_freq(dt, theta, k_cache.device)
    block_p = max(1, triton.next_power_of_2(d // 2))
    block_m = max(1, min(triton.next_power_of_2(m), max(1, 2048 // block_p)))
    grid = (triton.cdiv(m, block_m), h)
    _delta_rotate_kernel[grid](
        k_cache, k_scale, slots, inv_t, float(delta_t), m,
        *k_cache.stride(), *k_scale.stride(),
        HALF=d // 2, DT2=dt // 2, BLOCK_M=block_m, BLOCK_P=block_p, FP8=k_cache.dtype == FP8_DTYPE,
    )  # fmt: skip


def delta_rotate(
    k_cache: torch.Tensor,
    k_scale: torch.Tensor,
    slots: torch.Tensor,
    delta_t: int,
    *,
    rope_dims: tuple[int, int, int],
    theta: float = DEFAULT_THETA,
    backend: str = "auto",
) -> None:
    """Rotate the t band of ``k_cache[slots]`` by ``delta_t * inv_freq_t`` in place (see module docstring).

    ``backend``: "auto" | "triton" | "torch" (see ``vivant.kernels.backend``).
    """
    if not use_triton("delta_rotate", backend, k_cache.device):
        delta_rotate_ref(k_cache, k_scale, slots, delta_t, rope_dims=rope_dims, theta=theta)
        return
    _check_args(k_cache, k_scale, slots, delta_t, rope_dims)
    _delta_rotate_triton(k_cache, k_scale, slots, delta_t, check_rope_dims(rope_dims), theta)
