"""Q/K RMSNorm (per head, learned weight of size D) and RoPE of Q, fused, reading the fused QKV output.

qkv [N, 3·H·D] (q heads, k heads, v heads; bf16), q_weight/k_weight [D], cos/sin [N, D/2] float32
(the chunk's rotation angles, adjacent-pair convention of vivant.kernels.rope) →
q_rot [N, H, D] (normalized and rotated) and k_norm [N, H, D] (normalized; the cache write rotates K
with its absolute position). One program per token covers all H heads in contiguous [H, D] tiles (pairs split in registers): it
reads 2·H·D values and writes 2·H·D, where the unfused torch sequence (float casts, square, mean, rsqrt, two products, four for the
rotation) makes about a dozen passes over the same rows.
"""

from __future__ import annotations

import torch
from vivant.kernels.backend import use_triton

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def qk_norm_rope_ref(qkv, q_weight, k_weight, cos, sin, heads: int, eps: float = 1e-6):
    n = qkv.shape[0]
    d = q_weight.shape[0]
    q, k, _ = qkv.float().view(n, 3, heads, d).unbind(1)
    q = _rms(q, q_weight.float(), eps)
    k = _rms(k, k_weight.float(), eps)
    a, b = q[..., 0::2], q[..., 1::2]
    c, s = cos.float()[:, None, :], sin.float()[:, None, :]
    q_rot = torch.stack([a * c - b * s, a * s + b * c], dim=-1).view(n, heads, d)
    return q_rot, k


if triton is not None:

    @triton.jit
    def rms_heads_tl(x, w, D: tl.constexpr, eps):
        """RMSNorm of each row of a [heads, D] float32 tile with the weight w [D] (shared with kernels/qkv_ring.py)."""
        return x * (1.0 / tl.sqrt(tl.sum(x * x, axis=1) / D + eps))[:, None] * w[None, :]

    @triton.jit
    def rope_pairs_tl(x, c, s, BLOCK_H: tl.constexpr, D: tl.constexpr):
        """Rotate the adjacent pairs of a [BLOCK_H, D] tile by angles given as cos/sin [1, D/2] (split in registers)."""
        e, o = tl.split(tl.reshape(x, [BLOCK_H, D // 2, 2]))
        return tl.reshape(tl.join(e * c - o * s, e * s + o * c), [BLOCK_H, D])

    @triton.jit
    def _qk_norm_rope_kernel(qkv_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, q_out, k_out, stride_tok, H, eps,
                             D: tl.constexpr, BLOCK_H: tl.constexpr):
        # contiguous [heads, D] tiles (16-byte loads); the adjacent pairs are split in registers
        tok = tl.program_id(0)
        hh = tl.arange(0, BLOCK_H)
        dd = tl.arange(0, D)
        hm = hh < H
        offs = hh[:, None] * D + dd[None, :]
        base = qkv_ptr + tok * stride_tok
        q = tl.load(base + offs, mask=hm[:, None], other=0.0).to(tl.float32)
        k = tl.load(base + H * D + offs, mask=hm[:, None], other=0.0).to(tl.float32)
        qw = tl.load(qw_ptr + dd).to(tl.float32)
        kw = tl.load(kw_ptr + dd).to(tl.float32)
        q = rms_heads_tl(q, qw, D, eps)
        k = rms_heads_tl(k, kw, D, eps)
        j = tl.arange(0, D // 2)
        c = tl.load(cos_ptr + tok * (D // 2) + j)[None, :]
        s = tl.load(sin_ptr + tok * (D // 2) + j)[None, :]
        q_rot = rope_pairs_tl(q, c, s, BLOCK_H, D)
        out = tok * H * D + offs
        tl.store(q_out + out, q_rot.to(q_out.dtype.element_ty), mask=hm[:, None])
        tl.store(k_out + out, k.to(k_out.dtype.element_ty), mask=hm[:, None])


def qk_norm_rope(qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor, heads: int, eps: float = 1e-6, backend: str = "auto"):
    """Returns (q_rot, k_norm), each [N, heads, D] in qkv's dtype."""
    n = qkv.shape[0]
    d = q_weight.shape[0]
    if qkv.dim() != 2 or qkv.shape[1] != 3 * heads * d or qkv.stride(1) != 1:
        raise ValueError(f"qk_norm_rope: qkv must be [N, 3·{heads}·{d}] with contiguous rows, got {tuple(qkv.shape)}")
    if cos.shape != (n, d // 2) or sin.shape != (n, d // 2):
        raise ValueError(f"qk_norm_rope: cos/sin must be [{n}, {d // 2}], got {tuple(cos.shape)}/{tuple(sin.shape)}")
    if d & (d - 1) and backend == "triton":
        raise ValueError(f"qk_norm_rope: the Triton kernel needs a power-of-two head_dim, got {d}")
    if d & (d - 1) or not use_triton("qk_norm_rope", backend, qkv.device):
        q, k = qk_norm_rope_ref(qkv, q_weight, k_weight, cos, sin, heads, eps)
        return q.to(qkv.dtype), k.to(qkv.dtype)
    q_out = torch.empty(n, heads, d, dtype=qkv.dtype, device=qkv.device)
    k_out = torch.empty(n, heads, d, dtype=qkv.dtype, device=qkv.device)
    _qk_norm_rope_kernel[(n,)](qkv, q_weight, k_weight, cos.contiguous().float(), sin.contiguous().float(), q_out,
                               k_out, qkv.stride(0), heads, eps, D=d, BLOCK_H=triton.next_power_of_2(heads),
                               num_warps=4)
    return q_out, k_out
