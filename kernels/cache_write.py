"""Ring KV-cache write: RoPE on K at the token's absolute position, FP8 quantization, slot scatter.

Why: in the ring cache each chunk's K/V are written once into their ring slots, K already rotated
and both already quantized, so attention reads the cache as it is (no per-call whole-cache work).
One Triton launch does the whole write for a chunk; ``write_kv_ref`` is its float32 torch twin
(and what the model's baseline mode and CPU runs use).

Shapes and dtypes:
  k_new, v_new    [N, H, D]  float32 / bfloat16 / float16, any strides (e.g. views into a fused QKV output)
  pos             [N, 3]     int32 / int64: (t, h, w) absolute position per token
  slots           [N]        int64, distinct, in [0, S): the ring slot of each token
  k_cache,v_cache [S, H, D]  float8_e4m3fn (FP8 mode) or float32 / bfloat16 / float16 (no-FP8 mode)
  k_scale,v_scale [S, H]     float32: per-row dequantization scale (1.0 in no-FP8 mode)

FP8 rows follow ``vivant.kernels.fp8`` (scale = max(amax, 1e-8) / 448, round-to-nearest-even).
Validation checks shapes, dtypes and devices always; slot range and distinctness are value checks
and run only for CPU tensors (on CUDA they would force a host sync and break CUDA-graph capture).
"""

from __future__ import annotations

import torch
from vivant.kernels.backend import use_triton
from vivant.kernels.fp8 import FP8_DTYPE, quantize_rows_ref
from vivant.kernels.rope import DEFAULT_THETA, apply_rope_ref, check_rope_dims, rope_inv_freq

try:
    import triton
    import triton.language as tl
    from vivant.kernels.fp8 import to_e4m3_tl
except ImportError:  # pragma: no cover - installs without the kernels extra
    triton = None
    tl = None

TOKEN_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
CACHE_DTYPES = (FP8_DTYPE, torch.float32, torch.bfloat16, torch.float16)


def _shape(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(t.shape)


def check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: torch.Tensor, v_scale: torch.Tensor) -> None:
    """Validate the cache tensors' shapes, dtypes and devices (shared with ``delta_rotate``)."""
    if k_cache.dim() != 3:
        raise ValueError(f"k_cache must have shape [S, H, D], got {_shape(k_cache)}")
    if _shape(v_cache) != _shape(k_cache):
        raise ValueError(f"v_cache must have k_cache's shape {_shape(k_cache)}, got {_shape(v_cache)}")
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if c.dtype not in CACHE_DTYPES:
            raise TypeError(f"{name} dtype must be one of {CACHE_DTYPES}, got {c.dtype}")
    if v_cache.dtype != k_cache.dtype:
        raise TypeError(f"v_cache dtype {v_cache.dtype} must equal k_cache dtype {k_cache.dtype}")
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        if _shape(s) != _shape(k_cache)[:2]:
            raise ValueError(f"{name} must have shape [S, H] = {_shape(k_cache)[:2]}, got {_shape(s)}")
        if s.dtype != torch.float32:
            raise TypeError(f"{name} must be float32, got {s.dtype}")
    for name, t in (("v_cache", v_cache), ("k_scale", k_scale), ("v_scale", v_scale)):
        if t.device != k_cache.device:
            raise ValueError(f"{name} is on {t.device} but k_cache is on {k_cache.device}")


def check_slots(slots: torch.Tensor, n: int, num_slots: int, device: torch.device) -> None:
    """Validate ``slots[n]`` int64 on ``device``; on CPU also range ``[0, num_slots)`` and distinctness."""
    if slots.dim() != 1 or slots.shape[0] != n:
        raise ValueError(f"slots must have shape [{n}], got {_shape(slots)}")
    if slots.dtype != torch.int64:
        raise TypeError(f"slots must be int64, got {slots.dtype}")
    if slots.device != device:
        raise ValueError(f"slots is on {slots.device} but the cache is on {device}")
    if slots.device.type == "cpu" and n:
        lo, hi = int(slots.min()), int(slots.max())
        if lo < 0 or hi >= num_slots:
            raise ValueError(f"slots must lie in [0, S={num_slots}), got values in [{lo}, {hi}]")
        if torch.unique(slots).numel() != n:
            raise ValueError("slots must be distinct (two tokens would race for one cache slot)")


def _check_write_args(k_new, v_new, pos, slots, k_cache, v_cache, k_scale, v_scale, rope_dims) -> None:
    if k_new.dim() != 3:
        raise ValueError(f"k_new must have shape [N, H, D], got {_shape(k_new)}")
    if _shape(v_new) != _shape(k_new):
        raise ValueError(f"v_new must have k_new's shape {_shape(k_new)}, got {_shape(v_new)}")
    for name, t in (("k_new", k_new), ("v_new", v_new)):
        if t.dtype not in TOKEN_DTYPES:
            raise TypeError(f"{name} dtype must be one of {TOKEN_DTYPES}, got {t.dtype}")
    check_cache(k_cache, v_cache, k_scale, v_scale)
    n, h, d = _shape(k_new)
    if _shape(k_cache)[1:] != (h, d):
        raise ValueError(f"k_cache must have shape [S, H={h}, D={d}] to match k_new, got {_shape(k_cache)}")
    if pos.dim() != 2 or _shape(pos) != (n, 3):
        raise ValueError(f"pos must have shape [N={n}, 3], got {_shape(pos)}")
    if pos.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"pos must be int32 or int64, got {pos.dtype}")
    for name, t in (("k_new", k_new), ("v_new", v_new), ("pos", pos)):
        if t.device != k_cache.device:
            raise ValueError(f"{name} is on {t.device} but k_cache is on {k_cache.device}")
    check_slots(slots, n, k_cache.shape[0], k_cache.device)
    check_rope_dims(rope_dims, d)


def store_rows(cache: torch.Tensor, scale: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """Write float32 ``rows[M, H, D]`` into ``cache[slots]``: FP8-quantized with scales, or cast with scale 1."""
    if cache.dtype == FP8_DTYPE:
        q, s = quantize_rows_ref(rows)
        # index_put on float8 is not implemented on every device; the bytes are what we store.
        cache.view(torch.uint8)[slots] = q.view(torch.uint8)
        scale[slots] = s
    else:
        cache[slots] = rows.to(cache.dtype)
        scale[slots] = 1.0


def write_kv_ref(
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    pos: torch.Tensor,
    slots: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    *,
    rope_dims: tuple[int, int, int],
    theta: float = DEFAULT_THETA,
) -> None:
    """Float32 torch twin of ``write_kv``: in place, ``k_cache[slots] = q(rope(k_new, pos))``, ``v_cache[slots] = q(v_new)``."""
    _check_write_args(k_new, v_new, pos, slots, k_cache, v_cache, k_scale, v_scale, rope_dims)
    k_rot = apply_rope_ref(k_new, pos, rope_dims, theta)
    store_rows(k_cache, k_scale, slots, k_rot)
    store_rows(v_cache, v_scale, slots, v_new.float())


if triton is not None:

    @triton.jit
    def bf16_grid_tl(x):
        """Round float32 to the nearest bfloat16 value (ties to even), still as float32.

        Triton's CPU interpreter casts float32 -> bfloat16 by truncation; a value already on the
        bfloat16 grid casts exactly everywhere, so rounding first makes both cast paths agree with torch.
        """
        bits = x.to(tl.int32, bitcast=True)
        lsb = (bits >> 16) & 1
        r = ((bits + 0x7FFF + lsb) & ~0xFFFF).to(tl.float32, bitcast=True)
        return tl.where(x != x, x, r)

    @triton.jit
    def store_row_block_tl(
        ra,
        rb,
        slot,
        h,
        pairs,
        c_ptr,
        s_ptr,
        s_cs,
        s_ch,
        s_cd,
        s_ss,
        s_sh,
        mask2,
        rmask,
        FP8: tl.constexpr,
    ):
        """Store a block of rows given as even (``ra``) / odd (``rb``) halves ``[BLOCK_N, BLOCK_P]`` float32.

        FP8: per-row scale = max(amax, 1e-8) / 448 (NaN in a row makes the scale NaN, like torch),
        values divided by the scale (IEEE division), rounded to the e4m3 grid, cast (NaN -> NaN code), stored.
        Otherwise: cast to the cache dtype, scale 1.0.
        """
        even = c_ptr + slot[:, None] * s_cs + h * s_ch + (2 * pairs[None, :]) * s_cd
        if FP8:
            amax = tl.maximum(tl.max(tl.abs(ra), axis=1), tl.max(tl.abs(rb), axis=1))
            amax = tl.maximum(amax, 1e-8)
            nan_count = tl.sum(((ra != ra) | (rb != rb)).to(tl.int32), axis=1)
            amax = tl.where(nan_count > 0, float("nan"), amax)
            scale = tl.div_rn(amax, tl.full(amax.shape, 448.0, tl.float32))
            qa = to_e4m3_tl(tl.div_rn(ra, scale[:, None]))
            qb = to_e4m3_tl(tl.div_rn(rb, scale[:, None]))
            tl.store(even, qa, mask=mask2)
            tl.store(even + s_cd, qb, mask=mask2)
            tl.store(s_ptr + slot * s_ss + h * s_sh, scale, mask=rmask)
        else:
            if c_ptr.dtype.element_ty == tl.bfloat16:
                ra = bf16_grid_tl(ra)
                rb = bf16_grid_tl(rb)
            tl.store(even, ra.to(c_ptr.dtype.element_ty), mask=mask2)
            tl.store(even + s_cd, rb.to(c_ptr.dtype.element_ty), mask=mask2)
            tl.store(s_ptr + slot * s_ss + h * s_sh, tl.full(slot.shape, 1.0, tl.float32), mask=rmask)

    @triton.jit
    def _write_kv_kernel(
        k_ptr,
        v_ptr,
        pos_ptr,
        slot_ptr,
        inv_freq_ptr,
        kc_ptr,
        vc_ptr,
        ks_ptr,
        vs_ptr,
        N,
        s_kn,
        s_kh,
        s_kd,
        s_vn,
        s_vh,
        s_vd,
        s_pn,
        s_pc,
        s_kcs,
        s_kch,
        s_kcd,
        s_vcs,
        s_vch,
        s_vcd,
        s_kss,
        s_ksh,
        s_vss,
        s_vsh,
        HALF: tl.constexpr,
        DT2: tl.constexpr,
        DTH2: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_P: tl.constexpr,
        FP8: tl.constexpr,
    ):
        """One program per (block of BLOCK_N tokens, head): rotate K rows, quantize K and V rows, scatter."""
        pid_n = tl.program_id(0)
        h = tl.program_id(1)
        rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        pairs = tl.arange(0, BLOCK_P)
        rmask = rows < N
        pmask = pairs < HALF
        mask2 = rmask[:, None] & pmask[None, :]
        rows64 = rows.to(tl.int64)
        slot = tl.load(slot_ptr + rows64, mask=rmask, other=0)

        # Angles: pair p is driven by position column band(p) (0 = t, 1 = h, 2 = w).
        band = (pairs >= DT2).to(tl.int32) + (pairs >= DTH2).to(tl.int32)
        p = tl.load(pos_ptr + rows64[:, None] * s_pn + band[None, :] * s_pc, mask=mask2, other=0)
        inv = tl.load(inv_freq_ptr + pairs, mask=pmask, other=0.0)
        ang = p.to(tl.float32) * inv[None, :]
        c = tl.cos(ang)
        s = tl.sin(ang)

        kb = k_ptr + rows64[:, None] * s_kn + h * s_kh + (2 * pairs[None, :]) * s_kd
        a = tl.load(kb, mask=mask2, other=0.0).to(tl.float32)
        b = tl.load(kb + s_kd, mask=mask2, other=0.0).to(tl.float32)
        store_row_block_tl(
            a * c - b * s, a * s + b * c, slot, h, pairs, kc_ptr, ks_ptr, s_kcs, s_kch, s_kcd, s_kss, s_ksh, mask2, rmask, FP8
        )

        vb = v_ptr + rows64[:, None] * s_vn + h * s_vh + (2 * pairs[None, :]) * s_vd
        va = tl.load(vb, mask=mask2, other=0.0).to(tl.float32)
        vbb = tl.load(vb + s_vd, mask=mask2, other=0.0).to(tl.float32)
        store_row_block_tl(va, vbb, slot, h, pairs, vc_ptr, vs_ptr, s_vcs, s_vch, s_vcd, s_vss, s_vsh, mask2, rmask, FP8)


def _block_p(half: int) -> int:
    return max(1, triton.next_power_of_2(half))


def _write_kv_triton(k_new, v_new, pos, slots, k_cache, v_cache, k_scale, v_scale, rope_dims, theta) -> None:
    n, h, d = k_new.shape
    if n == 0:
        return
    dt, dh, _ = rope_dims
    inv = rope_inv_freq(rope_dims, theta, k_new.device)
    block_p = _block_p(d // 2)
    # Rows per program: enough work per program on the GPU, few programs in the interpreter.
    block_n = max(1, min(triton.next_power_of_2(n), max(1, 2048 // block_p)))
    fp8 = k_cache.dtype == FP8_DTYPE
    grid = (triton.cdiv(n, block_n), h)
    _write_kv_kernel[grid](
        k_new, v_new, pos, slots, inv, k_cache, v_cache, k_scale, v_scale,
        n,
        *k_new.stride(), *v_new.stride(), *pos.stride(),
        *k_cache.stride(), *v_cache.stride(), *k_scale.stride(), *v_scale.stride(),
        HALF=d // 2, DT2=dt // 2, DTH2=(dt + dh) // 2,
        BLOCK_N=block_n, BLOCK_P=block_p, FP8=fp8,
    )  # fmt: skip


def write_kv(
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    pos: torch.Tensor,
    slots: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    *,
    rope_dims: tuple[int, int, int],
    theta: float = DEFAULT_THETA,
    backend: str = "auto",
) -> None:
    """Write a chunk's K/V into the ring cache in place (see the module docstring for shapes).

    ``k_cache[slots[i]] = quantize(rope(k_new[i], pos[i]))`` and ``v_cache[slots[i]] = quantize(v_new[i])``,
    scales into ``k_scale[slots[i]]`` / ``v_scale[slots[i]]`` (1.0 for a float cache).
    ``backend``: "auto" | "triton" | "torch" (see ``vivant.kernels.backend``).
    """
    if not use_triton("write_kv", backend, k_cache.device):
        write_kv_ref(
            k_new, v_new, pos, slots, k_cache, v_cache, k_scale, v_scale, rope_dims=rope_dims, theta=theta
        )
        return
    _check_write_args(k_new, v_new, pos, slots, k_cache, v_cache, k_scale, v_scale, rope_dims)
    _write_kv_triton(k_new, v_new, pos, slots, k_cache, v_cache, k_scale, v_scale, check_rope_dims(rope_dims), theta)
