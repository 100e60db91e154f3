"""Activation quantization fused into the op that precedes each FP8 GEMM.

One program per token row (row width K: 8192 before QKV and gate/up, 2048 before O, 6912 before
down at the 57b TP=4 shard). Each kernel reads its bf16/fp32 inputs once, computes the row in
float32, takes the row's absolute max, and writes FP8 e4m3 values plus one float32 scale per row —
exactly the per-row (rowwise) activation scales `torch._scaled_mm` takes. Bytes per row: 2K in,
K + 4 out (vs. 2K in, 2K out, then 2K in, K out for an unfused norm + quantize).

  ln_mod_quant(x, shift, scale)  LayerNorm (no affine) → y·(1 + scale) + shift → FP8 rows
  swiglu_quant(gu)               gu = [gate | up] (2F wide) → silu(gate)·up → FP8 rows
  quant_rows(x)                  plain rowwise FP8 quantization
  residual_ln_mod_quant(x, y, g, shift, scale)  x + g·y (written back), then ln_mod_quant of it

Scales follow vivant.kernels.fp8: s = max(amax, 1e-8) / 448, q = RNE_e4m3(y / s).
Each has a float32 torch twin (`*_ref`) and a `backend` switch ("auto" | "triton" | "torch").
"""

from __future__ import annotations

import torch
from vivant.kernels.backend import use_triton
from vivant.kernels.fp8 import quantize_rows_ref

try:
    import triton
    import triton.language as tl
    from vivant.kernels.fp8 import e4m3_grid_tl
except ImportError:  # pragma: no cover - triton is a dependency of the kernels extra
    triton = None


# ---- references ------------------------------------------------------------------------------------
def ln_mod_quant_ref(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, eps: float = 1e-6):
    xf = x.float()
    y = torch.nn.functional.layer_norm(xf, (xf.shape[-1],), eps=eps) * (1 + scale.float()) + shift.float()
    return quantize_rows_ref(y)


def residual_ln_mod_quant_ref(x: torch.Tensor, y: torch.Tensor, gate: torch.Tensor, shift: torch.Tensor,
                              scale: torch.Tensor, eps: float = 1e-6):
    """x_new = x + gate·y (in x's dtype), then ln_mod_quant(x_new): returns (x_new, fp8 rows, scales)."""
    x_new = (x.float() + gate.float() * y.float()).to(x.dtype)
    q, s = ln_mod_quant_ref(x_new, shift, scale, eps)
    return x_new, q, s


def swiglu_quant_ref(gu: torch.Tensor):
    gate, up = gu.float().chunk(2, dim=-1)
    return quantize_rows_ref(torch.nn.functional.silu(gate) * up)


def quant_rows_ref(x: torch.Tensor):
    return quantize_rows_ref(x.float())


# ---- Triton -------------------------------------------------------------------------------------------
if triton is not None:

    @triton.jit
    def _store_fp8_row(q_ptr, s_ptr, row, y, offs, mask, K):
        amax = tl.max(tl.where(mask, tl.abs(y), 0.0), axis=0)
        # tl.max drops NaN: count them so a row holding one gets a NaN scale, as the reference twin does
        nans = tl.sum(tl.where(mask & (y != y), 1, 0), axis=0)
        s = tl.where(nans > 0, float("nan"), tl.maximum(amax, 1e-8) / 448.0)
        q = e4m3_grid_tl(y / s)
        tl.store(q_ptr + row * K + offs, q.to(tl.float8e4nv), mask=mask)
        tl.store(s_ptr + row, s)

    @triton.jit
    def _ln_mod_quant_kernel(x_ptr, shift_ptr, scale_ptr, q_ptr, s_ptr, K, stride_x, eps, BLOCK: tl.constexpr):
        # every load is issued before the first reduction, and mean and mean-square reduce side by side
        # (var = E[x²] − E[x]², float32): two dependent reduction steps per row instead of four
        row = tl.program_id(0)
        offs = tl.arange(0, BLOCK)
        mask = offs < K
        x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
        sh = tl.load(shift_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        sc = tl.load(scale_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        mean = tl.sum(x, axis=0) / K
        var = tl.maximum(tl.sum(x * x, axis=0) / K - mean * mean, 0.0)
        y = (x - mean) * (1.0 / tl.sqrt(var + eps))
        _store_fp8_row(q_ptr, s_ptr, row, y * (1.0 + sc) + sh, offs, mask, K)

    @triton.jit
    def _residual_ln_mod_quant_kernel(x_ptr, y_ptr, gate_ptr, shift_ptr, scale_ptr, xo_ptr, q_ptr, s_ptr, K, stride_x,
                                      stride_y, eps, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        offs = tl.arange(0, BLOCK)
        mask = offs < K
        x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
        y = tl.load(y_ptr + row * stride_y + offs, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(gate_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        sh = tl.load(shift_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        sc = tl.load(scale_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        xn = (x + g * y).to(xo_ptr.dtype.element_ty)
        tl.store(xo_ptr + row * K + offs, xn, mask=mask)
        x = tl.where(mask, xn.to(tl.float32), 0.0)  # normalize what was stored, as the reference does
        mean = tl.sum(x, axis=0) / K
        var = tl.maximum(tl.sum(x * x, axis=0) / K - mean * mean, 0.0)
        yv = (x - mean) * (1.0 / tl.sqrt(var + eps))
        _store_fp8_row(q_ptr, s_ptr, row, yv * (1.0 + sc) + sh, offs, mask, K)

    @triton.jit
    def _swiglu_quant_kernel(gu_ptr, q_ptr, s_ptr, F, stride_gu, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        offs = tl.arange(0, BLOCK)
        mask = offs < F
        g = tl.load(gu_ptr + row * stride_gu + offs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(gu_ptr + row * stride_gu + F + offs, mask=mask, other=0.0).to(tl.float32)
        y = g / (1.0 + tl.exp(-g)) * u
        _store_fp8_row(q_ptr, s_ptr, row, y, offs, mask, F)

    @triton.jit
    def _quant_rows_kernel(x_ptr, q_ptr, s_ptr, K, stride_x, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        offs = tl.arange(0, BLOCK)
        mask = offs < K
        y = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
        _store_fp8_row(q_ptr, s_ptr, row, y, offs, mask, K)


def _warps(block: int) -> int:
    return max(1, min(16, block // 512))


def _check_2d(name: str, x: torch.Tensor) -> None:
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"{name}: expected a 2-D tensor with contiguous rows, got shape {tuple(x.shape)} "
                         f"strides {tuple(x.stride())}")


def ln_mod_quant(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, eps: float = 1e-6, backend: str = "auto"):
    """x [M, K]; shift, scale [K] → (fp8 [M, K], float32 scales [M])."""
    _check_2d("ln_mod_quant x", x)
    K = x.shape[1]
    if shift.shape != (K,) or scale.shape != (K,):
        raise ValueError(f"ln_mod_quant: shift/scale must have shape ({K},), got {tuple(shift.shape)}/{tuple(scale.shape)}")
    if not use_triton("ln_mod_quant", backend, x.device):
        return ln_mod_quant_ref(x, shift, scale, eps)
    q = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
    block = triton.next_power_of_2(K)
    _ln_mod_quant_kernel[(x.shape[0],)](x, shift.contiguous(), scale.contiguous(), q, s, K, x.stride(0), eps,
                                        BLOCK=block, num_warps=_warps(block))
    return q, s


def residual_ln_mod_quant(x: torch.Tensor, y: torch.Tensor, gate: torch.Tensor, shift: torch.Tensor,
                          scale: torch.Tensor, eps: float = 1e-6, backend: str = "auto"):
    """x, y [M, K]; gate, shift, scale [K] → (x + gate·y [M, K] in x's dtype, fp8 [M, K], float32 scales [M]).
    The gated residual add of one sub-block fused with the next sub-block's norm, modulation and quantization."""
    _check_2d("residual_ln_mod_quant x", x)
    _check_2d("residual_ln_mod_quant y", y)
    K = x.shape[1]
    if y.shape != x.shape:
        raise ValueError(f"residual_ln_mod_quant: y shape {tuple(y.shape)} != x shape {tuple(x.shape)}")
    for name, t in (("gate", gate), ("shift", shift), ("scale", scale)):
        if t.shape != (K,):
            raise ValueError(f"residual_ln_mod_quant: {name} must have shape ({K},), got {tuple(t.shape)}")
    if not use_triton("residual_ln_mod_quant", backend, x.device):
        return residual_ln_mod_quant_ref(x, y, gate, shift, scale, eps)
    xo = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    q = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
    block = triton.next_power_of_2(K)
    _residual_ln_mod_quant_kernel[(x.shape[0],)](x, y, gate.contiguous(), shift.contiguous(), scale.contiguous(), xo, q,
                                                 s, K, x.stride(0), y.stride(0), eps, BLOCK=block,
                                                 num_warps=_warps(block))
    return xo, q, s


def swiglu_quant(gu: torch.Tensor, backend: str = "auto"):
    """gu [M, 2F] = [gate | up] → (fp8 [M, F], float32 scales [M])."""
    _check_2d("swiglu_quant gu", gu)
    if gu.shape[1] % 2:
        raise ValueError(f"swiglu_quant: last dim must be even ([gate | up]), got {gu.shape[1]}")
    if not use_triton("swiglu_quant", backend, gu.device):
        return swiglu_quant_ref(gu)
    F = gu.shape[1] // 2
    q = torch.empty((gu.shape[0], F), dtype=torch.float8_e4m3fn, device=gu.device)
    s = torch.empty(gu.shape[0], dtype=torch.float32, device=gu.device)
    block = triton.next_power_of_2(F)
    _swiglu_quant_kernel[(gu.shape[0],)](gu, q, s, F, gu.stride(0), BLOCK=block, num_warps=_warps(block))
    return q, s


def quant_rows(x: torch.Tensor, backend: str = "auto"):
    """x [M, K] → (fp8 [M, K], float32 scales [M])."""
    _check_2d("quant_rows x", x)
    if not use_triton("quant_rows", backend, x.device):
        return quant_rows_ref(x)
    K = x.shape[1]
    q = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
    block = triton.next_power_of_2(K)
    _quant_rows_kernel[(x.shape[0],)](x, q, s, K, x.stride(0), BLOCK=block, num_warps=_warps(block))
    return q, s
