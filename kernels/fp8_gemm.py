"""FP8 e4m3 GEMM with rowwise scales: y[M, N] = (a[M, K]·sa[M]) @ (w[N, K]·sw[N])ᵀ, bf16 out.

Fast path: `torch._scaled_mm` (cuBLASLt, Hopper FP8 tensor cores) with a row-major, w passed as its
column-major transpose, scale_a [M, 1], scale_b [1, N]. Reference: float32 matmul of the dequantized
operands (`fp8_linear_ref`). Weights are quantized once at load (`quantize_weight`: one scale per output
channel); activations per token by the fused kernels in vivant.kernels.fused_quant.
"""

from __future__ import annotations

import logging
import os

import torch
from vivant.kernels.fp8 import quantize_rows_ref

log = logging.getLogger(__name__)
_warned: set[str] = set()
BACKENDS = ("auto", "cublas", "torch")
CUBLASLT_WORKSPACE_ENV = "CUBLASLT_WORKSPACE_SIZE"  # KiB; torch reads it once, at the process's first cuBLASLt call


def prefer_static_gemm_schedule() -> str:
    """Give cuBLASLt no workspace (CUBLASLT_WORKSPACE_SIZE=0) unless the variable is already set; returns the
    value in effect. Call before the process's first cuBLASLt GEMM.

    Why: with torch's default workspace cuBLASLt picks FP8 kernels with a dynamic tile scheduler whose counter
    is zeroed by a memset before every GEMM; without a workspace it picks the same tiles with a static schedule
    ("ssched" in the kernel name) and no memset, so each GEMM is one graph node instead of two
    (docs/ARCHITECTURE.md, "GEMM algorithms", gives the measured gain)."""
    return os.environ.setdefault(CUBLASLT_WORKSPACE_ENV, "0")


def quantize_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] (any float dtype) → (fp8 [N, K], float32 [N]) with one scale per output channel."""
    return quantize_rows_ref(w.float()) if w.device.type == "cpu" else _quantize_weight_cuda(w)


def _quantize_weight_cuda(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # chunked so a 13824×8192 weight does not need a float32 copy of itself at once
    q = torch.empty(w.shape, dtype=torch.float8_e4m3fn, device=w.device)
    s = torch.empty(w.shape[0], dtype=torch.float32, device=w.device)
    for i in range(0, w.shape[0], 2048):
        q[i:i + 2048], s[i:i + 2048] = quantize_rows_ref(w[i:i + 2048].float())
    return q, s


def fp8_linear_ref(a: torch.Tensor, sa: torch.Tensor, w: torch.Tensor, sw: torch.Tensor) -> torch.Tensor:
    return (a.float() * sa.float()[:, None]) @ (w.float() * sw.float()[:, None]).t()


def fp8_linear(a: torch.Tensor, sa: torch.Tensor, w: torch.Tensor, sw: torch.Tensor, *,
               out_dtype: torch.dtype = torch.bfloat16, backend: str = "auto", fast_accum: bool = False) -> torch.Tensor:
    """a fp8 [M, K], sa f32 [M]; w fp8 [N, K], sw f32 [N] → [M, N] out_dtype.

    fast_accum: cuBLASLt's FP8 fast-accumulation mode (Hopper accumulates in the tensor core's reduced
    precision instead of promoting partial sums to float32 every few k-steps): faster, less exact; ignored
    by the float32 reference."""
    if backend not in BACKENDS:
        raise ValueError(f"fp8_linear: backend must be one of {BACKENDS}, got {backend!r}")
    if a.shape[1] != w.shape[1]:
        raise ValueError(f"fp8_linear: K mismatch: a {tuple(a.shape)} vs w {tuple(w.shape)}")
    if sa.shape != (a.shape[0],):
        raise ValueError(f"fp8_linear: sa must have shape ({a.shape[0]},) (one scale per row of a), got {tuple(sa.shape)}")
    if sw.shape != (w.shape[0],):
        raise ValueError(f"fp8_linear: sw must have shape ({w.shape[0]},) (one scale per row of w), got {tuple(sw.shape)}")
    use_fast = backend in ("auto", "cublas") and a.is_cuda
    if backend == "cublas" and not a.is_cuda:
        raise RuntimeError("fp8_linear: backend='cublas' needs CUDA tensors")
    if use_fast:
        return torch._scaled_mm(a, w.t(), scale_a=sa.view(-1, 1), scale_b=sw.view(1, -1), out_dtype=out_dtype,
                                use_fast_accum=fast_accum)
    if backend == "auto" and "cpu" not in _warned:
        _warned.add("cpu")
        log.info("fp8_linear: using the float32 reference, not cuBLASLt: tensors are on %s", a.device.type)
    return fp8_linear_ref(a, sa, w, sw).to(out_dtype)
