"""3D rotary position embedding (t, h, w bands) — the float32 torch reference.

Why: the DiT rotates queries and keys by each token's (t, h, w) position. In the ring cache, keys
are rotated once, at write time (``qkv_ring``), and at a position reset only the temporal band
of cached keys is rotated back (``delta_rotate``). Both kernels follow the conventions here; these
functions are also what the model's baseline mode uses.

Conventions (fixed; the model depends on them):
  * ``x[N, H, D]``: N tokens, H heads, head_dim D (even). ``pos[N, 3]`` int: (t, h, w) per token.
  * ``rope_dims = (dt, dh, dw)``, each even, summing to D. Band b has ``d_b / 2`` rotation pairs;
    pair j of band b has ``inv_freq = theta ** (-(2 j) / d_b)`` and angle ``pos[:, b] * inv_freq``.
  * Pairs are adjacent elements: pair p is ``(x[2p], x[2p+1])``; p runs over the t band's pairs
    first, then h's, then w's (so the t band is ``x[..., 0:dt]``).
  * Rotation: ``(a, b) -> (a cos - b sin, a sin + b cos)``.

``inv_freq`` is computed in float64 and rounded once to float32, so every backend and device uses
the same float32 constants; angles are float32 products ``float32(pos) * inv_freq``.
"""

from __future__ import annotations

import functools

import torch

DEFAULT_THETA = 10000.0


def check_rope_dims(rope_dims: tuple[int, int, int], head_dim: int | None = None) -> tuple[int, int, int]:
    """Validate ``rope_dims`` (three even, non-negative ints summing to ``head_dim`` when given)."""
    try:
        dims = tuple(int(d) for d in rope_dims)
    except TypeError as e:
        raise TypeError(f"rope_dims must be a tuple of three ints (dt, dh, dw), got {rope_dims!r}") from e
    if len(dims) != 3:
        raise ValueError(f"rope_dims must have three entries (dt, dh, dw), got {rope_dims!r}")
    if any(d < 0 or d % 2 for d in dims):
        raise ValueError(f"rope_dims entries must be even and >= 0, got {rope_dims!r}")
    if head_dim is not None and sum(dims) != head_dim:
        raise ValueError(f"rope_dims {dims} must sum to head_dim D={head_dim}, they sum to {sum(dims)}")
    return dims  # type: ignore[return-value]


def _device(device: torch.device | str | None) -> torch.device:
    return torch.device("cpu") if device is None else torch.device(device)


# The tables below are constants, built once per (shape, theta, device) and then reused: a kernel
# launch must not build them (a host-to-device copy per call costs time and breaks CUDA-graph
# capture). Callers must treat the returned tensors as read-only.
@functools.lru_cache(maxsize=256)
def _band_inv_freq(d_band: int, theta: float, device: torch.device) -> torch.Tensor:
    j = torch.arange(d_band // 2, dtype=torch.float64)
    inv = theta ** (-(2.0 * j) / d_band) if d_band else j
    return inv.to(torch.float32).to(device)


@functools.lru_cache(maxsize=256)
def _rope_inv_freq(dims: tuple[int, int, int], theta: float, device: torch.device) -> torch.Tensor:
    return torch.cat([_band_inv_freq(d, theta, device) for d in dims])


@functools.lru_cache(maxsize=256)
def _pair_band_index(dims: tuple[int, int, int], device: torch.device) -> torch.Tensor:
    return torch.cat([torch.full((d // 2,), b, dtype=torch.int64) for b, d in enumerate(dims)]).to(device)


def band_inv_freq(d_band: int, theta: float = DEFAULT_THETA, device: torch.device | str | None = None) -> torch.Tensor:
    """``theta ** (-(2 j) / d_band)`` for j in ``[0, d_band/2)``, float32 (computed in float64); cached, read-only."""
    return _band_inv_freq(int(d_band), float(theta), _device(device))


def rope_inv_freq(
    rope_dims: tuple[int, int, int], theta: float = DEFAULT_THETA, device: torch.device | str | None = None
) -> torch.Tensor:
    """Per-pair inverse frequencies ``[D // 2]`` float32, t band's pairs first, then h's, then w's; cached, read-only."""
    return _rope_inv_freq(check_rope_dims(rope_dims), float(theta), _device(device))


def pair_band_index(rope_dims: tuple[int, int, int], device: torch.device | str | None = None) -> torch.Tensor:
    """Which position column (0 = t, 1 = h, 2 = w) drives each pair: ``[D // 2]`` int64; cached, read-only."""
    return _pair_band_index(check_rope_dims(rope_dims), _device(device))


def _check_pos(pos: torch.Tensor, n: int | None = None) -> None:
    if pos.dim() != 2 or pos.shape[1] != 3:
        raise ValueError(f"pos must have shape [N, 3] (t, h, w per token), got {tuple(pos.shape)}")
    if pos.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"pos must be int32 or int64, got {pos.dtype}")
    if n is not None and pos.shape[0] != n:
        raise ValueError(f"pos has {pos.shape[0]} rows but x has N={n} tokens")


def rope_angles(pos: torch.Tensor, rope_dims: tuple[int, int, int], theta: float = DEFAULT_THETA) -> torch.Tensor:
    """Rotation angles ``[N, D // 2]`` float32: ``float32(pos[:, band(p)]) * inv_freq[p]`` per pair p."""
    _check_pos(pos)
    inv = rope_inv_freq(rope_dims, theta, pos.device)
    band = pair_band_index(rope_dims, pos.device)
    return pos.to(torch.float32)[:, band] * inv


def _rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate adjacent pairs of float32 ``x[..., 2P]`` by angles given as ``cos``/``sin`` ``[..., P]``."""
    a = x[..., 0::2]
    b = x[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = a * cos - b * sin
    out[..., 1::2] = a * sin + b * cos
    return out


def _check_x(x: torch.Tensor, name: str = "x") -> None:
    if x.dim() != 3:
        raise ValueError(f"{name} must have shape [N, H, D], got {tuple(x.shape)}")
    if x.shape[-1] % 2:
        raise ValueError(f"{name}: head_dim D must be even, got D={x.shape[-1]}")


def apply_rope_ref(
    x: torch.Tensor, pos: torch.Tensor, rope_dims: tuple[int, int, int], theta: float = DEFAULT_THETA
) -> torch.Tensor:
    """3D RoPE of ``x[N, H, D]`` at positions ``pos[N, 3]``; returns float32 ``[N, H, D]``."""
    _check_x(x)
    check_rope_dims(rope_dims, x.shape[-1])
    _check_pos(pos, x.shape[0])
    ang = rope_angles(pos.to(x.device), rope_dims, theta).unsqueeze(1)  # [N, 1, D/2]
    return _rotate_pairs(x.float(), torch.cos(ang), torch.sin(ang))


def rotate_t_band_ref(
    x: torch.Tensor,
    delta_t: torch.Tensor | int,
    rope_dims: tuple[int, int, int],
    theta: float = DEFAULT_THETA,
) -> torch.Tensor:
    """Rotate only the t band (``x[..., :dt]``) of ``x[N, H, D]`` by ``delta_t * inv_freq_t``; float32.

    ``delta_t`` is an int (same shift for every token) or a ``[N]`` tensor. Pass a negative delta to
    rotate backwards (a position reset by Δ rotates cached keys by ``-Δ``). The h and w bands are
    returned unchanged (as float32).
    """
    _check_x(x)
    dt, _, _ = check_rope_dims(rope_dims, x.shape[-1])
    out = x.float().clone()
    if dt == 0:
        return out
    inv_t = band_inv_freq(dt, theta, x.device)  # [dt/2]
    if isinstance(delta_t, torch.Tensor):
        if delta_t.dim() != 1 or delta_t.shape[0] != x.shape[0]:
            raise ValueError(f"delta_t must be an int or a [N={x.shape[0]}] tensor, got shape {tuple(delta_t.shape)}")
        d = delta_t.to(device=x.device, dtype=torch.float32)
    else:
        d = torch.full((x.shape[0],), float(int(delta_t)), dtype=torch.float32, device=x.device)
    ang = (d[:, None] * inv_t).unsqueeze(1)  # [N, 1, dt/2]
    out[..., :dt] = _rotate_pairs(out[..., :dt], torch.cos(ang), torch.sin(ang))
    return out
