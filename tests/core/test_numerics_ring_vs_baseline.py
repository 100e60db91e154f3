"""Optimized (the served bf16 ring, write-time RoPE, delta rotation) vs baseline (per-call whole-cache work):
same weights, seed and parts (the FP8 parts' CPU twins, EngineOptions.served("cpu")), `tiny` preset, 100+ chunks
spanning several position resets, so only the cache differs.

The bound is the issue's: every chunk's output latents within 2% relative RMS of the baseline's, with no
growth over the session. An ablation (skipping the delta rotation) shows the comparison has teeth. The float parts'
float32 ring agrees with the baseline to float32 rounding.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from engine_runs import rel_rms
from vivant.worker.model.config import ModelConfig
from vivant.worker.model.generator import ChunkGenerator
from vivant.worker.model.options import EngineOptions

CHUNKS = 104
SERVED = EngineOptions.served("cpu")


def speech_like(cfg: ModelConfig, n: int) -> np.ndarray:
    a, b = cfg.chunk_sample_range(n)
    t = np.arange(a, b) / cfg.audio_sample_rate
    env = 0.5 + 0.5 * np.sin(2 * np.pi * 3.1 * t)
    return (0.3 * env * np.sin(2 * np.pi * (180 + 40 * np.sin(n)) * t)).astype(np.float32)


def run(cfg: ModelConfig, mode: str, fp8: bool, chunks: int = CHUNKS, gen_hook=None,
        options: EngineOptions = SERVED):
    gen = ChunkGenerator(cfg, mode=mode, seed=3, fp8=fp8, options=options)
    if gen_hook:
        gen_hook(gen)
    outs, resets = [], 0
    for n in range(chunks):
        out = gen.generate_chunk(speech_like(cfg, n), cfg.audio_sample_rate)
        assert torch.isfinite(out.latents).all(), f"{mode}: chunk {n} has non-finite latents"
        outs.append(out.latents)
        resets += out.reset
    return outs, resets


@pytest.fixture(scope="module")
def cfg() -> ModelConfig:
    return ModelConfig.from_name("tiny")


@pytest.fixture(scope="module")
def baseline(cfg):
    return run(cfg, "baseline", fp8=False)


def test_served_ring_matches_baseline_within_2pct_without_growth(cfg, baseline):
    base, base_resets = baseline
    ring, resets = run(cfg, "optimized", fp8=False)
    assert resets >= 2 and resets == base_resets, f"expected ≥ 2 position resets in both modes, got {resets}/{base_resets}"
    errs = np.array([rel_rms(a, b) for a, b in zip(ring, base, strict=True)])
    worst = int(errs.argmax())
    assert errs.max() <= 0.02, f"chunk {worst}: relative RMS {errs[worst]:.3e} > 2% (errors: {np.round(errs, 5).tolist()})"
    quarter = len(errs) // 4
    first, last = errs[:quarter].max(), errs[-quarter:].max()
    assert last <= 2 * first + 1e-6, f"error grows: max over first quarter {first:.3e}, last quarter {last:.3e}"


def test_without_fp8_the_modes_agree_to_float32_rounding(cfg):
    base, _ = run(cfg, "baseline", fp8=False, chunks=40, options=EngineOptions())
    ring, resets = run(cfg, "optimized", fp8=False, chunks=40, options=EngineOptions())
    assert resets >= 2
    errs = [rel_rms(a, b) for a, b in zip(ring, base, strict=True)]
    assert max(errs) < 1e-5, f"float32 ring vs baseline differ by up to {max(errs):.3e} (chunk {int(np.argmax(errs))})"


def test_the_baselines_fp8_is_actually_in_effect(cfg):
    """The baseline cache's per-call FP8 quantization of K/V (`fp8`, the original step's work) changes the latents."""
    base_fp8, _ = run(cfg, "baseline", fp8=True, chunks=12, options=EngineOptions())
    base_f32, _ = run(cfg, "baseline", fp8=False, chunks=12, options=EngineOptions())
    errs = [rel_rms(a, b) for a, b in zip(base_fp8, base_f32, strict=True)]
    assert max(errs) > 1e-5, "FP8 and float32 baseline caches give identical latents: FP8 quantization is not applied"


def test_skipping_the_delta_rotation_is_detected(cfg):
    """Ablation: with positions shifted but cached keys left unrotated, the error jumps at each reset. On the float
    parts' float32 ring, where a correct reset leaves only float32 rounding (the served bf16 ring's own rounding,
    ~3e-3 here, would blur the contrast)."""
    float_parts = EngineOptions()
    base, _ = run(cfg, "baseline", fp8=False, chunks=30, options=float_parts)

    def no_rotation(gen):
        cache_shift = gen.cache.shift_positions

        def shift(delta, slots):
            cache_shift(delta, slots[:0])  # shift the frame, rotate nothing

        gen.cache.shift_positions = shift

    broken, _ = run(cfg, "optimized", fp8=False, chunks=30, gen_hook=no_rotation, options=float_parts)
    good, _ = run(cfg, "optimized", fp8=False, chunks=30, options=float_parts)
    bad_err = max(rel_rms(a, b) for a, b in zip(broken, base, strict=True))
    good_err = max(rel_rms(a, b) for a, b in zip(good, base, strict=True))
    assert bad_err > 10 * good_err, f"unrotated cache error {bad_err:.3e} not ≫ correct {good_err:.3e}"


def test_runs_are_deterministic(cfg):
    a, _ = run(cfg, "optimized", fp8=False, chunks=5)
    b, _ = run(cfg, "optimized", fp8=False, chunks=5)
    for n, (x, y) in enumerate(zip(a, b, strict=True)):
        assert torch.equal(x, y), f"chunk {n} differs between two identical runs"
