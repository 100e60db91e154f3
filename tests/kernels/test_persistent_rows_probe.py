"""The persistent row-kernel prototypes (bench/gpu_persistent_rows_probe.py) in Triton's interpreter: residual +
LayerNorm + modulation + FP8 and SwiGLU + FP8 with the next row's loads issued ahead (prefetch) and through the
pipelined loop, on rows that do not divide evenly over the programs, a width that is not a power of two, and more
programs than rows — against the production kernels' float32 twins. The GPU timing is gpu_tune's part `persist`."""

from __future__ import annotations

import pytest
import torch
from kernel_compare import assert_close, needs_triton_cpu
from vivant.kernels.fused_quant import residual_ln_mod_quant_ref, swiglu_quant_ref


def _deq(q, s):
    return q.float() * s[:, None]


@needs_triton_cpu
@pytest.mark.parametrize("m,k,programs,prefetch", [(37, 96, 5, True), (37, 96, 5, False), (6, 200, 8, True),
                                                   (19, 128, 19, False)])
def test_persistent_residual_matches_the_twin(m, k, programs, prefetch):
    from vivant.bench.gpu_persistent_rows_probe import res_ln_persist

    gen = torch.Generator().manual_seed(m + k)
    x, y = torch.randn(m, k, generator=gen) * 3, torch.randn(m, k, generator=gen)
    g, sh, sc = (torch.randn(k, generator=gen) * 0.3 for _ in range(3))
    xo, q, s = res_ln_persist(x, y, g, sh, sc, programs=programs, warps=4, prefetch=prefetch, stages=2)
    rx, rq, rs = residual_ln_mod_quant_ref(x, y, g, sh, sc)
    assert torch.equal(xo, rx), f"x + g·y differs by {float((xo - rx).abs().max()):.3e}"
    assert_close(s, rs, rel_rms=1e-5, max_abs=1e-5, what=f"residual scales {m}x{k}")
    assert_close(_deq(q, s), _deq(rq, rs), rel_rms=1e-2, max_abs=0.2, what=f"residual FP8 rows {m}x{k}")


@needs_triton_cpu
@pytest.mark.parametrize("m,f,programs,prefetch", [(37, 96, 5, True), (37, 96, 5, False), (6, 200, 8, True)])
def test_persistent_swiglu_matches_the_twin(m, f, programs, prefetch):
    from vivant.bench.gpu_persistent_rows_probe import swiglu_persist

    gu = torch.randn(m, 2 * f, generator=torch.Generator().manual_seed(m + f))
    q, s = swiglu_persist(gu, programs=programs, warps=4, prefetch=prefetch, stages=2)
    rq, rs = swiglu_quant_ref(gu)
    assert_close(s, rs, rel_rms=1e-5, max_abs=1e-5, what=f"swiglu scales {m}x{f}")
    assert_close(_deq(q, s), _deq(rq, rs), rel_rms=1e-2, max_abs=0.2, what=f"swiglu FP8 rows {m}x{f}")
