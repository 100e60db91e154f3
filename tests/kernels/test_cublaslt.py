"""cuBLASLt FP8 GEMM with a chosen algorithm (vivant.kernels.cublaslt) against the float32 reference.

GPU tests (marked ``gpu``): at the four 57b TP = 4 per-rank shapes and at odd and long ones, every algorithm the
heuristic offers (no workspace and 32 MiB) matches `fp8_linear_ref` of the same quantized operands, and the
heuristic's first equals torch._scaled_mm bit for bit (torch takes the same first answer); with the residual as the
epilogue's C (in place and separate) the GEMM adds it, rounded once, as the float32 reference does. On CPU: the
binding refuses without CUDA, with a message that says so.
"""

from __future__ import annotations

import pytest
import torch
from kernel_compare import assert_close, needs_cuda
from vivant.kernels.cublaslt import CublasLtError, Fp8Gemm
from vivant.kernels.fp8_gemm import fp8_linear, fp8_linear_ref, quantize_weight
from vivant.kernels.fused_quant import quant_rows

SHAPES = {  # (M, K, N)
    "qkv_757x8192x6144": (757, 8192, 6144),
    "o_757x2048x8192": (757, 2048, 8192),
    "gate_up_757x8192x13824": (757, 8192, 13824),
    "down_757x6912x8192": (757, 6912, 8192),
    "odd_13x112x48": (13, 112, 48),
    "long_4099x256x128": (4099, 256, 128),
}


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_without_cuda_the_binding_refuses_clearly():
    with pytest.raises(CublasLtError, match="needs a CUDA device"):
        Fp8Gemm(757, 6144, 8192, fast_accum=True)


def _operands(m, k, n, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, k, generator=g, device="cuda") * torch.logspace(-2, 2, m, device="cuda")[:, None]
    w = torch.randn(n, k, generator=g, device="cuda") / k ** 0.5
    a, sa = quant_rows(x.to(torch.bfloat16), backend="triton")
    wq, sw = quantize_weight(w)
    return a, sa, wq, sw


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("fast_accum", [True, False], ids=["fast", "exact"])
@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_gpu_every_candidate_matches_the_reference(shape, fast_accum, monkeypatch):
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    m, k, n = shape
    a, sa, wq, sw = _operands(m, k, n, seed=11)
    want = fp8_linear_ref(a, sa, wq, sw)
    gemm = Fp8Gemm(m, n, k, fast_accum=fast_accum)
    cands = gemm.candidates(count=16) + gemm.candidates(workspace_bytes=32 << 20, count=16)
    assert cands, f"cuBLASLt offered no algorithm for {shape}"
    for algo in cands:
        got = gemm(a, sa, wq, sw, algo=algo)
        assert_close(got, want, rel_rms=1e-2, max_abs=5e-2 * want.abs().max().item(),
                     what=f"Fp8Gemm {shape} fast_accum={fast_accum} {algo.describe()}")
    first = gemm(a, sa, wq, sw)
    torch_out = fp8_linear(a, sa, wq, sw, backend="cublas", fast_accum=fast_accum)
    assert torch.equal(first, torch_out), (f"{shape}: the heuristic's first algorithm differs from torch._scaled_mm "
                                           f"(max diff {(first.float() - torch_out.float()).abs().max().item():.3e})")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("in_place", [True, False], ids=["c_is_out", "c_separate"])
@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_gpu_epilogue_adds_c(shape, in_place, monkeypatch):
    """out = c + (a·sa)(w·sw)ᵀ with a gate folded into sw: the residual add of the O / down GEMMs
    (EngineOptions.residual_in_gemm)."""
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    m, k, n = shape
    a, sa, wq, sw = _operands(m, k, n, seed=13)
    g = torch.Generator(device="cuda").manual_seed(14)
    gate = (0.3 * torch.randn(n, generator=g, device="cuda")).to(torch.bfloat16)
    c = (3 * torch.randn(m, n, generator=g, device="cuda")).to(torch.bfloat16)
    sg = sw * gate.float()
    want = c.float() + gate.float() * fp8_linear_ref(a, sa, wq, sw)
    gemm = Fp8Gemm(m, n, k, fast_accum=True)
    c_in = c.clone()
    got = gemm(a, sa, wq, sg, out=c_in if in_place else None, c=c_in)
    if in_place:
        assert got.data_ptr() == c_in.data_ptr()
    else:
        assert torch.equal(c_in, c), "a separate C must be left as it was"
    # the product's bounds above (fast accumulation), plus one bf16 rounding of the sum
    assert_close(got, want, rel_rms=1e-2, max_abs=5e-2 * want.abs().max().item(),
                 what=f"Fp8Gemm {shape} c + product, in_place={in_place}")
    with pytest.raises(ValueError, match=r"Fp8Gemm c: expected .*shape"):
        gemm(a, sa, wq, sg, c=c[:, :16].contiguous())


@pytest.mark.gpu
@needs_cuda
def test_gpu_bad_operands_name_the_argument():
    a, sa, wq, sw = _operands(13, 112, 48, seed=12)
    gemm = Fp8Gemm(13, 48, 112, fast_accum=True)
    with pytest.raises(ValueError, match=r"Fp8Gemm sa: expected .*shape \(13,\)"):
        gemm(a, sa[:5], wq, sw)
    with pytest.raises(ValueError, match=r"Fp8Gemm w: expected .*shape \(48, 112\)"):
        gemm(a, sa, wq[:, :96].contiguous(), sw)
    with pytest.raises(ValueError, match="Fp8Gemm shape"):
        Fp8Gemm(13, 50, 112, fast_accum=True)
