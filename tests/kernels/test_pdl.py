"""Programmatic dependent launch (PDL) of the Triton kernels the engine runs between library calls.

`pdl=True` must never change a result: the programs wait for the preceding kernel before their first access.
On CPU (interpreter or torch) `pdl_launch` says no and the flag is ignored, which is checked here against the
same call without it. On the GPU (marked ``gpu``) each kernel runs right after the cuBLASLt GEMM or the
attention that feeds it, the way the engine's graph has them, eagerly and inside a captured CUDA graph, and
its outputs must equal the plain launch's bit for bit.
"""

from __future__ import annotations

import pytest
import torch
from kernel_compare import needs_cuda, needs_triton_cpu
from vivant.kernels import fused_quant as fq
from vivant.kernels.backend import pdl_launch
from vivant.kernels.fp8 import quantize_rows_ref
from vivant.kernels.fp8_gemm import fp8_linear
from vivant.kernels.qkv_ring import qkv_ring_write
from vivant.kernels.rope import rope_angles


def test_pdl_launch_is_off_on_cpu_and_when_not_asked():
    cpu = torch.device("cpu")
    assert pdl_launch(True, cpu) is False, "PDL is a CUDA launch attribute: it must be off for CPU tensors"
    assert pdl_launch(False, cpu) is False
    if torch.cuda.is_available():
        assert pdl_launch(False, torch.device("cuda")) is False, "pdl=False must launch plainly on a GPU too"


def _equal(a, b, what):
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        if not torch.equal(x.view(torch.uint8) if x.dtype == torch.float8_e4m3fn else x,
                           y.view(torch.uint8) if y.dtype == torch.float8_e4m3fn else y):
            diff = (x.float() - y.float()).abs()
            raise AssertionError(f"{what}: output {i} differs with pdl=True: {int((diff > 0).sum())} elements, "
                                 f"max |diff| {float(diff.nan_to_num().max()):.3g}")


def _fused_calls(x, y, vec, gu, att):
    g, sh, sc = vec
    return {
        "ln_mod_quant": lambda p: fq.ln_mod_quant(x, sh, sc, backend="triton", pdl=p),
        "residual_ln_mod_quant": lambda p: fq.residual_ln_mod_quant(x, y, g, sh, sc, backend="triton", pdl=p),
        "swiglu_quant": lambda p: fq.swiglu_quant(gu, backend="triton", pdl=p),
        "quant_rows": lambda p: fq.quant_rows(att, backend="triton", pdl=p),
    }


@needs_triton_cpu
def test_pdl_flag_is_ignored_in_the_interpreter():
    g = torch.Generator().manual_seed(5)
    x, y = torch.randn(5, 48, generator=g), torch.randn(5, 48, generator=g)
    vec = tuple(torch.randn(48, generator=g) * 0.3 for _ in range(3))
    calls = _fused_calls(x, y, vec, torch.randn(5, 64, generator=g), torch.randn(5, 40, generator=g))
    for name, fn in calls.items():
        _equal(fn(True), fn(False), f"{name} (interpreter)")


def _ring_case(device, n=757, h=16, d=128, s=5788, seed=3):
    g = torch.Generator(device=device).manual_seed(seed)
    qkv = torch.randn(n, 3 * h * d, generator=g, device=device).to(torch.bfloat16) * 2
    w = torch.rand(d, generator=g, device=device) + 0.5
    pos = torch.randint(0, 30, (n, 3), generator=g, device=device)
    ang = rope_angles(pos, (32, 48, 48))
    slots = torch.randperm(s, generator=g, device=device)[:n]
    ring = [torch.zeros(s, h, d, device=device, dtype=torch.bfloat16) for _ in range(2)]
    return qkv, w, ang.cos(), ang.sin(), slots, ring, h


@pytest.mark.gpu
@needs_cuda
class TestPdlGpu:
    """57b TP=4 shapes: each kernel after the library kernel that feeds it, eager and in a CUDA graph."""

    def _inputs(self, seed):
        g = torch.Generator(device="cuda").manual_seed(seed)
        bf = torch.bfloat16
        a8, sa = quantize_rows_ref(torch.randn(757, 2048, generator=g, device="cuda"))
        w8, sw = quantize_rows_ref(torch.randn(8192, 2048, generator=g, device="cuda") / 45)
        x = torch.randn(757, 8192, generator=g, device="cuda").to(bf)
        vec = tuple((torch.randn(8192, generator=g, device="cuda") * 0.3).to(bf) for _ in range(3))
        gu = torch.randn(757, 13824, generator=g, device="cuda").to(bf)
        att = torch.randn(757, 2048, generator=g, device="cuda").to(bf)
        return (a8, sa, w8, sw), x, vec, gu, att

    def test_fused_kernels_after_a_gemm_equal_plain_launch(self):
        (a8, sa, w8, sw), x, vec, gu, att = self._inputs(11)
        for name in ("ln_mod_quant", "residual_ln_mod_quant", "swiglu_quant", "quant_rows"):
            def pair(p, name=name):
                y = fp8_linear(a8, sa, w8, sw, fast_accum=True)  # the GEMM the kernel follows in the engine
                return _fused_calls(y if name == "ln_mod_quant" else x, y, vec, gu, att)[name](p)

            plain = [t.clone() for t in pair(False)]
            _equal(pair(True), plain, f"{name} eager")
            graph = torch.cuda.CUDAGraph()
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                pair(True)
            torch.cuda.current_stream().wait_stream(side)
            with torch.cuda.graph(graph):
                outs = pair(True)
            for t in outs:  # poison: the replay must write every element again
                (t.view(torch.uint8).fill_(0x7F) if t.dtype == torch.float8_e4m3fn else t.fill_(float("nan")))
            graph.replay()
            torch.cuda.synchronize()
            _equal(outs, plain, f"{name} in a CUDA graph")

    def test_qkv_ring_write_equal_plain_launch(self):
        qkv, w, cos, sin, slots, ring, h = _ring_case("cuda")
        results = {}
        for p in (False, True):
            r = [t.clone() for t in ring]
            q = qkv_ring_write(qkv, w, w, cos, sin, slots, r[0], r[1], h, pdl=p)
            results[p] = (q, *r)
        _equal(results[True], results[False], "qkv_ring_write")
