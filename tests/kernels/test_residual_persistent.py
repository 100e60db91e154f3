"""residual_ln_mod_quant_persistent (kernels/residual_persistent.py): the persistent form of the gated residual
+ LayerNorm + modulation + FP8 kernel, against the float32 twin it shares with fused_quant.residual_ln_mod_quant.

On CPU (Triton interpreted): odd shapes (K not a power of two, fewer programs than rows so each program walks
several rows, more programs than rows), a strided input, bf16 and float32, NaN-poisoned outputs, a NaN row,
bad arguments named. On a GPU (marked ``gpu``): 757 × 8192 (the 57b TP=4 shape) over programs / stages / warps.
"""

from __future__ import annotations

import pytest
import torch
from kernel_compare import needs_cuda, needs_triton_cpu
from test_residual_ln_mod_quant import _check, _inputs
from vivant.kernels.fused_quant import ln_mod_quant_ref, residual_ln_mod_quant_ref
from vivant.kernels.residual_persistent import residual_ln_mod_quant_persistent

LAUNCH = {"p3_s1_w4": dict(programs=3, stages=1, num_warps=4), "p4_s2_w2": dict(programs=4, stages=2, num_warps=2),
          "p64_s3_w4": dict(programs=64, stages=3, num_warps=4)}


@needs_triton_cpu
@pytest.mark.parametrize("m, k, dtype", [(5, 100, torch.float32), (37, 70, torch.float32), (9, 70, torch.bfloat16),
                                         (3, 8192, torch.float32)])
@pytest.mark.parametrize("launch", LAUNCH.values(), ids=LAUNCH.keys())
def test_matches_twin(m, k, dtype, launch, monkeypatch):
    args = _inputs(m, k, dtype=dtype, seed=m * k)
    real_empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **kw: real_empty(*a, **kw).fill_(float("nan"))
                        if kw.get("dtype", torch.float32).is_floating_point and kw.get("dtype") != torch.float8_e4m3fn
                        else real_empty(*a, **kw))
    got = residual_ln_mod_quant_persistent(*args, backend="triton", **launch)
    monkeypatch.undo()
    want = residual_ln_mod_quant_ref(*args)
    what = f"{m}x{k} {dtype} {launch}"
    if dtype == torch.float32:
        _check(got, want, what)
        assert torch.equal(got[0], want[0]), f"{what}: residual not bit-identical to the twin"
    else:  # the interpreter's bf16 cast: the FP8 rows must be the twin's norm of what the kernel stored
        _check(got, (got[0], *ln_mod_quant_ref(got[0], *args[3:])), what)
        _check(got, (want[0], *got[1:]), what)


@needs_triton_cpu
def test_strided_rows_and_a_nan_row():
    x, y, gate, shift, scale = _inputs(7, 96, seed=3)
    wide = torch.zeros(7, 128)
    wide[:, :96] = x
    y[4, 10] = float("nan")
    xo, q, s = residual_ln_mod_quant_persistent(wide[:, :96], y, gate, shift, scale, backend="triton", programs=2)
    xr, qr, sr = residual_ln_mod_quant_ref(x, y, gate, shift, scale)
    assert torch.isnan(s[4]), "a row holding NaN must get a NaN scale"
    keep = torch.arange(7) != 4
    _check((xo[keep], q[keep], s[keep]), (xr[keep], qr[keep], sr[keep]), "strided x, other rows")


@pytest.mark.parametrize("kw, message", [
    (dict(programs=0), "programs must be an int >= 1"), (dict(stages=5), "stages must be an int in 1..4"),
    (dict(num_warps=3), "num_warps must be"), (dict(programs=True), "programs must be an int >= 1"),
])
def test_bad_launch_named(kw, message):
    with pytest.raises(ValueError, match=message):
        residual_ln_mod_quant_persistent(*_inputs(3, 16), **kw)


def test_bad_shapes_named():
    x, y, gate, shift, scale = _inputs(3, 16)
    with pytest.raises(ValueError, match=r"shift must have shape \(16,\)"):
        residual_ln_mod_quant_persistent(x, y, gate, shift[:8], scale)
    with pytest.raises(ValueError, match="y shape"):
        residual_ln_mod_quant_persistent(x, y[:2], gate, shift, scale)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("launch", [dict(programs=132, stages=1, num_warps=8), dict(programs=264, stages=2, num_warps=8),
                                    dict(programs=396, stages=3, num_warps=16)], ids=str)
def test_gpu_57b(launch):
    args = _inputs(757, 8192, dtype=torch.bfloat16, device="cuda", seed=57)
    got = residual_ln_mod_quant_persistent(*args, backend="triton", **launch)
    want = residual_ln_mod_quant_ref(*args)
    _check(tuple(t.cpu() for t in got), tuple(t.cpu() for t in want), f"757x8192 cuda {launch}")
