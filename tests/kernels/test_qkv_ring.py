"""QKV → bf16 ring in one kernel (kernels/qkv_ring.py): Triton vs its float32 twin, the twin vs the float parts.

On CPU the kernel runs in Triton's interpreter (TRITON_INTERPRET=1) on odd shapes (H=3 heads, D=16/32, N=37
tokens scattered into a 90-slot ring; bf16 and float32 QKV; a QKV that is a column slice of a wider buffer), a
realistic per-head shape at few tokens (H=16 × D=128, the 57b rank's heads) and a long case (300 tokens). Checked:
q_rot and the written k and v rows (relative RMS and max error in the message; the kernel's float32 norm and
rotation may differ from torch's in the last bit, so a bf16 row may land one bf16 step away), slots outside
`slots` untouched, NaN rows kept in their own rows, and bad input named by field. The twin equals the float parts'
arithmetic (RMSNorm, RoPE at the token's positions) rounded once to bf16. GPU tests (marked ``gpu``) run the 57b
shape: 757 tokens, 16 heads × 128.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from kernel_compare import assert_close, needs_cuda, needs_triton_cpu
from vivant.kernels.qk_norm_rope import qk_norm_rope_ref
from vivant.kernels.qkv_ring import qkv_ring_write, qkv_ring_write_ref
from vivant.kernels.rope import apply_rope_ref, rope_angles

BF16 = torch.bfloat16


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
    "realistic_h16_d128": Case(n=5, h=16, d=128, s=12),
    "long": Case(n=300, h=2, d=16, s=400),
}
ROPE = {16: (4, 6, 6), 32: (12, 10, 10), 128: (44, 42, 42)}


def make(c: Case, seed: int, device="cpu"):
    """([qkv, q_weight, k_weight, cos, sin, slots], the ring {k_cache, v_cache} filled with 7.0, positions)."""
    g = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(c.n, 3 * c.h * c.d + c.pad, generator=g) * 3).to(c.dtype)[:, : 3 * c.h * c.d]
    qw = torch.rand(c.d, generator=g) + 0.5
    kw = torch.rand(c.d, generator=g) + 0.5
    pos = torch.stack([torch.randint(0, 40, (c.n,), generator=g), torch.randint(0, 22, (c.n,), generator=g),
                       torch.randint(0, 34, (c.n,), generator=g)], dim=1)
    ang = rope_angles(pos, ROPE[c.d])
    slots = torch.randperm(c.s, generator=g)[: c.n]
    ring = {"k_cache": torch.full((c.s, c.h, c.d), 7.0, dtype=BF16), "v_cache": torch.full((c.s, c.h, c.d), 7.0, dtype=BF16)}
    args = [qkv, qw, kw, ang.cos(), ang.sin(), slots]
    return [t.to(device) for t in args], {k: v.to(device) for k, v in ring.items()}, pos.to(device)


def run(fn, args, ring, c, **kw):
    r = {k: v.clone() for k, v in ring.items()}
    q = fn(*args, r["k_cache"], r["v_cache"], c.h, **kw)
    return q, r


def compare_rows(got: dict, want: dict, slots: torch.Tensor, what: str) -> None:
    """The written k and v rows: at most one bf16 step apart, on a small fraction of values."""
    for x in ("k", "v"):
        a, b = got[f"{x}_cache"][slots].float(), want[f"{x}_cache"][slots].float()
        assert_close(a, b, rel_rms=4e-3, max_abs=2 ** -7 * b.abs().max().item(), what=f"{x} ring rows{what}")
        differ = int((a != b).sum())
        assert differ <= 2e-3 * b.numel(), f"{x} ring rows{what}: {differ} of {b.numel()} differ from the twin's"


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
@needs_triton_cpu
def test_triton_matches_twin(case):
    args, ring, _ = make(case, seed=case.n + case.d)
    q_t, r_t = run(qkv_ring_write, args, ring, case, backend="triton")
    q_r, r_r = run(qkv_ring_write_ref, args, ring, case)
    tol = 1e-5 if case.dtype == torch.float32 else 8e-3
    assert_close(q_t.float(), q_r.float(), rel_rms=tol, max_abs=tol * 8 * q_r.float().abs().max().item(), what="q_rot")
    slots = args[5]
    compare_rows(r_t, r_r, slots, "")
    untouched = torch.ones(case.s, dtype=torch.bool)
    untouched[slots] = False
    for name in ("k_cache", "v_cache"):
        assert torch.equal(r_t[name][untouched], ring[name][untouched]), f"{name}: a slot outside `slots` was written"


@pytest.mark.parametrize("case", [CASES["odd_h3_d32_fp32_strided"], Case(n=5, h=16, d=128, s=12, dtype=torch.float32)],
                         ids=["odd_h3_d32_fp32_strided", "realistic_h16_d128_fp32"])
def test_twin_is_the_float_parts_rounded_once(case):
    """q/k RMSNorm + RoPE at the positions (the float parts' definition, in float32 from a float32 QKV), then one
    bf16 rounding."""
    args, ring, pos = make(case, seed=9)
    qkv, qw, kw, cos, sin, slots = args
    q_new, r = run(qkv_ring_write_ref, args, ring, case)
    q_old, k_norm = qk_norm_rope_ref(qkv, qw, kw, cos, sin, case.h)
    assert_close(q_new.float(), q_old.float(), rel_rms=1e-6, max_abs=1e-5, what="q_rot vs qk_norm_rope")
    k_rot = apply_rope_ref(k_norm.float(), pos, ROPE[case.d])
    v = qkv.float().view(case.n, 3, case.h, case.d)[:, 2]
    for x, exact in (("k", k_rot), ("v", v)):
        got = r[f"{x}_cache"][slots].float()
        assert_close(got, exact, rel_rms=4e-3, max_abs=2 ** -7 * exact.abs().max().item(), what=f"twin {x} vs exact")
        differ = int((r[f"{x}_cache"][slots] != exact.to(BF16)).sum())
        assert differ <= 2e-3 * exact.numel(), f"twin {x}: {differ} of {exact.numel()} values not bf16(exact)"


@needs_triton_cpu
def test_nan_row_stays_in_its_row():
    c = CASES["odd_h3_d16_bf16"]
    args, ring, _ = make(c, seed=3)
    args[0] = args[0].clone()
    args[0][5, 2 * c.h * c.d + 3] = float("nan")  # token 5, v head 0
    _, r = run(qkv_ring_write, args, ring, c, backend="triton")
    slot = args[5][5]
    assert torch.isnan(r["v_cache"][slot, 0, 3]), "the NaN must be stored where it was"
    others = torch.ones(c.s, dtype=torch.bool)
    others[slot] = False
    assert not torch.isnan(r["v_cache"][others]).any() and not torch.isnan(r["k_cache"]).any(), "a NaN spread"


class TestBadInput:
    c = CASES["odd_h3_d16_bf16"]

    @pytest.mark.parametrize("field, change, message", [
        ("qkv", lambda a, r: a.__setitem__(0, a[0][:, :-1]), "qkv must be [N, 3·3·16]"),
        ("cos", lambda a, r: a.__setitem__(3, a[3][:, :4]), "cos/sin must be [37, 8]"),
        ("slots", lambda a, r: a.__setitem__(5, a[5].int()), "slots must be int64"),
        ("slots", lambda a, r: a.__setitem__(5, a[5][:-1]), "slots must have shape [37]"),
        ("slots", lambda a, r: a.__setitem__(5, torch.cat([a[5][:-1], a[5][:1]])), "slots must be distinct"),
        ("slots", lambda a, r: a.__setitem__(5, a[5] + 1000), "slots must lie in [0, S=90)"),
        ("k_cache", lambda a, r: r.__setitem__("k_cache", r["k_cache"].float()), "the ring must be torch.bfloat16"),
        ("v_cache", lambda a, r: r.__setitem__("v_cache", r["v_cache"][:, :2]), "v_cache must have k_cache's shape"),
    ])
    def test_rejected_naming_the_field(self, field, change, message):
        args, ring, _ = make(self.c, seed=1)
        change(args, ring)
        before = {k: v.clone() for k, v in ring.items()}
        with pytest.raises((ValueError, TypeError)) as e:
            qkv_ring_write(*args, ring["k_cache"], ring["v_cache"], self.c.h)
        assert message in str(e.value), f"{field}: {e.value!s} lacks {message!r}"
        for k, v in ring.items():
            assert torch.equal(v.float(), before[k].float()), f"a rejected call wrote into {k}"


@pytest.mark.gpu
@needs_cuda
def test_gpu_57b_matches_twin():
    c = Case(n=757, h=16, d=128, s=5788)
    args, ring, _ = make(c, seed=22, device="cuda")
    q_t, r_t = run(qkv_ring_write, args, ring, c)
    q_r, r_r = run(qkv_ring_write_ref, args, ring, c)
    assert_close(q_t.float(), q_r.float(), rel_rms=8e-3, max_abs=0.1, what="q_rot 57b")
    compare_rows(r_t, r_r, args[5], " 57b")
