"""Audio → the chunk's audio tokens' input features.

A chunk covers `fpc / fps` seconds of audio (1/6 s: 2666 or 2667 samples at 16 kHz, see
`ModelConfig.chunk_sample_range`). It is split into A equal windows (A = audio tokens per chunk);
each window gives F log band energies: a Hann-windowed FFT (size = next power of two ≥ the window),
its power summed into F bands evenly spaced on the mel scale between 60 Hz and sr/2, then log(1e-6 + ·).
Output `[A, F]` float32. Deterministic and cheap; no learned frontend, no downloads. Computed in numpy (float32
FFT): this runs on the host path of every chunk before the device gets its first pass, and numpy's FFT and small
array ops cost less per call than torch's CPU ops at these sizes.

Samples are float PCM with full scale 1.0: finite samples beyond it are clipped to ±1 (a louder
sender gets a saturated voice, never features that overflow float32 and poison the session); NaN or
Inf samples are refused with `AudioError`.
"""

from __future__ import annotations

import math

import numpy as np
import torch

FULL_SCALE = 1.0  # float PCM full scale; louder samples are clipped to it


class AudioError(ValueError):
    """Audio that cannot be featurized; the message names what was expected."""


def _mel(f: np.ndarray) -> np.ndarray:
    return 2595.0 * np.log10(1.0 + f / 700.0)


def _band_matrix(n_fft: int, sample_rate: int, bands: int) -> np.ndarray:
    freqs = np.fft.rfftfreq(n_fft, 1.0 / sample_rate)
    edges = np.linspace(_mel(np.array(60.0)), _mel(np.array(sample_rate / 2)), bands + 1)
    mel_f = _mel(freqs)
    m = np.zeros((freqs.size, bands), dtype=np.float32)
    for b in range(bands):
        m[:, b] = (mel_f >= edges[b]) & (mel_f < edges[b + 1])
    # bands narrower than one FFT bin borrow the nearest bin so no feature is constant zero
    for b in range(bands):
        if not m[:, b].any():
            centre = 700.0 * (10 ** (((edges[b] + edges[b + 1]) / 2) / 2595.0) - 1)
            m[int(np.argmin(np.abs(freqs - centre))), b] = 1.0
    return m


class AudioFeaturizer:
    def __init__(self, *, sample_rate: int, tokens: int, features: int, nominal_samples: int):
        if tokens <= 0:
            raise AudioError(f"audio tokens = {tokens}; expected > 0")
        self.sample_rate, self.tokens, self.features = sample_rate, tokens, features
        self.window = max(1, nominal_samples // tokens)
        self.n_fft = 1 << max(4, math.ceil(math.log2(self.window)))
        self.bands = _band_matrix(self.n_fft, sample_rate, features)
        self.hann = np.hanning(self.window).astype(np.float32)  # symmetric, as torch's periodic=False

    def __call__(self, audio: np.ndarray | torch.Tensor, sample_rate: int) -> torch.Tensor:
        if sample_rate != self.sample_rate:
            raise AudioError(f"audio sample_rate = {sample_rate} Hz; expected {self.sample_rate} Hz "
                             "(resample before the generator)")
        x = (audio.detach().cpu().float().numpy() if torch.is_tensor(audio)
             else np.asarray(audio, dtype=np.float32))
        if x.ndim != 1:
            raise AudioError(f"audio shape = {tuple(x.shape)}; expected mono 1-D samples")
        if not np.isfinite(x).all():
            raise AudioError("audio contains NaN or Inf samples; expected finite float PCM in [-1, 1]")
        x = np.clip(x, -FULL_SCALE, FULL_SCALE)
        need = self.window * self.tokens
        if x.size < need:  # a short last chunk (or a 2666 vs 2667 sample chunk): pad with silence
            x = np.pad(x, (0, need - x.size))
        spec = np.fft.rfft(x[:need].reshape(self.tokens, self.window) * self.hann, n=self.n_fft)
        power = (spec.real ** 2 + spec.imag ** 2).astype(np.float32, copy=False)
        return torch.from_numpy(np.log(np.float32(1e-6) + power @ self.bands))
