"""The ablation's GPU-only paths on a GPU, at small shapes (run by bench/run_gpu.sh's `tests` step): each undone
choice under CUDA graphs — an option of the served engine, or a variant's parts swapped in (bench/ablation_parts.py;
the whole-window policy's and the bf16 row's `torch.compile`d parts captured into the engine's graphs) — tracks the
float parts; the whole-window vs ring-write kernel timing runs its captured
functions; the memory report of a real allocator is consistent. Speed is not asserted (bench/ablation.py)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from vivant.bench.ablation_parts import WholeWindowCache, install_variant, rotate_window_compiled
from vivant.worker.model.config import ModelConfig
from vivant.worker.model.engine import Engine
from vivant.worker.model.fast_parts import install_parts
from vivant.worker.model.generator import ChunkGenerator
from vivant.worker.model.model import VideoDiT, init_random_
from vivant.worker.model.options import CacheMode, EngineOptions

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

# bench/gpu_smoke.py's shapes: the tiny preset widened to what the Triton kernels take (head_dim 32)
CFG = ModelConfig.from_name("tiny", d_model=128, n_heads=4, head_dim=32, rope_dims=(12, 10, 10), d_ff=256)


def _audio(n):
    a, b = CFG.chunk_sample_range(n)
    return (0.3 * np.sin(np.arange(a, b) * 0.05 + n)).astype(np.float32)


@pytest.fixture(scope="module")
def model():
    return init_random_(VideoDiT(CFG), seed=4).cuda().to(torch.bfloat16)


@pytest.fixture(scope="module")
def reference(model):
    g = ChunkGenerator(CFG, mode=CacheMode.BASELINE, device="cuda", dtype=torch.bfloat16, model=model, seed=2)
    return [g.generate_chunk(_audio(n), CFG.audio_sample_rate).latents for n in range(30)]


@pytest.mark.parametrize("change", ["whole_window", "bf16_gemm", "bf16_o_gemm", "unfused_norm", {"kv_splits": 1},
                                    {"residual_in_gemm": False}])
def test_each_choice_under_cuda_graphs_tracks_the_float_parts(model, reference, change):
    served = EngineOptions.served("cuda")
    if isinstance(change, str):  # a variant's parts swapped into the served engine
        options = served
        parts = install_variant(change, model=model, fp8_model=install_parts(model, served), options=served)
        engine = Engine(parts, options)
    else:
        options = served.replace(**change)
        engine = Engine.build(model, options)
    gen = ChunkGenerator(CFG, mode=CacheMode.OPTIMIZED, device="cuda", dtype=torch.bfloat16, engine=engine, seed=2)
    if change == "whole_window":
        WholeWindowCache.adopt(gen.cache)
    outs = [gen.generate_chunk(_audio(n), CFG.audio_sample_rate) for n in range(30)]
    errs = [float((o.latents - r).norm() / r.norm()) for o, r in zip(outs, reference, strict=True)]
    assert sum(o.reset for o in outs) >= 2, "the run should cross position resets"
    assert engine.graph_replays > 0, f"{change}: no pass was replayed from a CUDA graph"
    assert max(errs) < 0.05, f"{change}: relative RMS vs the float parts up to {max(errs):.3e} ({errs})"
    if change == "whole_window":
        assert gen.cache.window is not None and not gen.cache.k.float().any(), "the whole window wrote the ring"
        assert gen.cache.window.rotate is rotate_window_compiled(), "the whole window should run its compiled function"


def test_policy_kernel_timing_runs_captured():
    from vivant.bench.ablation import policy_kernel_times

    out = policy_kernel_times(CFG, 1)
    for name in ("ring_write", "whole_window_call", "whole_window_function"):
        for key, value in out["bf16"][name].items():
            assert math.isfinite(value) and value > 0, f"bf16.{name}.{key} = {value}"


def test_memory_report_on_the_allocator(model):
    from vivant.bench.ablation import run_row
    from vivant.bench.memory import StepMemory

    memory = StepMemory("cuda")
    fp8 = install_parts(model, EngineOptions(fp8=True))
    args = SimpleNamespace(warmup=2, chunks=3, seed=2)
    row, _ = run_row("optimized", EngineOptions.served("cuda"), cfg=CFG, model=model, fp8_model=fp8,
                     device=torch.device("cuda"), args=args, memory=memory)
    m = row["memory"]
    assert m is not None and m["weights_bytes"] > 0 and m["ring_bytes"] > 0, m
    assert "read_image_bytes" not in m, f"the served bf16 ring is what attention reads; no image of its own: {m}"
    assert m["measured_deltas"]["ring_cache"] >= m["ring_bytes"], m["measured_deltas"]
    assert m["served_estimate_bytes"] > m["weights_bytes"] + m["ring_bytes"]
    assert m["headroom_bytes"]["h200_141gb"] - m["headroom_bytes"]["h100_80gb"] == pytest.approx(61e9)
    assert m["graphs_reserved_bytes"] >= 0 and m["process_peak_reserved_bytes"] >= m["process_peak_allocated_bytes"]
