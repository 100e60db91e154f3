"""The ablation's variant parts: what each row of `vivant bench step --ablation` (bench/ablation.py) swaps into a
built engine to undo one choice of the served one. The engine (worker/model/) holds only the served parts and the
float32 reference; a variant here replaces parts of a `VideoDiT` that `install_parts` built, the way the engine
installs its own (one model forward, swappable parts), and never adds a branch inside a served part.

  whole_window   `WholeWindowAttention` + `WholeWindowCache`: what streaming peers do — the window kept as the QKV
                 projection gives it (k after its RMSNorm, not rotated), in bf16, one row per ring slot and head;
                 on EVERY attention call every key is rotated to its slot's current position (one
                 `torch.compile`d function on a GPU: inductor fuses the rotation and the store; its eager form on a
                 CPU), then the image attention the ring uses reads that rotated window. The ring rotates once, at
                 write, and delta-rotates at a position reset; this policy re-derives the rotation per call, so a
                 reset only moves the kept positions. Only the policy differs, not the precision (both bf16). Per
                 call at 57b TP=4 (S = 5,788 slots, 16 heads, D = 128) it reads and writes S·H·D keys (≈ 24 MB).
  bf16_gemm      `install_bf16_gemm`: the float projections stay (bf16 GEMMs); residual/LayerNorm/modulation and
                 SwiGLU are the float parts through `torch.compile` on a GPU (kernels/fused_quant.py has no
                 non-quantizing form); attention's output stays bf16 (`UnquantizedOutputAttention`).
  bf16_o_gemm    `install_bf16_o_gemm`: the FP8 engine with the O projection alone on its float weights (a bf16
                 GEMM) and attention's output unquantized; the other three projections stay FP8.
  unfused_norm   `install_unfused_norm`: the FP8 engine with residual/LayerNorm/modulation and SwiGLU as torch ops
                 (the float parts), then `quant_rows`; the residual stays out of the GEMM epilogue.

Shapes: window k, v [L, S, H, D]; slot positions [S, 3] int64 (device); cos, sin [S, D/2] float32 (device).
"""

from __future__ import annotations

import functools

import torch
from vivant.kernels.fused_quant import quant_rows
from vivant.kernels.qk_norm_rope import qk_norm_rope
from vivant.kernels.ring_attention import ring_attention
from vivant.kernels.rope import _rotate_pairs as rotate_pairs
from vivant.kernels.rope import rope_angles
from vivant.kernels.split_kv import split_kv_sdpa
from vivant.worker.model.fast_parts import Fp8RingAttention, GatedRowSum, Rows8, fork, install_parts
from vivant.worker.model.kv_cache import KVCache, StepState
from vivant.worker.model.model import ResidualNormMod, SwiGLUAct, VideoDiT, keep_gates
from vivant.worker.model.options import CacheMode, EngineOptions

VARIANTS = ("whole_window", "bf16_gemm", "bf16_o_gemm", "unfused_norm")


# ---- whole window ----------------------------------------------------------------------------------------------
def rotate_window_eager(k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                        sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """k [S, H, D] un-rotated; cos, sin [S, D/2] → (k rotated to its positions in k's dtype, v as kept)."""
    return rotate_pairs(k.float(), cos[:, None, :], sin[:, None, :]).to(k.dtype), v


@functools.cache
def rotate_window_compiled():
    """The per-call function through torch.compile (inductor, default mode: no CUDA graphs of its own, so the
    engine's captured graph can hold its kernels; fullgraph: a graph break would fail loudly, not run eagerly)."""
    return torch.compile(rotate_window_eager, fullgraph=True, dynamic=False)


class WindowStore:
    """The whole-window policy's state for all layers of one rank: un-rotated K/V [L, S, H, D] in `dtype`, the
    rotary angles of every slot's current position [S, D/2] (refilled per chunk, fixed addresses). `compiled`
    picks the compiled per-call function (a GPU) or the eager one (a CPU)."""

    def __init__(self, *, layers: int, slots: int, heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, compiled: bool) -> None:
        self.k = torch.zeros(layers, slots, heads, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros(layers, slots, heads, head_dim, dtype=dtype, device=device)
        self.cos = torch.ones(slots, head_dim // 2, device=device)
        self.sin = torch.zeros(slots, head_dim // 2, device=device)
        self.rotate = rotate_window_compiled() if compiled else rotate_window_eager

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.k, self.v, self.cos, self.sin))

    def set_angles(self, positions: torch.Tensor, rope_dims: tuple[int, int, int], theta: float) -> None:
        """The angles of every slot at `positions` [S, 3] (its current position in the frame)."""
        ang = rope_angles(positions.to(self.cos.device), rope_dims, theta)
        self.cos.copy_(ang.cos())
        self.sin.copy_(ang.sin())

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        """The chunk's normalized, un-rotated k and its v [T, H, D] into `slots` [T] of `layer`."""
        self.k[layer].index_copy_(0, slots, k.to(self.k.dtype))
        self.v[layer].index_copy_(0, slots, v.to(self.v.dtype))

    def images(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The per-call whole-window work of `layer`: every key rotated → (k, v) [S, H, D] attention reads."""
        return self.rotate(self.k[layer], self.v[layer], self.cos, self.sin)

    def clear(self) -> None:
        self.k.zero_()
        self.v.zero_()


class WholeWindowCache(KVCache):
    """The ring cache plus what the whole-window policy keeps beside it: every slot's current position (updated at
    chunk boundaries and position resets, on the device: no host sync) and the `WindowStore` (allocated at the
    first attention call, before any CUDA graph capture: the engine's chunk 0 runs eagerly). `adopt` turns a
    generator's cache into one (the generator built it; this swaps its class and adds the state). No undo log:
    a rewind other than to the session's start is refused."""

    @classmethod
    def adopt(cls, cache: KVCache) -> WholeWindowCache:
        if cache.mode is not CacheMode.OPTIMIZED:
            raise ValueError("WholeWindowCache: the whole-window store sits beside the ring (mode='optimized')")
        cache.__class__ = cls
        cache.slot_pos = torch.zeros(cache.layout.slots, 3, dtype=torch.int64, device=cache.device)
        cache.window = None
        return cache

    def enable_whole_window(self, dtype: torch.dtype) -> WindowStore:
        if self.window is None:
            self.window = WindowStore(layers=self.layers, slots=self.layout.slots, heads=self.heads,
                                      head_dim=self.head_dim, dtype=dtype, device=self.device,
                                      compiled=self.device.type == "cuda")
            self.window.set_angles(self.slot_pos, self.rope_dims, self.rope_theta)
        elif self.window.k.dtype != dtype:
            raise ValueError(f"WholeWindowCache: the store is {self.window.k.dtype}, asked for {dtype}")
        return self.window

    def _fill_step(self, st: StepState) -> None:
        super()._fill_step(st)
        self.slot_pos[self.step.slots] = st.pos.to(self.device)
        if self.step.writes_sink:
            self.slot_pos[self.step.sink_slots] = st.sink_pos.to(self.device)
        if self.window is not None:
            self.window.set_angles(self.slot_pos, self.rope_dims, self.rope_theta)

    def shift_positions(self, delta: int, resident_slots: torch.Tensor) -> None:
        super().shift_positions(delta, resident_slots)
        self.slot_pos[resident_slots.to(self.device), 0] -= delta  # the window's keys re-rotate from these per call

    def clear(self) -> None:
        super().clear()
        self.slot_pos.zero_()
        if self.window is not None:
            self.window.clear()
            self.window.set_angles(self.slot_pos, self.rope_dims, self.rope_theta)

    def rewind(self, to_chunk: int) -> None:
        if to_chunk not in (0, self.next_chunk):
            raise ValueError("WholeWindowCache.rewind: the whole-window policy keeps no undo log; rewind serves the "
                             "ring only")
        super().rewind(to_chunk)


class WholeWindowAttention(Fp8RingAttention):
    """QKV rows → q/k RMSNorm and RoPE(q) at the chunk's positions, the un-rotated k and v into the window store at
    the chunk's slots (and the sink's while chunk 0 runs), then every key of the window re-rotated, and attention
    over that image — the image backend's calls (split-KV when every slot is valid and `kv_splits` > 1) whatever
    `backend` says, since the rotated window is what this policy produces. Needs a `WholeWindowCache`."""

    def __call__(self, qkv: torch.Tensor, attn, layer: int, cache: WholeWindowCache):
        n, h, d = qkv.shape[0], attn.local_heads, attn.head_dim
        if cache.mode is CacheMode.BASELINE:
            return self.baseline(qkv, attn, layer, cache)
        step, window = cache.step, cache.enable_whole_window(qkv.dtype)
        q_rot, k = qk_norm_rope(qkv, attn.q_norm.weight, attn.k_norm.weight, step.cos, step.sin, h,
                                eps=attn.q_norm.eps)
        v = qkv.view(n, 3, h, d)[:, 2]
        window.write(layer, k, v, step.slots)
        if step.writes_sink:
            ns = step.sink_slots.shape[0]
            window.write(layer, k[:ns], v[:ns], step.sink_slots)
        k_img, v_img = window.images(layer)
        splits = self.splits(cache, h)
        if splits > 1 and step.all_valid and cache.layout.slots % splits == 0:
            return self.split_attend(q_rot, k_img, v_img, splits)
        att = ring_attention(q_rot, k_img, v_img, step.valid, backend="image", all_valid=step.all_valid)
        return self.rows(att.reshape(n, h * d))


def install_whole_window(fp8_model: VideoDiT, options: EngineOptions) -> VideoDiT:
    """The served parts with every block's attention the whole-window policy's (the generator's cache must be
    adopted: `WholeWindowCache.adopt(gen.cache)`)."""
    m = install_parts(fp8_model, options)
    core = WholeWindowAttention(options.attention, options.kv_splits)
    for blk in m.blocks:
        blk.attn.core = core
    return m


# ---- an unquantized O input: bf16 GEMMs, or the O GEMM alone in bf16 ----------------------------------------------
class UnquantizedOutputAttention(Fp8RingAttention):
    """`Fp8RingAttention` whose output rows stay unquantized, for a float O projection: [T, h·D] in q's dtype
    (split-KV: `split_kv_sdpa`'s unquantized combine)."""

    def rows(self, att: torch.Tensor) -> torch.Tensor:
        return att

    def split_attend(self, q_rot: torch.Tensor, k: torch.Tensor, v: torch.Tensor, splits: int) -> torch.Tensor:
        n, h, d = q_rot.shape
        return split_kv_sdpa(q_rot, k, v, splits).reshape(n, h * d)

    def __call__(self, qkv: torch.Tensor, attn, layer: int, cache: KVCache) -> torch.Tensor:
        # the O projection's dtype (bf16 on a GPU, a no-op; the CPU twins' float32 model)
        return super().__call__(qkv, attn, layer, cache).to(attn.o.weight.dtype)


def compiled_part(part, device: torch.device):
    """`part` (a callable of tensors) through torch.compile on a GPU (inductor fuses its elementwise ops and
    reductions into Triton kernels; compiled at its first call, which the engine makes eagerly before any CUDA
    graph capture); unchanged on a CPU (the tests run its eager form). One compiled object serves every block."""
    if device.type != "cuda":
        return part
    return torch.compile(part, fullgraph=True, dynamic=False)


def install_bf16_gemm(model: VideoDiT, options: EngineOptions) -> VideoDiT:
    """A fork of the float `model` (its bf16 projections) with the served ring write and attention, attention's
    output unquantized, and the float residual/norm/modulation and SwiGLU compiled on a GPU."""
    m = fork(model)
    dev = m.patch_embed.weight.device
    res_norm, act = compiled_part(ResidualNormMod(m.cfg.norm_eps), dev), compiled_part(SwiGLUAct(), dev)
    core = UnquantizedOutputAttention(options.attention, options.kv_splits)
    for blk in m.blocks:
        blk.res_norm, blk.attn.core, blk.mlp.act = res_norm, core, act
    m.gate_fold = keep_gates
    return m


def install_bf16_o_gemm(model: VideoDiT, options: EngineOptions) -> VideoDiT:
    """The served parts over the float `model`, except every block's O projection: its float weights (a bf16 GEMM)
    fed attention's unquantized output; the O residual is added by the residual kernel."""
    m = install_parts(model, options)
    core = UnquantizedOutputAttention(options.attention, options.kv_splits)
    for blk, float_blk in zip(m.blocks, model.blocks, strict=True):
        blk.attn.o, blk.attn.core = float_blk.attn.o, core
    return m


# ---- unfused norm ------------------------------------------------------------------------------------------------
class UnfusedFp8ResidualNormMod:
    """`Fp8ResidualNormMod` as separate ops: the float part (`ResidualNormMod`: x += gate·delta, LayerNorm,
    modulation, each a torch op in x's dtype), then `quant_rows`."""

    def __init__(self, eps: float) -> None:
        self.float_part = ResidualNormMod(eps)

    def __call__(self, x, delta, gate, shift, scale) -> tuple[torch.Tensor, Rows8 | None]:
        if isinstance(delta, GatedRowSum):
            delta = delta.materialize()
        x, h = self.float_part(x, delta, gate, shift, scale)
        return x, None if h is None else Rows8(*quant_rows(h))


class UnfusedFp8SwiGLU:
    """`Fp8SwiGLU` as separate ops: silu(gate)·up as torch ops (`SwiGLUAct`), then `quant_rows`."""

    def __init__(self) -> None:
        self.float_part = SwiGLUAct()

    def __call__(self, gu: torch.Tensor) -> Rows8:
        return Rows8(*quant_rows(self.float_part(gu)))


def install_unfused_norm(fp8_model: VideoDiT, options: EngineOptions) -> VideoDiT:
    """The served parts with the norm/modulation/quantization and SwiGLU as torch ops, the residual added after
    the GEMM (the unfused parts have no epilogue form)."""
    m = install_parts(fp8_model, options.replace(residual_in_gemm=False))
    res_norm, act = UnfusedFp8ResidualNormMod(m.cfg.norm_eps), UnfusedFp8SwiGLU()
    for blk in m.blocks:
        blk.res_norm, blk.mlp.act = res_norm, act
    return m


def install_variant(name: str, *, model: VideoDiT, fp8_model: VideoDiT, options: EngineOptions) -> VideoDiT:
    """Variant `name`'s model: `model` holds the float (bf16) projections, `fp8_model` the FP8 ones (may be the
    same model when it still has its float projections)."""
    if name == "whole_window":
        return install_whole_window(fp8_model, options)
    if name == "bf16_gemm":
        return install_bf16_gemm(model, options)
    if name == "bf16_o_gemm":
        return install_bf16_o_gemm(model, options)
    if name == "unfused_norm":
        return install_unfused_norm(fp8_model, options)
    raise ValueError(f"ablation variant = {name!r}; expected one of {', '.join(VARIANTS)}")
