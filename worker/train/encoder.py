"""The VAE encoder of the `ref` character: one chunk of 4 RGB frames → one latent frame.

Why this shape: the decoder (worker/stream/vae.py) turns one latent frame into 4 frames causally; the encoder
only runs in training (and in evaluation, to encode ground truth), so it can see the whole chunk at once:
the 4 frames are stacked on channels `[B, 3·4, H, W]` and downsampled by stride-2 convolutions to
`[B, C, H/8, W/8]` (8× for `ref`: 96×96 → 12×12, C = 8). The latent of chunk n depends only on chunk n's
frames, so encoding is causal by construction. Latents are scaled to unit RMS after training (the scale
is folded into this encoder's last convolution and the decoder's first one, see train_vae.py).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from vivant.worker.stream.vae import VAEConfig


class _Res(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.norm = nn.GroupNorm(8, c)
        self.conv1 = nn.Conv2d(c, c, 3, padding=1)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv2(F.silu(self.conv1(F.silu(self.norm(x)))))


class ChunkEncoder(nn.Module):
    """frames [B, 3, T·4, H, W] in [-1, 1] → latents [B, C, T, H/f, W/f] (f = the preset's spatial factor)."""

    def __init__(self, cfg: VAEConfig) -> None:
        super().__init__()
        self.cfg = cfg
        widths = tuple(reversed(cfg.widths))  # e.g. (16, 32, 48, 64): fine to coarse
        tf = cfg.temporal_factor
        layers: list[nn.Module] = [nn.Conv2d(cfg.out_channels * tf, widths[0], 3, padding=1)]
        for i in range(len(widths) - 1):
            layers += [_Res(widths[i]), nn.Conv2d(widths[i], widths[i + 1], 3, stride=2, padding=1)]
        layers += [_Res(widths[-1]), nn.GroupNorm(8, widths[-1]), nn.SiLU()]
        self.body = nn.Sequential(*layers)
        self.head = nn.Conv2d(widths[-1], cfg.latent_channels, 3, padding=1)

    def forward(self, frames: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        b, c, t, h, w = frames.shape
        tf = cfg.temporal_factor
        if c != cfg.out_channels or t % tf or (h, w) != (cfg.out_h, cfg.out_w):
            raise ValueError(f"frames: expected [B, {cfg.out_channels}, T·{tf}, {cfg.out_h}, {cfg.out_w}], "
                             f"got {list(frames.shape)}")
        n = t // tf
        x = frames.reshape(b, c, n, tf, h, w).permute(0, 2, 1, 3, 4, 5).reshape(b * n, c * tf, h, w)
        z = self.head(self.body(x))
        return z.reshape(b, n, cfg.latent_channels, cfg.latent_h, cfg.latent_w).permute(0, 2, 1, 3, 4)


def load_chunk_encoder(path: str | Path, cfg: VAEConfig) -> ChunkEncoder:
    """The encoder saved by `vivant train ref` (ref_vae_encoder.safetensors), float32, eval mode.

    Read by name and shape (`load_state_dict`, strict): the shipped file predates the checksum metadata that
    `load_weights` requires, and the encoder only ever runs in training and evaluation, never in a worker."""
    from safetensors.torch import load_file

    path = Path(path)
    if not path.is_file():
        raise ValueError(f"VAE encoder {str(path)!r} does not exist; expected the output of `vivant train ref`")
    enc = ChunkEncoder(cfg)
    try:
        enc.load_state_dict(load_file(str(path)), strict=True)
    except RuntimeError as exc:
        raise ValueError(f"VAE encoder {str(path)!r} does not fit the {cfg.name} encoder: {exc}") from None
    return enc.float().eval()
