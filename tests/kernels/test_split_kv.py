"""Split-KV attention over the bf16 ring (kernels/split_kv.py) and its log-sum-exp combine.

The combine kernel runs in Triton's interpreter on CPU (TRITON_INTERPRET=1) against its float32 twin on odd
shapes (H=3, N=37, D=16/32, 2 and 3 parts; partial outputs as a strided view; a part that saw nothing, lse
= -inf), with NaN-poisoned outputs. The twin is checked against attention done in one piece (float64). The
whole split path runs on CPU through torch's CPU flash kernel (which returns the log-sum-exp, as cuDNN does on
GPUs) and must equal unsplit SDPA; through ring_attention's image backend `kv_splits` must not change the result,
and falls back (logged) where it cannot apply. The GPU test (marked ``gpu``) runs cuDNN at the 57b shape.
"""

from __future__ import annotations

import logging

import pytest
import torch
from kernel_compare import assert_close, assert_fp8_rows_match, needs_cuda, needs_triton_cpu
from vivant.kernels.fused_quant import quant_rows_ref
from vivant.kernels.ring_attention import ring_attention, ring_attention_ref
from vivant.kernels.split_kv import (
    combine_quant,
    combine_quant_ref,
    combine_splits,
    combine_splits_ref,
    split_kv_attention_fp8,
    split_kv_sdpa,
)

SHAPES = {"h3_n37_d16_p2": (2, 3, 37, 16), "h3_n37_d32_p3": (3, 3, 37, 32), "long_p2": (2, 2, 300, 16)}


def partials(p, h, n, d, g, dead_part=False):
    o = torch.randn(p, n, h, d, generator=g).permute(0, 2, 1, 3)  # [P, H, N, D], not contiguous
    lse = torch.randn(p, h, n, generator=g) * 4
    if dead_part:
        lse[0, 0, :5] = float("-inf")  # the first part saw no valid key for these rows
    return o, lse


@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
@needs_triton_cpu
def test_combine_kernel_matches_twin(shape, monkeypatch):
    g = torch.Generator().manual_seed(sum(shape))
    o, lse = partials(*shape, g, dead_part=True)
    real_empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **k: real_empty(*a, **k).fill_(float("nan")))
    got = combine_splits(o, lse, torch.float32, backend="triton")
    monkeypatch.undo()
    want = combine_splits_ref(o, lse)
    assert_close(got, want, rel_rms=1e-6, max_abs=1e-5, what=f"combine {shape}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
@needs_triton_cpu
def test_combine_quant_kernel_matches_twin(shape, dtype, monkeypatch):
    """Combine + O quantization in one kernel vs its twin (combine, round to dtype, rowwise FP8), with NaN-poisoned
    outputs, a strided o and a part that saw nothing for some rows."""
    g = torch.Generator().manual_seed(sum(shape) + 1)
    o, lse = partials(*shape, g, dead_part=True)
    real_empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **k: real_empty(*a, **k).fill_(float("nan")))
    q, sc = combine_quant(o.to(dtype), lse, dtype, backend="triton")
    monkeypatch.undo()
    rq, rs = combine_quant_ref(o.to(dtype), lse, dtype)
    assert q.shape == (shape[2], shape[1] * shape[3]) and sc.shape == (shape[2],), f"shapes {q.shape} {sc.shape}"
    if dtype == torch.float32:
        assert_fp8_rows_match(q, sc, rq, rs, max_ulp_fraction=2e-3, what=f"combine_quant {shape} {dtype}")
    else:  # a row max within one bf16 step of a rounding midpoint may round the other way: scales 2^-8 apart
        assert_close(sc, rs, rel_rms=2**-8, max_abs=2**-8 * float(rs.abs().max()), what=f"scales {shape} {dtype}")
        assert_close(q.float() * sc[:, None], rq.float() * rs[:, None], rel_rms=3e-2, max_abs=0.07 * float(rs.max()) * 448,
                     what=f"dequantized rows {shape} {dtype}")


def test_combine_quant_twin_is_quant_rows_of_the_combine():
    g = torch.Generator().manual_seed(4)
    o, lse = partials(3, 3, 37, 16, g)
    q, sc = combine_quant_ref(o, lse, torch.bfloat16)
    want_q, want_s = quant_rows_ref(combine_splits_ref(o, lse).to(torch.bfloat16).reshape(37, 48))
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(sc, want_s), \
        "combine_quant_ref must be quant_rows of the combine rounded to the output dtype"


def test_split_attention_fp8_equals_quantized_single_call():
    """The engine's form: the queries per part as a stride-0 view [P, H, N, D] → FP8 rows over every slot."""
    g = torch.Generator().manual_seed(8)
    n, h, d, s, p = 37, 3, 32, 96, 3
    q = torch.randn(n, h, d, generator=g)
    k, v = (torch.randn(s, h, d, generator=g) for _ in range(2))
    q8, qs = split_kv_attention_fp8(q.transpose(0, 1).unsqueeze(0).expand(p, h, n, d), k, v)
    one = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                                           v.transpose(0, 1)[None])[0].transpose(0, 1)
    assert_close(q8.float() * qs[:, None], one.reshape(n, h * d), rel_rms=4e-2, max_abs=0.1,
                 what="split attention FP8 rows vs one call")
    w8, ws = quant_rows_ref(one.reshape(n, h * d))
    assert_fp8_rows_match(q8, qs, w8, ws, max_ulp_fraction=2e-2, what="FP8 codes vs quant_rows of one call")


def test_twin_equals_attention_in_one_piece():
    g = torch.Generator().manual_seed(1)
    n, h, d, s, p = 11, 2, 8, 12, 3
    q, k, v = (torch.randn(*shape, generator=g, dtype=torch.float64) for shape in ((n, h, d), (s, h, d), (s, h, d)))
    logits = torch.einsum("nhd,shd->hns", q, k) / d**0.5
    full = torch.einsum("hns,shd->nhd", torch.softmax(logits, -1), v)
    parts = logits.view(h, n, p, s // p).permute(2, 0, 1, 3)  # [P, H, N, S/P]
    o = torch.einsum("phns,pshd->phnd", torch.softmax(parts, -1), v.view(p, s // p, h, d))
    lse = torch.logsumexp(parts, -1)
    assert_close(combine_splits_ref(o, lse).double(), full, rel_rms=1e-6, max_abs=1e-6, what="combine vs one piece")


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("splits", [1, 2, 3])
def test_split_sdpa_equals_unsplit(splits, dtype, tol):
    g = torch.Generator().manual_seed(splits)
    n, h, d, s = 37, 3, 32, 96
    q = torch.randn(n, h, d, generator=g).to(dtype)
    k, v = (torch.randn(s, h, d, generator=g).to(dtype) for _ in range(2))
    got = split_kv_sdpa(q, k, v, splits)
    want = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1)[None].float(), k.transpose(0, 1)[None].float(), v.transpose(0, 1)[None].float()
    )[0].transpose(0, 1)
    assert got.dtype == dtype and got.shape == q.shape
    assert_close(got.float(), want, rel_rms=tol, max_abs=4 * tol * want.abs().max().item(), what=f"{splits} parts {dtype}")


def _ring(s, h, d, g):
    """A ring of one layer, k and v [S, H, D] (float32: the CPU twins' dtype)."""
    return torch.randn(s, h, d, generator=g), torch.randn(s, h, d, generator=g)


def test_image_backend_kv_splits_changes_nothing_and_falls_back_with_a_reason(caplog):
    g = torch.Generator().manual_seed(7)
    s, h, d = 90, 3, 16
    k, v = _ring(s, h, d, g)
    q = torch.randn(37, h, d, generator=g)
    valid = torch.ones(s, dtype=torch.bool)
    one = ring_attention(q, k, v, valid, backend="image", all_valid=True)
    two = ring_attention(q, k, v, valid, backend="image", all_valid=True, kv_splits=2)
    ref = ring_attention_ref(q, k, v, valid)
    assert_close(two, one, rel_rms=1e-5, max_abs=1e-5, what="kv_splits=2 vs 1")
    assert_close(two, ref, rel_rms=1e-5, max_abs=1e-4, what="kv_splits=2 vs reference")
    with caplog.at_level(logging.INFO, logger="vivant.kernels.ring_attention"):
        seven = ring_attention(q, k, v, valid, backend="image", all_valid=True, kv_splits=7)  # 7 does not divide 90
    assert torch.equal(seven, one), "a split that cannot apply must give the single call's result"
    assert any("does not divide the 90 slots" in r.getMessage() for r in caplog.records), "the fallback was not logged"


class TestBadInput:
    @pytest.mark.parametrize("splits", [0, -1, 1.5, True])
    def test_splits_must_be_a_positive_int(self, splits):
        q, k = torch.randn(4, 2, 8), torch.randn(12, 2, 8)
        with pytest.raises(ValueError, match="splits must be an int >= 1"):
            split_kv_sdpa(q, k, k, splits)

    def test_splits_must_divide_the_slots(self):
        q, k = torch.randn(4, 2, 8), torch.randn(12, 2, 8)
        with pytest.raises(ValueError, match="splits = 5 must divide the slot count S = 12"):
            split_kv_sdpa(q, k, k, 5)

    def test_ring_attention_kv_splits_named(self):
        g = torch.Generator().manual_seed(0)
        k, v = _ring(12, 2, 8, g)
        with pytest.raises(ValueError, match="kv_splits must be an int >= 1"):
            ring_attention(torch.randn(4, 2, 8), k, v, torch.ones(12, dtype=torch.bool), backend="image", kv_splits=0)

    def test_split_attention_fp8_parts_must_divide_the_slots(self):
        with pytest.raises(ValueError, match="the 5 parts must divide the slot count S = 12"):
            split_kv_attention_fp8(torch.randn(5, 2, 4, 8), torch.randn(12, 2, 8), torch.randn(12, 2, 8))

    def test_combine_quant_dtype_named(self):
        with pytest.raises(ValueError, match="combine_quant: dtype must be one of"):
            combine_quant(torch.randn(2, 3, 5, 8), torch.randn(2, 3, 5), torch.int8)

    def test_combine_shapes_named(self):
        with pytest.raises(ValueError, match=r"o must be \[P, H, N, D\] and lse \[P, H, N\]"):
            combine_splits(torch.randn(2, 3, 5, 8), torch.randn(2, 3, 4))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("splits", [2, 4])
def test_gpu_57b_split_equals_unsplit(splits):
    g = torch.Generator().manual_seed(splits)
    n, h, d, s = 757, 16, 128, 5788
    q = torch.randn(n, h, d, generator=g).cuda().to(torch.bfloat16)
    k, v = (torch.randn(s, h, d, generator=g).cuda().to(torch.bfloat16) for _ in range(2))
    got = split_kv_sdpa(q, k, v, splits)
    want = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                                            v.transpose(0, 1)[None])[0].transpose(0, 1)
    assert_close(got.float(), want.float(), rel_rms=1e-2, max_abs=0.05, what=f"57b {splits} parts (cuDNN)")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("splits", [2, 4])
def test_gpu_57b_split_attention_fp8(splits):
    """The engine's split path at the 57b shape: cuDNN over the parts, combine + quantization compiled; against
    quant_rows of the single cuDNN call (codes within one e4m3 step on a small fraction), and the kernel against
    its twin on the same partial outputs."""
    g = torch.Generator().manual_seed(10 + splits)
    n, h, d, s = 757, 16, 128, 5788
    q = torch.randn(n, h, d, generator=g).cuda().to(torch.bfloat16)
    k, v = (torch.randn(s, h, d, generator=g).cuda().to(torch.bfloat16) for _ in range(2))
    q8, qs = split_kv_attention_fp8(q.transpose(0, 1).unsqueeze(0).expand(splits, h, n, d), k, v)
    one = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                                           v.transpose(0, 1)[None])[0].transpose(0, 1)
    assert_close((q8.float() * qs[:, None]).cpu(), one.reshape(n, h * d).float().cpu(), rel_rms=4e-2, max_abs=0.05,
                 what=f"57b {splits} parts, FP8 rows vs one cuDNN call")
    o = torch.randn(splits, n, h, d, generator=g).cuda().to(torch.bfloat16).permute(0, 2, 1, 3)
    lse = (torch.randn(splits, h, n, generator=g) * 3).cuda()
    got = combine_quant(o, lse, torch.bfloat16, backend="triton")
    want = combine_quant_ref(o, lse, torch.bfloat16)
    assert_fp8_rows_match(*(t.cpu() for t in got), *(t.cpu() for t in want), max_ulp_fraction=2e-3,
                          what=f"combine_quant 57b {splits} parts (compiled vs twin)")
