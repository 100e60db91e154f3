"""Ring KV-cache write: Triton kernel vs its float32 torch twin, the twin vs the math, bad input.

On CPU the Triton kernel runs in Triton's interpreter (TRITON_INTERPRET=1) on small shapes: odd
(D=24, H=3, N=7, strided views of a fused QKV output, slots out of order, S=13), a model head
(D=128 with the 57b rope_dims, bfloat16 inputs) and long (N=300). Destinations are poisoned with
NaN first; only the target slots may change and every target slot must be written. The GPU tests
(marked ``gpu``) repeat this at the 57b per-rank shapes with the compiled kernel.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import pytest
import torch
import vivant.kernels.backend as backend_mod
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
from vivant.kernels.fp8 import dequantize_rows
from vivant.kernels.rope import apply_rope_ref


@dataclass(frozen=True)
class Case:
    n: int
    h: int
    d: int
    s: int
    rope_dims: tuple[int, int, int]
    token_dtype: torch.dtype = torch.float32
    layout: str = "fused_qkv"  # "fused_qkv" | "heads_major" | "contiguous"
    pos_dtype: torch.dtype = torch.int64


CASES = {
    "odd": Case(n=7, h=3, d=24, s=13, rope_dims=(8, 8, 8), pos_dtype=torch.int32),
    "model_head_bf16": Case(n=40, h=4, d=128, s=101, rope_dims=(44, 42, 42), token_dtype=torch.bfloat16),
    "long": Case(n=300, h=2, d=16, s=517, rope_dims=(4, 6, 6), layout="heads_major"),
}
CACHE_DTYPES = {"fp8": FP8, "f32": torch.float32, "bf16": torch.bfloat16}


def make_inputs(c: Case, seed: int = 0, device="cpu"):
    """K/V as the model produces them (views of a fused QKV output, or head-major), ring slots, positions."""
    g = torch.Generator().manual_seed(seed)
    if c.layout == "fused_qkv":
        qkv = torch.randn(c.n, 3, c.h, c.d, generator=g).to(device=device, dtype=c.token_dtype)
        k, v = qkv[:, 1], qkv[:, 2]
        assert not k.is_contiguous()
    elif c.layout == "heads_major":
        k = torch.randn(c.h, c.n, c.d, generator=g).to(device=device, dtype=c.token_dtype).transpose(0, 1)
        v = (3.0 * torch.randn(c.h, c.n, c.d, generator=g)).to(device=device, dtype=c.token_dtype).transpose(0, 1)
    else:
        k = torch.randn(c.n, c.h, c.d, generator=g).to(device=device, dtype=c.token_dtype)
        v = torch.randn(c.n, c.h, c.d, generator=g).to(device=device, dtype=c.token_dtype)
    t = torch.randint(0, 500, (c.n, 1), generator=g)
    hw = torch.stack([torch.randint(0, 22, (c.n,), generator=g), torch.randint(0, 34, (c.n,), generator=g)], 1)
    pos = torch.cat([t, hw], 1).to(c.pos_dtype)
    slots = torch.randperm(c.s, generator=g)[: c.n]
    return k, v, pos.to(device), slots.to(device)


def empty_cache(c: Case, dtype: torch.dtype, device="cpu"):
    kc = poison_cache((c.s, c.h, c.d), dtype, device)
    vc = poison_cache((c.s, c.h, c.d), dtype, device)
    ks = torch.full((c.s, c.h), float("nan"), device=device)
    vs = torch.full((c.s, c.h), float("nan"), device=device)
    return kc, vc, ks, vs


def run_write(c: Case, cache_dtype, backend: str, seed=0, device="cpu"):
    k, v, pos, slots = make_inputs(c, seed, device)
    cache = empty_cache(c, cache_dtype, device)
    before = tuple(t.clone() for t in cache)
    write_kv(k, v, pos, slots, *cache, rope_dims=c.rope_dims, backend=backend)
    for name, b, a in zip(("k_cache", "v_cache", "k_scale", "v_scale"), before, cache, strict=True):
        assert_only_rows_changed(b, a, slots, what=f"{backend} {name}")
    return cache, slots


def compare_caches(got, want, slots, cache_dtype, *, k_ulp_fraction: float, what: str) -> None:
    """Compare the target slots of two written caches (K may differ in trig's last bit, V must not)."""
    # Rows are gathered on the CPU (advanced indexing of float8 tensors is not on every device).
    kc, vc, ks, vs = (t.cpu()[slots.cpu()] for t in got)
    kc_r, vc_r, ks_r, vs_r = (t.cpu()[slots.cpu()] for t in want)
    if cache_dtype == FP8:
        assert_fp8_rows_match(kc, ks, kc_r, ks_r, max_ulp_fraction=k_ulp_fraction, what=f"{what} K")
        assert_fp8_rows_match(vc, vs, vc_r, vs_r, max_ulp_fraction=0.0, what=f"{what} V")
    else:
        # float caches: K within a few float32 ulps of the reference before the cast (so at most one
        # ulp of the cache dtype after it); V is a pure cast and must match bitwise.
        ulp = 2.0**-23 if cache_dtype == torch.float32 else 2.0**-8
        assert_close(kc, kc_r, rel_rms=max(1e-6, ulp), max_abs=4 * ulp * kc_r.float().abs().max().item(), what=f"{what} K")
        assert torch.equal(vc, vc_r), f"{what} V: pure cast differs, max abs {(vc.float() - vc_r.float()).abs().max():.3e}"
        assert torch.all(ks == 1) and torch.all(vs == 1), f"{what}: float cache scales must be 1.0"


@needs_triton_cpu
@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES.values(), ids=CACHE_DTYPES.keys())
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_triton_matches_reference(case, cache_dtype):
    got, slots = run_write(case, cache_dtype, "triton")
    want, _ = run_write(case, cache_dtype, "torch")
    compare_caches(got, want, slots, cache_dtype, k_ulp_fraction=2e-3, what=f"write_kv {case}")


@needs_triton_cpu
@pytest.mark.parametrize("cache_dtype", [FP8, torch.float32], ids=["fp8", "f32"])
def test_ring_overwrite_touches_only_the_new_chunks_slots(cache_dtype):
    """Two chunks in a small ring: the second reuses some of the first's slots (wrap-around)."""
    c = CASES["odd"]
    results = []
    for backend in ("triton", "torch"):
        cache = empty_cache(c, cache_dtype)
        k, v, pos, slots = make_inputs(c, seed=1)
        write_kv(k, v, pos, slots, *cache, rope_dims=c.rope_dims, backend=backend)
        k2, v2, pos2, _ = make_inputs(c, seed=2)
        slots2 = torch.cat([slots[:3], torch.tensor([s for s in range(c.s) if s not in slots.tolist()][:4])])
        before = tuple(t.clone() for t in cache)
        write_kv(k2, v2, pos2, slots2, *cache, rope_dims=c.rope_dims, backend=backend)
        for b, a in zip(before, cache, strict=True):
            assert_only_rows_changed(b, a, slots2, what=f"{backend} second chunk")
        results.append(cache)
    written = torch.cat([slots, slots2]).unique()
    compare_caches(results[0], results[1], written, cache_dtype, k_ulp_fraction=2e-3, what="ring overwrite")


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the interpreter's numpy inf/inf
@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_triton_cpu)])
def test_non_finite_input_rows_stay_non_finite_and_contained(backend):
    """A NaN in a K row or an inf in a V row poisons that row (scale and values), never a neighbour."""
    c = CASES["odd"]
    k, v, pos, slots = make_inputs(c)
    k, v = k.clone(), v.clone()
    k[2, 1, 5] = float("nan")
    v[4, 0, 0] = float("inf")
    cache = empty_cache(c, FP8)
    write_kv(k, v, pos, slots, *cache, rope_dims=c.rope_dims, backend=backend)
    kc, vc, ks, vs = (t[slots] for t in cache)
    deq_k, deq_v = dequantize_rows(kc, ks), dequantize_rows(vc, vs)
    assert ks[2, 1].isnan() and deq_k[2, 1].isnan().all(), f"{backend}: NaN K row came out {deq_k[2, 1].tolist()}"
    assert not deq_v[4, 0].isfinite().any(), f"{backend}: inf V row came out {deq_v[4, 0].tolist()}"
    finite_k = torch.ones(c.n, c.h, dtype=torch.bool)
    finite_k[2, 1] = False
    finite_v = torch.ones(c.n, c.h, dtype=torch.bool)
    finite_v[4, 0] = False
    assert deq_k[finite_k].isfinite().all() and deq_v[finite_v].isfinite().all(), f"{backend}: a non-finite value leaked"


class TestReferenceMath:
    """The torch twin against the math it stands for (so the kernels are compared with something right)."""

    def test_float32_cache_holds_rope_of_k_and_v_exactly(self):
        c = CASES["odd"]
        k, v, pos, slots = make_inputs(c)
        kc, vc, ks, vs = empty_cache(c, torch.float32)
        write_kv_ref(k, v, pos, slots, kc, vc, ks, vs, rope_dims=c.rope_dims)
        assert torch.equal(kc[slots], apply_rope_ref(k, pos, c.rope_dims)), "K rows are not rope(k_new, pos)"
        assert torch.equal(vc[slots], v.float()), "V rows are not v_new"

    @pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
    def test_fp8_cache_dequantizes_to_rope_of_k_within_e4m3_error(self, case):
        k, v, pos, slots = make_inputs(case)
        kc, vc, ks, vs = empty_cache(case, FP8)
        write_kv_ref(k, v, pos, slots, kc, vc, ks, vs, rope_dims=case.rope_dims)
        for name, cache, scale, exact in (
            ("K", kc, ks, apply_rope_ref(k, pos, case.rope_dims)),
            ("V", vc, vs, v.float()),
        ):
            deq = dequantize_rows(cache[slots], scale[slots])
            # e4m3: 3 mantissa bits -> |error| <= 2**-4 |x| (normal codes) + half the subnormal quantum.
            bound = 2.0**-4 * exact.abs() + 2.0**-10 * scale[slots].unsqueeze(-1)
            excess = ((deq - exact).abs() - bound).max().item()
            assert excess <= 0, f"{name}: dequantized cache exceeds the e4m3 error bound by {excess:.3e}"
            assert_close(deq, exact, rel_rms=0.04, max_abs=float("inf"), what=f"{name} dequantized vs exact")


class TestBadInput:
    """Rejected calls name the field and what was expected, and leave the cache untouched."""

    def _call(self, backend="torch", **override):
        c = CASES["odd"]
        rope_dims = override.pop("rope_dims", c.rope_dims)
        k, v, pos, slots = make_inputs(c)
        kc, vc, ks, vs = empty_cache(c, FP8)
        args = dict(k_new=k, v_new=v, pos=pos, slots=slots, k_cache=kc, v_cache=vc, k_scale=ks, v_scale=vs)
        args.update(override)
        before = [t.clone() for t in (kc, vc, ks, vs)]
        try:
            write_kv(**args, rope_dims=rope_dims, backend=backend)
        finally:
            for b, a in zip(before, (kc, vc, ks, vs), strict=True):
                assert torch.equal(b.view(torch.uint8), a.view(torch.uint8)), "a rejected call changed the cache"

    @pytest.mark.parametrize(
        "override, error, message",
        [
            ({"slots": torch.tensor([0, 1, 2, 3, 4, 5, 5])}, ValueError, "slots must be distinct"),
            ({"slots": torch.tensor([0, 1, 2, 3, 4, 5, 13])}, ValueError, r"slots must lie in \[0, S=13\)"),
            ({"slots": torch.arange(7, dtype=torch.int32)}, TypeError, "slots must be int64"),
            ({"slots": torch.arange(6)}, ValueError, r"slots must have shape \[7\]"),
            ({"v_new": torch.zeros(7, 3, 22)}, ValueError, "v_new must have k_new's shape"),
            ({"k_scale": torch.ones(13, 3, dtype=torch.float16)}, TypeError, "k_scale must be float32"),
            ({"v_scale": torch.ones(13, 2)}, ValueError, r"v_scale must have shape \[S, H\] = \(13, 3\)"),
            ({"pos": torch.zeros(7, 2, dtype=torch.int64)}, ValueError, r"pos must have shape \[N=7, 3\]"),
            ({"pos": torch.zeros(7, 3)}, TypeError, "pos must be int32 or int64"),
            ({"k_new": torch.zeros(7, 3, 24, dtype=torch.float64)}, TypeError, "k_new dtype must be one of"),
            ({"rope_dims": (8, 8, 6)}, ValueError, "must sum to head_dim D=24"),
        ],
    )
    def test_rejected_with_named_field(self, override, error, message):
        with pytest.raises(error, match=message):
            self._call(**override)

    def test_cache_head_mismatch(self):
        c = CASES["odd"]
        kc, vc, ks, vs = empty_cache(Case(n=7, h=2, d=24, s=13, rope_dims=(8, 8, 8)), FP8)
        with pytest.raises(ValueError, match=r"k_cache must have shape \[S, H=3, D=24\]"):
            self._call(k_cache=kc, v_cache=vc, k_scale=ks, v_scale=vs)
        assert c.h == 3

    def test_mixed_cache_dtypes(self):
        c = CASES["odd"]
        with pytest.raises(TypeError, match="v_cache dtype torch.float32 must equal k_cache dtype"):
            self._call(v_cache=torch.zeros(c.s, c.h, c.d))

    def test_unknown_backend(self):
        with pytest.raises(ValueError, match="backend must be one of"):
            self._call(backend="cuda")


class TestBackendChoice:
    def test_auto_on_cpu_uses_torch_and_logs_the_reason_once(self, caplog, monkeypatch):
        monkeypatch.setattr(backend_mod, "_logged", set())
        c = CASES["odd"]
        with caplog.at_level(logging.INFO, logger="vivant.kernels.backend"):
            for _ in range(2):
                k, v, pos, slots = make_inputs(c)
                cache = empty_cache(c, FP8)
                write_kv(k, v, pos, slots, *cache, rope_dims=c.rope_dims)
        reasons = [r.getMessage() for r in caplog.records if "write_kv" in r.getMessage()]
        assert reasons == ["write_kv: using the torch reference, not Triton: tensors are on cpu, not CUDA"], reasons
        ref = empty_cache(c, FP8)
        write_kv_ref(k, v, pos, slots, *ref, rope_dims=c.rope_dims)
        assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(cache, ref, strict=True))

    def test_forced_triton_on_cpu_without_interpreter_is_an_error(self, monkeypatch):
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        c = CASES["odd"]
        k, v, pos, slots = make_inputs(c)
        with pytest.raises(RuntimeError, match="needs CUDA tensors or TRITON_INTERPRET=1"):
            write_kv(k, v, pos, slots, *empty_cache(c, FP8), rope_dims=c.rope_dims, backend="triton")


# The 57b per-rank shapes (docs/ARCHITECTURE.md): 757 new tokens, 16 heads x 128, 5,788 cache slots.
GPU_CASE = Case(n=757, h=16, d=128, s=5788, rope_dims=(44, 42, 42), token_dtype=torch.bfloat16)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("cache_dtype", [FP8, torch.float32, torch.bfloat16], ids=["fp8", "f32", "bf16"])
def test_gpu_57b_shapes_match_reference(cache_dtype):
    got, slots = run_write(GPU_CASE, cache_dtype, "triton", device="cuda")
    want, _ = run_write(GPU_CASE, cache_dtype, "torch", device="cuda")
    # V is bitwise (same division, same rounding); K may differ by one e4m3 ulp where the GPU's
    # cos/sin or a fused multiply-add moves a value across a rounding midpoint.
    compare_caches(got, want, slots, cache_dtype, k_ulp_fraction=1e-3, what="write_kv 57b")
    if cache_dtype == FP8:
        assert torch.equal(got[1].view(torch.uint8), want[1].view(torch.uint8)), "V cache not bitwise equal"
        assert torch.equal(got[3][slots], want[3][slots]), "V scales not bitwise equal"
