"""Train the `ref` VAE: ChunkEncoder (train/encoder.py) + the causal VAEDecoder of worker/stream/vae.py.

Objective per window of K chunks (4·K frames, inside one clip): pixel MSE of decode(encode(x) + ε) against
x, weighted ×8 in the mouth box and ×3 in the eye band (the parts that move and that the lip-sync proxy
reads), plus 1e-3·mean(z²) to keep latents bounded. ε ~ N(0, 0.05²·rms(z)) teaches the decoder to
tolerate the small latent errors the DiT will make. The decoder runs causally from a fresh
DecoderCache, as at the start of a session.

After training, latents are rescaled to unit RMS over the dataset: the scale s is folded into the
encoder's last convolution (÷ s) and the decoder's first (× s, exact: its zero padding stays zero), so
the shipped decoder takes unit-scale latents and the DiT's Gaussian prior fits them.
Shapes: frames [B, 3, 4K, 96, 96] in [-1, 1]; latents [B, 8, K, 12, 12].
"""

from __future__ import annotations

import numpy as np
import torch
from vivant.worker.stream.vae import VAEConfig, VAEDecoder
from vivant.worker.train.common import Budget, Log, sample_windows
from vivant.worker.train.dataset import LOOK, mouth_box
from vivant.worker.train.encoder import ChunkEncoder


def loss_weights(cfg: VAEConfig, device) -> torch.Tensor:
    w = torch.ones(cfg.out_h, cfg.out_w, device=device)
    y0, y1, x0, x1 = mouth_box(cfg.out_h, cfg.out_w)
    w[y0:y1, x0:x1] = 8.0
    ey = int(LOOK.eye_y * cfg.out_h)
    w[ey - 8: ey + 8, :] = torch.maximum(w[ey - 8: ey + 8, :], torch.tensor(3.0, device=device))
    return w


def window_frames(frames_u8: torch.Tensor, first_chunks: np.ndarray, chunks: int, fpc: int) -> torch.Tensor:
    """uint8 [F, 3, H, W] + window starts → float [B, 3, chunks·fpc, H, W] in [-1, 1]."""
    idx = torch.from_numpy((first_chunks[:, None] * fpc + np.arange(chunks * fpc)[None]).reshape(-1))
    x = frames_u8[idx.to(frames_u8.device)].float().div(127.5).sub(1.0)
    b = len(first_chunks)
    return x.view(b, chunks * fpc, *x.shape[1:]).transpose(1, 2)


def train_vae(frames_u8: torch.Tensor, clip_chunks: np.ndarray, cfg: VAEConfig, *, seconds: float, seed: int,
              device: torch.device, log: Log, batch: int = 8, window_chunks: int = 3,
              autocast_cpu: bool = False) -> tuple[ChunkEncoder, VAEDecoder, dict]:
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    enc, dec = ChunkEncoder(cfg).to(device), VAEDecoder(cfg).to(device)
    params = list(enc.parameters()) + list(dec.parameters())
    opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.0, betas=(0.9, 0.99))
    budget = Budget(seconds, warmup_steps=50)
    weights = loss_weights(cfg, device)
    fpc = cfg.temporal_factor
    step, last_print, ema = 0, -1e9, None
    amp = device.type == "cuda" or autocast_cpu
    while not budget.done() or step == 0:
        for g in opt.param_groups:
            g["lr"] = 1e-3 * budget.lr_factor(step)
        x = window_frames(frames_u8, sample_windows(rng, clip_chunks, window_chunks, batch), window_chunks, fpc)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
            z = enc(x)
            rms = z.float().pow(2).mean().sqrt().detach()
            y = dec(z + 0.05 * rms * torch.randn_like(z))
        err = (y.float() - x).pow(2) * weights
        loss = err.mean() / weights.mean() + 1e-3 * z.float().pow(2).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        val = float(loss.detach())
        ema = val if ema is None else 0.98 * ema + 0.02 * val
        if budget.elapsed() - last_print >= 10 or budget.done():
            last_print = budget.elapsed()
            psnr = 10 * np.log10(4.0 / max(float((y.detach().float() - x).pow(2).mean()), 1e-10))
            log(f"vae step {step}: loss {ema:.5f}, psnr {psnr:.2f} dB, latent rms {float(rms):.3f}",
                stage="vae", step=step, loss=ema, psnr_db=round(float(psnr), 2))
    enc.eval()
    dec.eval()
    scale = latent_rms(enc, frames_u8, clip_chunks, cfg, device)
    with torch.no_grad():
        enc.head.weight.div_(scale)
        enc.head.bias.div_(scale)
        dec.conv_in.conv.weight.mul_(scale)
    info = {"steps": step, "seconds": round(budget.elapsed(), 1), "latent_scale_folded": scale, "final_loss": ema}
    log(f"vae done: {step} steps in {budget.elapsed():.0f} s; latent scale {scale:.4f} folded into encoder/decoder")
    return enc, dec.requires_grad_(False), info


@torch.no_grad()
def encode_all(enc: ChunkEncoder, frames_u8: torch.Tensor, cfg: VAEConfig, device, batch_chunks: int = 256) -> torch.Tensor:
    """Latents of every chunk: [chunks, C, h, w] float32 (each chunk encoded on its own, as the encoder does)."""
    fpc = cfg.temporal_factor
    n = frames_u8.shape[0] // fpc
    out = []
    for s in range(0, n, batch_chunks):
        e = min(n, s + batch_chunks)
        x = frames_u8[s * fpc: e * fpc].to(device).float().div(127.5).sub(1.0)  # [F, 3, H, W]
        x = x.view(e - s, fpc, *x.shape[1:]).transpose(1, 2)  # [n, 3, fpc, H, W]
        out.append(enc(x)[:, :, 0].float())
    return torch.cat(out)


def latent_rms(enc: ChunkEncoder, frames_u8, clip_chunks, cfg: VAEConfig, device) -> float:
    z = encode_all(enc, frames_u8[: 4096 * cfg.temporal_factor], cfg, device)
    return float(z.pow(2).mean().sqrt())
