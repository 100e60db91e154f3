"""The lip-sync proxy and frame-quality numbers: no external model, only pixels and the audio envelope.

Why a proxy: the reference system claims its optimizations caused "no detected degradation in lip-sync";
vivant checks such claims on its own trained character (worker/train), whose mouth interior is the only
dark area in a fixed box of the frame. Per frame f:

    mouth[f]    fraction of pixels in the mouth box (train/dataset.mouth_box) whose luma < 0.25
    envelope[f] RMS of the audio samples of frame f (16 kHz, 1/24 s frames)

The lip-sync score is the Pearson correlation of mouth and envelope over a session at the best lag
within ±max_lag frames (positive lag: the mouth follows the audio). Frame quality: PSNR (dB, frames
uint8 [N, H, W, 3], peak 255) and SSIM (luma, 7×7 Gaussian window σ = 1.5, the usual C1/C2 constants).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from vivant.worker.train.dataset import frame_envelope, mouth_box

DARK_LUMA = 0.25


def _check_frames(frames: np.ndarray, name: str = "frames") -> np.ndarray:
    frames = np.asarray(frames)
    if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != np.uint8:
        raise ValueError(f"{name}: expected uint8 [N, H, W, 3], got {frames.dtype} {list(frames.shape)}")
    return frames


def luma(frames: np.ndarray) -> np.ndarray:
    """uint8 [N, H, W, 3] → float32 [N, H, W] in [0, 1] (BT.601 weights)."""
    f = frames.astype(np.float32) / 255.0
    return f[..., 0] * 0.299 + f[..., 1] * 0.587 + f[..., 2] * 0.114


def mouth_opening(frames: np.ndarray, box: tuple[int, int, int, int] | None = None) -> np.ndarray:
    """Dark-pixel fraction of the mouth box per frame: float32 [N]."""
    frames = _check_frames(frames)
    y0, y1, x0, x1 = box or mouth_box(frames.shape[1], frames.shape[2])
    region = luma(frames[:, y0:y1, x0:x1])
    return (region < DARK_LUMA).mean(axis=(1, 2)).astype(np.float32)


def lagged_correlation(mouth: np.ndarray, envelope: np.ndarray, max_lag: int) -> tuple[float, int, list[float]]:
    """Pearson r of mouth[f] with envelope[f − lag] for lag in [−max_lag, max_lag]: (best r, its lag, all r).
    A constant series has no correlation: r = 0 (never NaN)."""
    n = min(len(mouth), len(envelope))
    if n < 2 * max_lag + 3:
        raise ValueError(f"series of {n} frames is too short for max_lag = {max_lag}; expected ≥ {2 * max_lag + 3}")
    m, e = np.asarray(mouth[:n], np.float64), np.asarray(envelope[:n], np.float64)
    rs = []
    for lag in range(-max_lag, max_lag + 1):
        a = m[max(lag, 0): n + min(lag, 0)]
        b = e[max(-lag, 0): n - max(lag, 0)]
        sa, sb = a.std(), b.std()
        rs.append(0.0 if sa < 1e-9 or sb < 1e-9 else float(((a - a.mean()) * (b - b.mean())).mean() / (sa * sb)))
    best = int(np.argmax(rs))
    return rs[best], best - max_lag, rs


@dataclass
class LipSync:
    correlation: float
    lag_frames: int
    mouth: np.ndarray
    envelope: np.ndarray

    def to_dict(self) -> dict:
        return {"correlation": round(self.correlation, 4), "lag_frames": self.lag_frames}


def lip_sync(frames: np.ndarray, audio: np.ndarray, sample_rate: int, fps: int, max_lag: int = 6) -> LipSync:
    """The proxy over a session: frames uint8 [N, H, W, 3] and the audio they were generated from."""
    mouth = mouth_opening(frames)
    env = frame_envelope(np.asarray(audio, np.float32), len(mouth), sample_rate, fps)
    r, lag, _ = lagged_correlation(mouth, env, max_lag)
    return LipSync(r, lag, mouth, env)


def psnr(a: np.ndarray, b: np.ndarray, cap: float = 100.0) -> float:
    """Mean over frames of per-frame PSNR in dB (identical frames count as `cap`)."""
    a, b = _check_frames(a, "a"), _check_frames(b, "b")
    if a.shape != b.shape:
        raise ValueError(f"psnr: shapes differ {list(a.shape)} vs {list(b.shape)}")
    mse = ((a.astype(np.float64) - b.astype(np.float64)) ** 2).mean(axis=(1, 2, 3))
    vals = np.where(mse > 0, 10 * np.log10(255.0 ** 2 / np.maximum(mse, 1e-12)), cap)
    return float(np.minimum(vals, cap).mean())


def ssim(a: np.ndarray, b: np.ndarray) -> float:
    """Mean SSIM over frames, on luma in [0, 1], 7×7 Gaussian window (σ 1.5), valid region only."""
    a, b = _check_frames(a, "a"), _check_frames(b, "b")
    if a.shape != b.shape:
        raise ValueError(f"ssim: shapes differ {list(a.shape)} vs {list(b.shape)}")
    x = torch.from_numpy(luma(a))[:, None].double()
    y = torch.from_numpy(luma(b))[:, None].double()
    g = torch.exp(-((torch.arange(7, dtype=torch.float64) - 3) ** 2) / (2 * 1.5 ** 2))
    g = g / g.sum()
    g_rows, g_cols = g.view(1, 1, 7, 1), g.view(1, 1, 1, 7)

    def blur(t):  # the separable 7×7 Gaussian: a 7-tap pass down, then across (2/7 of the 2D window's work)
        return F.conv2d(F.conv2d(t, g_rows), g_cols)

    mx, my = blur(x), blur(y)
    vx, vy, cxy = blur(x * x) - mx ** 2, blur(y * y) - my ** 2, blur(x * y) - mx * my
    c1, c2 = 0.01 ** 2, 0.03 ** 2
    s = ((2 * mx * my + c1) * (2 * cxy + c2)) / ((mx ** 2 + my ** 2 + c1) * (vx + vy + c2))
    return float(s.mean())
