"""Split-KV attention over the bf16 ring: the keys cut into `splits` equal parts that one SDPA call
takes as a batch, then one kernel that combines the partial outputs by their log-sum-exp.

Why: at 57b TP=4 one attention call is 757 queries × 16 heads over 5,788 keys. By its kernel name cuDNN's
SDPA tiles 64 queries per CTA: 12 × 16 = 192 CTAs for 132 SMs, 1.45 waves, so about a quarter of the
machine idles in the second wave. With the keys in P parts batched into one call the same work comes as
P·192 shorter CTAs. The parts' outputs o_i [N, D] and log-sum-exps l_i (natural log of Σ exp(scaled logits))
combine exactly: out = Σ_i exp(l_i − m)·o_i / Σ_i exp(l_i − m), m = max_i l_i. The engine picks P with
vivant.worker.model.fast_parts.auto_kv_splits (docs/ARCHITECTURE.md, "Split-KV attention", gives the gain).

Shapes: q [N, H, D]; the ring's k, v [S, H, D] (S divisible by `splits`); partial outputs o [splits, H, N, D]
(any strides), lse [splits, H, N] float32; out [N, H, D] in q's dtype. The combine reads splits·N·H·(D·2 + 4)
bytes and writes N·H·D·2. `combine_splits_ref` is its float32 twin.

The engine's form, `split_kv_attention_fp8(q_parts, k, v)`, takes the queries per part as q_parts [P, H, N, D],
a stride-0 expand view of q (cuDNN reads it as given, bit-equal to a copied q, so no copy kernel runs), and fuses the O projection's input quantization into the combine: one program per token
combines its H·D values, rounds them to q's dtype and writes FP8 codes [N, H·D] with one float32 scale per
token — exactly quant_rows of the unfused combine's output (`combine_quant_ref` is that twin). One kernel
instead of the combine + quant_rows.
"""

from __future__ import annotations

import torch
from vivant.kernels.backend import pdl_launch, use_triton
from vivant.kernels.fp8 import quantize_rows_ref

try:
    import triton
    import triton.language as tl
    from triton.language.extra.cuda import gdc_wait
    from vivant.kernels.fused_quant import _absmax, _row_scale, _store_fp8_tile
    from vivant.kernels.ring_checks import bf16_grid_tl
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


def combine_quant_ref(o: torch.Tensor, lse: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """o [P, H, N, D], lse [P, H, N] → (FP8 [N, H·D], float32 scales [N]): the combine rounded to `dtype`,
    then rowwise FP8 (vivant.kernels.fp8)."""
    out = combine_splits_ref(o, lse).to(dtype)
    return quantize_rows_ref(out.reshape(out.shape[0], -1).float())


if triton is not None:

    @triton.jit
    def _combine_parts(o_ptr, lse_ptr, lse_offs, o_offs, rmask, so_p, sl_p, SPLITS: tl.constexpr):
        """Σ_p exp(lse_p − m)·o_p / Σ_p exp(lse_p − m), m = max_p lse_p, over rows selected by lse_offs [R] and
        o_offs [R, D] (part p at + p·sl_p / + p·so_p); float32 [R, D]. Rows that no part saw give 0."""
        m = tl.full(lse_offs.shape, float("-inf"), tl.float32)
        for p in tl.static_range(SPLITS):
            m = tl.maximum(m, tl.load(lse_ptr + p * sl_p + lse_offs, mask=rmask, other=float("-inf")))
        m = tl.where(m == float("-inf"), 0.0, m)
        num = tl.zeros(o_offs.shape, tl.float32)
        den = tl.zeros(lse_offs.shape, tl.float32)
        for p in tl.static_range(SPLITS):
            w = tl.exp(tl.load(lse_ptr + p * sl_p + lse_offs, mask=rmask, other=float("-inf")) - m)
            o = tl.load(o_ptr + p * so_p + o_offs, mask=rmask[:, None], other=0.0)
            num += o.to(tl.float32) * w[:, None]
            den += w
        return num / tl.where(den == 0.0, 1.0, den)[:, None]

    @triton.jit
    def _combine_quant_kernel(o_ptr, lse_ptr, q_ptr, s_ptr, H, so_p, so_h, so_n, sl_p, sl_h,
                              SPLITS: tl.constexpr, BLOCK_H: tl.constexpr, D: tl.constexpr,
                              OUT_DTYPE: tl.constexpr, HW_CAST: tl.constexpr, PDL: tl.constexpr):
        # one program per token: its [H, D] values from every part, combined, rounded, quantized as one row
        if PDL:
            gdc_wait()
        n = tl.program_id(0)
        hh = tl.arange(0, BLOCK_H)
        dd = tl.arange(0, D)
        hm = hh < H
        out = _combine_parts(o_ptr + n * so_n, lse_ptr + n, hh * sl_h, hh[:, None] * so_h + dd[None, :], hm, so_p, sl_p,
                             SPLITS)
        if OUT_DTYPE == tl.bfloat16 and not HW_CAST:  # the interpreter's bf16 cast truncates: round to nearest first
            out = bf16_grid_tl(out)
        out = out.to(OUT_DTYPE).to(tl.float32)
        y = tl.reshape(out, [1, BLOCK_H * D])
        mask = tl.reshape(hm[:, None] & (dd[None, :] < D), [1, BLOCK_H * D])
        s = _row_scale(_absmax(y, mask))
        rows = n + tl.arange(0, 1)
        cols = tl.arange(0, BLOCK_H * D)
        _store_fp8_tile(q_ptr, rows, cols, mask, y, s, H * D, HW_CAST)
        tl.store(s_ptr + rows, s)

    @triton.jit
    def _combine_kernel(o_ptr, lse_ptr, out_ptr, N, H, so_p, so_h, so_n, sl_p, sl_h, SPLITS: tl.constexpr,
                        D: tl.constexpr, BLOCK_N: tl.constexpr):
        # one program per (block of BLOCK_N queries, head)
        n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        h = tl.program_id(1)
        d = tl.arange(0, D)
        nm = n < N
        out = _combine_parts(o_ptr + h * so_h, lse_ptr + h * sl_h, n, n[:, None] * so_n + d[None, :], nm, so_p, sl_p,
                             SPLITS)
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
        raise ValueError("split_kv_sdpa: k and v must be contiguous [S, H, D] (a layer of the ring is)")
    scale = sm_scale if sm_scale is not None else D ** -0.5
    qb = q.transpose(0, 1).unsqueeze(0).expand(splits, H, N, D)  # [P, H, N, D], a stride-0 view of q
    kb = k.view(splits, S // splits, H, D).permute(0, 2, 1, 3)  # [P, H, S/P, D], a view of the image
    vb = v.view(splits, S // splits, H, D).permute(0, 2, 1, 3)
    o, lse = _partial_sdpa(qb, kb, vb, scale)
    return combine_splits(o, lse, q.dtype, backend=backend)


_TL_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


def combine_quant(o: torch.Tensor, lse: torch.Tensor, dtype: torch.dtype, *, backend: str = "auto",
                  exact_rounding: bool = False, pdl: bool = False, num_warps: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """Partial outputs o [P, H, N, D] and lse [P, H, N] → (FP8 [N, H·D], float32 scales [N]), the combine
    rounded to `dtype` (what the unfused combine would store) and quantized per token. exact_rounding: the
    twin's IEEE division and grid rounding on a GPU (see vivant.kernels.fused_quant); pdl: programmatic
    dependent launch (vivant.kernels.backend.pdl_launch)."""
    if o.dim() != 4 or lse.shape != o.shape[:3]:
        raise ValueError(f"combine_quant: o must be [P, H, N, D] and lse [P, H, N], got {tuple(o.shape)} and "
                         f"{tuple(lse.shape)}")
    if o.stride(3) != 1:
        raise ValueError("combine_quant: o needs a contiguous head_dim")
    if dtype not in _TL_DTYPES:
        raise ValueError(f"combine_quant: dtype must be one of {list(_TL_DTYPES)}, got {dtype}")
    if num_warps not in (1, 2, 4, 8, 16):
        raise ValueError(f"combine_quant: num_warps must be one of (1, 2, 4, 8, 16), got {num_warps!r}")
    P, H, N, D = o.shape
    if D & (D - 1) or not use_triton("combine_quant", backend, o.device):
        return combine_quant_ref(o, lse, dtype)
    lse = lse.float()
    if lse.stride(2) != 1:
        lse = lse.contiguous()
    q = torch.empty(N, H * D, dtype=torch.float8_e4m3fn, device=o.device)
    s = torch.empty(N, dtype=torch.float32, device=o.device)
    use_pdl = pdl_launch(pdl, o.device)
    extra = {"launch_pdl": True} if use_pdl else {}
    _combine_quant_kernel[(N,)](o, lse, q, s, H, o.stride(0), o.stride(1), o.stride(2), lse.stride(0),
                                lse.stride(1), SPLITS=P, BLOCK_H=triton.next_power_of_2(H), D=D,
                                OUT_DTYPE=getattr(tl, _TL_DTYPES[dtype]), HW_CAST=o.is_cuda and not exact_rounding,
                                PDL=use_pdl, num_warps=num_warps, **extra)
    return q, s


def split_kv_attention_fp8(q_parts: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sm_scale: float | None = None,
                           *, backend: str = "auto", exact_rounding: bool = False, pdl: bool = False,
                           combine_warps: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of the queries over every slot of k, v [S, H, D], the slots in P equal parts, with the output
    quantized for the O projection. q_parts [P, H, N, D]: the queries for each part (the engine passes
    q.transpose(0, 1).expand(P, H, N, D), a view). Returns (FP8 [N, H·D], float32 scales [N])."""
    if q_parts.dim() != 4:
        raise ValueError(f"split_kv_attention_fp8: q_parts must be [P, H, N, D], got {tuple(q_parts.shape)}")
    P, H, N, D = q_parts.shape
    S = k.shape[0]
    if k.shape != (S, H, D) or v.shape != k.shape:
        raise ValueError(f"split_kv_attention_fp8: k, v must be [S, {H}, {D}], got {tuple(k.shape)} / "
                         f"{tuple(v.shape)}")
    if S % P:
        raise ValueError(f"split_kv_attention_fp8: the {P} parts must divide the slot count S = {S}")
    if not (k.is_contiguous() and v.is_contiguous()):
        raise ValueError("split_kv_attention_fp8: k and v must be contiguous [S, H, D] (a layer of the ring is)")
    scale = sm_scale if sm_scale is not None else D ** -0.5
    kb = k.view(P, S // P, H, D).permute(0, 2, 1, 3)
    vb = v.view(P, S // P, H, D).permute(0, 2, 1, 3)
    o, lse = _partial_sdpa(q_parts, kb, vb, scale)
    return combine_quant(o, lse, q_parts.dtype, backend=backend, exact_rounding=exact_rounding, pdl=pdl,
                         num_warps=combine_warps)
