"""3D RoPE reference: the layout convention, the math's invariants, the t-band delta rotation, bad input.

The references here are what the Triton cache kernels are compared against and what the model's
baseline mode uses, so they are checked against an independent float64 loop and against the
properties RoPE exists for (norm preservation, relative-position dot products).
"""

from __future__ import annotations

import math

import pytest
import torch
from kernel_compare import assert_close
from vivant.kernels.rope import apply_rope_ref, rope_angles, rotate_t_band_ref

ODD = dict(n=7, h=3, d=24, rope_dims=(8, 8, 8))
MODEL = dict(n=40, h=4, d=128, rope_dims=(44, 42, 42))  # the 57b head layout, few tokens
SKEWED = dict(n=9, h=2, d=20, rope_dims=(2, 12, 6))
SHAPES = {"odd": ODD, "model_head": MODEL, "skewed": SKEWED}


def make(n, h, d, rope_dims, seed=0, pos_max=60):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, h, d, generator=g)
    pos = torch.randint(0, pos_max, (n, 3), generator=g)
    return x, pos, rope_dims


def rope_loop_f64(x: torch.Tensor, pos: torch.Tensor, rope_dims, theta=10000.0) -> torch.Tensor:
    """Independent float64 RoPE written straight from the convention, pair by pair."""
    out = x.double().clone()
    p = 0
    for band, d_b in enumerate(rope_dims):
        for j in range(d_b // 2):
            inv = theta ** (-(2 * j) / d_b)
            ang = pos[:, band].double() * inv
            c, s = torch.cos(ang)[:, None], torch.sin(ang)[:, None]
            a, b = x[:, :, 2 * p].double(), x[:, :, 2 * p + 1].double()
            out[:, :, 2 * p] = a * c - b * s
            out[:, :, 2 * p + 1] = a * s + b * c
            p += 1
    return out


@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
class TestConvention:
    def test_matches_independent_float64_loop(self, shape):
        x, pos, rd = make(**shape)
        assert_close(apply_rope_ref(x, pos, rd), rope_loop_f64(x, pos, rd), rel_rms=1e-6, max_abs=2e-5, what="rope vs f64 loop")

    def test_angles_per_band(self, shape):
        _, pos, rd = make(**shape)
        ang = rope_angles(pos, rd)
        assert ang.shape == (pos.shape[0], sum(rd) // 2) and ang.dtype == torch.float32
        start = 0
        for band, d_b in enumerate(rd):
            for j in range(d_b // 2):
                want = pos[:, band].float() * (10000.0 ** (-(2 * j) / d_b))
                torch.testing.assert_close(ang[:, start + j], want, rtol=1e-6, atol=0)
            start += d_b // 2

    def test_each_position_column_moves_only_its_band(self, shape):
        x, _, rd = make(**shape)
        bounds = [0, rd[0], rd[0] + rd[1], sum(rd)]
        for band in range(3):
            pos = torch.zeros(x.shape[0], 3, dtype=torch.int64)
            pos[:, band] = 5
            y = apply_rope_ref(x, pos, rd)
            lo, hi = bounds[band], bounds[band + 1]
            outside = torch.cat([y[..., :lo], y[..., hi:]], dim=-1)
            assert torch.equal(outside, torch.cat([x[..., :lo], x[..., hi:]], dim=-1)), f"band {band} leaked"
            if hi > lo:
                assert not torch.equal(y[..., lo:hi], x[..., lo:hi]), f"band {band} did not rotate"


class TestInvariants:
    def test_preserves_norms(self):
        x, pos, rd = make(**ODD, pos_max=10_000)
        y = apply_rope_ref(x, pos, rd)
        rel = ((y.norm(dim=-1) - x.norm(dim=-1)).abs() / x.norm(dim=-1)).max().item()
        assert rel < 1e-6, f"RoPE changed a row norm by {rel:.2e} relative"

    @pytest.mark.parametrize("band", [0, 1, 2])
    def test_dot_product_depends_only_on_relative_position_per_band(self, band):
        q, p, rd = make(**MODEL, seed=1)
        k, p2, _ = make(**MODEL, seed=2)
        shift = torch.zeros(3, dtype=torch.int64)
        shift[band] = 37
        dot = (apply_rope_ref(q, p, rd) * apply_rope_ref(k, p2, rd)).sum(-1)
        dot_shifted = (apply_rope_ref(q, p + shift, rd) * apply_rope_ref(k, p2 + shift, rd)).sum(-1)
        assert_close(dot_shifted, dot, rel_rms=1e-5, max_abs=1e-4, what=f"<rope(q,p+s),rope(k,p'+s)> band {band}")
        # And it does depend on the relative position: shifting only q changes it.
        moved = (apply_rope_ref(q, p + shift, rd) * apply_rope_ref(k, p2, rd)).sum(-1)
        assert (moved - dot).abs().max() > 1e-2, f"shifting band {band} of q alone changed nothing"

    def test_int32_and_int64_positions_agree(self):
        x, pos, rd = make(**ODD)
        assert torch.equal(apply_rope_ref(x, pos, rd), apply_rope_ref(x, pos.int(), rd))

    def test_bfloat16_input_gives_float32_rotation_of_its_value(self):
        x, pos, rd = make(**ODD)
        xb = x.to(torch.bfloat16)
        y = apply_rope_ref(xb, pos, rd)
        assert y.dtype == torch.float32 and torch.equal(y, apply_rope_ref(xb.float(), pos, rd))


class TestTBandRotation:
    def test_rotating_t_band_equals_rope_at_shifted_time(self):
        x, pos, rd = make(**MODEL)
        delta = -23
        rotated = rotate_t_band_ref(apply_rope_ref(x, pos, rd), delta, rd)
        direct = apply_rope_ref(x, pos + torch.tensor([delta, 0, 0]), rd)
        # Float32 angles t*f and delta*f vs (t+delta)*f: each product is off by <= 2**-24 of itself.
        ang_err = 3 * (pos[:, 0].abs().max().item() + abs(delta)) * 2.0**-24
        bound = x.abs().max().item() * 2 * (ang_err + 1e-6)
        assert_close(rotated, direct, rel_rms=1e-5, max_abs=bound, what="rotate_t_band(rope(x,t), d) vs rope(x,t+d)")

    def test_h_and_w_bands_untouched_bitwise(self):
        x, _, rd = make(**SKEWED)
        y = rotate_t_band_ref(x, 11, rd)
        assert torch.equal(y[..., rd[0] :], x[..., rd[0] :]), "rotate_t_band changed the h/w bands"
        assert not torch.equal(y[..., : rd[0]], x[..., : rd[0]]), "rotate_t_band did not rotate the t band"

    def test_per_token_delta_tensor(self):
        x, _, rd = make(**ODD)
        deltas = torch.arange(x.shape[0]) - 3
        y = rotate_t_band_ref(x, deltas, rd)
        for i, d in enumerate(deltas.tolist()):
            assert torch.equal(y[i], rotate_t_band_ref(x[i : i + 1], d, rd)[0]), f"token {i} (delta {d})"

    def test_rotate_back_and_forth_is_identity(self):
        x, _, rd = make(**ODD)
        y = rotate_t_band_ref(rotate_t_band_ref(x, 1000, rd), -1000, rd)
        assert_close(y, x, rel_rms=1e-6, max_abs=1e-5, what="rotate(+1000) then rotate(-1000)")


class TestBadInput:
    @pytest.mark.parametrize(
        "rope_dims, message",
        [((8, 8, 6), "must sum to head_dim D=24"), ((7, 9, 8), "even"), ((12, 12), "three entries")],
    )
    def test_rope_dims(self, rope_dims, message):
        x, pos, _ = make(**ODD)
        with pytest.raises(ValueError, match=message):
            apply_rope_ref(x, pos, rope_dims)

    def test_pos_shape_and_dtype(self):
        x, pos, rd = make(**ODD)
        with pytest.raises(ValueError, match=r"pos must have shape \[N, 3\]"):
            apply_rope_ref(x, pos[:, :2], rd)
        with pytest.raises(ValueError, match="pos has 6 rows but x has N=7"):
            apply_rope_ref(x, pos[:6], rd)
        with pytest.raises(TypeError, match="pos must be int32 or int64"):
            apply_rope_ref(x, pos.float(), rd)

    def test_odd_head_dim_and_wrong_rank(self):
        with pytest.raises(ValueError, match="head_dim D must be even"):
            apply_rope_ref(torch.zeros(2, 1, 5), torch.zeros(2, 3, dtype=torch.int64), (2, 2, 1))
        with pytest.raises(ValueError, match=r"x must have shape \[N, H, D\]"):
            apply_rope_ref(torch.zeros(2, 8), torch.zeros(2, 3, dtype=torch.int64), (4, 2, 2))

    def test_delta_tensor_shape(self):
        x, _, rd = make(**ODD)
        with pytest.raises(ValueError, match=r"delta_t must be an int or a \[N=7\] tensor"):
            rotate_t_band_ref(x, torch.zeros(3), rd)


def test_theta_changes_frequencies():
    _, pos, rd = make(**ODD)
    a, b = rope_angles(pos, rd, theta=10000.0), rope_angles(pos, rd, theta=500.0)
    assert torch.equal(a[:, 0], b[:, 0]), "pair 0 of each band has inv_freq 1 for any theta"
    assert not torch.equal(a, b)
    assert math.isclose(b[1, 1].item(), pos[1, 0].item() * 500.0 ** (-2 / 8), rel_tol=1e-6)
