"""The ring's read image (kernels/ring_image.py) and the "image" attention backend.

The refresh kernel runs in Triton's interpreter on CPU (TRITON_INTERPRET=1) and is compared with its float32
twin on odd shapes (H=3, D=16, scattered slots, one slot) and a long one; untouched slots must keep their
old values (a sentinel). The "image" attention backend must give what the "sdpa" backend (whole-ring
dequantization per call) gives, and the engine-level test in tests/core checks that the image follows the
ring through writes, delta rotations and clears. GPU tests (marked ``gpu``) run the compiled kernel at the
57b shape (757 of 5,788 slots, 16 heads × 128).
"""

from __future__ import annotations

import pytest
import torch
from kernel_compare import assert_close, needs_cuda, needs_triton_cpu
from vivant.kernels.fp8 import quantize_rows_ref
from vivant.kernels.ring_attention import ring_attention, ring_attention_ref
from vivant.kernels.ring_image import dequant_all, dequant_slots, dequant_slots_ref

SHAPES = {"odd_h3_d16": (50, 3, 16, 17), "one_slot": (9, 2, 32, 1), "long": (600, 4, 32, 300)}


def ring(s, h, d, g, device="cpu"):
    mag = torch.logspace(-2, 2, s)[torch.randperm(s, generator=g)][:, None, None]
    q, sc = quantize_rows_ref(torch.randn(s, h, d, generator=g) * mag)
    return q.to(device), sc.to(device)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
@needs_triton_cpu
def test_refresh_matches_twin_and_leaves_other_slots(shape, dtype):
    s, h, d, n = shape
    g = torch.Generator().manual_seed(s + n)
    src, sc = ring(s, h, d, g)
    slots = torch.randperm(s, generator=g)[:n]
    got = torch.full((s, h, d), 7.0, dtype=dtype)
    want = got.clone()
    dequant_slots(src, sc, slots, got, backend="triton")
    dequant_slots_ref(src, sc, slots, want)
    assert torch.equal(got, want), f"refresh differs from the twin: max |diff| {(got.float() - want.float()).abs().max()}"
    untouched = torch.ones(s, dtype=torch.bool)
    untouched[slots] = False
    assert bool((got[untouched] == 7.0).all()), "a slot outside `slots` was written"
    exact = (src[slots].float() * sc[slots][..., None]).to(dtype)
    assert torch.equal(got[slots], exact), "refreshed rows are not bf16(fp8 · scale)"


@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
@needs_triton_cpu
def test_whole_ring_fill_matches_the_slot_refresh_of_every_slot(shape):
    s, h, d, _ = shape
    g = torch.Generator().manual_seed(s)
    src, sc = ring(s, h, d, g)
    got = torch.full((s, h, d), float("nan"), dtype=torch.bfloat16)
    want = got.clone()
    dequant_all(src, sc, got, backend="triton")
    dequant_slots_ref(src, sc, torch.arange(s), want)
    assert torch.equal(got, want), f"whole-ring fill differs from the twin: max |diff| {(got.float() - want.float()).abs().max()}"


def test_twin_is_the_dequantization():
    g = torch.Generator().manual_seed(3)
    src, sc = ring(20, 2, 16, g)
    dst = torch.zeros(20, 2, 16)
    dequant_slots_ref(src, sc, torch.arange(20), dst)
    assert_close(dst, src.float() * sc[..., None], rel_rms=0, max_abs=0, what="twin vs fp8·scale")


class TestBadInput:
    def setup_method(self):
        g = torch.Generator().manual_seed(0)
        self.src, self.sc = ring(10, 2, 16, g)
        self.dst = torch.zeros(10, 2, 16, dtype=torch.bfloat16)

    @pytest.mark.parametrize("field, kwargs, message", [
        ("dst", {"dst": torch.zeros(10, 2, 8)}, "dst must have src's shape"),
        ("dst", {"dst": torch.zeros(10, 2, 16, dtype=torch.int32)}, "dst dtype"),
        ("scale", {"scale": torch.ones(10, 3)}, "scale must be float32 [S, H]"),
        ("slots", {"slots": torch.tensor([1, 2], dtype=torch.int32)}, "slots must be int64"),
        ("slots", {"slots": torch.tensor([[1, 2]])}, "slots must be a 1-D int64"),
        ("slots", {"slots": torch.tensor([2, 2])}, "slots must be distinct"),
        ("slots", {"slots": torch.tensor([3, 10])}, "slots must lie in [0, S=10)"),
        ("src", {"src": torch.zeros(10, 32)}, "src must be [S, H, D]"),
    ])
    def test_rejected_naming_the_field(self, field, kwargs, message):
        args = {"src": self.src, "scale": self.sc, "slots": torch.tensor([1, 2]), "dst": self.dst} | kwargs
        before = self.dst.clone()
        with pytest.raises((ValueError, TypeError)) as e:
            dequant_slots(**args)
        assert message in str(e.value), f"{field}: message {e.value!s} lacks {message!r}"
        assert torch.equal(self.dst, before), "a rejected call wrote into the image"

    def test_image_backend_needs_the_image(self):
        q = torch.randn(4, 2, 16)
        valid = torch.ones(10, dtype=torch.bool)
        with pytest.raises(ValueError, match="needs k_image and v_image"):
            ring_attention(q, self.src, self.src, self.sc, self.sc, valid, backend="image")
        with pytest.raises(ValueError, match="k_image must be torch.float32"):
            ring_attention(q, self.src, self.src, self.sc, self.sc, valid, backend="image",
                           k_image=self.dst, v_image=self.dst)


@pytest.mark.parametrize("all_valid", [True, False])
def test_image_backend_equals_sdpa_backend(all_valid):
    g = torch.Generator().manual_seed(5)
    s, h, d = 90, 3, 32
    k8, ks = ring(s, h, d, g)
    v8, vs = ring(s, h, d, g)
    q = torch.randn(37, h, d, generator=g)
    valid = torch.ones(s, dtype=torch.bool) if all_valid else torch.rand(s, generator=g) < 0.6
    valid[-1] = True
    kimg, vimg = torch.empty(s, h, d), torch.empty(s, h, d)
    dequant_slots_ref(k8, ks, torch.arange(s), kimg)
    dequant_slots_ref(v8, vs, torch.arange(s), vimg)
    got = ring_attention(q, k8, v8, ks, vs, valid, backend="image", all_valid=all_valid, k_image=kimg, v_image=vimg)
    sdpa = ring_attention(q, k8, v8, ks, vs, valid, backend="sdpa", all_valid=all_valid)
    ref = ring_attention_ref(q, k8, v8, ks, vs, valid)
    assert torch.equal(got, sdpa), f"image != sdpa: max |diff| {(got - sdpa).abs().max():.3e}"
    assert_close(got, ref, rel_rms=1e-5, max_abs=1e-4 * ref.abs().max().item(), what="image vs float32 reference")


@pytest.mark.gpu
@needs_cuda
def test_gpu_57b_refresh_and_attention():
    g = torch.Generator().manual_seed(11)
    s, h, d, n = 5788, 16, 128, 757
    k8, ks = ring(s, h, d, g, "cuda")
    v8, vs = ring(s, h, d, g, "cuda")
    slots = torch.randperm(s, generator=g)[:n].cuda()
    kimg = torch.zeros(s, h, d, dtype=torch.bfloat16, device="cuda")
    want = kimg.clone()
    dequant_slots(k8, ks, slots, kimg)
    dequant_slots_ref(k8, ks, slots, want)
    assert torch.equal(kimg, want), "GPU refresh differs from the twin"
    every = torch.arange(s, device="cuda")
    vimg = torch.empty_like(kimg)
    dequant_slots(k8, ks, every, kimg)
    dequant_slots(v8, vs, every, vimg)
    q = torch.randn(n, h, d, device="cuda", dtype=torch.bfloat16)
    valid = torch.ones(s, dtype=torch.bool, device="cuda")
    got = ring_attention(q, k8, v8, ks, vs, valid, backend="image", all_valid=True, k_image=kimg, v_image=vimg)
    sdpa = ring_attention(q, k8, v8, ks, vs, valid, backend="sdpa", all_valid=True)
    assert torch.equal(got, sdpa), f"image != sdpa on the GPU: max |diff| {(got - sdpa).abs().max():.3e}"
    ref = ring_attention_ref(q, k8, v8, ks, vs, valid)
    # keys span 1e-2..1e2 in magnitude here, so bf16 logits round coarsely: the bound is the sdpa backend's
    assert_close(got.float(), ref, rel_rms=4e-2, max_abs=0.25 * ref.abs().max().item(), what="image vs reference")
