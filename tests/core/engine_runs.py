"""Shared helpers of the engine tests in tests/core: the audio each chunk gets, a run of chunks, relative RMS.

One definition for the tests that compare engine variants on the tiny preset (test_engine_parts_cpu.py,
test_ablation_parts_cpu.py, test_engine_options_cpu.py), so their runs stay comparable.
"""

from __future__ import annotations

import numpy as np
import torch
from vivant.worker.model.config import ModelConfig
from vivant.worker.model.generator import ChunkGenerator


def chunk_audio(cfg: ModelConfig, n: int) -> np.ndarray:
    """Chunk n's PCM (float32 [samples]): a sine whose phase moves with n, so each chunk's audio differs."""
    a, b = cfg.chunk_sample_range(n)
    return (0.3 * np.sin(np.arange(a, b) * 0.05 + n)).astype(np.float32)


def run_chunks(gen: ChunkGenerator, cfg: ModelConfig, chunks: int) -> tuple[list[torch.Tensor], int]:
    """Generate chunks 0 … chunks − 1; returns their latents and how many began with a position reset."""
    outs = [gen.generate_chunk(chunk_audio(cfg, n), cfg.audio_sample_rate) for n in range(chunks)]
    return [o.latents for o in outs], sum(o.reset for o in outs)


def rel_rms(a: torch.Tensor, b: torch.Tensor) -> float:
    """‖a − b‖ / ‖b‖."""
    return float((a - b).norm() / b.norm())
