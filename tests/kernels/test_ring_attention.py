"""Attention over the bf16 ring: the image backend (torch SDPA, split-KV) vs the float32 reference, bad input.

On CPU torch's SDPA runs on odd shapes (N=37 queries, S=90 slots, H=3, D=16/32; q a non-contiguous slice of a
fused QKV output; K/V slices of a fused KV buffer), random valid masks including a fully masked middle block and
an invalid leading block, bf16 queries over a bf16 ring, and a long case (300 queries over 200 slots). GPU tests
(marked ``gpu``) run cuDNN/flash SDPA at the 57b per-rank shape: 757 queries, 5,788 slots, 16 heads × 128.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
from kernel_compare import assert_close, needs_cuda
from vivant.kernels.ring_attention import ring_attention, ring_attention_ref

BLOCK = 32


@dataclass(frozen=True)
class Case:
    n: int
    s: int
    h: int
    d: int
    mask: str = "random"  # "all" | "random" | "hole" (a whole middle block invalid) | "lead" (first block invalid)
    dtype: torch.dtype = torch.float32  # of q and the ring
    fused: bool = True  # q sliced from a fused [N, 3, H, D] QKV output; K/V from a fused [S, 2, ...] buffer


CASES = {
    "odd_d16_hole": Case(n=37, s=90, h=3, d=16, mask="hole"),
    "odd_d32_lead": Case(n=37, s=90, h=3, d=32, mask="lead"),
    "odd_d32_all_valid": Case(n=37, s=90, h=3, d=32, mask="all"),
    "bf16_random": Case(n=37, s=90, h=3, d=16, dtype=torch.bfloat16),
    "long": Case(n=300, s=200, h=2, d=16, mask="hole", fused=False),
}


def valid_mask(c: Case, g: torch.Generator) -> torch.Tensor:
    valid = torch.rand(c.s, generator=g) < 0.6
    if c.mask == "all":
        valid[:] = True
    elif c.mask == "hole":
        valid[BLOCK:2 * BLOCK] = False
    elif c.mask == "lead":
        valid[:BLOCK] = False
    valid[-1] = True  # at least one attendable slot per query (otherwise the reference is NaN)
    return valid


def make_inputs(c: Case, seed: int, device="cpu"):
    """q [N, H, D]; the ring's K/V rows over magnitudes 1e-2..1e1; valid [S] bool."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(c.n, 3, c.h, c.d, generator=g)[:, 0] if c.fused else torch.randn(c.n, c.h, c.d, generator=g)
    q = (2.0 * q).to(c.dtype)
    mag = torch.logspace(-2, 1, c.s)[torch.randperm(c.s, generator=g)][:, None, None, None]
    kv = (torch.randn(c.s, 2, c.h, c.d, generator=g) * mag).to(c.dtype)
    k, v = (kv[:, 0], kv[:, 1]) if c.fused else (kv[:, 0].contiguous(), kv[:, 1].contiguous())
    valid = valid_mask(c, g)
    return tuple(t.to(device) for t in (q, k, v, valid))


def tolerance(dtype: torch.dtype) -> float:
    return 1e-5 if dtype == torch.float32 else 2e-2  # bf16: SDPA's math and output rounding in bf16


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
class TestBackendsMatchReference:
    def test_image(self, case):
        q, k, v, valid = make_inputs(case, seed=2)
        got = ring_attention(q, k, v, valid, backend="image", all_valid=bool(valid.all()))
        want = ring_attention_ref(q, k, v, valid)
        tol = tolerance(case.dtype)
        assert got.dtype == case.dtype, f"output dtype {got.dtype}, q dtype {case.dtype}"
        assert_close(got, want, rel_rms=tol, max_abs=4 * tol * want.abs().max().item(), what=f"image {case}")

    def test_torch_backend_is_the_reference_in_q_dtype(self, case):
        q, k, v, valid = make_inputs(case, seed=3)
        got = ring_attention(q, k, v, valid, backend="torch")
        want = ring_attention_ref(q, k, v, valid).to(case.dtype)
        assert got.dtype == case.dtype and torch.equal(got, want), "backend='torch' != reference"


@pytest.mark.parametrize("splits", [2, 3])
def test_image_split_kv_matches_reference(splits):
    c = Case(n=37, s=90, h=3, d=16, mask="all", fused=False)
    q, k, v, valid = make_inputs(c, seed=4)
    got = ring_attention(q, k, v, valid, backend="image", all_valid=True, kv_splits=splits)
    want = ring_attention_ref(q, k, v, valid)
    assert_close(got, want, rel_rms=1e-5, max_abs=1e-4 * want.abs().max().item(), what=f"split-KV {splits} parts")


def test_custom_sm_scale():
    c = CASES["odd_d16_hole"]
    q, k, v, valid = make_inputs(c, seed=4)
    got = ring_attention(q, k, v, valid, sm_scale=0.05, backend="image")
    want = ring_attention_ref(q, k, v, valid, sm_scale=0.05)
    default = ring_attention_ref(q, k, v, valid)
    assert_close(got, want, rel_rms=1e-5, max_abs=1e-4 * want.abs().max().item(), what="image sm_scale=0.05")
    assert (want - default).abs().max() > 1e-3, "sm_scale had no effect on the reference (test is vacuous)"


class TestReferenceMath:
    def test_matches_float64_masked_softmax(self):
        c = CASES["odd_d16_hole"]
        q, k, v, valid = make_inputs(c, seed=5)
        want = torch.empty(c.n, c.h, c.d, dtype=torch.float64)
        idx = valid.nonzero().flatten()
        for h in range(c.h):
            logits = q[:, h].double() @ k[idx, h].double().t() / math.sqrt(c.d)
            want[:, h] = torch.softmax(logits, dim=-1) @ v[idx, h].double()
        got = ring_attention_ref(q, k, v, valid)
        assert_close(got, want, rel_rms=1e-6, max_abs=1e-5 * want.abs().max().item(), what="reference vs float64")

    @pytest.mark.parametrize("backend", ["image", "torch"])
    def test_invalid_slots_have_no_influence(self, backend):
        """Whatever (finite) garbage sits in invalid slots, the output does not change."""
        c = CASES["odd_d32_lead"]
        q, k, v, valid = make_inputs(c, seed=6)
        base = ring_attention(q, k, v, valid, backend=backend)
        k2, v2 = k.clone(), v.clone()
        k2[~valid], v2[~valid] = 448.0, -448.0
        got = ring_attention(q, k2, v2, valid, backend=backend)
        assert_close(got, base, rel_rms=0.0, max_abs=0.0, what=f"{backend}: output changed with invalid-slot contents")


def _good():
    return make_inputs(Case(n=5, s=20, h=3, d=16, mask="random", fused=False), seed=8)


class TestBadInput:
    @pytest.mark.parametrize(
        ("index", "bad_shape", "message"),
        [
            (1, (20, 2, 16), r"shapes q \(5, 3, 16\), k \(20, 2, 16\), v \(20, 3, 16\) do not fit \[S, 3, 16\]"),
            (1, (20, 3, 32), r"k \(20, 3, 32\).* do not fit \[S, 3, 16\]"),
            (2, (19, 3, 16), r"v \(19, 3, 16\)"),
            (3, (19,), r"valid must have shape \(20,\), got \(19,\)"),
        ],
        ids=["k_heads", "k_head_dim", "v_slots", "valid"],
    )
    @pytest.mark.parametrize("backend", ["image", "torch"])
    def test_wrong_shape_names_the_shapes(self, index, bad_shape, message, backend):
        args = list(_good())
        args[index] = torch.zeros(bad_shape).to(args[index].dtype)
        with pytest.raises(ValueError, match=message):
            ring_attention(*args, backend=backend)

    def test_unknown_backend(self):
        with pytest.raises(ValueError, match=r"backend must be one of \('image', 'torch'\), got 'sdpa'"):
            ring_attention(*_good(), backend="sdpa")

    def test_image_needs_the_ring_in_q_dtype(self):
        q, k, v, valid = _good()
        with pytest.raises(ValueError, match="reads the ring in q's dtype torch.float32, got k torch.bfloat16"):
            ring_attention(q, k.bfloat16(), v.bfloat16(), valid, backend="image")


N_57B, S_57B, H_57B, D_57B = 757, 5788, 16, 128
SINKS_57B = 489


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("mask", ["all", "partial"])
def test_gpu_57b_matches_reference(mask, monkeypatch):
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)  # the reference stays float32
    g = torch.Generator(device="cuda").manual_seed(10)
    q, k, v = (torch.randn(n, H_57B, D_57B, generator=g, device="cuda").to(torch.bfloat16) for n in (N_57B, S_57B, S_57B))
    valid = torch.ones(S_57B, dtype=torch.bool, device="cuda")
    if mask == "partial":  # ring filling up: sinks + 3 of 7 chunks written, plus a few holes
        valid[SINKS_57B + 3 * N_57B:] = False
        valid[torch.randperm(SINKS_57B, generator=g, device="cuda")[:40]] = False
    got = ring_attention(2.0 * q, k, v, valid, backend="image", all_valid=(mask == "all"))
    want = ring_attention_ref(2.0 * q, k, v, valid)
    assert got.dtype == torch.bfloat16 and got.shape == (N_57B, H_57B, D_57B), f"{got.dtype} {tuple(got.shape)}"
    assert_close(got, want, rel_rms=2e-2, max_abs=0.1 * want.abs().max().item(),
                 what=f"image 57b N=757 S=5788 H=16 D=128 mask={mask}")
