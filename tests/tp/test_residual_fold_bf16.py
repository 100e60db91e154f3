"""The residual in the GEMM (EngineOptions.residual_in_gemm) at TP > 1 with bf16 activations, on CPU with gloo.

With the fold, rank 0 adds the residual x inside its O/down GEMM and the all-reduce sums bf16 values of |x|'s size
(x + rank 0's partial, then the other ranks' partials), where without it the all-reduce sums the partials alone and
x is added after, in float32 (the residual kernel). The float32 runs of tests/tp/test_fp8_parts_fused.py cannot see
that rounding; here the tiny preset's FP8 engine runs in bf16 at world sizes 2 and 4, fold on and off, 6 chunks.

Checked: the ranks agree bit for bit; fold and no fold each stay within 1e-2 (relative, over all latents) of the
float32 TP = 1 engine without the fold; and fold against no fold within 1e-2. Measured (2026-12-03, this file's
runs): fold vs no fold ≈ 5.0e-3 at both world sizes in bf16 (3.4e-3 in float32, where the only difference is the
order of float32 products: FP8 quantization of activations turns last-bit differences into code flips, the floor
of any two FP8 paths here); against the float32 TP = 1 reference ≈ 6.9e-3 (world 2) and 7.5e-3 (world 4) with the
fold, 6.8e-3 and 7.2e-3 without. Every rank adding x (the residual summed `world` times) measured 0.109 (world 2)
and 0.125 (world 4) against the float32 engine: caught."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from gloo_ranks import run_ranks
from vivant.worker.model.config import ModelConfig
from vivant.worker.model.engine import Engine
from vivant.worker.model.generator import ChunkGenerator
from vivant.worker.model.model import VideoDiT, init_random_
from vivant.worker.model.options import EngineOptions
from vivant.worker.model.tp import apply_tensor_parallel

CHUNKS = 6
TOL = 1e-2


def _latents(cfg: ModelConfig, model: VideoDiT, fold: bool, dtype: torch.dtype) -> torch.Tensor:
    """[CHUNKS, C, h, w] float32 latents of one session (seed 5, a sine as audio) on the FP8 engine."""
    engine = Engine.build(model.to(dtype), EngineOptions(fp8=True, residual_in_gemm=fold))
    gen = ChunkGenerator(cfg, mode="optimized", seed=5, engine=engine, dtype=dtype)
    out = []
    for n in range(CHUNKS):
        a, b = cfg.chunk_sample_range(n)
        audio = (0.2 * np.sin(np.arange(a, b) * 0.05 + n)).astype(np.float32)
        out.append(gen.generate_chunk(audio, cfg.audio_sample_rate).latents.float())
    return torch.stack(out)


def _rank_body(rank: int, world: int, out_dir: str) -> None:
    cfg = ModelConfig.from_name("tiny")
    result = {fold: _latents(cfg, apply_tensor_parallel(init_random_(VideoDiT(cfg), seed=11), rank, world), fold,
                             torch.bfloat16) for fold in (True, False)}
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.fixture(scope="module")
def float32_tp1() -> torch.Tensor:
    cfg = ModelConfig.from_name("tiny")
    return _latents(cfg, init_random_(VideoDiT(cfg), seed=11), False, torch.float32)


@pytest.mark.parametrize("world", [2, 4])
def test_the_fold_in_bf16_at_tp_stays_within_fp8_noise_of_the_float32_engine(world, float32_tp1, tmp_path):
    results = run_ranks(_rank_body, world, tmp_path)
    for fold in (True, False):
        for rank, res in enumerate(results[1:], start=1):
            assert torch.equal(res[fold], results[0][fold]), f"world {world} fold={fold}: rank {rank} differs from 0"
        assert torch.isfinite(results[0][fold]).all(), f"world {world} fold={fold}: non-finite latents"
        err = rel(results[0][fold], float32_tp1)
        assert err < TOL, f"world {world} bf16 fold={fold} vs float32 TP = 1: relative error {err:.3e} (bound {TOL})"
    err = rel(results[0][True], results[0][False])
    assert err < TOL, f"world {world} bf16: fold vs no fold relative error {err:.3e} (bound {TOL})"
