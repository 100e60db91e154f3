"""The whole-window cache policy (`EngineOptions.cache_policy = "whole_window"`): what streaming peers do, kept
to measure the ring against (docs/ARCHITECTURE.md, "The engine's choices and their ablation").

The window's keys and values are kept as the QKV projection gives them (k after its RMSNorm, not rotated), in
the projection's dtype, one row per ring slot and head, with every slot's current position beside them. On
EVERY attention call every key is rotated to its slot's current position and, when the ring it stands in for is
FP8 (`EngineOptions.ring`), the whole window (keys and values) is quantized to FP8 rows (one scale per slot and
head, vivant.kernels.fp8's rule) and dequantized into an image in the same dtype; with a bf16 ring the rotated
keys and the kept values are the image (what a bf16 ring holds). Attention reads that image exactly as the
ring's image path reads its own. The ring (worker/model/kv_cache.py) does the rotation (and the quantization)
once, at write, and delta-rotates at a position reset; this policy re-derives everything per call, so a reset
only moves the kept positions. Only the policy differs from the ring it is measured against, not the precision.

Per call at 57b TP=4 (S = 5,788 slots, 16 heads, D = 128) the FP8 form reads 2·S·H·D values (≈ 47 MB in
bf16) and writes as many; the bf16 form reads and writes the keys only. On a GPU each is one `torch.compile`d
function (inductor fuses the rotation, the row absmax, the e4m3 round trip and the store; compiled at the first
call, before any CUDA graph capture); on a CPU its eager form (tests). The rotary angles of all slots are computed once per chunk
(`set_angles`), in buffers of fixed address, as the ring's chunk angles are.

Shapes: k, v [L, S, H, D]; positions [S, 3] int64 (host); cos, sin [S, D/2] float32 on the device.
"""

from __future__ import annotations

import functools

import torch
from vivant.kernels.fp8 import dequantize_rows, quantize_rows_ref
from vivant.kernels.rope import _rotate_pairs as rotate_pairs
from vivant.kernels.rope import rope_angles


def requantize_window_eager(k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                            sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """k, v [S, H, D] un-rotated; cos, sin [S, D/2] → (k rotated, v), each quantized to FP8 rows and back,
    in k's dtype: the image attention reads."""
    k_rot = rotate_pairs(k.float(), cos[:, None, :], sin[:, None, :])
    k_img = dequantize_rows(*quantize_rows_ref(k_rot)).to(k.dtype)
    v_img = dequantize_rows(*quantize_rows_ref(v.float())).to(v.dtype)
    return k_img, v_img


def rotate_window_eager(k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                        sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The bf16-ring form: k [S, H, D] rotated to its positions, in k's dtype; v as kept."""
    return rotate_pairs(k.float(), cos[:, None, :], sin[:, None, :]).to(k.dtype), v


WINDOW_FUNCTIONS = {True: requantize_window_eager, False: rotate_window_eager}  # keyed by "re-quantize to FP8"


@functools.cache
def window_function_compiled(quantize: bool):
    """The per-call function through torch.compile (inductor, default mode: no CUDA graphs of its own, so the
    engine's captured graph can hold its kernels; fullgraph: a graph break would fail loudly, not run eagerly)."""
    return torch.compile(WINDOW_FUNCTIONS[quantize], fullgraph=True, dynamic=False)


class WindowStore:
    """The whole-window policy's state for all layers of one rank: un-rotated K/V [L, S, H, D] in `dtype`, the
    rotary angles of every slot's current position [S, D/2] (refilled per chunk, fixed addresses). `quantize`:
    the per-call FP8 round trip (an FP8 ring's stand-in) or none (a bf16 ring's); `compiled` picks the compiled
    per-call function (a GPU) or the eager one (a CPU)."""

    def __init__(self, *, layers: int, slots: int, heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, quantize: bool, compiled: bool) -> None:
        self.k = torch.zeros(layers, slots, heads, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros(layers, slots, heads, head_dim, dtype=dtype, device=device)
        self.cos = torch.ones(slots, head_dim // 2, device=device)
        self.sin = torch.zeros(slots, head_dim // 2, device=device)
        self.quantize = quantize
        self.requantize = window_function_compiled(quantize) if compiled else WINDOW_FUNCTIONS[quantize]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.k, self.v, self.cos, self.sin))

    def set_angles(self, positions: torch.Tensor, rope_dims: tuple[int, int, int], theta: float) -> None:
        """The angles of every slot at `positions` [S, 3] (its current position in the frame)."""
        ang = rope_angles(positions.to(self.cos.device), rope_dims, theta)
        self.cos.copy_(ang.cos())
        self.sin.copy_(ang.sin())

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        """The chunk's normalized, un-rotated k and its v [T, H, D] into `slots` [T] of `layer`."""
        self.k[layer].index_copy_(0, slots, k.to(self.k.dtype))
        self.v[layer].index_copy_(0, slots, v.to(self.v.dtype))

    def images(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The per-call whole-window work of `layer`: every key rotated (and everything re-quantized to FP8 when
        `quantize`) → the image (k, v) [S, H, D] attention reads (module docstring)."""
        return self.requantize(self.k[layer], self.v[layer], self.cos, self.sin)

    def clear(self) -> None:
        self.k.zero_()
        self.v.zero_()
