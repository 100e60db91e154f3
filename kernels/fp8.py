"""FP8 (e4m3) per-row quantization, and the e4m3 grid rounding the kernels share.

Why: the FP8 GEMMs take their operands as ``torch.float8_e4m3fn`` rows with one float32 scale per
row (an activation row: one token, ``K`` values; a weight row: one output channel), and the
baseline cache quantizes its K/V rows (one token's one head, ``D`` values) the same way per call.
This module holds the float32 reference of that quantization (the twin of the Triton kernels in
kernels/fused_quant.py and kernels/split_kv.py) and ``round_to_e4m3_grid``.

Quantization of a row ``x[D]``::

    scale = max(amax(|x|), 1e-8) / 448.0          # float32, one per row
    q     = (x / scale).to(float8_e4m3fn)         # round-to-nearest-even, |q| <= 448
    x'    = q.float() * scale                     # dequantized

Why ``round_to_e4m3_grid`` exists: Triton's CPU interpreter (used by CI) casts float32 to fp8
wrongly when rounding carries into the next power of two (e.g. -124.8 -> -64 instead of -128).
Values already on the e4m3 grid cast exactly, so the kernels round to the grid by float32 bit
arithmetic first and then cast. The torch function here is the same algorithm, kept as the
oracle the tests check against torch's own (correct) cast.
"""

from __future__ import annotations

import torch

try:  # Triton is optional: the references work without it.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only on installs without the kernels extra
    triton = None
    tl = None

FP8_MAX = 448.0
"""Largest finite magnitude of float8_e4m3fn."""

FP8_DTYPE = torch.float8_e4m3fn

AMAX_FLOOR = 1e-8
"""Lower bound on a row's amax before dividing by FP8_MAX (an all-zero row gets a tiny, finite scale)."""

# e4m3fn: 4 exponent bits (bias 7), 3 mantissa bits. Smallest normal 2**-6; subnormal quantum 2**-9.
_E4M3_MIN_NORMAL = 2.0**-6
# Adding 2**14 to a value below 2**-6 leaves a float32 whose unit in the last place is 2**-9,
# so (a + 2**14) - 2**14 rounds a to the subnormal grid with round-to-nearest-even.
_SUBNORMAL_SHIFTER = 2.0**14
# float32 has 23 mantissa bits; keeping 3 drops the low 20.
_DROPPED_BITS = 20
_HALF_MINUS_ONE = (1 << (_DROPPED_BITS - 1)) - 1  # 0x7FFFF
_DROPPED_MASK = (1 << _DROPPED_BITS) - 1  # 0xFFFFF


def round_to_e4m3_grid(x: torch.Tensor) -> torch.Tensor:
    """Round float32 values to the nearest float8_e4m3fn value (as float32), ties to even.

    Magnitudes above 448 (including inf) saturate to +-448; NaN stays NaN; the sign of zero is kept.
    Normal range (|x| >= 2**-6): add half-minus-one plus the kept LSB to the float32 bits and clear
    the 20 dropped mantissa bits (a carry into the exponent is the correct next power of two).
    Subnormal range: (|x| + 2**14) - 2**14 rounds to multiples of 2**-9.
    """
    if x.dtype != torch.float32:
        raise TypeError(f"round_to_e4m3_grid: x must be float32, got {x.dtype}")
    a = x.abs()
    bits = a.view(torch.int32)
    lsb = (bits >> _DROPPED_BITS) & 1
    normal = ((bits + _HALF_MINUS_ONE + lsb) & ~_DROPPED_MASK).view(torch.float32)
    subnormal = (a + _SUBNORMAL_SHIFTER) - _SUBNORMAL_SHIFTER
    r = torch.where(a >= _E4M3_MIN_NORMAL, normal, subnormal)
    r = torch.clamp(r, max=FP8_MAX)
    r = torch.where(x.isnan(), x, torch.copysign(r, x))
    return r


def row_scales(x: torch.Tensor) -> torch.Tensor:
    """Per-row scale ``max(amax(|x|), 1e-8) / 448`` over the last axis, float32, shape ``x.shape[:-1]``.

    The division uses a tensor divisor so it is an IEEE division on every device (torch's CUDA
    division by a Python scalar multiplies by the reciprocal instead, which differs in the last bit).
    """
    amax = x.float().abs().amax(dim=-1).clamp_min(AMAX_FLOOR)
    return amax / torch.full_like(amax, FP8_MAX)


def quantize_rows_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x[..., D]`` to float8_e4m3fn with one float32 scale per row.

    Returns ``(q, scale)``: ``q`` has ``x``'s shape and dtype float8_e4m3fn, ``scale`` has shape
    ``x.shape[:-1]``. A NaN anywhere in a row makes that row's scale NaN (it is never hidden).
    """
    if x.dim() < 1 or x.shape[-1] == 0:
        raise ValueError(f"quantize_rows_ref: x must have a non-empty last axis, got shape {tuple(x.shape)}")
    xf = x.float()
    scale = row_scales(xf)
    # NaN-propagating amax: torch's amax propagates NaN, clamp_min keeps it.
    y = torch.clamp(xf / scale.unsqueeze(-1), -FP8_MAX, FP8_MAX)
    return y.to(FP8_DTYPE), scale


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``q.float() * scale[..., None]``: float32 values of quantized rows (``q`` fp8 or float)."""
    if tuple(scale.shape) != tuple(q.shape[:-1]):
        raise ValueError(
            f"dequantize_rows: scale must have shape q.shape[:-1] = {tuple(q.shape[:-1])}, got {tuple(scale.shape)}"
        )
    return q.float() * scale.float().unsqueeze(-1)


if triton is not None:

    @triton.jit
    def e4m3_grid_tl(x):
        """Triton twin of ``round_to_e4m3_grid`` for float32 blocks (same bit arithmetic)."""
        a = tl.abs(x)
        bits = a.to(tl.int32, bitcast=True)
        lsb = (bits >> 20) & 1
        normal = ((bits + 0x7FFFF + lsb) & ~0xFFFFF).to(tl.float32, bitcast=True)
        subnormal = (a + 16384.0) - 16384.0
        r = tl.where(a >= 0.015625, normal, subnormal)
        r = tl.minimum(r, 448.0)
        # Copy the sign bit (not -r, which is 0 - r and turns -0.0 into +0.0).
        sign = x.to(tl.int32, bitcast=True) & ~0x7FFFFFFF
        r = (r.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)
        r = tl.where(x != x, x, r)
        return r

    @triton.jit
    def to_e4m3_tl(x):
        """float32 block -> float8e4nv codes: RNE, saturating at +-448, NaN -> the e4m3fn NaN code 0x7F.

        Grid rounding first (see ``e4m3_grid_tl``); NaN is encoded by bits because Triton's
        interpreter casts NaN to a finite code (0x7C = 384).
        """
        q = e4m3_grid_tl(x).to(tl.float8e4nv).to(tl.uint8, bitcast=True)
        q = tl.where(x != x, 0x7F, q).to(tl.uint8)
        return q.to(tl.float8e4nv, bitcast=True)
