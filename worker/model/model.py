"""The causal video DiT: one chunk of latent video + its audio tokens → a velocity, per denoising pass.

Per chunk: the latent frame `[C, H_lat, W_lat]` is patchified (p×p) into `H_lat/p · W_lat/p` video
tokens; the chunk's audio features `[A, F]` become A audio tokens; together the T = video + A tokens of
the chunk. Each block is adaLN-modulated (timestep → shift/scale/gate, one shared MLP plus a learned
per-block table, so modulation costs 6·d per block rather than a d×6d matrix per block), with
block-causal self-attention through the KV cache (the chunk attends the sink, the window and itself)
and a SwiGLU MLP. Q and K get a per-head RMSNorm; RoPE (3 bands t, h, w) is applied by the cache.

Tensor parallelism is a separate transform (worker/model/tp.py): it slices `qkv`, `gate_up` column-wise
and `o`, `down` row-wise and installs the all-reduce after the row-parallel projections; the modules
here read their local head count and widths from their weights' shapes.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from vivant.worker.model.config import ModelConfig
from vivant.worker.model.kv_cache import KVCache


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.float()).to(x.dtype)


class Reduce(nn.Module):
    """The all-reduce after a row-parallel projection: identity at TP=1; tp.py installs the real one."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


def timestep_embedding(t: torch.Tensor, dim: int = 256, max_period: float = 10_000.0) -> torch.Tensor:
    """Sinusoidal embedding of timesteps t (any shape [B]) in [0, 1000] → [B, dim] float32."""
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
    args = t.float()[:, None] * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.head_dim = cfg.head_dim
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.n_heads * cfg.head_dim, bias=False)  # column-parallel
        self.o = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.d_model, bias=False)  # row-parallel
        self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps)
        self.reduce = Reduce()

    @property
    def local_heads(self) -> int:
        return self.qkv.weight.shape[0] // (3 * self.head_dim)

    def forward(self, x: torch.Tensor, layer: int, cache: KVCache) -> torch.Tensor:
        n = x.shape[0]
        h = self.local_heads
        q, k, v = self.qkv(x).view(n, 3, h, self.head_dim).unbind(1)
        out = cache.attend(layer, self.q_norm(q), self.k_norm(k), v)
        return self.reduce(self.o(out.reshape(n, h * self.head_dim)))


class SwiGLU(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_up = nn.Linear(cfg.d_model, 2 * cfg.d_ff, bias=False)  # column-parallel: [gate; up]
        self.down = nn.Linear(cfg.d_ff, cfg.d_model, bias=False)  # row-parallel
        self.reduce = Reduce()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.reduce(self.down(F.silu(gate) * up))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.mod_table = nn.Parameter(torch.zeros(6, cfg.d_model))
        self.norm1 = nn.LayerNorm(cfg.d_model, elementwise_affine=False, eps=cfg.norm_eps)
        self.norm2 = nn.LayerNorm(cfg.d_model, elementwise_affine=False, eps=cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp = SwiGLU(cfg)

    def forward(self, x: torch.Tensor, mod: torch.Tensor, layer: int, cache: KVCache) -> torch.Tensor:
        shift1, scale1, gate1, shift2, scale2, gate2 = (mod + self.mod_table).to(x.dtype).unbind(0)
        x = x + gate1 * self.attn(self.norm1(x) * (1 + scale1) + shift1, layer, cache)
        x = x + gate2 * self.mlp(self.norm2(x) * (1 + scale2) + shift2)
        return x


class VideoDiT(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        d = cfg.d_model
        self.patch_embed = nn.Linear(cfg.patch_dim, d)
        self.audio_embed = nn.Linear(cfg.audio_feature_dim, d)
        self.audio_pos = nn.Parameter(torch.zeros(max(cfg.audio_tokens, 1), d))
        self.time_mlp = nn.Sequential(nn.Linear(256, d), nn.SiLU(), nn.Linear(d, d))
        self.time_mod = nn.Linear(d, 6 * d)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.final_norm = nn.LayerNorm(d, elementwise_affine=False, eps=cfg.norm_eps)
        self.final_mod = nn.Linear(d, 2 * d)
        self.out = nn.Linear(d, cfg.patch_dim)

    # ---- (un)patchify: [C, H, W] ↔ [H/p·W/p, C·p·p] ---------------------------------------------------
    def patchify(self, lat: torch.Tensor) -> torch.Tensor:
        c, h, w = lat.shape
        p = self.cfg.patch
        return lat.reshape(c, h // p, p, w // p, p).permute(1, 3, 0, 2, 4).reshape((h // p) * (w // p), c * p * p)

    def unpatchify(self, tokens: torch.Tensor) -> torch.Tensor:
        cfg, p = self.cfg, self.cfg.patch
        gh, gw = cfg.grid_h, cfg.grid_w
        return tokens.reshape(gh, gw, cfg.latent_channels, p, p).permute(2, 0, 3, 1, 4).reshape(
            cfg.latent_channels, gh * p, gw * p)

    def forward(self, latents: torch.Tensor, sigma: float, audio_feats: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """latents [C, H_lat, W_lat] at noise level sigma ∈ (0, 1]; audio_feats [A, F]. Returns velocity [C, H_lat, W_lat]."""
        cfg = self.cfg
        dtype = self.patch_embed.weight.dtype
        x = self.patch_embed(self.patchify(latents.to(dtype)))
        if cfg.audio_tokens:
            a = self.audio_embed(audio_feats.to(dtype)) + self.audio_pos[: cfg.audio_tokens].to(dtype)
            x = torch.cat([x, a], dim=0)
        t = torch.tensor([sigma * 1000.0], device=x.device)
        temb = self.time_mlp(timestep_embedding(t).to(dtype))  # [1, d]
        mod = self.time_mod(F.silu(temb)).view(6, cfg.d_model)
        for i, block in enumerate(self.blocks):
            x = block(x, mod, i, cache)
        shift, scale = self.final_mod(F.silu(temb)).view(2, cfg.d_model).to(x.dtype).unbind(0)
        x = self.final_norm(x) * (1 + scale) + shift
        return self.unpatchify(self.out(x[: cfg.video_tokens]).float())


@torch.no_grad()
def init_random_(model: VideoDiT, seed: int = 0, std: float = 0.02) -> VideoDiT:
    """Deterministic random weights of the exact shapes (benchmarks, tests). Gates start small, not zero,
    so every block contributes and numerical comparisons exercise the whole network."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight") or name.endswith("_norm.weight"):
            p.fill_(1.0)
            continue
        cpu = torch.empty(p.shape, dtype=torch.float32)
        if name.endswith("mod_table"):
            cpu.normal_(0.0, 0.1, generator=gen)
        elif p.dim() == 1:
            cpu.zero_()
        else:
            fan_in = p.shape[1]
            cpu.normal_(0.0, 1.0 / math.sqrt(fan_in), generator=gen)
        p.copy_(cpu.to(p.dtype))
    return model
