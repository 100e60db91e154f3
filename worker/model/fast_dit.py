"""The GPU hot path of one denoising pass: FP8 GEMMs, fused activation quantization, the ring FP8
attention, and the whole pass captured as a CUDA graph.

Same call signature as VideoDiT (`engine(latents, sigma, audio_feats, cache) -> velocity`), same
weights (quantized once to FP8 e4m3 with one scale per output channel), same KV cache object
(optimized mode). Per block and pass (57b, TP=4 rank: N = 757 tokens):

  ln_mod_quant(x)           LayerNorm·(1+scale)+shift → FP8 rows          (kernels/fused_quant.py)
  qkv = fp8_linear          757×8192 · 8192×6144                             (kernels/fp8_gemm.py)
  qkv_ring_write            q/k RMSNorm, RoPE(q, k), FP8 + ring write of k, v, the ring's read image: one
                            kernel (kernels/qkv_ring.py; chunk 0, which also writes the sink, runs the
                            unfused qk_norm_rope + write_kv + image refresh)
  ring_attention            over the ring: "image" = cuDNN SDPA over the read image (bf16 copy of the FP8
                            ring kept current at write time), or the Triton FP8 kernel / per-call
                            dequantization + SDPA (kernels/ring_attention.py); with every slot valid the image
                            attention runs in attn_kv_splits KV parts ("auto": 4 at 57b TP=4), and the parts'
                            combine also quantizes the output for the O GEMM (kernels/split_kv.py)
  quant_rows → o GEMM       757×2048 · 2048×8192, then the TP all-reduce (quant_rows only without the split)
  residual_ln_mod_quant     x += gate·o fused with norm2 + modulation + FP8 rows
  gate_up GEMM              757×8192 · 8192×13824
  swiglu_quant → down       757×6912 · 6912×8192, then the TP all-reduce
  residual_ln_mod_quant     x += gate·down fused with the next block's norm1 + modulation + FP8 rows

With a baseline-mode cache (numerics reference only) the same FP8 GEMMs run with the original per-call
whole-cache work in place of the ring write + ring attention, eagerly.

The O and down projections with their TP sums go through one swappable step, `row_parallel(a8, sa, w8,
sw, reduce) -> bf16` (worker/model/fused_tp.py): `unfused_fp8_row_parallel` (the FP8 GEMM, then the block's
all-reduce) or a `FusedFP8RowParallel` (the GEMM fused with the reduction: torch's symmetric-memory
scaled matmul + reduce-scatter on CUDA/NCCL, chunked overlap elsewhere). `set_row_parallel_path` swaps it
between chunks (`ChunkGenerator.apply_flags`) and drops the captured graphs, which hold the old step's
kernels and collectives, so the next pass captures again.

Static shapes are what make the graph possible: positions, ring slots, the valid mask, sigma and the
inputs live in fixed buffers that are refilled before each replay. Chunk 0 (which also writes the sink)
runs eagerly; every later pass replays the captured graph.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from vivant.kernels.fp8_gemm import fp8_linear, quantize_weight
from vivant.kernels.fused_quant import ln_mod_quant, quant_rows, residual_ln_mod_quant, swiglu_quant
from vivant.kernels.qk_norm_rope import qk_norm_rope
from vivant.kernels.qkv_ring import qkv_ring_write
from vivant.kernels.ring_attention import ring_attention
from vivant.kernels.rope import rope_angles
from vivant.kernels.split_kv import split_kv_attention_fp8
from vivant.worker.model.fused_tp import (
    FusedFP8RowParallel,
    FusedMethod,
    tp_group_of,
    unfused_fp8_row_parallel,
)
from vivant.worker.model.kv_cache import KVCache
from vivant.worker.model.model import VideoDiT, timestep_embedding

log = logging.getLogger(__name__)


def auto_kv_splits(tokens: int, heads: int, slots: int, sms: int, *, q_tile: int = 64, waves: int = 4,
                   max_splits: int = 4) -> int:
    """KV parts per attention call so that cuDNN's flash kernel (one CTA per q_tile queries × head × part; its
    kernel name at these shapes says 64-query tiles) has at least `waves` CTAs per SM: the smallest such P ≤
    max_splits that divides the slots, else 1. No SMs (CPU): 1. At 57b TP=4 (757 tokens, 16 heads, 5,788 slots,
    132 SMs) one call is 192 CTAs, 1.45 waves: P = 4 (768 CTAs) measured 3 ms per chunk faster on an H200 and
    P = 2 no faster (bench/results/tune_57b_tp4_rank0_h200_2026-11-29_*.json); whole-model TP=1 (64 heads, 768
    CTAs) keeps one call."""
    if sms <= 0:
        return 1
    ctas = -(-tokens // q_tile) * heads
    for p in range(1, max_splits + 1):
        if slots % p == 0 and ctas * p >= waves * sms:
            return p
    return 1


class FastDiT:
    # the unfused step until `set_row_parallel_path` swaps it
    row_parallel = staticmethod(unfused_fp8_row_parallel)
    row_parallel_path = "gemm_then_all_reduce"
    fast_accum = False  # cuBLASLt FP8 fast accumulation in all four GEMMs (kernels/fp8_gemm.py); set before capture
    # image backend: the slots in this many parts per attention call (kernels/split_kv.py), or "auto"
    # (auto_kv_splits: enough parts to fill the GPU's SMs); set before capture
    attn_kv_splits: int | str = "auto"
    # Triton kernels launched with programmatic dependent launch (kernels/backend.py), by the library kernel they
    # follow; set before capture. PDL_SITES: "qkv" (QKV GEMM → ring write), "attn" (attention → O quantization),
    # "o" (O GEMM → residual + norm2), "gate_up" (gate/up GEMM → SwiGLU), "down" (down GEMM → residual + norm1).
    pdl: frozenset[str] = frozenset()
    PDL_SITES = frozenset({"qkv", "attn", "o", "gate_up", "down"})

    def __init__(self, model: VideoDiT, *, attn_backend: str = "triton", use_graphs: bool = True,
                 drop_bf16: bool = False,
                 fp8_weights: list[list[tuple[torch.Tensor, torch.Tensor]]] | None = None):
        """fp8_weights: per block [(w8, scale)] for qkv, o, gate_up, down, already quantized (a rank built
        block by block without keeping bf16 copies, bench/gpu_step.py); None quantizes the model's weights."""
        if not next(model.parameters()).is_cuda and use_graphs:
            raise RuntimeError("FastDiT: CUDA graphs need the model on a CUDA device (use_graphs=False on CPU)")
        self.m, self.cfg = model, model.cfg
        self.attn_backend, self.use_graphs = attn_backend, use_graphs
        self.device = next(model.parameters()).device
        self.mod_tables = torch.stack([blk.mod_table.detach() for blk in model.blocks])  # [L, 6, d]
        if fp8_weights is not None:
            if len(fp8_weights) != len(model.blocks) or any(len(b) != 4 for b in fp8_weights):
                raise ValueError(f"FastDiT: fp8_weights must hold 4 (weight, scale) pairs for each of the "
                                 f"{len(model.blocks)} blocks")
            self.w = fp8_weights
        else:
            self.w = []
            for blk in model.blocks:
                packed = []
                for lin in (blk.attn.qkv, blk.attn.o, blk.mlp.gate_up, blk.mlp.down):
                    packed.append(quantize_weight(lin.weight.data))
                    if drop_bf16:
                        lin.weight = torch.nn.Parameter(torch.empty(0, device=self.device), requires_grad=False)
                self.w.append(packed)
        self.local_heads = self.w[0][0][0].shape[0] // (3 * self.cfg.head_dim)  # from the (FP8) QKV rows
        self._graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._static: dict[str, torch.Tensor] | None = None
        self._mod_cache: dict[float, tuple[torch.Tensor, torch.Tensor]] = {}
        self.graph_replays = 0
        self.eager_calls = 0

    # ---- the row-parallel step (between chunks only) ---------------------------------------------------
    def set_row_parallel_path(self, *, fused: bool, method: str | FusedMethod = FusedMethod.AUTO,
                              chunks: int = 4) -> str:
        """Swap the O/down step between GEMM + all-reduce and the fused step; returns the path in effect:
        "fused_gemm_all_reduce", "gemm_then_all_reduce", or "no_tp" when no block sums over a real group
        (TP = 1, or the one-GPU simulated reduce), which then keeps the unfused step. A change drops the
        captured CUDA graphs so the next pass captures the new step. Every TP rank must call this at the
        same chunk boundary (the ranks must issue the same collectives)."""
        step = FusedFP8RowParallel(method, chunks) if fused else unfused_fp8_row_parallel  # validates first
        reduces = [mod.reduce for blk in self.m.blocks for mod in (blk.attn, blk.mlp)]
        if all(tp_group_of(r) is False for r in reduces):
            step, path = unfused_fp8_row_parallel, "no_tp"
        else:
            path = "fused_gemm_all_reduce" if fused else "gemm_then_all_reduce"
        if step != self.row_parallel:
            self.row_parallel = step
            if self._graphs:
                log.info("row-parallel step now %s: dropping %d captured CUDA graph(s)", path, len(self._graphs))
                self._graphs.clear()
        self.row_parallel_path = path
        return path

    # ---- one pass, reading only static buffers -------------------------------------------------------
    def _attend(self, i, blk, qkv, s, cache: KVCache, sink_pos, all_valid,
                splits: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The chunk's attention for block i, quantized for the O projection: (FP8 [N, H·D], scales [N]).
        splits: the resolved attn_kv_splits (_kv_splits, once per pass)."""
        cfg, n, h, d = self.cfg, qkv.shape[0], self.local_heads, self.cfg.head_dim
        v = qkv.view(n, 3, h, d)[:, 2]
        if cache.mode == "baseline":  # the original per-call whole-cache work, same GEMMs (numerics reference)
            q, k = qkv.view(n, 3, h, d)[:, 0], qkv.view(n, 3, h, d)[:, 1]
            return quant_rows(cache.attend(i, blk.attn.q_norm(q), blk.attn.k_norm(k), v).reshape(n, h * d))
        images = (cache.k_image[i], cache.v_image[i]) if cache.k_image is not None else (None, None)
        if sink_pos is None:  # every graph-captured pass: QKV → q_rot, ring and image in one kernel
            q_rot = qkv_ring_write(qkv, blk.attn.q_norm.weight, blk.attn.k_norm.weight, s["cos"], s["sin"], s["slots"],
                                   cache.k[i], cache.v[i], cache.k_scale[i], cache.v_scale[i], h, eps=cfg.norm_eps,
                                   k_image=images[0], v_image=images[1], pdl="qkv" in self.pdl)
            # the split-KV attention with the O projection's quantization fused into its combine, where it applies
            # (image backend, every slot valid, parts dividing the slots; else ring_attention below logs why not)
            if splits > 1 and self.attn_backend == "image" and all_valid and cache.layout.slots % splits == 0:
                q_parts = q_rot.transpose(0, 1).unsqueeze(0).expand(splits, h, n, d)  # a view: cuDNN reads it as is
                return split_kv_attention_fp8(q_parts, images[0], images[1], pdl="attn" in self.pdl)
        else:  # chunk 0 (eager) also writes the sink at its own positions: the unfused kernels
            q_rot, k = qk_norm_rope(qkv, blk.attn.q_norm.weight, blk.attn.k_norm.weight, s["cos"], s["sin"], h,
                                    eps=cfg.norm_eps)
            cache.write_chunk(i, k, v, s["pos"], s["slots"], sink_pos, s["sink_slots"])
        img = images if self.attn_backend == "image" else (None, None)
        att = ring_attention(q_rot, cache.k[i], cache.v[i], cache.k_scale[i], cache.v_scale[i], s["valid"],
                             backend=self.attn_backend, all_valid=all_valid, k_image=img[0], v_image=img[1],
                             kv_splits=splits)
        return quant_rows(att.reshape(n, h * d), pdl="attn" in self.pdl)

    def _kv_splits(self, cache: KVCache) -> int:
        """attn_kv_splits as a number ("auto" resolved by auto_kv_splits for this GPU and ring)."""
        p = self.attn_kv_splits
        if p == "auto":
            sms = torch.cuda.get_device_properties(self.device).multi_processor_count if self.device.type == "cuda" else 0
            return auto_kv_splits(self.cfg.tokens_per_chunk, self.local_heads, cache.layout.slots, sms)
        if isinstance(p, bool) or not isinstance(p, int) or p < 1:
            raise ValueError(f"FastDiT: attn_kv_splits must be an int >= 1 or 'auto', got {p!r}")
        return p

    def _pass(self, s: dict[str, torch.Tensor], cache: KVCache, sink_pos: torch.Tensor | None, all_valid: bool):
        m, cfg = self.m, self.cfg
        dt = m.patch_embed.weight.dtype
        x = m.patch_embed(m.patchify(s["lat"].to(dt)))
        if cfg.audio_tokens:
            a = m.audio_embed(s["feats"].to(dt)) + m.audio_pos[: cfg.audio_tokens].to(dt)
            x = torch.cat([x, a], dim=0)
        mods = s["mods"]  # [L, 6, d]: this noise level's modulation (self._modulation), refilled per pass
        eps = cfg.norm_eps
        pdl, splits = self.pdl, self._kv_splits(cache)
        a8, a_s = ln_mod_quant(x, mods[0, 0], mods[0, 1], eps=eps)
        last = len(m.blocks) - 1
        for i, blk in enumerate(m.blocks):
            (wqkv, sqkv), (wo, so), (wgu, sgu), (wdn, sdn) = self.w[i]
            gate1, shift2, scale2, gate2 = mods[i, 2], mods[i, 3], mods[i, 4], mods[i, 5]
            fa = self.fast_accum
            o8, o_s = self._attend(i, blk, fp8_linear(a8, a_s, wqkv, sqkv, fast_accum=fa), s, cache, sink_pos,
                                   all_valid, splits)
            o = self.row_parallel(o8, o_s, wo, so, blk.attn.reduce, fast_accum=fa)
            x, h8, h_s = residual_ln_mod_quant(x, o, gate1, shift2, scale2, eps=eps, pdl="o" in pdl)  # x += g1·o
            d8, d_s = swiglu_quant(fp8_linear(h8, h_s, wgu, sgu, fast_accum=fa), pdl="gate_up" in pdl)
            dn = self.row_parallel(d8, d_s, wdn, sdn, blk.mlp.reduce, fast_accum=fa)
            if i < last:  # x += g2·down, fused with the next block's norm1 + modulation + quantization
                x, a8, a_s = residual_ln_mod_quant(x, dn, gate2, mods[i + 1, 0], mods[i + 1, 1], eps=eps,
                                                   pdl="down" in pdl)
            else:
                x = x + gate2 * dn
        shift, scale = s["final_mod"].unbind(0)
        x = m.final_norm(x) * (1 + scale) + shift
        return m.unpatchify(m.out(x[: cfg.video_tokens]).float())

    def _modulation(self, sigma: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Every block's adaLN modulation [L, 6, d] and the final layer's (shift, scale) [2, d] at noise level
        sigma. A pure function of sigma (timestep MLP → modulation projections + the blocks' tables): the
        schedule has `passes` levels, so each is computed once, eagerly, and reused by every chunk instead of
        re-reading the d×6d projection (805 MB in bf16 at 57b) in every pass. The engine's weights are fixed
        at construction; a new checkpoint means a new engine."""
        cache = self._mod_cache
        hit = cache.get(sigma)
        if hit is None:
            m, cfg = self.m, self.cfg
            dt = m.patch_embed.weight.dtype
            t = torch.full((1,), sigma, dtype=torch.float32, device=self.device) * 1000.0
            temb = m.time_mlp(timestep_embedding(t).to(dt))
            mods = (m.time_mod(F.silu(temb)).view(1, 6, cfg.d_model) + self.mod_tables).to(dt)
            final = m.final_mod(F.silu(temb)).view(2, cfg.d_model).to(dt)
            if len(cache) >= 32:  # a session never has more levels than its schedule; bound it anyway
                cache.pop(next(iter(cache)))
            hit = cache[sigma] = (mods, final)
        return hit

    def _fill(self, latents, sigma, feats, cache: KVCache) -> dict[str, torch.Tensor]:
        st = cache.state
        if self._static is None:
            cfg, dev = self.cfg, self.device
            dt = self.m.patch_embed.weight.dtype
            self._static = {
                "mods": torch.empty(cfg.n_layers, 6, cfg.d_model, dtype=dt, device=dev),
                "final_mod": torch.empty(2, cfg.d_model, dtype=dt, device=dev),
                "lat": torch.empty(cfg.latent_channels, cfg.latent_h, cfg.latent_w, device=dev),
                "feats": torch.empty(cfg.audio_tokens, cfg.audio_feature_dim, device=dev),
                "sigma": torch.empty(1, device=dev),
                "pos": torch.empty(cfg.tokens_per_chunk, 3, dtype=torch.int64, device=dev),
                "slots": torch.empty(cfg.tokens_per_chunk, dtype=torch.int64, device=dev),
                "valid": torch.empty(cache.layout.slots, dtype=torch.bool, device=dev),
                "cos": torch.empty(cfg.tokens_per_chunk, cfg.head_dim // 2, dtype=torch.float32, device=dev),
                "sin": torch.empty(cfg.tokens_per_chunk, cfg.head_dim // 2, dtype=torch.float32, device=dev),
                "sink_slots": cache.layout.sink_slots().to(dev),
            }
        s = self._static
        s["lat"].copy_(latents)
        s["feats"].copy_(feats[: self.cfg.audio_tokens])
        s["sigma"].fill_(float(sigma))
        mods, final = self._modulation(float(sigma))
        s["mods"].copy_(mods)
        s["final_mod"].copy_(final)
        # positions change once per chunk, not per pass. The key is host-side (the chunk index and the cache's
        # count of position shifts): reading a device tensor here would make the host wait for the previous
        # pass before it can launch the next one, leaving the GPU idle at every pass boundary.
        key = (id(cache), st.chunk, cache.position_shift)
        if self._pos_key != key:
            ang = rope_angles(st.pos, self.cfg.rope_dims, self.cfg.rope_theta)  # on the device: no round trip
            s["cos"].copy_(ang.cos())
            s["sin"].copy_(ang.sin())
            s["pos"].copy_(st.pos)
            s["slots"].copy_(st.slots)
            s["valid"].copy_(st.valid)
            self._pos_key = key
        return s

    _pos_key = None

    @torch.no_grad()
    def __call__(self, latents: torch.Tensor, sigma: float, feats: torch.Tensor, cache: KVCache) -> torch.Tensor:
        st = cache.state
        if cache.mode == "optimized" and not cache.fp8:
            raise ValueError("FastDiT's optimized path reads an FP8 ring (KVCache fp8=True)")
        if cache.mode == "optimized" and self.attn_backend == "image":
            cache.enable_read_image(torch.bfloat16)  # q's dtype: the FP8 GEMMs write bf16
        if not self.pdl <= self.PDL_SITES:
            raise ValueError(f"FastDiT: pdl sites must be among {sorted(self.PDL_SITES)}, got unknown "
                             f"{sorted(self.pdl - self.PDL_SITES)}")
        s = self._fill(latents, sigma, feats, cache)
        all_valid = bool(st.valid.all())
        sink = st.sink_pos.to(self.device) if st.sink_pos is not None else None
        if not self.use_graphs or sink is not None or cache.mode == "baseline":
            self.eager_calls += 1
            return self._pass(s, cache, sink, all_valid)
        key = (id(cache.k), all_valid if self.attn_backend in ("sdpa", "image") else None)
        if key not in self._graphs:
            self._graphs[key] = self._capture(s, cache, all_valid)
        graph, out = self._graphs[key]
        graph.replay()
        self.graph_replays += 1
        return out.clone()

    def _capture(self, s, cache, all_valid):
        side = torch.cuda.Stream(device=self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):  # warm-up: kernel compilation, autotuning, cuBLAS handles
                self._pass(s, cache, None, all_valid)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = self._pass(s, cache, None, all_valid)
        log.info("captured a CUDA graph of one denoising pass (%d layers)", self.cfg.n_layers)
        return graph, out
