"""Fused activation quantization (LayerNorm+modulation, SwiGLU, plain rows → FP8 rows): Triton vs twin.

On CPU the Triton kernels run in Triton's interpreter (TRITON_INTERPRET=1) on odd widths (K=100, 70,
rows of a wider buffer, bfloat16 inputs) and long inputs (a few hundred rows). The outputs the
launchers allocate are poisoned (``torch.empty`` returns NaN-filled memory while a kernel is launched),
so an element or scale the kernel fails to write shows up as NaN. FP8 rows are compared as codes
(at most one e4m3 ulp on a small fraction), scales to 1e-6 relative, and dequantized values by
relative RMS / max abs error. Every Triton comparison runs under several launch configs
``(rows_per_program, block_k, num_warps)``: the default, several rows per program with the whole row in
one tile, and the looped form (block_k < K) — with row counts that are not a multiple of rows_per_program
and widths that are not a multiple of block_k. The twins are checked against the plain math they stand
for. GPU tests (marked ``gpu``) run the compiled kernels at the 57b TP=4 shapes (757 tokens; K = 8192,
6912, 2048) under the same kinds of configs.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import pytest
import torch
from kernel_compare import FP8, assert_close, assert_fp8_rows_match, needs_cuda, needs_triton_cpu
from vivant.kernels.fp8 import FP8_MAX, dequantize_rows
from vivant.kernels.fused_quant import (
    DEFAULT_CONFIGS,
    ln_mod_quant,
    ln_mod_quant_ref,
    quant_rows,
    quant_rows_ref,
    residual_ln_mod_quant,
    swiglu_quant,
    swiglu_quant_ref,
)


@dataclass(frozen=True)
class Case:
    m: int  # rows (tokens)
    k: int  # row width (for swiglu: F, the output width; the input is 2F wide)
    dtype: torch.dtype = torch.float32
    row_pad: int = 0  # >0: the input is a view of the first columns of a wider buffer (row stride > width)


CASES = {
    "odd_k100": Case(m=7, k=100),
    "odd_k70_strided_bf16": Case(m=9, k=70, dtype=torch.bfloat16, row_pad=13),
    "long": Case(m=256, k=48, row_pad=5),
}

# (rows_per_program, block_k, num_warps); None = DEFAULT_CONFIGS, block_k 0 = the whole row in one tile.
# m = 7, 9, 256 and k = 100, 70, 48: the looped configs leave a partial last tile and (but for 256) a partial
# last row group.
CONFIGS = {
    "default": None,
    "rows4_whole_row": (4, 0, 4),
    "loop_2x16_w4": (2, 16, 4),
    "loop_4x32_w2": (4, 32, 2),
}
LOOPED = {k: v for k, v in CONFIGS.items() if k.startswith("loop")}


def rows(m: int, k: int, dtype, row_pad: int, g: torch.Generator, spread: bool = True) -> torch.Tensor:
    """[m, k] activations with per-row magnitudes spanning 1e-3..1e3 (so scales differ row to row)."""
    x = torch.randn(m, k + row_pad, generator=g)
    if spread:
        x = x * torch.logspace(-3, 3, m)[torch.randperm(m, generator=g)][:, None]
    x = x.to(dtype)[:, :k]
    assert row_pad == 0 or not x.is_contiguous()
    return x


@pytest.fixture
def poisoned_outputs(monkeypatch):
    """While active, ``torch.empty`` hands out NaN-filled memory (e4m3 NaN byte 0x7F for FP8)."""
    real_empty = torch.empty

    def empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        if t.dtype == FP8:
            t.view(torch.uint8).fill_(0x7F)
        elif t.is_floating_point():
            t.fill_(float("nan"))
        return t

    monkeypatch.setattr(torch, "empty", empty)  # monkeypatch restores the real one after the test


def compare_fp8(got, want, *, ulp_fraction: float, what: str) -> None:
    (q, s), (qr, sr) = got, want
    assert q.shape == qr.shape and s.shape == sr.shape, f"{what}: shapes {q.shape}/{s.shape} vs {qr.shape}/{sr.shape}"
    assert not s.isnan().any(), f"{what}: {int(s.isnan().sum())} row scales are NaN (poison not overwritten)"
    assert_fp8_rows_match(q, s, qr, sr, max_ulp_fraction=ulp_fraction, what=what)
    # One e4m3 ulp is 2**-3 of the value's binade, so a dequantized rel-RMS of 1e-2 allows only a few such codes.
    assert_close(dequantize_rows(q, s), dequantize_rows(qr, sr), rel_rms=1e-2, max_abs=float("inf"),
                 what=f"{what} dequantized")


# ---- Triton (interpreted) vs the float32 twins -----------------------------------------------------------
@needs_triton_cpu
@pytest.mark.usefixtures("poisoned_outputs")
@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
class TestTritonMatchesReference:
    def test_ln_mod_quant(self, case, config):
        g = torch.Generator().manual_seed(11)
        x = rows(case.m, case.k, case.dtype, case.row_pad, g)
        shift = (0.5 * torch.randn(case.k, generator=g)).to(case.dtype)
        scale = (0.5 * torch.randn(case.k, generator=g)).to(case.dtype)
        got = ln_mod_quant(x, shift, scale, backend="triton", config=config)
        compare_fp8(got, ln_mod_quant_ref(x, shift, scale), ulp_fraction=2e-3, what=f"ln_mod_quant {case} {config}")

    @pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")  # silu of gates ≤ -89
    def test_swiglu_quant(self, case, config):
        g = torch.Generator().manual_seed(12)
        gu = rows(case.m, 2 * case.k, case.dtype, case.row_pad, g)
        got = swiglu_quant(gu, backend="triton", config=config)
        compare_fp8(got, swiglu_quant_ref(gu), ulp_fraction=2e-3, what=f"swiglu_quant {case} {config}")

    def test_quant_rows(self, case, config):
        g = torch.Generator().manual_seed(13)
        x = rows(case.m, case.k, case.dtype, case.row_pad, g)
        got = quant_rows(x, backend="triton", config=config)
        # A pure scale-and-round: codes must be identical.
        compare_fp8(got, quant_rows_ref(x), ulp_fraction=0.0, what=f"quant_rows {case} {config}")


@needs_triton_cpu
class TestTritonEdgeRows:
    def test_zero_row_gets_floor_scale_and_zero_codes(self):
        x = torch.randn(3, 100)
        x[1] = 0.0
        q, s = quant_rows(x, backend="triton")
        assert s[1] == torch.tensor(1e-8) / FP8_MAX and torch.all(q[1].float() == 0), (
            f"zero row: scale {s[1].item():.3e} (want 1e-8/448), codes {q[1].float().unique().tolist()}"
        )
        q, s = ln_mod_quant(x, torch.zeros(100), torch.zeros(100), backend="triton")
        assert torch.all(q[1].float() == 0) and s[1] == torch.tensor(1e-8) / FP8_MAX, (
            f"LayerNorm of a zero row: scale {s[1].item():.3e}, codes {q[1].float().unique().tolist()}"
        )

    @pytest.mark.parametrize("config", [None, *LOOPED.values()], ids=["default", *LOOPED.keys()])
    @pytest.mark.parametrize("op", ["quant_rows", "ln_mod_quant", "swiglu_quant"])
    def test_nan_in_a_row_makes_its_scale_nan_like_the_twin(self, op, config):
        # the NaN sits in a middle tile of a middle row of its row group for the looped configs
        x = torch.randn(4, 100)
        x[2, 37] = float("nan")
        zeros = torch.zeros(100)
        run = {
            "quant_rows": lambda b: quant_rows(x, backend=b, config=config),
            "ln_mod_quant": lambda b: ln_mod_quant(x, zeros, zeros, backend=b, config=config),
            "swiglu_quant": lambda b: swiglu_quant(torch.cat([x, x], 1), backend=b, config=config),
        }[op]
        (q, s), (_, sr) = run("triton"), run("torch")
        assert sr[2].isnan() and not sr[[0, 1, 3]].isnan().any(), f"twin scales {sr.tolist()}"
        assert s[2].isnan(), (
            f"{op}: row 2 holds a NaN but its Triton scale is {s[2].item():.4g} and "
            f"{int(q[2].float().isnan().sum())} of its codes are NaN (twin: scale NaN)"
        )
        assert not s[[0, 1, 3]].isnan().any(), f"{op}: NaN leaked into other rows' scales {s.tolist()}"

    @pytest.mark.parametrize("config", LOOPED.values(), ids=LOOPED.keys())
    def test_zero_row_looped(self, config):
        x = torch.randn(5, 70)
        x[3] = 0.0
        q, s = ln_mod_quant(x, torch.zeros(70), torch.zeros(70), backend="triton", config=config)
        assert torch.all(q[3].float() == 0) and s[3] == torch.tensor(1e-8) / FP8_MAX, (
            f"{config}: LayerNorm of a zero row: scale {s[3].item():.3e}, codes {q[3].float().unique().tolist()}"
        )

    def test_row_max_maps_to_448(self):
        x = torch.randn(5, 70) * 1e4
        q, _ = quant_rows(x, backend="triton")
        amax = q.float().abs().amax(dim=1)
        assert torch.equal(amax, torch.full((5,), FP8_MAX)), f"row |max| codes {amax.tolist()} (want 448)"


# ---- the twins vs the math they stand for -----------------------------------------------------------------
class TestReferenceMath:
    def test_ln_mod_quant_ref_dequantizes_to_modulated_layernorm(self):
        g = torch.Generator().manual_seed(21)
        x = torch.randn(16, 100, generator=g, dtype=torch.float64) * 3 + 1
        shift, scale = torch.randn(100, generator=g, dtype=torch.float64), torch.randn(100, generator=g, dtype=torch.float64)
        mean, var = x.mean(1, keepdim=True), x.var(1, unbiased=False, keepdim=True)
        want = (x - mean) / torch.sqrt(var + 1e-6) * (1 + scale) + shift
        deq = dequantize_rows(*ln_mod_quant_ref(x.float(), shift.float(), scale.float()))
        # e4m3 keeps 3 mantissa bits: relative error ≤ 2**-4 per normal value, RMS well under 4e-2.
        assert_close(deq, want, rel_rms=4e-2, max_abs=2.0**-4 * want.abs().max().item(), what="ln_mod_quant_ref vs math")

    def test_swiglu_quant_ref_dequantizes_to_silu_gate_times_up(self):
        g = torch.Generator().manual_seed(22)
        gate, up = torch.randn(16, 70, generator=g, dtype=torch.float64), torch.randn(16, 70, generator=g, dtype=torch.float64)
        want = gate * torch.sigmoid(gate) * up
        q, s = swiglu_quant_ref(torch.cat([gate, up], 1).float())
        assert q.shape == (16, 70) and s.shape == (16,), f"shapes {tuple(q.shape)}, {tuple(s.shape)}"
        assert_close(dequantize_rows(q, s), want, rel_rms=4e-2, max_abs=2.0**-4 * want.abs().max().item(),
                     what="swiglu_quant_ref vs math")

    def test_auto_on_cpu_is_the_reference(self):
        x = torch.randn(6, 40)
        q, s = quant_rows(x)
        qr, sr = quant_rows_ref(x)
        assert torch.equal(q.view(torch.uint8), qr.view(torch.uint8)) and torch.equal(s, sr), "auto on CPU != reference"


# ---- bad input ---------------------------------------------------------------------------------------------
class TestBadInput:
    def test_ln_mod_quant_shift_shape_named(self):
        with pytest.raises(ValueError, match=r"shift/scale must have shape \(100,\), got \(99,\)/\(100,\)"):
            ln_mod_quant(torch.randn(4, 100), torch.zeros(99), torch.zeros(100))

    @pytest.mark.parametrize("fn", [quant_rows, swiglu_quant], ids=["quant_rows", "swiglu_quant"])
    def test_non_2d_input_named(self, fn):
        with pytest.raises(ValueError, match=r"expected a 2-D tensor with contiguous rows, got shape \(2, 3, 8\)"):
            fn(torch.randn(2, 3, 8))

    def test_non_contiguous_rows_rejected(self):
        x = torch.randn(8, 6).t()
        with pytest.raises(ValueError, match=r"got shape \(6, 8\) strides \(1, 6\)"):
            quant_rows(x)

    def test_swiglu_odd_width(self):
        with pytest.raises(ValueError, match="last dim must be even.*got 71"):
            swiglu_quant(torch.randn(3, 71))

    @pytest.mark.parametrize(
        "config",
        [(1, 24, 4), (0, 32, 4), (-2, 32, 4), (3, 32, 4), (1, 8, 4), (1, 32, 3), (1, 32), (1.0, 32, 4), None],
        ids=["block_k_not_pow2", "rows_0", "rows_negative", "rows_not_pow2", "block_k_below_16", "warps_3",
             "two_fields", "float_rows", "table_entry"],
    )
    @pytest.mark.parametrize("op", ["quant_rows", "ln_mod_quant", "swiglu_quant", "residual_ln_mod_quant"])
    def test_bad_config_named(self, op, config, monkeypatch):
        if config is None:  # a bad value in DEFAULT_CONFIGS is refused the same way as a bad argument
            config = (1, 24, 0)
            monkeypatch.setitem(DEFAULT_CONFIGS, op, config)
            kwargs = {}
        else:
            kwargs = {"config": config}
        x = torch.randn(4, 64)
        run = {
            "quant_rows": lambda: quant_rows(x, **kwargs),
            "ln_mod_quant": lambda: ln_mod_quant(x, x[0], x[0], **kwargs),
            "swiglu_quant": lambda: swiglu_quant(x, **kwargs),
            "residual_ln_mod_quant": lambda: residual_ln_mod_quant(x, x, x[0], x[0], x[0], **kwargs),
        }[op]
        want = rf"{op}: config must be \(rows_per_program, block_k, num_warps\) .*block_k a power of two >= 16.*"
        with pytest.raises(ValueError, match=want + re.escape(f"got {config!r}")):
            run()

    def test_default_configs_cover_every_kernel_and_are_valid(self):
        assert set(DEFAULT_CONFIGS) == {"ln_mod_quant", "residual_ln_mod_quant", "swiglu_quant", "quant_rows"}
        for name, cfg in DEFAULT_CONFIGS.items():  # each must run the default (torch backend validates it too)
            quant_rows(torch.randn(2, 16), config=cfg)
            assert len(cfg) == 3, f"{name}: {cfg}"

    def test_unknown_backend(self):
        with pytest.raises(ValueError, match=r"backend must be one of .*got 'cuda'"):
            quant_rows(torch.randn(3, 8), backend="cuda")


# ---- GPU: compiled kernels at the 57b TP=4 shapes ---------------------------------------------------------
M_57B = 757


# the default, a multi-row whole-row config, the looped configs of the CPU tests, and realistic looped tiles
GPU_CONFIGS = {**CONFIGS, "loop_4x1024_w4": (4, 1024, 4), "loop_8x512_w8": (8, 512, 8)}


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("config", GPU_CONFIGS.values(), ids=GPU_CONFIGS.keys())
class TestGpu57b:
    def test_ln_mod_quant_757x8192(self, config):
        g = torch.Generator(device="cuda").manual_seed(31)
        x = torch.randn(M_57B, 8192, generator=g, device="cuda").to(torch.bfloat16)
        shift = (0.3 * torch.randn(8192, generator=g, device="cuda")).to(torch.bfloat16)
        scale = (0.3 * torch.randn(8192, generator=g, device="cuda")).to(torch.bfloat16)
        got = ln_mod_quant(x, shift, scale, backend="triton", config=config)
        want = ln_mod_quant_ref(x, shift, scale)
        compare_fp8(tuple(t.cpu() for t in got), tuple(t.cpu() for t in want), ulp_fraction=2e-3,
                    what=f"ln_mod_quant 757x8192 cuda {config}")

    def test_swiglu_quant_757x13824(self, config):
        g = torch.Generator(device="cuda").manual_seed(32)
        gu = (2 * torch.randn(M_57B, 2 * 6912, generator=g, device="cuda")).to(torch.bfloat16)
        got = swiglu_quant(gu, backend="triton", config=config)
        want = swiglu_quant_ref(gu)
        compare_fp8(tuple(t.cpu() for t in got), tuple(t.cpu() for t in want), ulp_fraction=2e-3,
                    what=f"swiglu_quant 757x(2*6912) cuda {config}")

    def test_quant_rows_757x2048(self, config):
        g = torch.Generator(device="cuda").manual_seed(33)
        x = torch.randn(M_57B, 2048, generator=g, device="cuda").to(torch.bfloat16)
        got = quant_rows(x, backend="triton", config=config)
        want = quant_rows_ref(x)
        # compiled Triton divides y / s with the fast (approximate) division; the reference divides exactly:
        # measured on the H200, 274 of 1,550,336 codes (1.8e-4) land one e4m3 step apart, never more.
        compare_fp8(tuple(t.cpu() for t in got), tuple(t.cpu() for t in want), ulp_fraction=1e-3,
                    what=f"quant_rows 757x2048 cuda {config}")


@needs_triton_cpu
def test_one_reduction_row_scale_matches_the_interpreters_form(monkeypatch):
    """Compiled kernels take each row scale in one NaN-propagating max reduction (`ONE_REDUCTION`); the interpreter
    runs a max and a NaN count instead (a custom combine is slow there). Both forms, in the interpreter on a row
    with a NaN, a row with an inf and finite rows: the same codes and scales, bit for bit."""
    import triton.language as tl
    from vivant.kernels import fused_quant as fq

    x = torch.randn(4, 48, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    x[1, 7] = float("nan")
    x[3, 40] = float("inf")
    gu = torch.cat([x, x.flip(1)], dim=1)
    outs = {}
    for one in (False, True):
        monkeypatch.setattr(fq, "ONE_REDUCTION", tl.constexpr(one))
        outs[one] = (fq.quant_rows(x, backend="triton", config=(2, 16, 1)), fq.swiglu_quant(gu, backend="triton"))
    for (q0, s0), (q1, s1) in zip(outs[False], outs[True], strict=True):
        assert torch.equal(q0.view(torch.uint8), q1.view(torch.uint8)), "codes differ between the two row-scale forms"
        assert torch.equal(s0.isnan(), s1.isnan()) and torch.equal(s0.nan_to_num(), s1.nan_to_num()), (
            f"scales differ: {s0.tolist()} vs {s1.tolist()}")
    assert outs[True][0][1][1].isnan() and not outs[True][0][1][[0, 2]].isnan().any()
