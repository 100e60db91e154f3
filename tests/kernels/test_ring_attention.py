"""Attention over the FP8 ring KV cache: Triton and SDPA backends vs the float32 reference, bad input.

On CPU the Triton kernel runs in Triton's interpreter (TRITON_INTERPRET=1; it then multiplies in
float32, because the interpreter's bf16 dots are wrong in Triton 3.6) with 32×32 tiles, on odd shapes
(N=37 queries, S=90 slots, H=3, D=16/32; q a non-contiguous slice of a fused QKV output; K/V/scales
slices of a fused KV buffer), random valid masks including a fully masked middle block and an invalid
leading block, bfloat16 queries, and a long case (300 queries over 200 slots). ``torch.empty`` is
poisoned with NaN while the launcher runs, so an output row the kernel skips shows. The SDPA backend
(CPU torch SDPA here) is checked against the same reference. GPU tests (marked ``gpu``) run the
compiled kernel and cuDNN/flash SDPA at the 57b per-rank shape: 757 queries, 5,788 slots, 16 heads×128.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
from kernel_compare import assert_close, needs_cuda, needs_triton_cpu
from vivant.kernels.fp8 import quantize_rows_ref
from vivant.kernels.ring_attention import ring_attention, ring_attention_ref

# Triton's interpreter converts a 1-element array to a scalar in the kernel's loop bound (NumPy deprecation).
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")

CPU_BLOCK = 32  # the interpreter's BLOCK_N (ring_attention._pick_config on CPU)


@dataclass(frozen=True)
class Case:
    n: int
    s: int
    h: int
    d: int
    mask: str = "random"  # "all" | "random" | "hole" (a whole middle block invalid) | "lead" (first block invalid)
    q_dtype: torch.dtype = torch.float32
    fused: bool = True  # q sliced from a fused [N, 3, H, D] QKV output; K/V/scales from fused [S, 2, ...] buffers


CASES = {
    "odd_d16_hole": Case(n=37, s=90, h=3, d=16, mask="hole"),
    "odd_d32_lead": Case(n=37, s=90, h=3, d=32, mask="lead"),
    "odd_d32_all_valid": Case(n=37, s=90, h=3, d=32, mask="all"),
    "bf16_q_random": Case(n=37, s=90, h=3, d=16, q_dtype=torch.bfloat16),
    "long": Case(n=300, s=200, h=2, d=16, mask="hole", fused=False),
}


def valid_mask(c: Case, g: torch.Generator) -> torch.Tensor:
    valid = torch.rand(c.s, generator=g) < 0.6
    if c.mask == "all":
        valid[:] = True
    elif c.mask == "hole":
        valid[CPU_BLOCK:2 * CPU_BLOCK] = False
    elif c.mask == "lead":
        valid[:CPU_BLOCK] = False
    valid[-1] = True  # at least one attendable slot per query (otherwise the reference is NaN)
    return valid


def make_inputs(c: Case, seed: int, device="cpu"):
    """q [N, H, D]; K/V FP8 rows with per-(slot, head) scales over 1e-2..1e1; valid [S] bool."""
    g = torch.Generator().manual_seed(seed)
    if c.fused:
        q = torch.randn(c.n, 3, c.h, c.d, generator=g)[:, 0]
        assert not q.is_contiguous()
    else:
        q = torch.randn(c.n, c.h, c.d, generator=g)
    q = (2.0 * q).to(c.q_dtype)
    mag = torch.logspace(-2, 1, c.s)[torch.randperm(c.s, generator=g)][:, None, None, None]
    kv = torch.randn(c.s, 2, c.h, c.d, generator=g) * mag
    codes, scales = quantize_rows_ref(kv)  # [S, 2, H, D], [S, 2, H]
    if c.fused:
        k, v, ks, vs = codes[:, 0], codes[:, 1], scales[:, 0], scales[:, 1]
    else:
        k, v, ks, vs = (t.contiguous() for t in (codes[:, 0], codes[:, 1], scales[:, 0], scales[:, 1]))
    valid = valid_mask(c, g)
    return tuple(t.to(device) for t in (q, k, v, ks, vs, valid))


@pytest.fixture
def poisoned_outputs(monkeypatch):
    """While active, ``torch.empty`` hands out NaN-filled floating-point memory."""
    real_empty = torch.empty

    def empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        if t.is_floating_point() and t.element_size() > 1:
            t.fill_(float("nan"))
        return t

    monkeypatch.setattr(torch, "empty", empty)  # monkeypatch restores the real one after the test


def tolerance(backend: str, q_dtype: torch.dtype) -> float:
    if q_dtype == torch.float32:
        return 1e-5  # float32 end to end; only the summation order differs
    # bf16 output rounding (2**-9 relative); SDPA also dequantizes K/V and runs its math in bf16
    return 5e-3 if backend == "triton" else 2e-2


# ---- backends vs the reference --------------------------------------------------------------------------
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
class TestBackendsMatchReference:
    @needs_triton_cpu
    @pytest.mark.usefixtures("poisoned_outputs")
    def test_triton(self, case):
        q, k, v, ks, vs, valid = make_inputs(case, seed=1)
        got = ring_attention(q, k, v, ks, vs, valid, backend="triton")
        want = ring_attention_ref(q, k, v, ks, vs, valid)
        assert got.dtype == case.q_dtype, f"output dtype {got.dtype}, q dtype {case.q_dtype}"
        tol = tolerance("triton", case.q_dtype)
        assert_close(got, want, rel_rms=tol, max_abs=4 * tol * want.abs().max().item(), what=f"triton {case}")

    def test_sdpa(self, case):
        q, k, v, ks, vs, valid = make_inputs(case, seed=2)
        got = ring_attention(q, k, v, ks, vs, valid, backend="sdpa", all_valid=bool(valid.all()))
        want = ring_attention_ref(q, k, v, ks, vs, valid)
        tol = tolerance("sdpa", case.q_dtype)
        assert_close(got, want, rel_rms=tol, max_abs=4 * tol * want.abs().max().item(), what=f"sdpa {case}")

    def test_torch_backend_is_the_reference_in_q_dtype(self, case):
        q, k, v, ks, vs, valid = make_inputs(case, seed=3)
        got = ring_attention(q, k, v, ks, vs, valid, backend="torch")
        want = ring_attention_ref(q, k, v, ks, vs, valid).to(case.q_dtype)
        assert got.dtype == case.q_dtype and torch.equal(got, want), "backend='torch' != reference"


@needs_triton_cpu
def test_triton_custom_sm_scale_and_uint8_mask():
    c = CASES["odd_d16_hole"]
    q, k, v, ks, vs, valid = make_inputs(c, seed=4)
    got = ring_attention(q, k, v, ks, vs, valid.to(torch.uint8), sm_scale=0.05, backend="triton")
    want = ring_attention_ref(q, k, v, ks, vs, valid, sm_scale=0.05)
    default = ring_attention_ref(q, k, v, ks, vs, valid)
    assert_close(got, want, rel_rms=1e-5, max_abs=1e-4 * want.abs().max().item(), what="triton sm_scale=0.05")
    assert (want - default).abs().max() > 1e-3, "sm_scale had no effect on the reference (test is vacuous)"


# ---- the reference vs the math ----------------------------------------------------------------------------
class TestReferenceMath:
    def test_matches_float64_masked_softmax(self):
        c = CASES["odd_d16_hole"]
        q, k, v, ks, vs, valid = make_inputs(c, seed=5)
        kd = k.double() * ks.double()[..., None]
        vd = v.double() * vs.double()[..., None]
        want = torch.empty(c.n, c.h, c.d, dtype=torch.float64)
        idx = valid.nonzero().flatten()
        for h in range(c.h):
            logits = q[:, h].double() @ kd[idx, h].t() / math.sqrt(c.d)
            want[:, h] = torch.softmax(logits, dim=-1) @ vd[idx, h]
        got = ring_attention_ref(q, k, v, ks, vs, valid)
        assert_close(got, want, rel_rms=1e-6, max_abs=1e-5 * want.abs().max().item(), what="reference vs float64")

    @pytest.mark.parametrize("backend", [
        pytest.param("triton", marks=needs_triton_cpu), "sdpa", "torch"])
    def test_invalid_slots_have_no_influence(self, backend):
        """Whatever (finite) garbage sits in invalid slots, the output does not change."""
        c = CASES["odd_d32_lead"]
        q, k, v, ks, vs, valid = make_inputs(c, seed=6)
        base = ring_attention(q, k, v, ks, vs, valid, backend=backend)
        k2, v2, ks2, vs2 = (t.clone() for t in (k, v, ks, vs))
        bad = ~valid
        k2.view(torch.uint8)[bad] = 0x7E  # +448, the largest code
        v2.view(torch.uint8)[bad] = 0xFE  # -448
        ks2[bad], vs2[bad] = 1e3, 1e3
        got = ring_attention(q, k2, v2, ks2, vs2, valid, backend=backend)
        assert_close(got, base, rel_rms=0.0, max_abs=0.0, what=f"{backend}: output changed with invalid-slot contents")


# ---- layouts: v / v_scale laid out differently from k (once a launcher bug: k's strides were used for v) ----
@needs_triton_cpu
@pytest.mark.parametrize("which", ["v", "v_scale"])
def test_triton_v_laid_out_differently_from_k(which):
    c = Case(n=37, s=90, h=3, d=16, mask="random", fused=True)
    q, k, v, ks, vs, valid = make_inputs(c, seed=7)
    k, ks = k.contiguous(), ks.contiguous()  # v / v_scale stay strided views (in bounds of their buffer)
    if which == "v":
        vs = vs.contiguous()
    else:
        v = v.contiguous()
    got = ring_attention(q, k, v, ks, vs, valid, backend="triton")
    want = ring_attention_ref(q, k, v, ks, vs, valid)
    assert_close(got, want, rel_rms=1e-5, max_abs=1e-4 * want.abs().max().item(), what=f"triton, {which} strided")


# ---- bad input ---------------------------------------------------------------------------------------------
def _good():
    return make_inputs(Case(n=5, s=20, h=3, d=16, mask="random", fused=False), seed=8)


class TestBadInput:
    @pytest.mark.parametrize(
        ("index", "bad_shape", "message"),
        [
            (1, (20, 2, 16), r"shapes q \(5, 3, 16\), k \(20, 2, 16\), v \(20, 3, 16\).* do not fit \[S, 3, 16\]"),
            (1, (20, 3, 32), r"k \(20, 3, 32\).* do not fit \[S, 3, 16\]"),
            (2, (19, 3, 16), r"v \(19, 3, 16\)"),
            (3, (20, 2), r"k_scale \(20, 2\)"),
            (4, (20,), r"v_scale \(20,\)"),
            (5, (19,), r"valid must have shape \(20,\), got \(19,\)"),
        ],
        ids=["k_heads", "k_head_dim", "v_slots", "k_scale", "v_scale", "valid"],
    )
    @pytest.mark.parametrize("backend", ["triton", "sdpa", "torch"])
    def test_wrong_shape_names_the_shapes(self, index, bad_shape, message, backend):
        args = list(_good())
        dtype = args[index].dtype
        args[index] = torch.zeros(bad_shape).to(dtype)
        with pytest.raises(ValueError, match=message):
            ring_attention(*args, backend=backend)

    def test_unknown_backend(self):
        with pytest.raises(ValueError, match=r"backend must be one of \('auto', 'triton', 'sdpa', 'image', 'torch'\), got 'flash'"):
            ring_attention(*_good(), backend="flash")

    @needs_triton_cpu
    def test_triton_rejects_head_dim_not_a_power_of_two(self):
        q, k, v, ks, vs, valid = make_inputs(Case(n=5, s=20, h=2, d=24, fused=False), seed=9)
        with pytest.raises(ValueError, match="head_dim 24 must be a power of two"):
            ring_attention(q, k, v, ks, vs, valid, backend="triton")

    def test_forced_triton_on_cpu_without_interpreter_is_an_error(self, monkeypatch):
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        with pytest.raises(RuntimeError, match="needs CUDA tensors or TRITON_INTERPRET=1"):
            ring_attention(*_good(), backend="triton")


# ---- GPU: the 57b per-rank call ----------------------------------------------------------------------------
N_57B, S_57B, H_57B, D_57B = 757, 5788, 16, 128
SINKS_57B = 489


def gpu_inputs(mask: str, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = (2.0 * torch.randn(N_57B, H_57B, D_57B, generator=g, device="cuda")).to(torch.bfloat16)
    k, ks = quantize_rows_ref(torch.randn(S_57B, H_57B, D_57B, generator=g, device="cuda"))
    v, vs = quantize_rows_ref(torch.randn(S_57B, H_57B, D_57B, generator=g, device="cuda"))
    valid = torch.ones(S_57B, dtype=torch.bool, device="cuda")
    if mask == "partial":  # ring filling up: sinks + 3 of 7 chunks written, plus a few holes
        valid[SINKS_57B + 3 * N_57B:] = False
        valid[torch.randperm(SINKS_57B, generator=g, device="cuda")[:40]] = False
    return q, k, v, ks, vs, valid


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("mask", ["all", "partial"])
@pytest.mark.parametrize("backend", ["triton", "sdpa"])
def test_gpu_57b_matches_reference(backend, mask, monkeypatch):
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)  # the reference stays float32
    q, k, v, ks, vs, valid = gpu_inputs(mask, seed=10)
    got = ring_attention(q, k, v, ks, vs, valid, backend=backend, all_valid=(mask == "all"))
    want = ring_attention_ref(q, k, v, ks, vs, valid)
    assert got.dtype == torch.bfloat16 and got.shape == (N_57B, H_57B, D_57B), f"{got.dtype} {tuple(got.shape)}"
    assert_close(got, want, rel_rms=2e-2, max_abs=0.1 * want.abs().max().item(),
                 what=f"{backend} 57b N=757 S=5788 H=16 D=128 mask={mask}")
