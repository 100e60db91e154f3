"""residual_ln_mod_quant (kernels/fused_quant.py): x + gate·y written back, then LayerNorm → modulation → FP8
rows, in one kernel; compared with its float32 twin on odd, realistic-small and long shapes (Triton interpreted
on CPU), and at the 57b rank shape on a GPU, each under several launch configs (rows_per_program, block_k,
num_warps): the default, several whole rows per program, and the looped form (block_k < K), where passes 2-3
re-read the residual the kernel itself wrote in pass 1."""

from __future__ import annotations

import re

import pytest
import torch
from kernel_compare import needs_triton_cpu
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


# (rows_per_program, block_k, num_warps); None = DEFAULT_CONFIGS, block_k 0 = the whole row in one tile
CONFIGS = {"default": None, "rows4_whole_row": (4, 0, 4), "loop_2x16_w4": (2, 16, 4), "loop_4x32_w2": (4, 32, 2)}
LOOPED = {k: v for k, v in CONFIGS.items() if k.startswith("loop")}
# m, k not multiples of rows_per_program / block_k. The long shapes run the looped form with wider tiles: the
# interpreter walks tiles one by one, and 300x256 in 16-wide tiles alone would take half a minute.
WIDE = {"default": None, "rows4_whole_row": (4, 0, 4)}
CASES = [
    *[pytest.param(m, k, torch.float32, cfg, id=f"{m}x{k}-{name}") for m, k in [(5, 100), (37, 70)]
      for name, cfg in CONFIGS.items()],
    *[pytest.param(9, 70, torch.bfloat16, cfg, id=f"9x70-bf16-{name}") for name, cfg in CONFIGS.items()],
    *[pytest.param(300, 256, torch.float32, cfg, id=f"300x256-{name}")
      for name, cfg in {**WIDE, "loop_4x64_w4": (4, 64, 4)}.items()],
    *[pytest.param(3, 8192, torch.float32, cfg, id=f"3x8192-{name}")
      for name, cfg in {**WIDE, "loop_2x1024_w4": (2, 1024, 4)}.items()],
]


@needs_triton_cpu
@pytest.mark.parametrize("m,k,dtype,config", CASES)
def test_triton_matches_reference(m, k, dtype, config):
    args = _inputs(m, k, dtype=dtype, seed=m + k)
    got, want = residual_ln_mod_quant(*args, backend="triton", config=config), residual_ln_mod_quant_ref(*args)
    what = f"{m}x{k} {dtype} {config}"
    if dtype == torch.float32:
        _check(got, want, what)
        # the residual is computed elementwise with one rounding to x's dtype: identical to the twin's
        assert torch.equal(got[0], want[0]), f"{what}: residual not bit-identical to the twin"
    else:
        # Triton's interpreter rounds float32 → bfloat16 differently from torch (some residuals land one bf16 ulp
        # apart, with or without tiling), so: the residual within bf16 rounding, and the FP8 rows must be the
        # twin's LayerNorm of exactly what the kernel stored (statistics on the stored, rounded values)
        _check(got, (got[0], *ln_mod_quant_ref(got[0], *args[3:])), what)
        _check(got, (want[0], *got[1:]), what)


@needs_triton_cpu
@pytest.mark.parametrize("config", [None, *LOOPED.values()], ids=["default", *LOOPED.keys()])
def test_nan_in_a_row_makes_only_its_scale_nan(config):
    x, y, gate, shift, scale = _inputs(5, 100, seed=7)
    y[2, 53] = float("nan")  # lands in x_new[2], a middle tile of the looped configs
    xo, _, s = residual_ln_mod_quant(x, y, gate, shift, scale, backend="triton", config=config)
    xr, _, sr = residual_ln_mod_quant_ref(x, y, gate, shift, scale)
    assert sr[2].isnan() and not sr[[0, 1, 3, 4]].isnan().any(), f"twin scales {sr.tolist()}"
    assert torch.equal(xo.isnan(), xr.isnan()) and torch.equal(xo.nan_to_num(), xr.nan_to_num()), (
        f"{config}: residual differs from the twin (NaN at {xo.isnan().nonzero().tolist()})")
    assert s[2].isnan(), f"{config}: row 2 holds a NaN but its scale is {s[2].item():.4g} (twin: NaN)"
    assert not s[[0, 1, 3, 4]].isnan().any(), f"{config}: NaN leaked into other rows' scales {s.tolist()}"


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


@pytest.mark.parametrize("config", [(2, 48, 4), (0, 64, 4)], ids=["block_k_not_pow2", "rows_0"])
def test_bad_config_is_refused_naming_it(config):
    with pytest.raises(ValueError, match=r"residual_ln_mod_quant: config must be .* got " + re.escape(repr(config))):
        residual_ln_mod_quant(*_inputs(4, 32), config=config)


GPU_CONFIGS = {**CONFIGS, "loop_4x1024_w4": (4, 1024, 4), "loop_8x512_w8": (8, 512, 8)}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("config", GPU_CONFIGS.values(), ids=GPU_CONFIGS.keys())
def test_gpu_57b_rank_shape(config):
    args = _inputs(757, 8192, dtype=torch.bfloat16, device="cuda", seed=3)
    _check(residual_ln_mod_quant(*args, backend="triton", config=config), residual_ln_mod_quant_ref(*args),
           f"757x8192 cuda bf16 {config}")

