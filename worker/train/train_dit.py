"""Train the `ref` VideoDiT with teacher-forced context that has exactly the ring cache's semantics.

What the cache holds at inference (worker/model/generator.py, worker/model/kv_cache.py): every pass rewrites the
chunk's K/V, so after a chunk the cache keeps the K/V of its LAST pass — the chunk's latent at
σ_last = sigmas[-1] = 0.25 (after three Euler steps), embedded with timestep σ_last, attending its own
context. A later chunk attends those K/V (sink when valid, the window, itself).

Scheme (teacher forcing of σ_last-noised context, a fixed-level form of diffusion forcing): a window of
L chunks of ground-truth latents x0 is run as two token streams in one block-causal attention call:

    context stream  chunk j at σ_last:  x = (1−σ)·x0_j + σ·n_j, timestep σ_last — its keys/values are what
                    the cache would hold had the model denoised chunk j perfectly;
    target stream   chunk j at σ_j drawn from the sampler's own sigmas (1, .75, .5, .25): the pass the
                    generator runs at that level.

Mask (RingLayout rules): a context query of chunk j sees context chunks j−W+1..j and, once j ≥ W, the
sink (the first `sink` tokens of context chunk 0, which sit at t = 0 exactly like sink keys); a target
query of chunk j sees context chunks j−W+1..j−1, the sink when j ≥ W, and its own target tokens. Both
streams are supervised with the rectified-flow velocity v = n − x0. Training only the four sampler
levels trains exactly the 4-pass sampler's timesteps; noising the context to σ_last is not only faithful,
it also makes the model robust to its own imperfect context (exposure bias).

Why not self-forcing rollouts: they need the 4-pass sampler unrolled per chunk during training, ~4×L
sequential forward passes per step; with a few minutes of GPU time teacher forcing sees far more data.
`tests/quality` checks that this forward equals the generator's per-chunk path through the baseline
cache (FP8 off) to float32 rounding, so training and inference are the same function.
Shapes: latents [B, L, C, h, w]; audio features [B, L, A, F]; tokens [B, 2L, T, d] (T = video + audio).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from vivant.kernels.rope import rope_angles
from vivant.worker.model.config import ModelConfig
from vivant.worker.model.model import VideoDiT, init_random_, layer_norm, timestep_embedding
from vivant.worker.model.positions import RingLayout, chunk_positions
from vivant.worker.train.common import Budget, Log, sample_windows

LR = 5e-4  # peak AdamW learning rate (warm-up 200 steps, cosine over the time budget)


def stream_mask(cfg: ModelConfig, chunks: int, *, targets: bool = True) -> torch.Tensor:
    """Bool [N, N] (True = may attend), N = (2 if targets else 1)·L·T; context stream first."""
    T, W, S = cfg.tokens_per_chunk, cfg.window_chunks, cfg.sink_tokens
    layout = RingLayout(S, T, W)
    streams = 2 if targets else 1
    m = torch.zeros(streams * chunks * T, streams * chunks * T, dtype=torch.bool)
    for j in range(chunks):
        q = slice(j * T, (j + 1) * T)
        lo = max(0, j - W + 1)
        m[q, lo * T:(j + 1) * T] = True
        if layout.sink_valid(j):
            m[q, :S] = True
        if targets:
            qt = slice((chunks + j) * T, (chunks + j + 1) * T)
            m[qt, lo * T: j * T] = True
            m[qt, qt] = True
            if layout.sink_valid(j):
                m[qt, :S] = True
    return m


def stream_positions(cfg: ModelConfig, chunks: int, streams: int) -> torch.Tensor:
    pos = torch.cat([chunk_positions(j, cfg.grid_h, cfg.grid_w, cfg.audio_tokens) for j in range(chunks)])
    return pos.repeat(streams, 1)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, N, H, D]; cos/sin [N, 1, D/2] → rotated adjacent pairs, float32 (kernels/rope.py conventions)."""
    xf = x.float()
    a, b = xf[..., 0::2], xf[..., 1::2]
    return torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(-2)


def sequence_velocity(model: VideoDiT, latents: torch.Tensor, sigmas: torch.Tensor, feats: torch.Tensor,
                      mask: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """The VideoDiT over S streams of L chunks at once: latents [B, S·L, C, h, w] at per-chunk sigmas [B, S·L],
    feats [B, S·L, A, F]; mask/pos from stream_mask/stream_positions. Returns velocities [B, S·L, C, h, w]."""
    cfg = model.cfg
    B, L2 = latents.shape[:2]
    p, gh, gw, C = cfg.patch, cfg.grid_h, cfg.grid_w, cfg.latent_channels
    d, H, D, T = cfg.d_model, cfg.n_heads, cfg.head_dim, cfg.tokens_per_chunk
    patches = latents.reshape(B, L2, C, gh, p, gw, p).permute(0, 1, 3, 5, 2, 4, 6).reshape(B, L2, gh * gw, C * p * p)
    x = model.patch_embed(patches)
    if cfg.audio_tokens:
        a = model.audio_embed(feats) + model.audio_pos[: cfg.audio_tokens]
        x = torch.cat([x, a], dim=2)  # [B, L2, T, d]
    temb = model.time_mlp(timestep_embedding(sigmas.reshape(-1) * 1000.0))  # [B·L2, d]
    mod = model.time_mod(F.silu(temb)).view(B, L2, 1, 6, d)
    ang = rope_angles(pos.to(latents.device), cfg.rope_dims, cfg.rope_theta).unsqueeze(1)
    cos, sin = torch.cos(ang), torch.sin(ang)
    attn_mask = mask.to(latents.device)
    for blk in model.blocks:
        s1, c1, g1, s2, c2, g2 = (mod + blk.mod_table).unbind(3)
        h = layer_norm(x, cfg.norm_eps) * (1 + c1) + s1
        qkv = blk.attn.qkv(h).view(B, L2 * T, 3, H, D)
        q, k, v = qkv.unbind(2)
        q = _rope(blk.attn.q_norm(q), cos, sin).to(v.dtype)  # attention in the projections' dtype (bf16 under
        k = _rope(blk.attn.k_norm(k), cos, sin).to(v.dtype)  # autocast on GPU), as the cache path does
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=attn_mask)
        o = blk.attn.o(o.transpose(1, 2).reshape(B, L2, T, H * D))
        x = x + g1 * o
        x = x + g2 * blk.mlp(layer_norm(x, cfg.norm_eps) * (1 + c2) + s2)
    shift, scale = model.final_mod(F.silu(temb)).view(B, L2, 1, 2, d).unbind(3)
    x = model.final_norm(x) * (1 + scale) + shift
    out = model.out(x[:, :, : cfg.video_tokens])  # [B, L2, gh·gw, C·p·p]
    return out.reshape(B, L2, gh, gw, C, p, p).permute(0, 1, 4, 2, 5, 3, 6).reshape(B, L2, C, gh * p, gw * p)


@dataclass(frozen=True)
class WindowBatch:
    """One teacher-forced batch (module docstring): both streams stacked on the chunk axis, context first.
    xt [B, 2L, C, h, w] noised latents; sigmas [B, 2L]; feats [B, 2L, A, F]; velocity [B, 2L, C, h, w] = n − x0."""

    xt: torch.Tensor
    sigmas: torch.Tensor
    feats: torch.Tensor
    velocity: torch.Tensor


def draw_batch(rng: np.random.Generator, latents: torch.Tensor, feats: torch.Tensor, clip_chunks: np.ndarray,
               cfg: ModelConfig, *, window: int, batch: int, generator: torch.Generator | None = None) -> WindowBatch:
    """`batch` windows of `window` chunks inside one clip each (positions from `rng`), the context stream at
    σ_last, the target stream at levels drawn from the sampler's sigmas, noise from `generator` (None: torch's
    global generator). latents [chunks, C, h, w] and feats [chunks, A, F] on the training device."""
    device = latents.device
    first = torch.from_numpy(sample_windows(rng, clip_chunks, window, batch)).to(device)
    idx = first[:, None] + torch.arange(window, device=device)[None]
    x0 = torch.cat([latents[idx]] * 2, dim=1)  # [B, 2L, C, h, w]
    fe = torch.cat([feats[idx]] * 2, dim=1)
    levels = torch.tensor(cfg.sigmas, device=device)
    pick = torch.randint(0, len(levels), (batch, window), device=device, generator=generator)
    sig = torch.cat([torch.full((batch, window), float(cfg.sigmas[-1]), device=device), levels[pick]], dim=1)
    noise = torch.randn(x0.shape, device=device, dtype=x0.dtype, generator=generator)
    s = sig[..., None, None, None]
    return WindowBatch(xt=(1 - s) * x0 + s * noise, sigmas=sig, feats=fe, velocity=noise - x0)


def batch_loss(model: VideoDiT, b: WindowBatch, mask: torch.Tensor, pos: torch.Tensor, *, amp: bool) -> torch.Tensor:
    """Mean squared error of the predicted rectified-flow velocity over both streams (float32 scalar); `amp`
    runs the forward under bf16 autocast, as training on the GPU does."""
    with torch.autocast(b.xt.device.type, dtype=torch.bfloat16, enabled=amp):
        v = sequence_velocity(model, b.xt, b.sigmas, b.feats, mask, pos)
    return (v.float() - b.velocity).pow(2).mean()


def train_dit(latents: torch.Tensor, feats: torch.Tensor, clip_chunks: np.ndarray, cfg: ModelConfig, *,
              seconds: float, seed: int, device: torch.device, log: Log, batch: int = 32,
              window: int = 16, ema_decay: float = 0.998, autocast_cpu: bool = False) -> tuple[VideoDiT, dict]:
    """latents [chunks, C, h, w] (unit scale), feats [chunks, A, F] → the EMA VideoDiT (float32, eval)."""
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed + 1)
    window = min(window, int(clip_chunks.max()))
    model = init_random_(VideoDiT(cfg), seed=seed).to(device)
    with torch.no_grad():  # start with gates closed-ish and a zero output: the identity of a residual net
        for blk in model.blocks:
            blk.mod_table.zero_()
        model.out.weight.zero_()
        model.out.bias.zero_()
    ema = copy.deepcopy(model).eval().requires_grad_(False)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01, betas=(0.9, 0.98))
    budget = Budget(seconds, warmup_steps=200)
    mask = stream_mask(cfg, window).to(device)
    pos = stream_positions(cfg, window, 2).to(device)
    latents, feats = latents.to(device), feats.to(device).float()
    amp = device.type == "cuda" or autocast_cpu
    step, last_print, avg = 0, -1e9, None
    while not budget.done() or step == 0:
        for g in opt.param_groups:
            g["lr"] = LR * budget.lr_factor(step)
        b = draw_batch(rng, latents, feats, clip_chunks, cfg, window=window, batch=batch)
        loss = batch_loss(model, b, mask, pos, amp=amp)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        with torch.no_grad():
            decay = min(ema_decay, (1 + step) / (10 + step))
            for pe, pm in zip(ema.parameters(), model.parameters(), strict=True):
                pe.lerp_(pm, 1 - decay)
        step += 1
        val = float(loss.detach())
        avg = val if avg is None else 0.98 * avg + 0.02 * val
        if budget.elapsed() - last_print >= 10 or budget.done():
            last_print = budget.elapsed()
            log(f"dit step {step}: loss {avg:.4f} (lr {opt.param_groups[0]['lr']:.2e})",
                stage="dit", step=step, loss=avg)
    info = {"steps": step, "seconds": round(budget.elapsed(), 1), "final_loss": avg, "window_chunks": window,
            "batch": batch, "ema_decay": ema_decay}
    log(f"dit done: {step} steps in {budget.elapsed():.0f} s")
    return ema.float().cpu().eval(), info
