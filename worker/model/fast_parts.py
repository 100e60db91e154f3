"""The FP8 implementations of the DiT's parts, with the float parts' call signatures (worker/model/model.py).

`install_parts(model, options)` swaps them into a `VideoDiT` (in place, or into a structural copy that shares the
float model's other weights), as gpt-fast swaps modules and Liger patches them: the forward stays the model's.
Per block and pass (57b, TP = 4 rank: N = 757 tokens):

  res_norm                  `Fp8ResidualNormMod`: x += gate·delta fused with LayerNorm · (1+scale) + shift and
                            the FP8 quantization of the rows (kernels/fused_quant.py); one call joins a block's
                            end to the next block's start, so every GEMM input arrives quantized (`Rows8`)
  qkv, o, gate_up, down     `Fp8Linear`: weights quantized once to e4m3 with one scale per output channel,
                            `fp8_linear` (cuBLASLt `_scaled_mm`, rowwise scales; optional fast accumulation)
  attn.core                 `Fp8RingAttention`: `KVCache.write_qkv` (q/k RMSNorm, RoPE of q and k, FP8 + ring
                            write of k and v, the read image — one kernel, chunk 0's sink included), then the
                            attention (EngineOptions.attention): "image" = cuDNN SDPA over the ring's read
                            image, in `kv_splits` KV parts with every slot valid (the parts' combine quantizes
                            the output for the O GEMM, kernels/split_kv.py), "sdpa" = whole-ring dequantization
                            per call, "torch" = the float32 twin; the output quantized for the O GEMM
  mlp.act                   `Fp8SwiGLU`: silu(gate)·up → FP8 rows (kernels/fused_quant.py)
  row_parallel (O, down)    unchanged: `GemmThenAllReduce` / `FusedGemmAllReduce` call the Fp8Linear's product or
                            its fused product + TP sum (worker/model/fused_tp.py)

With a baseline-mode cache (numerics reference only) `Fp8RingAttention` runs the cache's per-call whole-cache
work in place of the ring write and attention, with the same FP8 GEMMs. On a CPU every kernel runs its float32
twin (or Triton's interpreter under TRITON_INTERPRET=1), which is how CI checks this path.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.distributed as dist
import torch.nn as nn
from vivant.kernels.fp8_gemm import fp8_linear, quantize_weight
from vivant.kernels.fused_quant import ln_mod_quant, quant_rows, residual_ln_mod_quant, swiglu_quant
from vivant.kernels.ring_attention import ring_attention
from vivant.kernels.split_kv import split_kv_attention_fp8
from vivant.worker.model.fused_tp import FusedMethod, fp8_matmul_all_reduce
from vivant.worker.model.options import AttentionBackend, CacheMode, EngineOptions

if TYPE_CHECKING:
    from vivant.worker.model.kv_cache import KVCache
    from vivant.worker.model.model import Attention, VideoDiT


class Rows8(NamedTuple):
    """Activation rows quantized for an FP8 GEMM: q float8_e4m3fn [M, K], scale float32 [M] (one per row)."""

    q: torch.Tensor
    scale: torch.Tensor


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


class Fp8Linear(nn.Module):
    """A bias-free linear with FP8 e4m3 weights w8 [N, K] and one float32 scale per output channel sw [N]; takes
    `Rows8` and returns bf16 [M, N]. The weights are plain attributes, not buffers, so `module.to(dtype)` never
    casts them."""

    def __init__(self, w8: torch.Tensor, sw: torch.Tensor, *, fast_accum: bool = False) -> None:
        super().__init__()
        if w8.dtype != torch.float8_e4m3fn or sw.shape != (w8.shape[0],):
            raise ValueError(f"Fp8Linear: expected float8_e4m3fn weights [N, K] and scales [N], got {w8.dtype} "
                             f"{tuple(w8.shape)} / {tuple(sw.shape)}")
        self.w8, self.sw, self.fast_accum = w8, sw, fast_accum
        self.out_features, self.in_features = w8.shape

    @classmethod
    def quantize(cls, linear: nn.Linear, *, fast_accum: bool = False) -> Fp8Linear:
        if linear.bias is not None:
            raise ValueError("Fp8Linear: the DiT's projections have no bias; got a linear with one")
        return cls(*quantize_weight(linear.weight.data), fast_accum=fast_accum)

    def as_fp8(self, *, fast_accum: bool) -> Fp8Linear:
        """The same FP8 weights with this fast-accumulation setting (a rank built already quantized)."""
        return Fp8Linear(self.w8, self.sw, fast_accum=fast_accum)

    def forward(self, a: Rows8) -> torch.Tensor:
        return fp8_linear(a.q, a.scale, self.w8, self.sw, fast_accum=self.fast_accum)

    def matmul_all_reduce(self, a: Rows8, group: dist.ProcessGroup, method: FusedMethod, chunks: int) -> torch.Tensor:
        return fp8_matmul_all_reduce(a.q, a.scale, self.w8, self.sw, group, method, chunks, fast_accum=self.fast_accum)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fast_accum={self.fast_accum}"


class Fp8ResidualNormMod:
    """`x += gate·delta` (skipped when delta is None), `LN(x)·(1 + scale) + shift` quantized to FP8 rows, in one
    kernel. Returns (x, Rows8)."""

    def __init__(self, eps: float) -> None:
        self.eps = eps

    def __call__(self, x: torch.Tensor, delta: torch.Tensor | None, gate: torch.Tensor | None,
                 shift: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, Rows8]:
        if delta is None:
            return x, Rows8(*ln_mod_quant(x, shift, scale, eps=self.eps))
        x, q, s = residual_ln_mod_quant(x, delta, gate, shift, scale, eps=self.eps)
        return x, Rows8(q, s)


class Fp8SwiGLU:
    """[T, 2F] (gate | up) → silu(gate)·up as FP8 rows."""

    def __call__(self, gu: torch.Tensor) -> Rows8:
        return Rows8(*swiglu_quant(gu))


class Fp8RingAttention:
    """QKV rows [T, 3·h·D] → the ring write and attention → the output as FP8 rows [T, h·D] for the O GEMM."""

    def __init__(self, backend: AttentionBackend, kv_splits: int | str) -> None:
        self.backend, self.kv_splits = AttentionBackend(backend), kv_splits
        self._splits: dict[tuple, int] = {}

    def splits(self, cache: KVCache, heads: int) -> int:
        """kv_splits as a number ("auto": `auto_kv_splits` for this device and ring, resolved once)."""
        if self.kv_splits != "auto":
            return int(self.kv_splits)
        key = (cache.device, heads, cache.layout.slots)
        if key not in self._splits:
            dev = cache.device
            sms = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 0
            self._splits[key] = auto_kv_splits(cache.layout.tokens_per_chunk, heads, cache.layout.slots, sms)
        return self._splits[key]

    def __call__(self, qkv: torch.Tensor, attn: Attention, layer: int, cache: KVCache) -> Rows8:
        n, h, d = qkv.shape[0], attn.local_heads, attn.head_dim
        if cache.mode is CacheMode.BASELINE:  # the original per-call whole-cache work, same GEMMs (numerics reference)
            q, k, v = qkv.view(n, 3, h, d).unbind(1)
            return Rows8(*quant_rows(cache.attend(layer, attn.q_norm(q), attn.k_norm(k), v).reshape(n, h * d)))
        q_rot = cache.write_qkv(layer, qkv, attn.q_norm.weight, attn.k_norm.weight, attn.q_norm.eps)
        step, splits = cache.step, self.splits(cache, h)
        image = self.backend is AttentionBackend.IMAGE
        if image and splits > 1 and step.all_valid and cache.layout.slots % splits == 0:
            # split-KV attention with the O projection's quantization fused into its combine
            q_parts = q_rot.transpose(0, 1).unsqueeze(0).expand(splits, h, n, d)  # a view: cuDNN reads it as is
            return Rows8(*split_kv_attention_fp8(q_parts, cache.k_image[layer], cache.v_image[layer]))
        att = ring_attention(q_rot, cache.k[layer], cache.v[layer], cache.k_scale[layer], cache.v_scale[layer],
                             step.valid, backend=self.backend, all_valid=step.all_valid,
                             k_image=cache.k_image[layer] if image else None,
                             v_image=cache.v_image[layer] if image else None, kv_splits=splits)
        return Rows8(*quant_rows(att.reshape(n, h * d)))


def fork(model: VideoDiT) -> VideoDiT:
    """A structural copy of `model` that shares every parameter and buffer with it: its blocks, attention and
    MLP modules are new objects, so parts installed into the copy leave the original as it was."""
    def shallow(m: nn.Module) -> nn.Module:
        c = copy.copy(m)
        c._modules = dict(m._modules)
        c._parameters = dict(m._parameters)
        c._buffers = dict(m._buffers)
        return c

    new = shallow(model)
    blocks = shallow(model.blocks)
    for i, blk in enumerate(model.blocks):
        b = shallow(blk)
        b.attn, b.mlp = shallow(blk.attn), shallow(blk.mlp)
        blocks[i] = b
    new.blocks = blocks
    return new


def install_parts(model: VideoDiT, options: EngineOptions, *, inplace: bool = False) -> VideoDiT:
    """`model` with the parts `options` names: the float parts as the model defines them (returned unchanged),
    or the FP8 parts (module docstring). inplace=False installs them into a `fork` (the float model stays
    usable, e.g. as the reference of a comparison); inplace=True replaces the float projections, so their
    weights are freed with the float modules (57b). Apply tensor parallelism (worker/model/tp.py) first."""
    if not options.fp8:
        return model
    m = model if inplace else fork(model)
    attention = Fp8RingAttention(options.attention, options.kv_splits)
    act, fa = Fp8SwiGLU(), options.fast_accum
    for blk in m.blocks:
        blk.res_norm = Fp8ResidualNormMod(blk.res_norm.eps)
        a, p = blk.attn, blk.mlp
        a.qkv, a.o = a.qkv.as_fp8(fast_accum=fa), a.o.as_fp8(fast_accum=fa)
        p.gate_up, p.down = p.gate_up.as_fp8(fast_accum=fa), p.down.as_fp8(fast_accum=fa)
        a.core, p.act = attention, act
    return m
