"""Split-KV attention over the read image (kernels/split_kv.py) and its log-sum-exp combine.

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
from kernel_compare import assert_close, needs_cuda, needs_triton_cpu
from vivant.kernels.fp8 import quantize_rows_ref
from vivant.kernels.ring_attention import ring_attention, ring_attention_ref
from vivant.kernels.split_kv import combine_splits, combine_splits_ref, split_kv_sdpa

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
    k8, ks = quantize_rows_ref(torch.randn(s, h, d, generator=g))
    v8, vs = quantize_rows_ref(torch.randn(s, h, d, generator=g))
    img = [(c.float() * sc[..., None]) for c, sc in ((k8, ks), (v8, vs))]
    return k8, v8, ks, vs, img


def test_image_backend_kv_splits_changes_nothing_and_falls_back_with_a_reason(caplog):
    g = torch.Generator().manual_seed(7)
    s, h, d = 90, 3, 16
    k8, v8, ks, vs, (ki, vi) = _ring(s, h, d, g)
    q = torch.randn(37, h, d, generator=g)
    valid = torch.ones(s, dtype=torch.bool)
    one = ring_attention(q, k8, v8, ks, vs, valid, backend="image", all_valid=True, k_image=ki, v_image=vi)
    two = ring_attention(q, k8, v8, ks, vs, valid, backend="image", all_valid=True, k_image=ki, v_image=vi,
                         kv_splits=2)
    ref = ring_attention_ref(q, k8, v8, ks, vs, valid)
    assert_close(two, one, rel_rms=1e-5, max_abs=1e-5, what="kv_splits=2 vs 1")
    assert_close(two, ref, rel_rms=1e-5, max_abs=1e-4, what="kv_splits=2 vs reference")
    with caplog.at_level(logging.INFO, logger="vivant.kernels.ring_attention"):
        seven = ring_attention(q, k8, v8, ks, vs, valid, backend="image", all_valid=True, k_image=ki, v_image=vi,
                               kv_splits=7)  # 7 does not divide 90
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
        k8, v8, ks, vs, (ki, vi) = _ring(12, 2, 8, g)
        with pytest.raises(ValueError, match="kv_splits must be an int >= 1"):
            ring_attention(torch.randn(4, 2, 8), k8, v8, ks, vs, torch.ones(12, dtype=torch.bool), backend="image",
                           k_image=ki, v_image=vi, kv_splits=0)

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
