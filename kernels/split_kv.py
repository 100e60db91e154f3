"""Split-KV attention over the ring's read image: the keys cut into `splits` equal parts that one SDPA call
takes as a batch, then one kernel that combines the partial outputs by their log-sum-exp.

Why: at 57b TP=4 one attention call is 757 queries × 16 heads over 5,788 keys. By its kernel name cuDNN's
SDPA tiles 64 queries per CTA: 12 × 16 = 192 CTAs for 132 SMs, 1.45 waves, so about a quarter of the
machine idles in the second wave. With the keys in two halves batched into one call the same work comes
as 384 half-length CTAs (2.9 waves). The halves' outputs o_i [N, D] and log-sum-exps l_i (natural log of
Σ exp(scaled logits)) combine exactly: out = Σ_i exp(l_i − m)·o_i / Σ_i exp(l_i − m), m = max_i l_i.
Whether the split is faster on a given GPU is measured (bench/gpu_tune.py); the engine's default is no split.

Shapes: q [N, H, D]; images k, v [S, H, D] (S divisible by `splits`); partial outputs o [splits, H, N, D]
(any strides), lse [splits, H, N] float32; out [N, H, D] in q's dtype. The combine reads splits·N·H·(D·2 + 4)
bytes and writes N·H·D·2. `combine_splits_ref` is its float32 twin.
"""

from __future__ import annotations

import torch
from vivant.kernels.backend import use_triton

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None


def combine_splits_ref(o: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """o [P, H, N, D], lse [P, H, N] → [N, H, D] float32."""
    lse = lse.float()
    m = lse.amax(0, keepdim=True)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)  # all parts empty: weights 0, output 0
    w = torch.exp(lse - m)
    den = w.sum(0)
    out = (o.float() * w[..., None]).sum(0) / torch.where(den == 0, torch.ones_like(den), den)[..., None]
    return out.transpose(0, 1)


if triton is not None:

    @triton.jit
    def _combine_kernel(o_ptr, lse_ptr, out_ptr, N, H, so_p, so_h, so_n, sl_p, sl_h, SPLITS: tl.constexpr,
                        D: tl.constexpr, BLOCK_N: tl.constexpr):
        # one program per (block of BLOCK_N queries, head); the parts are summed in float32
        n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        h = tl.program_id(1)
        d = tl.arange(0, D)
        nm = n < N
        m = tl.full([BLOCK_N], float("-inf"), tl.float32)
        for p in tl.static_range(SPLITS):
            m = tl.maximum(m, tl.load(lse_ptr + p * sl_p + h * sl_h + n, mask=nm, other=float("-inf")))
        m = tl.where(m == float("-inf"), 0.0, m)
        num = tl.zeros([BLOCK_N, D], tl.float32)
        den = tl.zeros([BLOCK_N], tl.float32)
        for p in tl.static_range(SPLITS):
            w = tl.exp(tl.load(lse_ptr + p * sl_p + h * sl_h + n, mask=nm, other=float("-inf")) - m)
            o = tl.load(o_ptr + p * so_p + h * so_h + n[:, None] * so_n + d[None, :], mask=nm[:, None], other=0.0)
            num += o.to(tl.float32) * w[:, None]
            den += w
        out = num / tl.where(den == 0.0, 1.0, den)[:, None]
        tl.store(out_ptr + n[:, None] * (H * D) + h * D + d[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=nm[:, None])


def combine_splits(o: torch.Tensor, lse: torch.Tensor, out_dtype: torch.dtype | None = None, *,
                   backend: str = "auto") -> torch.Tensor:
    """Partial outputs o [P, H, N, D] with their log-sum-exps lse [P, H, N] → [N, H, D] (out_dtype, default o's)."""
    if o.dim() != 4 or lse.shape != o.shape[:3]:
        raise ValueError(f"combine_splits: o must be [P, H, N, D] and lse [P, H, N], got {tuple(o.shape)} and "
                         f"{tuple(lse.shape)}")
    if o.stride(3) != 1:
        raise ValueError("combine_splits: o needs a contiguous head_dim")
    dt = out_dtype or o.dtype
    P, H, N, D = o.shape
    if D & (D - 1) or not use_triton("combine_splits", backend, o.device):
        return combine_splits_ref(o, lse).to(dt)
    lse = lse.float()
    if lse.stride(2) != 1:
        lse = lse.contiguous()
    out = torch.empty(N, H, D, dtype=dt, device=o.device)
    block = 16
    _combine_kernel[(triton.cdiv(N, block), H)](o, lse, out, N, H, o.stride(0), o.stride(1), o.stride(2),
                                                 lse.stride(0), lse.stride(1), SPLITS=P, D=D, BLOCK_N=block,
                                                 num_warps=4)
    return out


def _partial_sdpa(q, k, v, scale):
    """Batched SDPA that also returns the log-sum-exp: cuDNN on CUDA, the CPU flash kernel elsewhere."""
    if q.is_cuda:
        out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, False, False,
                                                                      scale=scale)[:2]
    else:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, scale=scale)
    return out, lse.reshape(q.shape[:3])


def split_kv_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, splits: int, sm_scale: float | None = None,
                  *, backend: str = "auto") -> torch.Tensor:
    """Attention of q [N, H, D] over every slot of k, v [S, H, D] (q's dtype), the slots in `splits` equal parts
    batched into one SDPA call and combined. `backend` selects the combine's implementation."""
    if isinstance(splits, bool) or not isinstance(splits, int) or splits < 1:
        raise ValueError(f"split_kv_sdpa: splits must be an int >= 1, got {splits!r}")
    N, H, D = q.shape
    S = k.shape[0]
    if k.shape != (S, H, D) or v.shape != k.shape:
        raise ValueError(f"split_kv_sdpa: k, v must be [S, {H}, {D}], got {tuple(k.shape)} / {tuple(v.shape)}")
    if S % splits:
        raise ValueError(f"split_kv_sdpa: splits = {splits} must divide the slot count S = {S}")
    if not (k.is_contiguous() and v.is_contiguous()):
        raise ValueError("split_kv_sdpa: k and v must be contiguous [S, H, D] (the read image is)")
    scale = sm_scale if sm_scale is not None else D ** -0.5
    qb = q.transpose(0, 1).unsqueeze(0).expand(splits, H, N, D).contiguous()  # [P, H, N, D]
    kb = k.view(splits, S // splits, H, D).permute(0, 2, 1, 3)  # [P, H, S/P, D], a view of the image
    vb = v.view(splits, S // splits, H, D).permute(0, 2, 1, 3)
    o, lse = _partial_sdpa(qb, kb, vb, scale)
    return combine_splits(o, lse, q.dtype, backend=backend)
