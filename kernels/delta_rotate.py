"""Delta rotation of cached keys' temporal RoPE band, in place (the position reset).

Why: positions grow without bound in a long session. When the window's temporal index passes a
limit, the model shifts positions back by Δ and rotates the keys already in the cache by -Δ in the
t band only, once, instead of recomputing them: rotate the t band by ``delta_t * inv_freq_t`` in
float32 and store in the cache's dtype. Because RoPE angles add, a key
written at temporal position t and rotated by -Δ equals the key written at t - Δ (to the cache
dtype's rounding).

Shapes: ``k_cache[S, H, D]`` (bfloat16 served; float32 or float16), ``slots[M]`` int64 distinct in ``[0, S)``, ``delta_t`` a Python int (radians are
``delta_t * inv_freq``; the model passes ``-Δ``). The h and w bands are not rotated.
"""

from __future__ import annotations

import torch
from vivant.kernels.backend import use_triton
from vivant.kernels.ring_checks import check_cache, check_slots
from vivant.kernels.rope import DEFAULT_THETA, band_inv_freq, check_rope_dims, rotate_t_band_ref

try:
    import triton
    import triton.language as tl
    from vivant.kernels.ring_checks import bf16_grid_tl
except ImportError:  # pragma: no cover - installs without the kernels extra
    triton = None
    tl = None


def _check_args(k_cache, slots, delta_t, rope_dims) -> None:
    check_cache(k_cache, k_cache)
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
    slots: torch.Tensor,
    delta_t: int,
    *,
    rope_dims: tuple[int, int, int],
    theta: float = DEFAULT_THETA,
) -> None:
    """Float32 torch twin of ``delta_rotate``: in place on ``k_cache[slots]``."""
    _check_args(k_cache, slots, delta_t, rope_dims)
    if slots.numel() == 0:
        return
    k_cache[slots] = rotate_t_band_ref(k_cache[slots].float(), delta_t, rope_dims, theta).to(k_cache.dtype)


if triton is not None:

    @triton.jit
    def _delta_rotate_kernel(
        kc_ptr,
        slot_ptr,
        inv_t_ptr,
        delta,
        M,
        s_cs,
        s_ch,
        s_cd,
        HALF: tl.constexpr,
        DT2: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_P: tl.constexpr,
        ROUND_BF16: tl.constexpr,
    ):
        """One program per (block of BLOCK_M slots, head): rotate the t-band pairs of the rows, store them.
        ROUND_BF16: round on the bf16 grid before the cast (the interpreter's own cast truncates)."""
        pid = tl.program_id(0)
        h = tl.program_id(1)
        rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
        pairs = tl.arange(0, BLOCK_P)
        rmask = rows < M
        mask2 = rmask[:, None] & (pairs < HALF)[None, :]
        slot = tl.load(slot_ptr + rows.to(tl.int64), mask=rmask, other=0)

        even = kc_ptr + slot[:, None] * s_cs + h * s_ch + (2 * pairs[None, :]) * s_cd
        a = tl.load(even, mask=mask2, other=0.0).to(tl.float32)
        b = tl.load(even + s_cd, mask=mask2, other=0.0).to(tl.float32)

        in_t = pairs < DT2
        inv = tl.load(inv_t_ptr + pairs, mask=in_t, other=0.0)
        ang = delta * inv
        c = tl.cos(ang)[None, :]
        s = tl.sin(ang)[None, :]
        ra = tl.where(in_t[None, :], a * c - b * s, a)
        rb = tl.where(in_t[None, :], a * s + b * c, b)
        if ROUND_BF16:
            ra = bf16_grid_tl(ra)
            rb = bf16_grid_tl(rb)
        tl.store(even, ra.to(kc_ptr.dtype.element_ty), mask=mask2)
        tl.store(even + s_cd, rb.to(kc_ptr.dtype.element_ty), mask=mask2)


def _delta_rotate_triton(k_cache, slots, delta_t, rope_dims, theta) -> None:
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
        k_cache, slots, inv_t, float(delta_t), m,
        *k_cache.stride(),
        HALF=d // 2, DT2=dt // 2, BLOCK_M=block_m, BLOCK_P=block_p,
        ROUND_BF16=k_cache.dtype == torch.bfloat16,
    )  # fmt: skip


def delta_rotate(
    k_cache: torch.Tensor,
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
        delta_rotate_ref(k_cache, slots, delta_t, rope_dims=rope_dims, theta=theta)
        return
    _check_args(k_cache, slots, delta_t, rope_dims)
    _delta_rotate_triton(k_cache, slots, delta_t, check_rope_dims(rope_dims), theta)
