"""qk_norm_rope (kernels/qk_norm_rope.py): the fused q/k RMSNorm + RoPE(q) Triton kernel against its float32
twin, and the twin against the model's own path (RMSNorm module + apply_rope_ref), on small, odd and long
shapes; GPU at the 57b rank shape."""

from __future__ import annotations

import pytest
import torch
from kernel_compare import assert_close
from vivant.kernels.qk_norm_rope import qk_norm_rope, qk_norm_rope_ref
from vivant.kernels.rope import apply_rope_ref, rope_angles


def _inputs(n, h, d, dims, device="cpu", dtype=torch.float32, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    qkv = (torch.randn(n, 3 * h * d, generator=g) * 3).to(device=device, dtype=dtype)
    qw = (torch.rand(d, generator=g) + 0.5).to(device)
    kw = (torch.rand(d, generator=g) + 0.5).to(device)
    pos = torch.randint(0, 50, (n, 3), generator=g)
    ang = rope_angles(pos, dims).to(device)
    return qkv, qw, kw, pos, ang.cos(), ang.sin()


@pytest.mark.parametrize("n,h,d,dims", [(7, 3, 16, (4, 6, 6)), (5, 1, 32, (8, 12, 12)), (300, 4, 32, (12, 10, 10)),
                                        (3, 16, 128, (44, 42, 42))])
def test_triton_matches_reference(n, h, d, dims):
    qkv, qw, kw, _, cos, sin = _inputs(n, h, d, dims)
    got = qk_norm_rope(qkv, qw, kw, cos, sin, h, backend="triton")
    want = qk_norm_rope_ref(qkv, qw, kw, cos, sin, h)
    for name, g_, w_ in zip(("q_rot", "k_norm"), got, want, strict=True):
        assert torch.isfinite(g_).all(), f"{name}: non-finite output"
        assert_close(g_, w_, rel_rms=1e-6, max_abs=1e-5, what=f"{name} {n}x{h}x{d}")


@torch.no_grad()
def test_reference_equals_the_models_unfused_path():
    from vivant.worker.model.model import RMSNorm

    n, h, d, dims = 11, 3, 16, (4, 6, 6)
    qkv, qw, kw, pos, cos, sin = _inputs(n, h, d, dims, seed=3)
    qn, kn = RMSNorm(d), RMSNorm(d)
    qn.weight.data, kn.weight.data = qw.clone(), kw.clone()
    q, k, _ = qkv.view(n, 3, h, d).unbind(1)
    q_rot, k_norm = qk_norm_rope_ref(qkv, qw, kw, cos, sin, h)
    assert_close(q_rot, apply_rope_ref(qn(q), pos, dims), rel_rms=1e-6, max_abs=1e-5, what="q_rot vs RMSNorm+apply_rope_ref")
    assert_close(k_norm, kn(k), rel_rms=1e-6, max_abs=1e-5, what="k_norm vs RMSNorm")


def test_bad_shapes_are_refused_naming_them():
    qkv, qw, kw, _, cos, sin = _inputs(4, 2, 16, (4, 6, 6))
    with pytest.raises(ValueError, match=r"qkv must be \[N, 3·3·16\]"):
        qk_norm_rope(qkv, qw, kw, cos, sin, 3)
    odd = _inputs(3, 1, 24, (8, 8, 8))
    with pytest.raises(ValueError, match="power-of-two head_dim, got 24"):
        qk_norm_rope(*odd[:3], *odd[4:], 1, backend="triton")
    assert_close(qk_norm_rope(*odd[:3], *odd[4:], 1)[0], qk_norm_rope_ref(*odd[:3], *odd[4:], 1)[0], rel_rms=1e-6,
                 max_abs=1e-5, what="auto falls back to the reference for a non-power-of-two head_dim")
    with pytest.raises(ValueError, match="cos/sin must be"):
        qk_norm_rope(qkv, qw, kw, cos[:2], sin[:2], 2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_57b_rank_shape():
    qkv, qw, kw, _, cos, sin = _inputs(757, 16, 128, (44, 42, 42), device="cuda", dtype=torch.bfloat16, seed=5)
    got = qk_norm_rope(qkv, qw, kw, cos, sin, 16, backend="triton")
    want = qk_norm_rope_ref(qkv, qw, kw, cos, sin, 16)
    for name, g_, w_ in zip(("q_rot", "k_norm"), got, want, strict=True):
        # bf16 outputs, normalised values times weights < 1.5 (|v| < 16): two ulps there are 2^-3
        assert_close(g_, w_, rel_rms=1e-2, max_abs=0.125, what=f"{name} 57b cuda (bf16 output)")
