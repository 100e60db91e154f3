"""The chunk start's host work: the audio features (numpy) against a float64 torch twin of the same definition, and
the rotary angles the generator computes with a chunk's host inputs against the ones the cache computes itself."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from vivant.worker.model.audio_features import AudioFeaturizer
from vivant.worker.model.config import ModelConfig
from vivant.worker.model.generator import ChunkGenerator
from vivant.worker.model.kv_cache import StepState


def _features_f64(f: AudioFeaturizer, audio: np.ndarray) -> torch.Tensor:
    """The module docstring's definition in float64 torch: Hann-windowed FFT per window, mel-band power, log."""
    x = torch.from_numpy(audio.astype(np.float64)).clamp(-1, 1)
    need = f.window * f.tokens
    x = torch.nn.functional.pad(x, (0, max(0, need - x.numel())))[:need]
    frames = x.view(f.tokens, f.window) * torch.hann_window(f.window, periodic=False, dtype=torch.float64)
    power = torch.fft.rfft(frames, n=f.n_fft).abs().pow(2)
    return torch.log(1e-6 + power @ torch.from_numpy(f.bands).double())


@pytest.mark.parametrize("samples, scale", [(2667, 0.3), (2666, 1.5), (1000, 0.05)],
                         ids=["nominal", "clipped", "short_padded"])
def test_audio_features_match_the_float64_definition(samples, scale):
    cfg = ModelConfig.from_name("57b")
    f = AudioFeaturizer(sample_rate=cfg.audio_sample_rate, tokens=cfg.audio_tokens, features=cfg.audio_feature_dim,
                        nominal_samples=cfg.chunk_sample_range(0)[1])
    audio = (scale * np.random.default_rng(samples).standard_normal(samples)).astype(np.float32)
    got, want = f(audio, cfg.audio_sample_rate), _features_f64(f, audio)
    assert got.dtype == torch.float32 and got.shape == (cfg.audio_tokens, cfg.audio_feature_dim), got.shape
    err = (got.double() - want).abs().max().item()
    assert err <= 1e-4, f"log band energies differ from the float64 definition by {err:.3e} (limit 1e-4)"
    as_tensor = f(torch.from_numpy(audio), cfg.audio_sample_rate)
    assert torch.equal(as_tensor, got), "a torch tensor of the same samples gives other features"


def test_host_rotary_angles_equal_the_caches_own():
    """begin_chunk with the angles computed among the host inputs fills the same StepBuffers as without them."""
    gen = ChunkGenerator(ModelConfig.from_name("tiny"))
    inputs = gen.host_inputs(0)
    state = StepState(chunk=0, pos=inputs.pos, slots=inputs.slots, valid=inputs.valid, sink_pos=None,
                      cos=inputs.cos, sin=inputs.sin)
    gen.cache.begin_chunk(state)
    host = (gen.cache.step.cos.clone(), gen.cache.step.sin.clone())
    gen.cache.begin_chunk(dataclasses.replace(state, cos=None, sin=None))
    own = (gen.cache.step.cos, gen.cache.step.sin)
    assert torch.equal(host[0], own[0]) and torch.equal(host[1], own[1]), (
        f"cos differs by {(host[0] - own[0]).abs().max().item():.3e}, sin by {(host[1] - own[1]).abs().max().item():.3e}")
    assert host[0].abs().sum() > 0, "no angles were written"


def test_step_bench_reports_the_host_phases_of_the_timed_chunks():
    from vivant.bench.harness import time_chunks

    cfg = ModelConfig.from_name("tiny")
    host: dict = {}
    times, lat = time_chunks(ChunkGenerator(cfg), cfg, warmup=1, chunks=2, host=host)
    assert len(times) == 2 and len(lat) == 3, (len(times), len(lat))
    assert set(host) == {"reset", "host_launch"}, host
    assert 0 < host["reset"] <= host["host_launch"] <= max(times), (host, times)
