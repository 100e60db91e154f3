"""Q/K RMSNorm (per head, learned weight of size D) and RoPE of Q, fused, reading the fused QKV output.

qkv [N, 3·H·D] (q heads, k heads, v heads; bf16), q_weight/k_weight [D], cos/sin [N, D/2] float32
(the chunk's rotation angles, adjacent-pair convention of vivant.kernels.rope) →
q_rot [N, H, D] (normalized and rotated) and k_norm [N, H, D] (normalized; the cache write rotates K
with its absolute position). One program per token covers all H heads: it reads 2·H·D values and writes
2·H·D, where the unfused torch sequence (float casts, square, mean, rsqrt, two products, four for the
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
    def _qk_norm_rope_kernel(qkv_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, q_out, k_out, stride_tok, H, eps,
                             D: tl.constexpr, BLOCK_H: tl.constexpr):
        tok = tl.program_id(0)
        hh = tl.arange(0, BLOCK_H)
        j = tl.arange(0, D // 2)
        hm = hh < H
        base = qkv_ptr + tok * stride_tok
        ev = hh[:, None] * D + 2 * j[None, :]
        qe = tl.load(base + ev, mask=hm[:, None], other=0.0).to(tl.float32)
        qo = tl.load(base + ev + 1, mask=hm[:, None], other=0.0).to(tl.float32)
        ke = tl.load(base + H * D + ev, mask=hm[:, None], other=0.0).to(tl.float32)
        ko = tl.load(base + H * D + ev + 1, mask=hm[:, None], other=0.0).to(tl.float32)
        qwe = tl.load(qw_ptr + 2 * j).to(tl.float32)
        qwo = tl.load(qw_ptr + 2 * j + 1).to(tl.float32)
        kwe = tl.load(kw_ptr + 2 * j).to(tl.float32)
        kwo = tl.load(kw_ptr + 2 * j + 1).to(tl.float32)
        rq = 1.0 / tl.sqrt((tl.sum(qe * qe, axis=1) + tl.sum(qo * qo, axis=1)) / D + eps)
        rk = 1.0 / tl.sqrt((tl.sum(ke * ke, axis=1) + tl.sum(ko * ko, axis=1)) / D + eps)
        qe = qe * rq[:, None] * qwe[None, :]
        qo = qo * rq[:, None] * qwo[None, :]
        ke = ke * rk[:, None] * kwe[None, :]
        ko = ko * rk[:, None] * kwo[None, :]
        c = tl.load(cos_ptr + tok * (D // 2) + j)[None, :]
        s = tl.load(sin_ptr + tok * (D // 2) + j)[None, :]
        out = tok * H * D + ev
        tl.store(q_out + out, (qe * c - qo * s).to(q_out.dtype.element_ty), mask=hm[:, None])
        tl.store(q_out + out + 1, (qe * s + qo * c).to(q_out.dtype.element_ty), mask=hm[:, None])
        tl.store(k_out + out, ke.to(k_out.dtype.element_ty), mask=hm[:, None])
        tl.store(k_out + out + 1, ko.to(k_out.dtype.element_ty), mask=hm[:, None])


def qk_norm_rope(qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor, heads: int, eps: float = 1e-6, backend: str = "auto"):
    """Returns (q_rot, k_norm), each [N, heads, D] in qkv's dtype."""
    n = qkv.shape[0]
    d = q_weight.shape[0]
    if qkv.dim() != 2 or qkv.shape[1] != 3 * heads * d or qkv.stride(1) != 1:
        raise ValueError(f"qk_norm_rope: qkv must be [N, 3·{heads}·{d}] with contiguous rows, got {tuple(qkv.shape)}")
    if cos.shape != (n, d // 2) or sin.shape != (n, d // 2):
        raise ValueError(f"qk_norm_rope: cos/sin must be [{n}, {d // 2}], got {tuple(cos.shape)}/{tuple(sin.shape)}")
    if not use_triton("qk_norm_rope", backend, qkv.device):
        q, k = qk_norm_rope_ref(qkv, q_weight, k_weight, cos, sin, heads, eps)
        return q.to(qkv.dtype), k.to(qkv.dtype)
    q_out = torch.empty(n, heads, d, dtype=qkv.dtype, device=qkv.device)
    k_out = torch.empty(n, heads, d, dtype=qkv.dtype, device=qkv.device)
    _qk_norm_rope_kernel[(n,)](qkv, q_weight, k_weight, cos.contiguous().float(), sin.contiguous().float(), q_out,
                               k_out, qkv.stride(0), heads, eps, D=d, BLOCK_H=triton.next_power_of_2(heads),
                               num_warps=4)
    return q_out, k_out
