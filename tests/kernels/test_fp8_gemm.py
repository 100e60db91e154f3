"""FP8 rowwise GEMM: weight quantization, the float32 reference vs the math, cuBLASLt vs reference, bad input.

On CPU only the reference path exists (``auto`` falls back to it, ``cublas`` is an error): the tests
check ``quantize_weight`` (one scale per output channel), ``fp8_linear_ref`` against a float64 product
of the dequantized operands on odd shapes (K=100, 70, N=37) and a long one (300 tokens), and that the
quantized product stays close to the unquantized one. GPU tests (marked ``gpu``) compare
``torch._scaled_mm`` with the float32 reference of the same quantized operands at the four 57b TP=4
per-rank GEMMs (757 tokens: QKV, O, gate+up, down).
"""

from __future__ import annotations

import logging
import os

import pytest
import torch
import vivant.kernels.fp8_gemm as fp8_gemm_mod
from kernel_compare import FP8, assert_close, fp8_ordinal, needs_cuda
from vivant.kernels.fp8 import FP8_MAX, dequantize_rows, quantize_rows_ref
from vivant.kernels.fp8_gemm import fp8_linear, fp8_linear_ref, quantize_weight
from vivant.kernels.fused_quant import quant_rows

SHAPES = {  # (M tokens, K, N outputs)
    "odd_k100_n37": (7, 100, 37),
    "odd_k70": (13, 70, 37),
    "long": (300, 48, 64),
}


def operands(m: int, k: int, n: int, seed: int, device="cpu"):
    """Activations with per-token magnitudes spanning 1e-2..1e2 and a weight with uneven channel norms."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.logspace(-2, 2, m)[torch.randperm(m, generator=g)][:, None]
    w = torch.randn(n, k, generator=g) * torch.logspace(-1, 1, n)[:, None] / k**0.5
    return x.to(device), w.to(device)


class TestQuantizeWeight:
    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
    def test_one_scale_per_output_channel(self, dtype):
        _, w = operands(1, 100, 37, seed=1)
        w = w.to(dtype)
        q, s = quantize_weight(w)
        assert q.dtype == FP8 and q.shape == (37, 100) and s.dtype == torch.float32 and s.shape == (37,), (
            f"got {q.dtype} {tuple(q.shape)}, scales {s.dtype} {tuple(s.shape)}"
        )
        want = w.float().abs().amax(1) / FP8_MAX
        rel = ((s - want).abs() / want).max().item()
        assert rel <= 1e-6, f"scales differ from amax/448 by {rel:.3e} relative"
        amax_codes = q.float().abs().amax(1)
        assert torch.equal(amax_codes, torch.full((37,), FP8_MAX)), f"channel |max| codes {amax_codes.tolist()}"
        deq = dequantize_rows(q, s)
        bound = 2.0**-4 * w.float().abs() + 2.0**-10 * s[:, None]  # half an e4m3 ulp (normal / subnormal)
        excess = ((deq - w.float()).abs() - bound).max().item()
        assert excess <= 0, f"dequantized weight error exceeds half an e4m3 ulp by {excess:.3e}"

    def test_matches_rowwise_reference_bitwise(self):
        _, w = operands(1, 70, 37, seed=2)
        q, s = quantize_weight(w)
        qr, sr = quantize_rows_ref(w)
        assert torch.equal(fp8_ordinal(q), fp8_ordinal(qr)) and torch.equal(s, sr), "quantize_weight != rowwise reference"


class TestReference:
    @pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
    def test_ref_is_the_product_of_dequantized_operands(self, shape):
        m, k, n = shape
        x, w = operands(m, k, n, seed=3)
        a, sa = quant_rows(x)
        wq, sw = quantize_weight(w)
        got = fp8_linear_ref(a, sa, wq, sw)
        want = dequantize_rows(a, sa).double() @ dequantize_rows(wq, sw).double().t()
        assert got.dtype == torch.float32 and got.shape == (m, n), f"{got.dtype} {tuple(got.shape)}"
        assert_close(got, want, rel_rms=1e-6, max_abs=1e-5 * want.abs().max().item(), what=f"fp8_linear_ref {shape}")

    @pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
    def test_quantized_product_is_close_to_the_unquantized_one(self, shape):
        m, k, n = shape
        x, w = operands(m, k, n, seed=4)
        a, sa = quant_rows(x)
        wq, sw = quantize_weight(w)
        got = fp8_linear(a, sa, wq, sw, out_dtype=torch.float32)
        want = x.double() @ w.double().t()
        # Each operand carries ≈3% RMS e4m3 rounding error (3 mantissa bits); measured here: mean per-token
        # error ≈3.6%, worst token of 300 at K=48 ≈8.6%. Rows are compared relative to their own size.
        assert not got.isnan().any(), "NaN in the product"
        rel_rows = (got.double() - want).norm(dim=1) / want.norm(dim=1)
        assert rel_rows.mean() <= 0.05 and rel_rows.max() <= 0.15, (
            f"per-token relative error mean {rel_rows.mean():.3e} (limit 5e-2), max {rel_rows.max():.3e} (limit 0.15)"
        )

    def test_auto_on_cpu_is_the_reference_in_out_dtype_and_logs_once(self, caplog, monkeypatch):
        monkeypatch.setattr(fp8_gemm_mod, "_warned", set())
        x, w = operands(13, 70, 37, seed=5)
        a, sa = quant_rows(x)
        wq, sw = quantize_weight(w)
        with caplog.at_level(logging.INFO, logger="vivant.kernels.fp8_gemm"):
            y1 = fp8_linear(a, sa, wq, sw)
            y2 = fp8_linear(a, sa, wq, sw)
        want = fp8_linear_ref(a, sa, wq, sw).to(torch.bfloat16)
        assert y1.dtype == torch.bfloat16 and torch.equal(y1, want) and torch.equal(y2, want), "auto on CPU != ref in bf16"
        msgs = [r.getMessage() for r in caplog.records if "fp8_linear" in r.getMessage()]
        assert msgs == ["fp8_linear: using the float32 reference, not cuBLASLt: tensors are on cpu"], msgs


class TestBadInput:
    def setup_method(self):
        x, w = operands(7, 100, 37, seed=6)
        self.a, self.sa = quant_rows(x)
        self.w, self.sw = quantize_weight(w)

    def test_k_mismatch_names_both_shapes(self):
        w, sw = quantize_weight(torch.randn(37, 99))
        with pytest.raises(ValueError, match=r"K mismatch: a \(7, 100\) vs w \(37, 99\)"):
            fp8_linear(self.a, self.sa, w, sw)

    def test_cublas_on_cpu_is_an_error(self):
        with pytest.raises(RuntimeError, match="backend='cublas' needs CUDA tensors"):
            fp8_linear(self.a, self.sa, self.w, self.sw, backend="cublas")

    def test_unknown_backend(self):
        with pytest.raises(ValueError, match="backend"):
            fp8_linear(self.a, self.sa, self.w, self.sw, backend="triton")

    @pytest.mark.parametrize("which", ["sa", "sw"])
    def test_scale_of_wrong_length(self, which):
        args = {"sa": self.sa, "sw": self.sw}
        args[which] = args[which][:1]
        with pytest.raises(ValueError, match=which):
            fp8_linear(self.a, args["sa"], self.w, args["sw"])


# ---- GPU: cuBLASLt at the 57b TP=4 per-rank GEMMs -------------------------------------------------------
GPU_SHAPES = {  # (M, K, N): QKV, O, gate+up, down
    "qkv_757x8192x6144": (757, 8192, 6144),
    "o_757x2048x8192": (757, 2048, 8192),
    "gate_up_757x8192x13824": (757, 8192, 13824),
    "down_757x6912x8192": (757, 6912, 8192),
}


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("shape", GPU_SHAPES.values(), ids=GPU_SHAPES.keys())
def test_gpu_cublas_matches_reference_at_57b_shapes(shape, monkeypatch):
    m, k, n = shape
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)  # the reference stays float32
    g = torch.Generator(device="cuda").manual_seed(7)
    x = torch.randn(m, k, generator=g, device="cuda").to(torch.bfloat16)
    w = (torch.randn(n, k, generator=g, device="cuda") / k**0.5).to(torch.bfloat16)
    a, sa = quant_rows(x, backend="triton")
    wq, sw = quantize_weight(w)
    wq_cpu, sw_cpu = quantize_rows_ref(w.cpu().float()[:64])
    assert torch.equal(wq[:64].cpu().view(torch.uint8), wq_cpu.view(torch.uint8)), "CUDA quantize_weight != CPU rows"
    got = fp8_linear(a, sa, wq, sw, backend="cublas")
    assert got.dtype == torch.bfloat16 and got.shape == (m, n), f"{got.dtype} {tuple(got.shape)}"
    want = fp8_linear_ref(a, sa, wq, sw)
    assert_close(got, want, rel_rms=1e-2, max_abs=5e-2 * want.abs().max().item(), what=f"fp8_linear cublas {shape}")


class TestStaticGemmSchedule:
    """prefer_static_gemm_schedule asks torch for no cuBLASLt workspace, unless the operator already chose one."""

    def test_sets_zero_when_unset(self, monkeypatch):
        monkeypatch.delenv(fp8_gemm_mod.CUBLASLT_WORKSPACE_ENV, raising=False)
        assert fp8_gemm_mod.prefer_static_gemm_schedule() == "0"
        assert os.environ[fp8_gemm_mod.CUBLASLT_WORKSPACE_ENV] == "0", "the variable torch reads was not set"

    def test_keeps_an_explicit_value(self, monkeypatch):
        monkeypatch.setenv(fp8_gemm_mod.CUBLASLT_WORKSPACE_ENV, "4096")
        assert fp8_gemm_mod.prefer_static_gemm_schedule() == "4096", "an operator's workspace size was overridden"
