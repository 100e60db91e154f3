"""QKV → ring in one kernel (kernels/qkv_ring.py): Triton vs its float32 twin, and vs the three-kernel path.

On CPU the kernel runs in Triton's interpreter (TRITON_INTERPRET=1) on odd shapes (H=3 heads, D=16/32, N=37
tokens scattered into a 90-slot ring; bf16 and float32 QKV; a QKV that is a column slice of a wider buffer)
and a long case. Checked: q_rot (relative RMS / max error), the ring's FP8 codes (at most one e4m3 ulp on a
small fraction: in-kernel and torch float32 arithmetic may differ in the last bit) and scales, the image
(exactly bf16(fp8 · scale) of what the kernel wrote), slots outside `slots` untouched, NaN rows, and bad input
named by field. A bf16 ring (its own read image): the rows are bf16 of the twin's exact rotated k and v, scale 1. The twin is checked against the three kernels it replaces (q/k-norm + RoPE, ring write with
RoPE at the positions, image refresh). GPU tests (marked ``gpu``) run the 57b shape: 757 tokens, 16 heads × 128.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from kernel_compare import FP8, assert_close, assert_fp8_rows_match, needs_cuda, needs_triton_cpu
from vivant.kernels.cache_write import write_kv_ref
from vivant.kernels.qk_norm_rope import qk_norm_rope_ref
from vivant.kernels.qkv_ring import qkv_ring_write, qkv_ring_write_ref
from vivant.kernels.rope import rope_angles


@dataclass(frozen=True)
class Case:
    n: int
    h: int
    d: int
    s: int
    dtype: torch.dtype = torch.bfloat16
    pad: int = 0  # > 0: qkv is the first columns of a wider buffer (row stride > width)


CASES = {
    "odd_h3_d16_bf16": Case(n=37, h=3, d=16, s=90),
    "odd_h3_d32_fp32_strided": Case(n=37, h=3, d=32, s=90, dtype=torch.float32, pad=7),
    "long": Case(n=300, h=2, d=16, s=400),
}
ROPE = {16: (4, 6, 6), 32: (12, 10, 10), 128: (44, 42, 42)}


def make(c: Case, seed: int, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(c.n, 3 * c.h * c.d + c.pad, generator=g) * 3).to(c.dtype)[:, : 3 * c.h * c.d]
    qw = torch.rand(c.d, generator=g) + 0.5
    kw = torch.rand(c.d, generator=g) + 0.5
    pos = torch.stack([torch.randint(0, 40, (c.n,), generator=g), torch.randint(0, 22, (c.n,), generator=g),
                       torch.randint(0, 34, (c.n,), generator=g)], dim=1)
    ang = rope_angles(pos, ROPE[c.d])
    slots = torch.randperm(c.s, generator=g)[: c.n]
    ring = dict(k_cache=torch.full((c.s, c.h, c.d), 0.5).to(FP8), v_cache=torch.full((c.s, c.h, c.d), 0.5).to(FP8),
                k_scale=torch.full((c.s, c.h), 3.0), v_scale=torch.full((c.s, c.h), 3.0),
                k_image=torch.full((c.s, c.h, c.d), 7.0, dtype=torch.bfloat16),
                v_image=torch.full((c.s, c.h, c.d), 7.0, dtype=torch.bfloat16))
    args = [qkv, qw, kw, ang.cos(), ang.sin(), slots]
    return [t.to(device) for t in args], {k: v.to(device) for k, v in ring.items()}, pos.to(device)


def run(fn, args, ring, c, **kw):
    r = {k: (v.clone() if v is not None else None) for k, v in ring.items()}
    q = fn(*args, r["k_cache"], r["v_cache"], r["k_scale"], r["v_scale"], c.h, k_image=r["k_image"],
           v_image=r["v_image"], **kw)
    return q, r


def check_written_rows(got: dict, want: dict, slots: torch.Tensor, what: str) -> None:
    """The k and v rows at `slots`: FP8 codes and scales as the twin's (one e4m3 ulp on a small fraction), and the
    read image exactly bf16(fp8 · scale) of what was written."""
    for x in ("k", "v"):
        assert_fp8_rows_match(got[f"{x}_cache"][slots], got[f"{x}_scale"][slots], want[f"{x}_cache"][slots],
                              want[f"{x}_scale"][slots], max_ulp_fraction=2e-3, what=f"{x} ring rows{what}")
        deq = (got[f"{x}_cache"][slots].float() * got[f"{x}_scale"][slots][..., None]).to(torch.bfloat16)
        assert torch.equal(got[f"{x}_image"][slots], deq), f"{x} image{what} != bf16(fp8 · scale) of the written rows"


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
@needs_triton_cpu
def test_triton_matches_twin(case):
    args, ring, _ = make(case, seed=case.n + case.d)
    q_t, r_t = run(qkv_ring_write, args, ring, case, backend="triton")
    q_r, r_r = run(qkv_ring_write_ref, args, ring, case)
    tol = 1e-5 if case.dtype == torch.float32 else 8e-3
    assert_close(q_t.float(), q_r.float(), rel_rms=tol, max_abs=tol * 8 * q_r.float().abs().max().item(), what="q_rot")
    slots = args[5]
    check_written_rows(r_t, r_r, slots, "")
    for x in ("k", "v"):
        untouched = torch.ones(case.s, dtype=torch.bool)
        untouched[slots] = False
        for part in ("cache", "scale", "image"):
            t = r_t[f"{x}_{part}"][untouched]
            assert torch.equal(t, ring[f"{x}_{part}"][untouched]), f"{x}_{part}: a slot outside `slots` was written"


def bf16_ring(ring: dict) -> dict:
    """The same ring stored in bf16 (no FP8 codes, no separate image)."""
    return {"k_cache": ring["k_image"].clone(), "v_cache": ring["v_image"].clone(), "k_scale": ring["k_scale"].clone(),
            "v_scale": ring["v_scale"].clone(), "k_image": None, "v_image": None}


def exact_rows(args, c: Case) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotated k and the v rows [N, H, D] in float32, before any rounding (the twin's arithmetic)."""
    qkv, qw, kw, cos, sin, _ = args
    r = {"k_cache": torch.zeros(c.s, c.h, c.d), "v_cache": torch.zeros(c.s, c.h, c.d),
         "k_scale": torch.zeros(c.s, c.h), "v_scale": torch.zeros(c.s, c.h), "k_image": None, "v_image": None}
    qkv_ring_write_ref(*args, r["k_cache"], r["v_cache"], r["k_scale"], r["v_scale"], c.h)
    return r["k_cache"][args[5]], r["v_cache"][args[5]]


@pytest.mark.parametrize("case", [CASES["odd_h3_d16_bf16"], CASES["long"]], ids=["odd_h3_d16_bf16", "long"])
@needs_triton_cpu
def test_bf16_ring_holds_the_exact_rows_rounded_once(case):
    args, ring, _ = make(case, seed=case.n + 5)
    ring = bf16_ring(ring)
    q_t, r_t = run(qkv_ring_write, args, ring, case, backend="triton")
    q_r, r_r = run(qkv_ring_write_ref, args, ring, case)
    assert_close(q_t.float(), q_r.float(), rel_rms=8e-3, max_abs=8e-3 * 8 * q_r.float().abs().max().item(),
                 what="q_rot (bf16 ring)")
    slots = args[5]
    k_exact, v_exact = exact_rows(args, case)
    for x, exact in (("k", k_exact), ("v", v_exact)):
        want = exact.to(torch.bfloat16)
        for name, r in (("triton", r_t), ("twin", r_r)):
            got = r[f"{x}_cache"][slots]
            bad = int((got != want).sum())  # the kernel's float32 norm/rotation may differ in the last bit
            assert bad <= 2e-3 * want.numel(), f"{name}: {bad} of {want.numel()} {x} rows differ from bf16(exact)"
            assert_close(got.float(), exact, rel_rms=4e-3, max_abs=0.02 * exact.abs().max().item(),
                         what=f"{name} {x} bf16 ring vs exact")
            assert torch.all(r[f"{x}_scale"][slots] == 1.0), f"{name}: a bf16 ring's written rows must have scale 1"
        untouched = torch.ones(case.s, dtype=torch.bool)
        untouched[slots] = False
        assert torch.equal(r_t[f"{x}_cache"][untouched], ring[f"{x}_cache"][untouched]), f"{x}: a slot outside `slots` was written"


def test_bf16_ring_refuses_a_separate_image():
    c = CASES["odd_h3_d16_bf16"]
    args, ring, _ = make(c, seed=2)
    r = bf16_ring(ring)
    with pytest.raises(ValueError, match="a bf16 ring is its own read image"):
        qkv_ring_write(*args, r["k_cache"], r["v_cache"], r["k_scale"], r["v_scale"], c.h, k_image=ring["k_image"],
                       v_image=ring["v_image"])


def test_twin_equals_the_three_kernel_path():
    """qk_norm_rope + write_kv (RoPE of k at its positions) + dequantization: the same up to k's bf16 hop."""
    c = Case(n=37, h=3, d=32, s=90, dtype=torch.float32)
    args, ring, pos = make(c, seed=9)
    qkv, qw, kw, cos, sin, slots = args
    q_new, r = run(qkv_ring_write_ref, args, ring, c)
    q_old, k_norm = qk_norm_rope_ref(qkv, qw, kw, cos, sin, c.h)
    old = {k: v.clone() for k, v in ring.items()}
    v = qkv.view(c.n, 3, c.h, c.d)[:, 2]
    write_kv_ref(k_norm, v, pos, slots, old["k_cache"], old["v_cache"], old["k_scale"], old["v_scale"],
                 rope_dims=ROPE[c.d])
    assert_close(q_new, q_old, rel_rms=1e-6, max_abs=1e-5, what="q_rot vs qk_norm_rope")
    for x in ("k", "v"):
        assert_fp8_rows_match(r[f"{x}_cache"][slots], r[f"{x}_scale"][slots], old[f"{x}_cache"][slots],
                              old[f"{x}_scale"][slots], max_ulp_fraction=5e-3, what=f"{x} vs write_kv")


@needs_triton_cpu
def test_nan_row_gets_nan_scale_and_others_survive():
    c = CASES["odd_h3_d16_bf16"]
    args, ring, _ = make(c, seed=3)
    args[0] = args[0].clone()
    args[0][5, 2 * c.h * c.d + 3] = float("nan")  # token 5, v head 0
    _, r = run(qkv_ring_write, args, ring, c, backend="triton")
    slot = args[5][5]
    assert torch.isnan(r["v_scale"][slot, 0]), "a v row holding NaN must get a NaN scale"
    assert not torch.isnan(r["v_scale"][slot, 1:]).any() and not torch.isnan(r["k_scale"][slot]).any()


class TestBadInput:
    c = CASES["odd_h3_d16_bf16"]

    @pytest.mark.parametrize("field, change, message", [
        ("qkv", lambda a, r: a.__setitem__(0, a[0][:, :-1]), "qkv must be [N, 3·3·16]"),
        ("cos", lambda a, r: a.__setitem__(3, a[3][:, :4]), "cos/sin must be [37, 8]"),
        ("slots", lambda a, r: a.__setitem__(5, a[5].int()), "slots must be int64"),
        ("slots", lambda a, r: a.__setitem__(5, a[5][:-1]), "slots must have shape [37]"),
        ("slots", lambda a, r: a.__setitem__(5, torch.cat([a[5][:-1], a[5][:1]])), "slots must be distinct"),
        ("slots", lambda a, r: a.__setitem__(5, a[5] + 1000), "slots must lie in [0, S=90)"),
        ("k_cache", lambda a, r: r.__setitem__("k_cache", r["k_cache"].float()), "the ring must be"),
        ("k_scale", lambda a, r: r.__setitem__("k_scale", r["k_scale"][:, :2]), "k_scale must have shape [S, H]"),
        ("v_scale", lambda a, r: r.__setitem__("v_scale", r["v_scale"].double()), "v_scale must be float32"),
        ("v_image", lambda a, r: r.__setitem__("v_image", None), "pass both k_image and v_image"),
        ("k_image", lambda a, r: r.__setitem__("k_image", r["k_image"].float()), "k_image must be contiguous bf16"),
    ])
    def test_rejected_naming_the_field(self, field, change, message):
        args, ring, _ = make(self.c, seed=1)
        change(args, ring)
        before = {k: (v.clone() if v is not None else None) for k, v in ring.items()}
        with pytest.raises((ValueError, TypeError)) as e:
            qkv_ring_write(*args, ring["k_cache"], ring["v_cache"], ring["k_scale"], ring["v_scale"], self.c.h,
                           k_image=ring["k_image"], v_image=ring["v_image"])
        assert message in str(e.value), f"{field}: {e.value!s} lacks {message!r}"
        for k, v in ring.items():
            assert v is None or torch.equal(v.float(), before[k].float()), f"a rejected call wrote into {k}"


@pytest.mark.gpu
@needs_cuda
def test_gpu_57b_matches_twin():
    c = Case(n=757, h=16, d=128, s=5788)
    args, ring, _ = make(c, seed=21, device="cuda")
    q_t, r_t = run(qkv_ring_write, args, ring, c)
    q_r, r_r = run(qkv_ring_write_ref, args, ring, c)
    assert_close(q_t.float(), q_r.float(), rel_rms=8e-3, max_abs=0.1, what="q_rot 57b")
    check_written_rows(r_t, r_r, args[5], " 57b")


@pytest.mark.gpu
@needs_cuda
def test_gpu_57b_bf16_ring_matches_twin():
    c = Case(n=757, h=16, d=128, s=5788)
    args, ring, _ = make(c, seed=22, device="cuda")
    ring = bf16_ring(ring)
    q_t, r_t = run(qkv_ring_write, args, ring, c)
    q_r, r_r = run(qkv_ring_write_ref, args, ring, c)
    assert_close(q_t.float(), q_r.float(), rel_rms=8e-3, max_abs=0.1, what="q_rot 57b (bf16 ring)")
    for x in ("k", "v"):
        got, want = r_t[f"{x}_cache"][args[5]].float(), r_r[f"{x}_cache"][args[5]].float()
        assert_close(got, want, rel_rms=4e-3, max_abs=0.05 * want.abs().max().item(), what=f"{x} bf16 ring 57b")
