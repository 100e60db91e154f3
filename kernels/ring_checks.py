"""Validation of the ring's tensors, shared by the kernels that write it (kernels/qkv_ring.py,
kernels/delta_rotate.py), and the bf16 rounding Triton's interpreter needs.

The ring of one layer: k_cache, v_cache [S, H, D] (bf16 served; float32/float16 accepted by the references),
slots [N] int64.
Shapes, dtypes and devices are checked always; slot range and distinctness are value checks and run only for
CPU tensors (on CUDA they would force a host sync and break CUDA-graph capture).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - installs without the kernels extra
    triton = None

CACHE_DTYPES = (torch.bfloat16, torch.float32, torch.float16)


def _shape(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(t.shape)


def check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """Validate the ring tensors' shapes, dtypes and devices."""
    if k_cache.dim() != 3:
        raise ValueError(f"k_cache must have shape [S, H, D], got {_shape(k_cache)}")
    if _shape(v_cache) != _shape(k_cache):
        raise ValueError(f"v_cache must have k_cache's shape {_shape(k_cache)}, got {_shape(v_cache)}")
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if c.dtype not in CACHE_DTYPES:
            raise TypeError(f"{name} dtype must be one of {CACHE_DTYPES}, got {c.dtype}")
    if v_cache.dtype != k_cache.dtype:
        raise TypeError(f"v_cache dtype {v_cache.dtype} must equal k_cache dtype {k_cache.dtype}")
    if v_cache.device != k_cache.device:
        raise ValueError(f"v_cache is on {v_cache.device} but k_cache is on {k_cache.device}")


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
