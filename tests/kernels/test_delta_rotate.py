"""Delta rotation of cached keys (position reset): Triton vs torch twin, the reset identity, bad input.

The cache is filled by the reference write at random positions; the slots NOT being rotated are
then poisoned with NaN, so the kernel touching any of them shows, and every rotated slot must come
out finite and different from before. Shapes: odd (D=24, H=3, S=13, slots out of order), a model
head (D=128, 57b rope_dims) and long (300 of 517 slots); GPU tests (marked ``gpu``) use the 57b
per-rank cache (5,788 slots x 16 heads x 128).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from kernel_compare import (
    FP8,
    assert_close,
    assert_fp8_rows_match,
    assert_only_rows_changed,
    needs_cuda,
    needs_triton_cpu,
    poison_cache,
)
from vivant.kernels.cache_write import write_kv, write_kv_ref
from vivant.kernels.delta_rotate import delta_rotate, delta_rotate_ref
from vivant.kernels.fp8 import dequantize_rows
from vivant.kernels.rope import apply_rope_ref


@dataclass(frozen=True)
class Case:
    m: int  # slots rotated
    h: int
    d: int
    s: int
    rope_dims: tuple[int, int, int]


CASES = {
    "odd": Case(m=7, h=3, d=24, s=13, rope_dims=(8, 8, 8)),
    "model_head": Case(m=40, h=4, d=128, s=61, rope_dims=(44, 42, 42)),
    "long": Case(m=300, h=2, d=16, s=517, rope_dims=(6, 6, 4)),
}
CACHE_DTYPES = {"fp8": FP8, "f32": torch.float32, "bf16": torch.bfloat16}
DELTA = -37


def filled_cache(c: Case, dtype: torch.dtype, seed=0, device="cpu"):
    """A cache whose every slot holds a key written (reference path) at a random position; V unused."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(c.s, c.h, c.d, generator=g)
    pos = torch.stack(
        [torch.randint(40, 400, (c.s,), generator=g), torch.randint(0, 22, (c.s,), generator=g), torch.randint(0, 34, (c.s,), generator=g)],
        1,
    )
    kc = poison_cache((c.s, c.h, c.d), dtype)
    vc = poison_cache((c.s, c.h, c.d), dtype)
    ks = torch.full((c.s, c.h), float("nan"))
    vs = ks.clone()
    write_kv_ref(k, k, pos, torch.arange(c.s), kc, vc, ks, vs, rope_dims=c.rope_dims)
    slots = torch.randperm(c.s, generator=g)[: c.m]
    # Poison everything that must not be touched.
    keep = torch.ones(c.s, dtype=torch.bool)
    keep[slots] = False
    kc.view(torch.uint8)[keep] = poison_cache((1, c.h, c.d), dtype).view(torch.uint8)
    ks[keep] = float("nan")
    return kc.to(device), ks.to(device), slots.to(device)


def run_rotate(c: Case, dtype, backend: str, device="cpu"):
    kc, ks, slots = filled_cache(c, dtype, device=device)
    before_c, before_s = kc.clone(), ks.clone()
    delta_rotate(kc, ks, slots, DELTA, rope_dims=c.rope_dims, backend=backend)
    assert_only_rows_changed(before_c, kc, slots, what=f"{backend} k_cache")
    assert_only_rows_changed(before_s, ks, slots, what=f"{backend} k_scale")
    cpu_slots = slots.cpu()  # gather on the CPU: float8 advanced indexing is not on every device
    old = dequantize_rows(before_c.cpu()[cpu_slots], before_s.cpu()[cpu_slots])[..., : c.rope_dims[0]]
    new = dequantize_rows(kc.cpu()[cpu_slots], ks.cpu()[cpu_slots])[..., : c.rope_dims[0]]
    unchanged = (old == new).reshape(c.m, -1).all(dim=1)
    assert not unchanged.any(), f"{backend}: {int(unchanged.sum())} target slots were not rotated"
    return kc, ks, slots


@needs_triton_cpu
@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES.values(), ids=CACHE_DTYPES.keys())
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_triton_matches_reference(case, cache_dtype):
    kc, ks, slots = run_rotate(case, cache_dtype, "triton")
    kc_r, ks_r, _ = run_rotate(case, cache_dtype, "torch")
    got, want = kc[slots], kc_r[slots]
    if cache_dtype == FP8:
        assert_fp8_rows_match(got, ks[slots], want, ks_r[slots], max_ulp_fraction=2e-3, what=f"delta_rotate {case}")
    else:
        ulp = 2.0**-23 if cache_dtype == torch.float32 else 2.0**-8
        assert_close(got, want, rel_rms=max(1e-6, ulp), max_abs=4 * ulp * want.float().abs().max().item(), what=f"delta_rotate {case}")
        assert torch.all(ks[slots] == 1), "float cache scales must be 1.0 after the rotation"


def reset_identity_inputs(c: Case, seed=3):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(c.m, c.h, c.d, generator=g)
    pos = torch.stack(
        [torch.randint(-DELTA, -DELTA + 60, (c.m,), generator=g), torch.randint(0, 22, (c.m,), generator=g), torch.randint(0, 34, (c.m,), generator=g)],
        1,
    )
    slots = torch.randperm(c.s, generator=g)[: c.m]
    return k, pos, slots


def write_then_reset(c: Case, dtype, backend: str):
    """Keys written at t, then rotated by DELTA (= -Δ): the cache a position reset leaves behind."""
    k, pos, slots = reset_identity_inputs(c)
    kc, vc = poison_cache((c.s, c.h, c.d), dtype), poison_cache((c.s, c.h, c.d), dtype)
    ks, vs = torch.full((c.s, c.h), float("nan")), torch.full((c.s, c.h), float("nan"))
    write_kv(k, k, pos, slots, kc, vc, ks, vs, rope_dims=c.rope_dims, backend=backend)
    delta_rotate(kc, ks, slots, DELTA, rope_dims=c.rope_dims, backend=backend)
    return dequantize_rows(kc[slots], ks[slots]), k, pos, ks[slots]


BACKENDS = [pytest.param("torch", id="torch"), pytest.param("triton", id="triton", marks=needs_triton_cpu)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
class TestPositionResetIdentity:
    """rotate(-Δ) of keys written at t equals keys written at t - Δ."""

    def test_float_cache_to_float_rounding(self, case, backend):
        reset, k, pos, _ = write_then_reset(case, torch.float32, backend)
        direct = apply_rope_ref(k, pos + torch.tensor([DELTA, 0, 0]), case.rope_dims)
        # Angles are float32 products: t*f, DELTA*f and (t+DELTA)*f each carry <= 2**-24 relative
        # error, so the rotations differ by at most ~3 (|t| + |DELTA|) 2**-24 radians per pair.
        ang_err = 3 * (pos[:, 0].abs().max().item() + abs(DELTA)) * 2.0**-24
        bound = 2 * k.abs().max().item() * (ang_err + 4 * 2.0**-23)
        assert_close(reset, direct, rel_rms=1e-5, max_abs=bound, what=f"{backend} float reset vs direct write")

    def test_fp8_cache_within_requantization_error(self, case, backend):
        reset, k, pos, new_scale = write_then_reset(case, FP8, backend)
        exact = apply_rope_ref(k, pos + torch.tensor([DELTA, 0, 0]), case.rope_dims).double()
        # Two e4m3 roundings (at write, at the reset): the first error (<= 2**-4 per element) is
        # rotated within its pair, so it is bounded by 2**-4 of the pair's norm; the second by
        # 2**-4 of the element; plus half a subnormal quantum of each scale.
        pair_norm = exact.reshape(*exact.shape[:-1], -1, 2).norm(dim=-1).repeat_interleave(2, dim=-1)
        first_scale = exact.abs().amax(-1, keepdim=True) / 448.0
        bound = 2.0**-4 * (pair_norm + exact.abs()) * 1.07 + 2.0**-10 * (first_scale + new_scale.unsqueeze(-1))
        excess = ((reset.double() - exact).abs() - bound).max().item()
        assert excess <= 0, f"{backend}: reset keys exceed the two-rounding e4m3 bound by {excess:.3e}"
        assert_close(reset, exact, rel_rms=0.05, max_abs=float("inf"), what=f"{backend} fp8 reset vs exact rope(t-Δ)")


class TestBadInput:
    """Rejected calls name the field and what was expected, and leave the cache untouched."""

    @pytest.mark.parametrize(
        "override, error, message",
        [
            ({"delta_t": 2.5}, TypeError, "delta_t must be a Python int"),
            ({"delta_t": True}, TypeError, "delta_t must be a Python int"),
            ({"delta_t": 2**24}, ValueError, r"\|delta_t\| < 2\*\*24"),
            ({"slots": torch.tensor([[0, 1]])}, ValueError, r"slots must have shape \[M\]"),
            ({"slots": torch.tensor([3, 3])}, ValueError, "slots must be distinct"),
            ({"slots": torch.tensor([-1, 2])}, ValueError, r"slots must lie in \[0, S=13\)"),
            ({"k_scale": torch.ones(13, 2)}, ValueError, r"k_scale must have shape \[S, H\] = \(13, 3\)"),
            ({"rope_dims": (10, 8, 8)}, ValueError, "must sum to head_dim D=24"),
        ],
    )
    @pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_triton_cpu)])
    def test_rejected_with_named_field(self, override, error, message, backend):
        c = CASES["odd"]
        kc, ks, slots = filled_cache(c, FP8)
        args = dict(k_cache=kc, k_scale=ks, slots=slots, delta_t=DELTA, rope_dims=c.rope_dims)
        args.update(override)
        before = kc.clone(), ks.clone()
        with pytest.raises(error, match=message):
            delta_rotate(**args, backend=backend)
        assert torch.equal(before[0].view(torch.uint8), kc.view(torch.uint8)), "a rejected call changed k_cache"
        assert torch.equal(before[1].nan_to_num(-1), ks.nan_to_num(-1)), "a rejected call changed k_scale"


def test_reference_twin_is_what_auto_runs_on_cpu():
    c = CASES["odd"]
    a, sa, slots = filled_cache(c, FP8)
    b, sb, _ = filled_cache(c, FP8)
    delta_rotate(a, sa, slots, DELTA, rope_dims=c.rope_dims)
    delta_rotate_ref(b, sb, slots, DELTA, rope_dims=c.rope_dims)
    assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)) and torch.equal(sa[slots], sb[slots])


GPU_CASE = Case(m=5788 - 757, h=16, d=128, s=5788, rope_dims=(44, 42, 42))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("cache_dtype", [FP8, torch.float32], ids=["fp8", "f32"])
def test_gpu_57b_cache_matches_reference(cache_dtype):
    kc, ks, slots = (t.cpu() for t in run_rotate(GPU_CASE, cache_dtype, "triton", device="cuda"))
    kc_r, ks_r, _ = (t.cpu() for t in run_rotate(GPU_CASE, cache_dtype, "torch", device="cuda"))
    if cache_dtype == FP8:
        # Codes may differ by one e4m3 ulp where the GPU's cos/sin or a fused multiply-add moves a
        # value across a rounding midpoint; scales come from the same amax and match to 1e-6.
        assert_fp8_rows_match(kc[slots], ks[slots], kc_r[slots], ks_r[slots], max_ulp_fraction=1e-3, what="57b")
    else:
        assert_close(kc[slots], kc_r[slots], rel_rms=1e-6, max_abs=1e-5, what="57b float delta_rotate")
