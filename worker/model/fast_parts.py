"""The FP8 implementations of the DiT's parts, with the float parts' call signatures (worker/model/model.py).

`install_parts(model, options)` swaps them into a `VideoDiT` (in place, or into a structural copy that shares the
float model's other weights), as gpt-fast swaps modules and Liger patches them: the forward stays the model's.
Per block and pass (57b, TP = 4 rank: N = 757 tokens):

  res_norm                  `Fp8ResidualNormMod`: x += gate·delta fused with LayerNorm · (1+scale) + shift and
                            the FP8 quantization of the rows (kernels/fused_quant.py); one call joins a block's
                            end to the next block's start, so every GEMM input arrives quantized (`Rows8`)
  qkv, o, gate_up, down     `Fp8Linear`: weights quantized once to e4m3 with one scale per output channel,
                            `fp8_linear` (cuBLASLt `_scaled_mm`, rowwise scales; optional fast accumulation)
  attn.core                 `Fp8RingAttention`: `KVCache.write_qkv` (q/k RMSNorm, RoPE of q and k, the bf16 ring
                            write — one kernel, chunk 0's sink included), then the attention
                            (EngineOptions.attention): "image" = cuDNN SDPA over the ring, in `kv_splits` KV parts
                            with every slot valid (the parts' combine quantizes the output for the O GEMM,
                            kernels/split_kv.py), "torch" = the float32 twin; the output quantized for the O GEMM
  mlp.act                   `Fp8SwiGLU`: silu(gate)·up → FP8 rows (kernels/fused_quant.py)
  row_parallel (O, down)    `GemmThenAllReduce` takes the Fp8Linear's `row_parallel_sum`: with
                            EngineOptions.residual_in_gemm a `GatedRowSum` (the product not yet run), which res_norm
                            runs as one cuBLASLt GEMM whose epilogue adds the residual (C = D = x, in place) with the
                            block's gate folded into the weights' per-channel scales (`GateFold`, the pass's first
                            part: one kernel writes every block's [2, d] gated scales from the pass's modulation),
                            then the TP sum (the rank whose `reduce.adds_residual()` adds x, so the sum holds it
                            once), then LayerNorm + modulation + FP8 alone (`ln_mod_quant`); without it, the product
                            (bf16) and the fused residual kernel. `FusedGemmAllReduce` across ranks returns its fused
                            product + TP sum (worker/model/fused_tp.py) for the residual kernel.

With a baseline-mode cache (numerics reference only) `Fp8RingAttention` runs the cache's per-call whole-cache
work in place of the ring write and attention, with the same FP8 GEMMs. On a CPU every kernel runs its float32
twin (or Triton's interpreter under TRITON_INTERPRET=1), which is how CI checks this path. The ablation's
variants (bench/ablation_parts.py) subclass or replace these parts on a built engine.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.distributed as dist
import torch.nn as nn
from vivant.kernels.cublaslt import Fp8Gemm, GemmPlan, tune
from vivant.kernels.fp8_gemm import fp8_linear, fp8_linear_ref, quantize_weight
from vivant.kernels.fused_quant import ln_mod_quant, quant_rows, residual_ln_mod_quant, swiglu_quant
from vivant.kernels.ring_attention import ring_attention
from vivant.kernels.split_kv import split_kv_attention_fp8
from vivant.worker.model.fused_tp import FusedMethod, fp8_matmul_all_reduce
from vivant.worker.model.model import keep_gates
from vivant.worker.model.options import AttentionBackend, CacheMode, EngineOptions, GemmAlgorithms

if TYPE_CHECKING:
    from vivant.worker.model.kv_cache import KVCache
    from vivant.worker.model.model import Attention, VideoDiT
    from vivant.worker.model.tp import Reduce


class Rows8(NamedTuple):
    """Activation rows quantized for an FP8 GEMM: q float8_e4m3fn [M, K], scale float32 [M] (one per row)."""

    q: torch.Tensor
    scale: torch.Tensor


def auto_kv_splits(tokens: int, heads: int, slots: int, sms: int, *, q_tile: int = 64, waves: int = 4,
                   max_splits: int = 4) -> int:
    """KV parts per attention call so that cuDNN's flash kernel (one CTA per q_tile queries × head × part; its
    kernel name at these shapes says 64-query tiles) has at least `waves` CTAs per SM: the smallest such P ≤
    max_splits that divides the slots, else 1. No SMs (CPU): 1. At 57b TP=4 (757 tokens, 16 heads, 5,788 slots,
    132 SMs) one call is 192 CTAs, 1.45 waves, so P = 4 (768 CTAs); whole-model TP=1 (64 heads, 768 CTAs) keeps
    one call. docs/ARCHITECTURE.md ("Split-KV attention") gives the measured gain."""
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

    def __init__(self, w8: torch.Tensor, sw: torch.Tensor, *, fast_accum: bool = False,
                 plan: GemmPlan | None = None) -> None:
        super().__init__()
        if w8.dtype != torch.float8_e4m3fn or sw.shape != (w8.shape[0],):
            raise ValueError(f"Fp8Linear: expected float8_e4m3fn weights [N, K] and scales [N], got {w8.dtype} "
                             f"{tuple(w8.shape)} / {tuple(sw.shape)}")
        if plan is not None and (plan.gemm.n, plan.gemm.k, plan.gemm.fast_accum) != (*w8.shape, fast_accum):
            raise ValueError(f"Fp8Linear: a GEMM plan for n={plan.gemm.n}, k={plan.gemm.k}, fast_accum="
                             f"{plan.gemm.fast_accum} does not fit weights {tuple(w8.shape)}, fast_accum={fast_accum}")
        self.w8, self.sw, self.fast_accum, self.plan = w8, sw, fast_accum, plan
        self.out_features, self.in_features = w8.shape
        # [N] float32, sw × the block's gate at this pass (a row of `GateFold`'s output) when the GEMM adds the
        # residual (install_parts, EngineOptions.residual_in_gemm); None: the product is returned as it is
        self.gated_scale: torch.Tensor | None = None
        self._gemms: dict[tuple, Fp8Gemm] = {}  # cuBLASLt problems for the gated GEMM, by (rows, out dtype)

    @classmethod
    def quantize(cls, linear: nn.Linear, *, fast_accum: bool = False) -> Fp8Linear:
        if linear.bias is not None:
            raise ValueError("Fp8Linear: the DiT's projections have no bias; got a linear with one")
        return cls(*quantize_weight(linear.weight.data), fast_accum=fast_accum)

    @classmethod
    def of(cls, linear: nn.Linear | Fp8Linear, *, fast_accum: bool) -> Fp8Linear:
        """`linear` as FP8 with this fast-accumulation setting: a float projection quantized, or the same FP8
        weights (a rank built already quantized)."""
        if isinstance(linear, Fp8Linear):
            return cls(linear.w8, linear.sw, fast_accum=fast_accum)
        return cls.quantize(linear, fast_accum=fast_accum)

    def with_plan(self, plan: GemmPlan | None) -> Fp8Linear:
        """The same weights, run with `plan`'s cuBLASLt algorithm at its row count (None: the heuristic's)."""
        return Fp8Linear(self.w8, self.sw, fast_accum=self.fast_accum, plan=plan)

    def forward(self, a: Rows8) -> torch.Tensor:
        if self.plan is not None and a.q.shape[0] == self.plan.rows:
            return self.plan(a.q, a.scale, self.w8, self.sw)
        return fp8_linear(a.q, a.scale, self.w8, self.sw, fast_accum=self.fast_accum)

    def matmul_all_reduce(self, a: Rows8, group: dist.ProcessGroup, method: FusedMethod, chunks: int) -> torch.Tensor:
        return fp8_matmul_all_reduce(a.q, a.scale, self.w8, self.sw, group, method, chunks, fast_accum=self.fast_accum)

    def row_parallel_sum(self, a: Rows8, reduce: Reduce) -> torch.Tensor | GatedRowSum:
        """The unfused row-parallel step: the product summed by `reduce`, or with a gated scale the product not yet
        run (`GatedRowSum`), for res_norm to run with the residual added in the GEMM."""
        if self.gated_scale is None:
            return reduce(self(a))
        return GatedRowSum(a, self, reduce)

    def gated_product(self, a: Rows8, x: torch.Tensor, *, add: bool) -> torch.Tensor:
        """x + (a·sa) @ (w8·gated_scale)ᵀ (add) or the gated product alone, in x's dtype, rounded once: on CUDA one
        cuBLASLt GEMM with x as its epilogue's C (the tuned plan's algorithm at its row count, else the
        heuristic's); elsewhere its float32 twin."""
        sg, m = self.gated_scale, a.q.shape[0]
        if not a.q.is_cuda:
            y = fp8_linear_ref(a.q, a.scale, self.w8, sg)
            return (x.float() + y if add else y).to(x.dtype)
        if self.plan is not None and m == self.plan.rows and x.dtype == self.plan.gemm.out_dtype:
            gemm, algo = self.plan.gemm, self.plan.algo
        else:
            gemm, algo = self._gemms.get((m, x.dtype)), None
            if gemm is None:
                gemm = self._gemms[(m, x.dtype)] = Fp8Gemm(m, self.out_features, self.in_features,
                                                           fast_accum=self.fast_accum, out_dtype=x.dtype)
        if not add:
            return gemm(a.q, a.scale, self.w8, sg, algo=algo)
        x = x.contiguous()
        return gemm(a.q, a.scale, self.w8, sg, algo=algo, c=x, out=x)  # in place: x is the block's to replace

    def extra_repr(self) -> str:
        algo = "heuristic" if self.plan is None else f"tuned at {self.plan.rows} rows: {self.plan.algo.describe()}"
        return (f"in_features={self.in_features}, out_features={self.out_features}, fast_accum={self.fast_accum}, "
                f"algorithm={algo}")


class GatedRowSum(NamedTuple):
    """A row-parallel product not yet run: `linear` (with a gated scale) over rows `a`, summed by `reduce`.
    `added_to(x)` runs it with the residual x added in the GEMM's epilogue; `materialize()` gives the plain sum."""

    a: Rows8
    linear: Fp8Linear
    reduce: Reduce

    def added_to(self, x: torch.Tensor) -> torch.Tensor:
        """x + gate·Σ_ranks product: the rank that `reduce.adds_residual()` adds x in its GEMM, the others their
        gated product alone, then the sum."""
        return self.reduce(self.linear.gated_product(self.a, x, add=self.reduce.adds_residual()))

    def materialize(self) -> torch.Tensor:
        return self.reduce(self.linear(self.a))


class Fp8ResidualNormMod:
    """`x += gate·delta` (skipped when delta is None), `LN(x)·(1 + scale) + shift` quantized to FP8 rows, in one
    kernel; a `GatedRowSum` delta is added by its own GEMM (its gate is already in the GEMM's scales), then the
    LayerNorm-modulation-FP8 kernel. Returns (x, Rows8); (x, None) when shift and scale are None (the last block)."""

    def __init__(self, eps: float) -> None:
        self.eps = eps

    def __call__(self, x: torch.Tensor, delta: torch.Tensor | GatedRowSum | None, gate: torch.Tensor | None,
                 shift: torch.Tensor | None, scale: torch.Tensor | None) -> tuple[torch.Tensor, Rows8 | None]:
        if isinstance(delta, GatedRowSum):
            x, delta = delta.added_to(x), None
        if shift is None:
            return (x if delta is None else x + gate * delta), None
        if delta is None:
            return x, Rows8(*ln_mod_quant(x, shift, scale, eps=self.eps))
        x, q, s = residual_ln_mod_quant(x, delta, gate, shift, scale, eps=self.eps)
        return x, Rows8(q, s)


class Fp8SwiGLU:
    """[T, 2F] (gate | up) → silu(gate)·up as FP8 rows."""

    def __call__(self, gu: torch.Tensor) -> Rows8:
        return Rows8(*swiglu_quant(gu))


class Fp8RingAttention:
    """QKV rows [T, 3·h·D] → the ring write and attention → the output for the O GEMM as FP8 rows [T, h·D]
    (`rows` and `split_attend` make that output; a variant with an unquantized O input overrides them)."""

    def __init__(self, backend: AttentionBackend, kv_splits: int | str) -> None:
        self.backend, self.kv_splits = AttentionBackend(backend), kv_splits
        self._splits: dict[tuple, int] = {}

    def rows(self, att: torch.Tensor) -> Rows8:
        """Attention's output rows [T, h·D] → the O GEMM's input."""
        return Rows8(*quant_rows(att))

    def split_attend(self, q_rot: torch.Tensor, k: torch.Tensor, v: torch.Tensor, splits: int) -> Rows8:
        """Split-KV attention over the ring k, v [S, h, D] with the O projection's quantization fused into its
        combine → the O GEMM's input [T, h·D]."""
        n, h, d = q_rot.shape
        q_parts = q_rot.transpose(0, 1).unsqueeze(0).expand(splits, h, n, d)  # a view: cuDNN reads it as is
        return Rows8(*split_kv_attention_fp8(q_parts, k, v))

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

    def baseline(self, qkv: torch.Tensor, attn: Attention, layer: int, cache: KVCache):
        """The original per-call whole-cache work (a baseline-mode cache), same GEMMs: the numerics reference."""
        n, h, d = qkv.shape[0], attn.local_heads, attn.head_dim
        q, k, v = qkv.view(n, 3, h, d).unbind(1)
        return self.rows(cache.attend(layer, attn.q_norm(q), attn.k_norm(k), v).reshape(n, h * d))

    def __call__(self, qkv: torch.Tensor, attn: Attention, layer: int, cache: KVCache):
        """The ring write and attention → the O GEMM's input."""
        n, h, d = qkv.shape[0], attn.local_heads, attn.head_dim
        if cache.mode is CacheMode.BASELINE:
            return self.baseline(qkv, attn, layer, cache)
        q_rot = cache.write_qkv(layer, qkv, attn.q_norm.weight, attn.k_norm.weight, attn.q_norm.eps)
        step, splits = cache.step, self.splits(cache, h)
        image = self.backend is AttentionBackend.IMAGE
        if image and splits > 1 and step.all_valid and cache.layout.slots % splits == 0:
            return self.split_attend(q_rot, cache.k[layer], cache.v[layer], splits)
        att = ring_attention(q_rot, cache.k[layer], cache.v[layer], step.valid, backend=self.backend.value,
                             all_valid=step.all_valid, kv_splits=splits)
        return self.rows(att.reshape(n, h * d))


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
    or the fast parts (module docstring). inplace=False installs them into a `fork` (the float model stays
    usable, e.g. as the reference of a comparison); inplace=True replaces the float projections, so their
    weights are freed with the float modules (57b). Apply tensor parallelism (worker/model/tp.py) first."""
    if not options.fp8:
        return model
    m = model if inplace else fork(model)
    attention = Fp8RingAttention(options.attention, options.kv_splits)
    res_norm, act, fa = Fp8ResidualNormMod(m.cfg.norm_eps), Fp8SwiGLU(), options.fast_accum
    for blk in m.blocks:
        blk.res_norm = res_norm
        a, p = blk.attn, blk.mlp
        a.qkv, a.o = Fp8Linear.of(a.qkv, fast_accum=fa), Fp8Linear.of(a.o, fast_accum=fa)
        p.gate_up, p.down = Fp8Linear.of(p.gate_up, fast_accum=fa), Fp8Linear.of(p.down, fast_accum=fa)
        a.core, p.act = attention, act
    if options.gemm_algorithms is GemmAlgorithms.TUNED and m.patch_embed.weight.device.type == "cuda":
        tune_gemms(m, rows=m.cfg.tokens_per_chunk)
    # a model already holding FP8 parts (a fork of one) keeps no folding it does not use
    m.gate_fold = GateFold(m) if options.residual_in_gemm else keep_gates
    return m


class GateFold:
    """FP8 part `VideoDiT.gate_fold` (EngineOptions.residual_in_gemm): at the start of every pass one kernel writes
    each block's gated scales, [L, 2, d] float32 = (O, down) weights' per-channel scales × (gate1, gate2) of the
    pass's modulation, into the buffer whose rows the Fp8Linears read as `gated_scale` (inside the pass's CUDA
    graph, so every replay folds its own noise level's gates). A projection that is not an Fp8Linear (an ablation
    variant's float O, bench/ablation_parts.py) keeps the residual kernel; its row here is unused."""

    def __init__(self, model: VideoDiT) -> None:
        d, dev = model.cfg.d_model, model.patch_embed.weight.device
        ones = torch.ones(d, dtype=torch.float32, device=dev)
        self.sw = torch.stack([torch.stack([lin.sw.float() if isinstance(lin, Fp8Linear) else ones
                                            for lin in (blk.attn.o, blk.mlp.down)]) for blk in model.blocks])
        self.scales = torch.empty_like(self.sw)
        for i, blk in enumerate(model.blocks):
            for j, lin in enumerate((blk.attn.o, blk.mlp.down)):
                if isinstance(lin, Fp8Linear):
                    lin.gated_scale = self.scales[i, j]

    @torch.no_grad()  # the FP8 parts are inference-only
    def __call__(self, mods: torch.Tensor) -> None:
        torch.mul(self.sw, mods[:, 2::3], out=self.scales)  # mods [L, 6, d]: rows 2 and 5 are gate1 and gate2


_ROLES = (("attn", "qkv"), ("attn", "o"), ("mlp", "gate_up"), ("mlp", "down"))


def tune_gemms(model: VideoDiT, rows: int, layers: int = 6) -> dict[tuple[int, int], GemmPlan | None]:
    """Give every FP8 projection of `model` the cuBLASLt algorithm `kernels.cublaslt.tune` finds fastest for its
    shape at `rows` rows (timed with the weights of up to `layers` blocks), swapping each `Fp8Linear` for one built
    with that plan. Returns the plans by (n, k); None where the heuristic's first answer stays."""
    linears: dict[tuple[int, int, bool], list[Fp8Linear]] = {}
    for blk in model.blocks:
        for owner, role in _ROLES:
            lin = getattr(getattr(blk, owner), role)
            if isinstance(lin, Fp8Linear):
                linears.setdefault((*lin.w8.shape, lin.fast_accum), []).append(lin)
    plans = {key: tune(rows, [(lin.w8, lin.sw) for lin in group[:layers]], fast_accum=key[2])
             for key, group in linears.items()}
    for blk in model.blocks:
        for owner, role in _ROLES:
            parent = getattr(blk, owner)
            lin = getattr(parent, role)
            if isinstance(lin, Fp8Linear):
                setattr(parent, role, lin.with_plan(plans[(*lin.w8.shape, lin.fast_accum)]))
    return {key[:2]: plan for key, plan in plans.items()}


def gemm_plan_report(model: VideoDiT) -> dict[str, dict]:
    """Per projection of the first block: its shape and the algorithm it runs (for benchmark JSON and logs)."""
    out = {}
    for owner, role in _ROLES:
        lin = getattr(getattr(model.blocks[0], owner), role)
        if isinstance(lin, Fp8Linear):
            plan = lin.plan
            out[role] = {"n": lin.out_features, "k": lin.in_features, "algorithm": "heuristic" if plan is None else
                         plan.algo.describe(), **({} if plan is None else {
                             "rows": plan.rows, "tuned_us": round(plan.chosen_us, 2),
                             "heuristic_us": round(plan.heuristic_us, 2)})}
    return out
