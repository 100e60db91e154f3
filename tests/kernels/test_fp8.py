"""FP8 e4m3 rows: grid rounding against torch's cast, per-row quantization math, bad input.

torch's CPU cast to float8_e4m3fn is correct (round-to-nearest-even), so it is the oracle for
``round_to_e4m3_grid`` and for the Triton twin of it (run in Triton's interpreter here, where a
plain ``.to(tl.float8e4nv)`` is known to be wrong for values whose rounding carries into the next
power of two, a defect seen in Triton 3.6; the kernels round to the grid first).
"""

from __future__ import annotations

import pytest
import torch
from kernel_compare import FP8, fp8_ordinal, needs_cuda, needs_triton_cpu
from vivant.kernels.fp8 import FP8_MAX, dequantize_rows, quantize_rows_ref, round_to_e4m3_grid

EDGE_VALUES = [
    0.0, -0.0, 448.0, -448.0, 449.0, -449.0, 463.9, 464.0, 464.1, 479.0, 480.0, 1e6, -1e30,
    float("inf"), float("-inf"),
    -124.8, 124.8, 120.0, 15.9, 31.5, 0.9999, 1.0625, 1.1875,        # carries and ties to even
    2.0**-9, -(2.0**-9), 2.0**-10, 3 * 2.0**-10, 5 * 2.0**-10,       # subnormal quantum and ties
    7 * 2.0**-9, 7.5 * 2.0**-9, 2.0**-6, 2.0**-6 * 0.99, 2.0**-6 * 1.01, 2.0**-12, 1e-30,
]  # fmt: skip


def random_values(n: int, seed: int) -> torch.Tensor:
    """Log-uniform magnitudes over [2**-14, 2**10] with random signs: every binade, subnormals, overflow."""
    g = torch.Generator().manual_seed(seed)
    mag = torch.exp2(torch.empty(n).uniform_(-14.0, 10.0, generator=g))
    sign = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0)
    return mag * sign


def torch_cast_saturating(x: torch.Tensor) -> torch.Tensor:
    """torch's cast after saturating at ±448 (torch itself maps large values to NaN, not to ±448)."""
    return x.clamp(-FP8_MAX, FP8_MAX).to(FP8).float()


def assert_same_bits(actual: torch.Tensor, expected: torch.Tensor, x: torch.Tensor, what: str) -> None:
    same = actual.view(torch.int32) == expected.view(torch.int32)
    bad = (~same).nonzero().flatten()
    assert bad.numel() == 0, (
        f"{what}: {bad.numel()} of {x.numel()} values differ, e.g. x={x[bad[:5]].tolist()} -> "
        f"{actual[bad[:5]].tolist()}, torch cast gives {expected[bad[:5]].tolist()}"
    )


class TestGridRounding:
    def test_matches_torch_cast_on_10k_random_values_and_edge_cases(self):
        x = torch.cat([random_values(10_000, seed=1), torch.tensor(EDGE_VALUES)])
        assert_same_bits(round_to_e4m3_grid(x), torch_cast_saturating(x), x, "round_to_e4m3_grid")

    def test_known_cases(self):
        x = torch.tensor([-124.8, 500.0, float("inf"), 2.0**-10, 3 * 2.0**-10, -0.0])
        got = round_to_e4m3_grid(x)
        want = torch.tensor([-128.0, 448.0, 448.0, 0.0, 2.0**-8, -0.0])
        assert torch.equal(got, want), f"got {got.tolist()}, want {want.tolist()}"
        assert torch.signbit(got[-1]), "the sign of -0.0 was lost"

    def test_nan_stays_nan(self):
        got = round_to_e4m3_grid(torch.tensor([float("nan"), 1.0]))
        assert got[0].isnan() and got[1] == 1.0, f"got {got.tolist()}"

    def test_rejects_non_float32(self):
        with pytest.raises(TypeError, match="float32"):
            round_to_e4m3_grid(torch.ones(3, dtype=torch.float64))


triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from vivant.kernels.fp8 import to_e4m3_tl  # noqa: E402


@triton.jit
def _grid_cast_kernel(x_ptr, q_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    x = tl.load(x_ptr + offs, mask=m, other=0.0)
    tl.store(q_ptr + offs, to_e4m3_tl(x), mask=m)


def _triton_cast(x: torch.Tensor) -> torch.Tensor:
    q = torch.empty(x.shape, dtype=FP8, device=x.device)
    _grid_cast_kernel[(triton.cdiv(x.numel(), 4096),)](x, q, x.numel(), BLOCK=4096)
    return q


class TestTritonGridRounding:
    @needs_triton_cpu
    def test_interpreted_kernel_casts_like_torch(self):
        x = torch.cat([random_values(4096, seed=2), torch.tensor(EDGE_VALUES)])
        q = _triton_cast(x)
        assert_same_bits(q.float(), torch_cast_saturating(x), x, "Triton to_e4m3_tl (interpreted)")

    @needs_triton_cpu
    def test_interpreted_kernel_keeps_nan(self):
        # The interpreter's own cast turns NaN into the finite code 0x7C (384); to_e4m3_tl must not.
        q = _triton_cast(torch.tensor([float("nan"), -float("nan"), 1.0]))
        codes = q.view(torch.uint8).tolist()
        assert codes[0] == 0x7F and codes[1] == 0x7F and codes[2] == 0x38, f"codes {[hex(c) for c in codes]}"

    @pytest.mark.gpu
    @needs_cuda
    def test_compiled_kernel_casts_like_torch_bitwise(self):
        x = torch.cat([random_values(1 << 20, seed=3), torch.tensor(EDGE_VALUES)]).cuda()
        q = _triton_cast(x)
        want = x.clamp(-FP8_MAX, FP8_MAX).to(FP8)
        n_bad = int((q.view(torch.uint8) != want.view(torch.uint8)).sum())
        assert n_bad == 0, f"{n_bad} of {x.numel()} FP8 codes differ from torch's cast on the GPU"


class TestQuantizeRows:
    def test_scale_formula_and_range(self):
        x = torch.randn(5, 3, 24) * torch.logspace(-3, 3, 5)[:, None, None]
        q, s = quantize_rows_ref(x)
        assert q.dtype == FP8 and q.shape == x.shape and s.shape == (5, 3), f"{q.dtype} {q.shape} {s.shape}"
        want = x.abs().amax(-1) / 448.0
        assert torch.allclose(s, want, rtol=1e-7, atol=0), f"max scale diff {(s - want).abs().max():.3e}"
        qf = q.float()
        assert qf.abs().max() <= FP8_MAX, f"code magnitude {qf.abs().max()} exceeds 448"
        # The row's largest element maps to exactly ±448.
        assert torch.equal(qf.abs().amax(-1), torch.full((5, 3), FP8_MAX)), "row amax does not map to 448"

    def test_dequantized_error_within_half_an_e4m3_ulp(self):
        x = torch.randn(64, 4, 32)
        q, s = quantize_rows_ref(x)
        deq = dequantize_rows(q, s)
        # 3 mantissa bits: |error| <= 2**-4 * |x| for normal codes; subnormal codes (|x/s| < 2**-6)
        # have an absolute quantum of 2**-9 * s, so half of it bounds their error.
        bound = 2.0**-4 * x.abs() + 2.0**-10 * s.unsqueeze(-1)
        excess = (deq - x).abs() - bound
        assert excess.max() <= 0, f"dequantization error exceeds the e4m3 bound by {excess.max():.3e}"

    def test_zero_row_gets_floor_scale_and_zero_codes(self):
        q, s = quantize_rows_ref(torch.zeros(2, 8))
        assert torch.all(s == torch.tensor(1e-8) / 448.0), f"scales {s.tolist()}"
        assert torch.all(q.float() == 0), "zero row did not quantize to zeros"

    def test_nan_row_is_never_hidden(self):
        x = torch.randn(3, 8)
        x[1, 4] = float("nan")
        q, s = quantize_rows_ref(x)
        assert s[1].isnan() and q[1].float().isnan().all(), "a NaN input row must come out NaN"
        assert not s[[0, 2]].isnan().any(), "NaN leaked into other rows"

    def test_bfloat16_input_quantizes_like_its_float32_value(self):
        x = torch.randn(4, 16).to(torch.bfloat16)
        qa, sa = quantize_rows_ref(x)
        qb, sb = quantize_rows_ref(x.float())
        assert torch.equal(fp8_ordinal(qa), fp8_ordinal(qb)) and torch.equal(sa, sb)


class TestBadInput:
    def test_dequantize_rejects_mismatched_scale_shape(self):
        q, s = quantize_rows_ref(torch.randn(4, 8))
        with pytest.raises(ValueError, match=r"scale must have shape q.shape\[:-1\] = \(4,\)"):
            dequantize_rows(q, s[:3])

    def test_quantize_rejects_empty_rows(self):
        with pytest.raises(ValueError, match="non-empty last axis"):
            quantize_rows_ref(torch.zeros(3, 0))
