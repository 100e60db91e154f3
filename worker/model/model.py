"""The causal video DiT — the one definition of its forward — and its float parts.

Per chunk: the latent frame `[C, H_lat, W_lat]` is patchified (p×p) into `H_lat/p · W_lat/p` video
tokens; the chunk's audio features `[A, F]` become A audio tokens; together the T = video + A tokens of
the chunk. Each block is adaLN-modulated (timestep → shift/scale/gate, one shared MLP plus a learned
per-block table, so modulation costs 6·d per block rather than a d×6d matrix per block), with
block-causal self-attention through the KV cache (the chunk attends the sink, the window and itself)
and a SwiGLU MLP. Q and K get a per-head RMSNorm; RoPE (3 bands t, h, w) is applied by the cache.

The forward is written once, as a sequence of parts with fixed call signatures:

  modulation(sigma)                      → every block's [L, 6, d] adaLN table and the head's [2, d]
  denoise(latents, feats, mods, final, cache):
    gate_fold(mods)                                    (FP8 parts: the gates into the O/down GEMMs' scales)
    x = embed(latents, feats)                          [T, d]
    x, h = res_norm(x, None, …, shift1₀, scale1₀)      h: the activation the next GEMM takes
    per block i:
      a = attn.core(attn.qkv(h), attn, i, cache)       q/k norm, RoPE, the ring write, attention
      o = attn.row_parallel(a, attn.o, attn.reduce)    O projection (+ the TP all-reduce)
      x, h = res_norm(x, o, gate1, shift2, scale2)     x += gate1·o; h = LN(x)·(1+scale2)+shift2
      m = mlp.row_parallel(mlp.act(mlp.gate_up(h)), mlp.down, mlp.reduce)
      x, h = res_norm(x, m, gate2, next shift1, next scale1)   (the last block: no next shift/scale, h = None)
    head(x, final)                                     → velocity [C, H_lat, W_lat]

Here each part is its float implementation (the reference: float32 on CPU, bf16 on GPUs, the cache's own
attention). worker/model/fast_parts.py provides the FP8 implementations of the same parts (FP8 GEMMs, the
residual + LayerNorm + modulation + quantization kernel that joins one block's end to the next block's start,
the fused QKV → ring write, read-image attention), installed by `install_parts(model, EngineOptions)`: the
activation `h` is then quantized rows instead of a tensor, and nothing else changes. The row-parallel step is
the one part swapped while serving (`set_row_parallel_path`, the `fusedGemmAllReduce` flag,
worker/model/fused_tp.py). What the row-parallel step hands to res_norm is the projection's `row_parallel_sum`: the
float parts' summed product, or (FP8 parts, EngineOptions.residual_in_gemm) the product not yet computed, which
the FP8 res_norm runs with the residual added in the GEMM's epilogue; `gate_fold(mods)`, the pass's first part,
puts the gates into that GEMM's weight scales (the float part keeps them in the residual add).
Tensor parallelism is a separate transform (worker/model/tp.py): it slices `qkv`,
`gate_up` column-wise and `o`, `down` row-wise and installs the all-reduce; the parts read their local head
count and widths from the weights' shapes.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from vivant.worker.model.config import ModelConfig
from vivant.worker.model.fused_tp import (
    FusedGemmAllReduce,
    FusedMethod,
    GemmThenAllReduce,
    RowParallelStep,
    SummedProduct,
    float_matmul_all_reduce,
)
from vivant.worker.model.kv_cache import KVCache
from vivant.worker.model.options import RowParallelPath
from vivant.worker.model.tp import Reduce


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.float()).to(x.dtype)


class Linear(nn.Linear, SummedProduct):
    """nn.Linear (same weights, same state-dict names) that can also give its product summed over a TP group,
    for the fused row-parallel step; its FP8 counterpart is fast_parts.Fp8Linear (`Fp8Linear.of`)."""

    def matmul_all_reduce(self, x: torch.Tensor, group: dist.ProcessGroup, method: FusedMethod,
                          chunks: int) -> torch.Tensor:
        return float_matmul_all_reduce(x, self.weight, self.bias, group, method, chunks)


def layer_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """LayerNorm over the last dim without affine parameters (the adaLN modulation supplies them)."""
    return F.layer_norm(x, x.shape[-1:], eps=eps)


class ResidualNormMod:
    """Float part: `x += gate·delta` (skipped when delta is None), then `h = LN(x)·(1 + scale) + shift`.
    x, delta [T, d]; gate, shift, scale [d]. Returns (x, h); h is None when shift and scale are (the last block:
    no next block to normalize for)."""

    def __init__(self, eps: float) -> None:
        self.eps = eps

    def __call__(self, x: torch.Tensor, delta: torch.Tensor | None, gate: torch.Tensor | None,
                 shift: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if delta is not None:
            x = x + gate * delta
        if shift is None:
            return x, None
        return x, layer_norm(x, self.eps) * (1 + scale) + shift


class CacheAttention:
    """Float part: split the QKV rows, q/k RMSNorm, and the cache's own attention (RoPE, ring write at the
    chunk's slots — the sink too while chunk 0 runs —, SDPA over the ring; or the baseline's per-call work).
    qkv [T, 3·h·D] → [T, h·D]."""

    def __call__(self, qkv: torch.Tensor, attn: Attention, layer: int, cache: KVCache) -> torch.Tensor:
        n, h, d = qkv.shape[0], attn.local_heads, attn.head_dim
        q, k, v = qkv.view(n, 3, h, d).unbind(1)
        return cache.attend(layer, attn.q_norm(q), attn.k_norm(k), v).reshape(n, h * d)


class SwiGLUAct:
    """Float part: [T, 2F] (gate | up) → silu(gate)·up [T, F]."""

    def __call__(self, gu: torch.Tensor) -> torch.Tensor:
        gate, up = gu.chunk(2, dim=-1)
        return F.silu(gate) * up


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
        self.qkv = Linear(cfg.d_model, 3 * cfg.n_heads * cfg.head_dim, bias=False)  # column-parallel
        self.o = Linear(cfg.n_heads * cfg.head_dim, cfg.d_model, bias=False)  # row-parallel
        self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps)
        self.reduce = Reduce()
        self.core = CacheAttention()
        self.row_parallel: RowParallelStep = GemmThenAllReduce()

    @property
    def local_heads(self) -> int:
        return self.qkv.out_features // (3 * self.head_dim)

    def forward(self, h, layer: int, cache: KVCache) -> torch.Tensor:
        return self.row_parallel(self.core(self.qkv(h), self, layer, cache), self.o, self.reduce)


class SwiGLU(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_up = Linear(cfg.d_model, 2 * cfg.d_ff, bias=False)  # column-parallel: [gate; up]
        self.down = Linear(cfg.d_ff, cfg.d_model, bias=False)  # row-parallel
        self.reduce = Reduce()
        self.act = SwiGLUAct()
        self.row_parallel: RowParallelStep = GemmThenAllReduce()

    def forward(self, h) -> torch.Tensor:
        return self.row_parallel(self.act(self.gate_up(h)), self.down, self.reduce)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.mod_table = nn.Parameter(torch.zeros(6, cfg.d_model))
        self.attn = Attention(cfg)
        self.mlp = SwiGLU(cfg)
        self.res_norm = ResidualNormMod(cfg.norm_eps)

    def forward(self, x: torch.Tensor, h, mod: torch.Tensor, next_mod: torch.Tensor | None, layer: int,
                cache: KVCache):
        """x [T, d] residual stream; h the block's normalized, modulated input (from the previous part); mod
        [6, d] this block's (shift1, scale1, gate1, shift2, scale2, gate2); next_mod the next block's [6, d] or
        None for the last block. Returns (x, the next block's h or None)."""
        _, _, gate1, shift2, scale2, gate2 = mod.unbind(0)
        x, h = self.res_norm(x, self.attn(h, layer, cache), gate1, shift2, scale2)
        m = self.mlp(h)
        if next_mod is None:
            return self.res_norm(x, m, gate2, None, None)
        return self.res_norm(x, m, gate2, next_mod[0], next_mod[1])


def keep_gates(mods: torch.Tensor) -> None:
    """Float part of `VideoDiT.gate_fold`: the gates stay in the residual add (res_norm multiplies them)."""


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
        self.gate_fold = keep_gates  # a part: what the pass does with the gates before its blocks run

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

    # ---- the forward -----------------------------------------------------------------------------------
    def forward(self, latents: torch.Tensor, sigma: float, audio_feats: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """latents [C, H_lat, W_lat] at noise level sigma ∈ (0, 1]; audio_feats [A, F]. Returns velocity [C, H_lat, W_lat]."""
        mods, final = self.modulation(sigma)
        return self.denoise(latents, audio_feats, mods, final, cache)

    def modulation(self, sigma: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Every block's adaLN modulation [L, 6, d] (the shared timestep projection plus each block's table) and
        the head's (shift, scale) [2, d], in the model's dtype, at noise level sigma. A pure function of sigma
        and the weights: an engine with fixed weights computes each level once (worker/model/engine.py)."""
        cfg, dt = self.cfg, self.patch_embed.weight.dtype
        t = torch.tensor([sigma * 1000.0], device=self.patch_embed.weight.device)
        temb = self.time_mlp(timestep_embedding(t).to(dt))  # [1, d]
        tables = torch.stack([blk.mod_table for blk in self.blocks])  # [L, 6, d]
        mods = (self.time_mod(F.silu(temb)).view(1, 6, cfg.d_model) + tables).to(dt)
        final = self.final_mod(F.silu(temb)).view(2, cfg.d_model).to(dt)
        return mods, final

    def embed(self, latents: torch.Tensor, audio_feats: torch.Tensor) -> torch.Tensor:
        """The chunk's tokens [T, d]: its patches, then its audio tokens."""
        cfg, dt = self.cfg, self.patch_embed.weight.dtype
        x = self.patch_embed(self.patchify(latents.to(dt)))
        if cfg.audio_tokens:
            a = self.audio_embed(audio_feats[: cfg.audio_tokens].to(dt)) + self.audio_pos[: cfg.audio_tokens].to(dt)
            x = torch.cat([x, a], dim=0)
        return x

    def denoise(self, latents: torch.Tensor, audio_feats: torch.Tensor, mods: torch.Tensor, final: torch.Tensor,
                cache: KVCache) -> torch.Tensor:
        """The forward after the modulation (module docstring): reads only tensors, so a CUDA graph can capture it."""
        self.gate_fold(mods)
        x = self.embed(latents, audio_feats)
        blocks = self.blocks
        x, h = blocks[0].res_norm(x, None, None, mods[0, 0], mods[0, 1])
        last = len(blocks) - 1
        for i, block in enumerate(blocks):
            x, h = block(x, h, mods[i], mods[i + 1] if i < last else None, i, cache)
        return self.head(x, final)

    def head(self, x: torch.Tensor, final: torch.Tensor) -> torch.Tensor:
        shift, scale = final.to(x.dtype).unbind(0)
        x = self.final_norm(x) * (1 + scale) + shift
        return self.unpatchify(self.out(x[: self.cfg.video_tokens].to(self.out.weight.dtype)).float())

    # ---- the row-parallel step (between chunks only) -------------------------------------------------
    def set_row_parallel_path(self, *, fused: bool, method: str | FusedMethod = FusedMethod.AUTO,
                              chunks: int = 4) -> RowParallelPath:
        """Install the fused GEMM + all-reduce step (fused=True) or GEMM then all-reduce in every block's O and
        down. Returns the path now in effect; NO_TP (and the unfused step) when no block sums over a group of
        more than one rank. Every TP rank must call this at the same chunk boundary."""
        step: RowParallelStep = FusedGemmAllReduce(method, chunks) if fused else GemmThenAllReduce()  # validates
        mods = [m for blk in self.blocks for m in (blk.attn, blk.mlp)]
        if all(m.reduce.fusable_group() is None for m in mods):
            step, path = GemmThenAllReduce(), RowParallelPath.NO_TP
        else:
            path = RowParallelPath.FUSED if fused else RowParallelPath.UNFUSED
        for m in mods:
            m.row_parallel = step
        return path

    @property
    def row_parallel_step(self) -> RowParallelStep:
        return self.blocks[0].attn.row_parallel


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
