"""The GPU benchmarks' engine plumbing on CPU at the tiny shapes: `bench/harness.build_rank` (one TP rank built block
by block, its projections quantized to FP8 as they are built) runs chunks through the engine the step benchmark
puts on it (FP8 parts, eager here; the GPU runs add CUDA graphs), with the ring and with the baseline cache. The
timings themselves are GPU-only (docs/BENCHMARKS.md)."""

from __future__ import annotations

import torch
from vivant.bench.harness import build_rank, chunk_audio
from vivant.worker.model.config import ModelConfig
from vivant.worker.model.engine import Engine
from vivant.worker.model.fast_parts import Fp8Linear
from vivant.worker.model.generator import ChunkGenerator
from vivant.worker.model.options import AttentionBackend, CacheMode, EngineOptions

CFG = ModelConfig.from_name("tiny")


def _chunks(engine: Engine, mode: CacheMode, n: int = 3) -> torch.Tensor:
    gen = ChunkGenerator(CFG, mode=mode, device="cpu", dtype=torch.bfloat16, engine=engine, seed=1)
    return torch.stack([gen.generate_chunk(chunk_audio(CFG, i), CFG.audio_sample_rate).latents for i in range(n)])


def test_an_fp8_rank_built_block_by_block_runs_on_the_unified_engine():
    model = build_rank(CFG, 2, 0, keep_bf16=False, device="cpu")
    assert all(type(getattr(b.attn, n)) is Fp8Linear for b in model.blocks for n in ("qkv", "o")), \
        "build_rank(keep_bf16=False) should leave FP8 projections only"
    ring = _chunks(Engine.build(model, EngineOptions(fp8=True)), CacheMode.OPTIMIZED)
    base = _chunks(Engine.build(model, EngineOptions(fp8=True, attention=AttentionBackend.TORCH)), CacheMode.BASELINE)
    assert bool(torch.isfinite(ring).all()) and bool(torch.isfinite(base).all())
    err = float((ring - base).norm() / base.norm())
    assert err < 0.05, f"the rank's ring vs baseline cache on the same FP8 weights: relative RMS {err:.3e}"
