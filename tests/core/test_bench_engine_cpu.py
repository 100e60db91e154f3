"""The GPU benchmarks' engine plumbing on CPU at the tiny shapes: `bench/gpu_step.build_rank` (one TP rank built block
by block, its projections quantized to FP8 as they are built) and the engines `bench/gpu_step.py` puts on it run
chunks through the unified engine (FP8 parts, eager here; the GPU runs add CUDA
graphs). The timings themselves are GPU-only (docs/BENCHMARKS.md)."""

from __future__ import annotations

import types

import torch
from vivant.bench.gpu_step import _audio, build_rank, compare_o_gemm
from vivant.worker.model.config import ModelConfig
from vivant.worker.model.engine import Engine
from vivant.worker.model.fast_parts import Fp8Linear
from vivant.worker.model.generator import ChunkGenerator
from vivant.worker.model.options import AttentionBackend, CacheMode, EngineOptions

CFG = ModelConfig.from_name("tiny")


def _chunks(engine: Engine, mode: CacheMode, n: int = 3) -> torch.Tensor:
    gen = ChunkGenerator(CFG, mode=mode, device="cpu", dtype=torch.bfloat16, engine=engine, seed=1)
    return torch.stack([gen.generate_chunk(_audio(CFG, i), CFG.audio_sample_rate).latents for i in range(n)])


def test_an_fp8_rank_built_block_by_block_runs_on_the_unified_engine():
    model = build_rank(CFG, 2, 0, keep_bf16=False, device="cpu")
    assert all(type(getattr(b.attn, n)) is Fp8Linear for b in model.blocks for n in ("qkv", "o")), \
        "build_rank(keep_bf16=False) should leave FP8 projections only"
    ring = _chunks(Engine.build(model, EngineOptions(fp8=True)), CacheMode.OPTIMIZED)
    base = _chunks(Engine.build(model, EngineOptions(fp8=True, attention=AttentionBackend.TORCH)), CacheMode.BASELINE)
    assert bool(torch.isfinite(ring).all()) and bool(torch.isfinite(base).all())
    err = float((ring - base).norm() / base.norm())
    assert err < 0.05, f"the rank's ring vs baseline cache on the same FP8 weights: relative RMS {err:.3e}"


def test_the_o_gemm_comparison_runs_both_precisions_on_the_same_rank():
    """`bench step --compare-o-gemm`'s second engine: the rank's bf16 O weights (TP > 1 keeps them), latents close to
    the timed engine's, its medians and the A-B-A repeat reported; a rank already quantized is refused in the JSON."""
    model = build_rank(CFG, 2, 0, keep_bf16=True, device="cpu")
    options = EngineOptions(fp8=True)
    timed = ChunkGenerator(CFG, mode=CacheMode.OPTIMIZED, device="cpu", dtype=torch.bfloat16,
                           engine=Engine.build(model, options), seed=1)
    lat = [timed.generate_chunk(_audio(CFG, i), CFG.audio_sample_rate).latents.cpu() for i in range(3)]
    args = types.SimpleNamespace(seed=1, warmup=1, chunks=2)
    got = compare_o_gemm(CFG, model, options, timed, lat, args, keep_bf16=True)
    assert got["o_gemm"] == "bf16" and len(got["per_chunk_ms"]) == 2 and len(got["optimized_again_per_chunk_ms"]) == 2
    assert 0 < got["max_rel_rms_vs_optimized"] < 0.05, f"bf16 O vs FP8 O latents: {got['max_rel_rms_vs_optimized']}"
    refused = compare_o_gemm(CFG, model, options, timed, lat, args, keep_bf16=False)
    assert "error" in refused and "bf16 projections" in refused["error"], refused
