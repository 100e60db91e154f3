"""Delta rotation of cached keys (position reset): Triton vs torch twin, the reset identity, bad input.

The cache (bf16, the served ring, or float32) is filled with keys rotated at random positions; the slots NOT
being rotated are
then poisoned with NaN, so the kernel touching any of them shows, and every rotated slot must come
out finite and different from before. Shapes: odd (D=24, H=3, S=13, slots out of order), a model
head (D=128, 57b rope_dims) and long (300 of 517 slots); GPU tests (marked ``gpu``) use the 57b
per-rank cache (5,788 slots x 16 heads x 128).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from kernel_compare import assert_close, assert_only_rows_changed, needs_cuda, needs_triton_cpu, poison_cache
from vivant.kernels.delta_rotate import delta_rotate, delta_rotate_ref
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
CACHE_DTYPES = {"bf16": torch.bfloat16, "f32": torch.float32}
DELTA = -37


def filled_cache(c: Case, dtype: torch.dtype, seed=0, device="cpu"):
    """A cache whose every slot holds a key written (reference path) at a random position; V unused."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(c.s, c.h, c.d, generator=g)
    pos = torch.stack(
        [torch.randint(40, 400, (c.s,), generator=g), torch.randint(0, 22, (c.s,), generator=g), torch.randint(0, 34, (c.s,), generator=g)],
        1,
    )
    kc = apply_rope_ref(k, pos, c.rope_dims).to(dtype)
    slots = torch.randperm(c.s, generator=g)[: c.m]
    # Poison everything that must not be touched.
    keep = torch.ones(c.s, dtype=torch.bool)
    keep[slots] = False
    kc[keep] = poison_cache((1, c.h, c.d), dtype)
    return kc.to(device), slots.to(device)


def run_rotate(c: Case, dtype, backend: str, device="cpu"):
    kc, slots = filled_cache(c, dtype, device=device)
    before = kc.clone()
    delta_rotate(kc, slots, DELTA, rope_dims=c.rope_dims, backend=backend)
    assert_only_rows_changed(before, kc, slots, what=f"{backend} k_cache")
    cpu_slots = slots.cpu()
    old, new = before.cpu()[cpu_slots][..., : c.rope_dims[0]], kc.cpu()[cpu_slots][..., : c.rope_dims[0]]
    unchanged = (old == new).reshape(c.m, -1).all(dim=1)
    assert not unchanged.any(), f"{backend}: {int(unchanged.sum())} target slots were not rotated"
    return kc, slots


@needs_triton_cpu
@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES.values(), ids=CACHE_DTYPES.keys())
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_triton_matches_reference(case, cache_dtype):
    kc, slots = run_rotate(case, cache_dtype, "triton")
    kc_r, _ = run_rotate(case, cache_dtype, "torch")
    got, want = kc[slots], kc_r[slots]
    ulp = 2.0**-23 if cache_dtype == torch.float32 else 2.0**-8
    assert_close(got, want, rel_rms=max(1e-6, ulp), max_abs=4 * ulp * want.float().abs().max().item(),
                 what=f"delta_rotate {case}")


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
    kc = poison_cache((c.s, c.h, c.d), dtype)
    kc[slots] = apply_rope_ref(k, pos, c.rope_dims).to(dtype)
    delta_rotate(kc, slots, DELTA, rope_dims=c.rope_dims, backend=backend)
    return kc[slots].float(), k, pos


BACKENDS = [pytest.param("torch", id="torch"), pytest.param("triton", id="triton", marks=needs_triton_cpu)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
class TestPositionResetIdentity:
    """rotate(-Δ) of keys written at t equals keys written at t - Δ."""

    def test_float_cache_to_float_rounding(self, case, backend):
        reset, k, pos = write_then_reset(case, torch.float32, backend)
        direct = apply_rope_ref(k, pos + torch.tensor([DELTA, 0, 0]), case.rope_dims)
        # Angles are float32 products: t*f, DELTA*f and (t+DELTA)*f each carry <= 2**-24 relative
        # error, so the rotations differ by at most ~3 (|t| + |DELTA|) 2**-24 radians per pair.
        ang_err = 3 * (pos[:, 0].abs().max().item() + abs(DELTA)) * 2.0**-24
        bound = 2 * k.abs().max().item() * (ang_err + 4 * 2.0**-23)
        assert_close(reset, direct, rel_rms=1e-5, max_abs=bound, what=f"{backend} float reset vs direct write")

    def test_bf16_cache_within_two_roundings(self, case, backend):
        reset, k, pos = write_then_reset(case, torch.bfloat16, backend)
        exact = apply_rope_ref(k, pos + torch.tensor([DELTA, 0, 0]), case.rope_dims).double()
        # Two bf16 roundings (at write, at the reset), each <= 2**-8 relative (unit roundoff of 8 significant
        # bits); the first is rotated within its pair, so it is bounded by 2**-8 of the pair's norm.
        pair_norm = exact.reshape(*exact.shape[:-1], -1, 2).norm(dim=-1).repeat_interleave(2, dim=-1)
        bound = 2.0**-8 * (pair_norm + exact.abs()) * 1.07
        excess = ((reset.double() - exact).abs() - bound).max().item()
        assert excess <= 0, f"{backend}: reset keys exceed the two-rounding bf16 bound by {excess:.3e}"
        assert_close(reset, exact, rel_rms=4e-3, max_abs=float("inf"), what=f"{backend} bf16 reset vs exact rope(t-Δ)")


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
            ({"k_cache": torch.zeros(13, 3, 24, dtype=torch.float64)}, TypeError, "k_cache dtype must be one of"),
            ({"rope_dims": (10, 8, 8)}, ValueError, "must sum to head_dim D=24"),
        ],
    )
    @pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_triton_cpu)])
    def test_rejected_with_named_field(self, override, error, message, backend):
        c = CASES["odd"]
        kc, slots = filled_cache(c, torch.bfloat16)
        args = dict(k_cache=kc, slots=slots, delta_t=DELTA, rope_dims=c.rope_dims)
        args.update(override)
        before = kc.clone()
        with pytest.raises(error, match=message):
            delta_rotate(**args, backend=backend)
        assert torch.equal(before.view(torch.int16), kc.view(torch.int16)), "a rejected call changed k_cache"


def test_reference_twin_is_what_auto_runs_on_cpu():
    c = CASES["odd"]
    a, slots = filled_cache(c, torch.bfloat16)
    b, _ = filled_cache(c, torch.bfloat16)
    delta_rotate(a, slots, DELTA, rope_dims=c.rope_dims)
    delta_rotate_ref(b, slots, DELTA, rope_dims=c.rope_dims)
    assert torch.equal(a.view(torch.int16), b.view(torch.int16)), "auto on a CPU must run the twin"


GPU_CASE = Case(m=5788 - 757, h=16, d=128, s=5788, rope_dims=(44, 42, 42))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
def test_gpu_57b_cache_matches_reference(cache_dtype):
    kc, slots = (t.cpu() for t in run_rotate(GPU_CASE, cache_dtype, "triton", device="cuda"))
    kc_r, _ = (t.cpu() for t in run_rotate(GPU_CASE, cache_dtype, "torch", device="cuda"))
    ulp = 2.0**-23 if cache_dtype == torch.float32 else 2.0**-8
    assert_close(kc[slots], kc_r[slots], rel_rms=max(1e-6, ulp), max_abs=4 * ulp * kc_r[slots].float().abs().max().item(),
                 what=f"57b {cache_dtype} delta_rotate")
