"""The lip-sync proxy: high on the procedural ground truth, low when the audio is shuffled; PSNR/SSIM."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
from vivant.worker.model.config import ModelConfig
from vivant.worker.quality.lipsync import lagged_correlation, lip_sync, mouth_opening, psnr, ssim
from vivant.worker.train.dataset import clip_from_audio, render_faces, session_audio

CFG = ModelConfig.from_name("ref")
pytestmark = pytest.mark.skipif(shutil.which("espeak-ng") is None or shutil.which("sox") is None,
                                reason="espeak-ng/sox missing (make sysdeps installs them)")


def _clip(seed: int):
    rng = np.random.default_rng(seed)
    audio, _ = session_audio(rng, CFG, held_out=True, sentences=2)
    clip = clip_from_audio(audio, CFG, rng)
    f = render_faces(*[torch.from_numpy(a) for a in (clip.opening, clip.eyes, clip.sway_x, clip.sway_y)])
    frames = ((f + 1) * 127.5).round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).numpy()
    return clip, frames


@pytest.mark.parametrize("seed", [1, 2])
def test_ground_truth_clips_correlate_highly_at_zero_lag(seed):
    clip, frames = _clip(seed)
    r = lip_sync(frames, clip.audio, CFG.audio_sample_rate, CFG.fps)
    assert r.correlation >= 0.8, f"ground-truth lip-sync r = {r.correlation:.3f}; expected ≥ 0.8"
    assert abs(r.lag_frames) <= 1, f"best lag {r.lag_frames} frames; the drawn mouth follows the audio at once"


@pytest.mark.parametrize("seed", [1, 2])
def test_block_shuffled_audio_scores_low(seed):
    clip, frames = _clip(seed)
    blocks = np.array_split(clip.audio, 24)  # ~0.3 s pieces in a fixed random order
    order = np.random.default_rng(100 + seed).permutation(len(blocks))
    shuffled = np.concatenate([blocks[i] for i in order])
    r = lip_sync(frames, shuffled, CFG.audio_sample_rate, CFG.fps)
    real = lip_sync(frames, clip.audio, CFG.audio_sample_rate, CFG.fps)
    assert r.correlation < 0.35, f"shuffled-audio r = {r.correlation:.3f}; expected < 0.35 (real {real.correlation:.3f})"


def test_correlation_finds_the_lag_and_never_returns_nan():
    rng = np.random.default_rng(0)
    env = rng.random(200)
    mouth = np.roll(env, 3)  # the mouth follows 3 frames late
    r, lag, _ = lagged_correlation(mouth, env, 6)
    assert lag == 3 and r > 0.99, f"lag {lag}, r {r}"
    r, _, rs = lagged_correlation(np.zeros(200), env, 6)
    assert r == 0.0 and not np.isnan(rs).any()
    with pytest.raises(ValueError, match="too short for max_lag = 6"):
        lagged_correlation(env[:10], env[:10], 6)


def test_psnr_and_ssim():
    _, frames = _clip(3)
    noisy = np.clip(frames.astype(np.int16) + np.random.default_rng(0).integers(-20, 21, frames.shape), 0, 255)
    noisy = noisy.astype(np.uint8)
    assert psnr(frames, frames) == 100.0 and ssim(frames, frames) == pytest.approx(1.0)
    p, s = psnr(frames, noisy), ssim(frames, noisy)
    assert 20 < p < 40 and 0.2 < s < 0.99, f"PSNR {p:.2f} dB, SSIM {s:.3f} for ±20 noise"
    with pytest.raises(ValueError, match=r"expected uint8 \[N, H, W, 3\]"):
        mouth_opening(frames.astype(np.float32))
    with pytest.raises(ValueError, match="shapes differ"):
        psnr(frames, frames[:-1])
