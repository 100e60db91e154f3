"""residual_ln_mod_quant (kernels/fused_quant.py): x + gate·y written back, then LayerNorm → modulation → FP8
rows, in one kernel; compared with its float32 twin on odd, realistic-small and long shapes (Triton interpreted
on CPU), and at the 57b rank shape on a GPU."""

from __future__ import annotations

import pytest
import torch
from vivant.kernels.fused_quant import ln_mod_quant_ref, residual_ln_mod_quant, residual_ln_mod_quant_ref


def _inputs(m, k, dtype=torch.float32, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, k, generator=g) * 2).to(device=device, dtype=dtype)
    y = torch.randn(m, k, generator=g).to(device=device, dtype=dtype)
    gate, shift, scale = (torch.randn(3, k, generator=g) * 0.3).to(device=device, dtype=dtype).unbind(0)
    return x, y, gate, shift, scale


def _check(got, want, what):
    (xg, qg, sg), (xw, qw, sw) = got, want
    assert torch.isfinite(xg.float()).all() and torch.isfinite(sg).all(), f"{what}: non-finite output"
    dx = float((xg.float() - xw.float()).abs().max())
    assert dx <= 1e-2 * float(xw.float().abs().max()) if xg.dtype == torch.bfloat16 else dx < 1e-5, (
        f"{what}: residual differs by up to {dx:.3e}")
    rel_s = float(((sg - sw).abs() / sw).max())
    assert rel_s < 1e-5, f"{what}: row scales differ by up to {rel_s:.3e} relative"
    dq = qg.float() * sg[:, None] - qw.float() * sw[:, None]
    ref = qw.float() * sw[:, None]
    rms = float(dq.norm() / ref.norm())
    assert rms < 2e-2, f"{what}: dequantized relative RMS {rms:.3e}, max abs {float(dq.abs().max()):.3e}"


@pytest.mark.parametrize("m,k", [(5, 100), (37, 70), (300, 256), (3, 8192)])
def test_triton_matches_reference(m, k):
    args = _inputs(m, k, seed=m + k)
    _check(residual_ln_mod_quant(*args, backend="triton"), residual_ln_mod_quant_ref(*args), f"{m}x{k}")


def test_reference_is_residual_then_ln_mod_quant():
    x, y, gate, shift, scale = _inputs(9, 64, seed=1)
    x_new, q, s = residual_ln_mod_quant_ref(x, y, gate, shift, scale)
    assert torch.allclose(x_new, x + gate * y, atol=1e-6)
    q2, s2 = ln_mod_quant_ref(x + gate * y, shift, scale)
    assert torch.equal(q.float(), q2.float()) and torch.allclose(s, s2)


def test_bad_shapes_are_refused_naming_them():
    x, y, gate, shift, scale = _inputs(4, 32)
    with pytest.raises(ValueError, match=r"y shape \(4, 16\) != x shape \(4, 32\)"):
        residual_ln_mod_quant(x, y[:, :16].contiguous(), gate, shift, scale)
    with pytest.raises(ValueError, match=r"gate must have shape \(32,\)"):
        residual_ln_mod_quant(x, y, gate[:5], shift, scale)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_57b_rank_shape():
    args = _inputs(757, 8192, dtype=torch.bfloat16, device="cuda", seed=3)
    _check(residual_ln_mod_quant(*args, backend="triton"), residual_ln_mod_quant_ref(*args), "757x8192 cuda bf16")
