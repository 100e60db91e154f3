"""The stream-K FP8 GEMM prototype (bench/gpu_gemm_probe.py) in Triton's interpreter: small shapes where the
data-parallel tiles and the stream-K tiles both occur (and where tiles divide evenly, so there is no stream-K
part), against the float32 reference; a second call must give the same bytes (the last program of each stream-K
tile zeroes its workspace and counter). The GPU timing is gpu_tune's part `streamk`."""

from __future__ import annotations

import pytest
import torch
from kernel_compare import assert_close, needs_triton_cpu
from vivant.kernels.fp8 import quantize_rows_ref
from vivant.kernels.fp8_gemm import fp8_linear_ref, quantize_weight


@needs_triton_cpu
@pytest.mark.parametrize("m,n,k,programs,tma", [(70, 96, 64, 5, False), (33, 64, 48, 3, True), (64, 64, 32, 4, False)])
def test_streamk_gemm_matches_the_float_reference(m, n, k, programs, tma):
    from vivant.bench.gpu_gemm_probe import StreamKGemm

    gen = torch.Generator().manual_seed(m + n)
    a8, sa = quantize_rows_ref(torch.randn(m, k, generator=gen))
    w8, sw = quantize_weight(torch.randn(n, k, generator=gen) / k ** 0.5)
    g = StreamKGemm(m, n, k, "cpu", bm=32, bn=32, bk=16, programs=programs, stages=2, warps=4, tma=tma)
    tiles = -(-m // 32) * -(-n // 32)
    assert g.stream_k == bool(tiles % programs), f"{tiles} tiles on {programs} programs: stream_k {g.stream_k}"
    y = g(a8, sa, w8, sw)
    assert_close(y.float(), fp8_linear_ref(a8, sa, w8, sw), rel_rms=1e-2, max_abs=0.05, what=f"stream-K {m}x{n}x{k}")
    assert torch.equal(g(a8, sa, w8, sw), y), "a second call differs: the stream-K workspace was not left clean"
    assert not g.ws.any() and not g.cnt.any(), "workspace or counters not zeroed after the call"
