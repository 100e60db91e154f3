"""The engine's choices, each named once: which parts run a `VideoDiT` forward, and the names the worker,
its metrics and its command line use for them.

Why one frozen object: the model is defined once (worker/model/model.py); what makes a forward fast is which
implementation of each part is installed (FP8 GEMMs, fused kernels, the ring's read-image attention, CUDA
graphs). `EngineOptions` says which, is validated when built (a bad value names its field), and is handed to
`install_parts` / `Engine` at construction — nothing is switched by setting attributes afterwards. The one
thing that changes while a worker serves is the tensor-parallel row-parallel step, and it changes through the
`fusedGemmAllReduce` flag at a chunk boundary (`Engine.set_row_parallel_path`), not through these options.

Names (StrEnum, so they compare equal to the strings the CLI, Redis and Prometheus carry):
  CacheMode        optimized (the ring: write-time RoPE + FP8, docs/ARCHITECTURE.md) | baseline (per-call
                   whole-cache work, kept to measure against and to check numerics)
  AttentionBackend what the FP8 parts attend with: image (cuDNN SDPA over the ring's bf16 read image, split-KV
                   when it helps) | sdpa (whole-ring dequantization per call, then SDPA) | torch (the float32
                   reference twin, CPU). The Triton FP8 attention kernel is not an engine choice: it measured
                   3.5x slower than cuDNN (docs/BENCHMARKS.md) and stays in kernels/ring_attention.py for the
                   step benchmark's component timings.
  EngineName       `vivant worker --engine`: model (float parts: the reference forward) | fast (FP8 parts,
                   read-image attention, CUDA graphs on a GPU) | auto (fast on CUDA with the optimized cache,
                   else model)
  RingFormat       what the FP8 parts' ring stores: fp8 (e4m3 codes with one scale per (slot, head) row, plus the
                   bf16 read image attention reads) | bf16 (the rotated K and V rows in bf16: the ring is its own read
                   image — no FP8 rounding of K/V, two bytes per value instead of three, for image attention)
  GemmPrecision    the fast parts' four projections (or the O projection alone, `o_gemm`): fp8 (FP8 e4m3 GEMMs,
                   activations quantized by the kernel before each) | bf16 (bf16 GEMMs on the float projections,
                   activations stay bf16; the ablation's row)
  CachePolicy      the fast parts' KV cache work: ring (RoPE + quantization once at write, the ring read as it is) |
                   whole_window (what streaming peers do: the window kept un-rotated in bf16, every attention call
                   re-rotates every key to its current position and, for an FP8 ring, re-quantizes the whole
                   window to FP8, worker/model/whole_window.py; the ablation's row)
  GemmAlgorithms   which cuBLASLt algorithm each FP8 GEMM shape runs: heuristic (cuBLASLt's first answer, what
                   torch._scaled_mm takes) | tuned (the fastest configuration cuBLASLt accepts for the chunk's row
                   count, timed when the engine is built on this GPU; kernels/cublaslt.py)
  RowParallelPath  `vivant_worker_kernel_path_info{path}`: the O/down step in effect — fused_gemm_all_reduce,
                   gemm_then_all_reduce, or no_tp (nothing to fuse: TP = 1 or the one-GPU stand-in reduce)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:  # torch is imported where a device is read, so `vivant bench` parses its options without it
    import torch


class CacheMode(StrEnum):
    OPTIMIZED = "optimized"
    BASELINE = "baseline"


class AttentionBackend(StrEnum):
    IMAGE = "image"
    SDPA = "sdpa"
    TORCH = "torch"


class EngineName(StrEnum):
    AUTO = "auto"
    FAST = "fast"
    MODEL = "model"


class RingFormat(StrEnum):
    FP8 = "fp8"
    BF16 = "bf16"


class GemmPrecision(StrEnum):
    FP8 = "fp8"
    BF16 = "bf16"


class GemmAlgorithms(StrEnum):
    HEURISTIC = "heuristic"
    TUNED = "tuned"


class CachePolicy(StrEnum):
    RING = "ring"
    WHOLE_WINDOW = "whole_window"


class RowParallelPath(StrEnum):
    FUSED = "fused_gemm_all_reduce"
    UNFUSED = "gemm_then_all_reduce"
    NO_TP = "no_tp"


def parse_choice(enum: type[StrEnum], value: object, field: str) -> StrEnum:
    """`value` as a member of `enum`, or a ValueError naming `field` and the choices."""
    try:
        return enum(value)
    except ValueError:
        raise ValueError(f"{field} = {value!r}; expected one of {', '.join(m.value for m in enum)}") from None


@dataclass(frozen=True)
class EngineOptions:
    """Which implementation of each part a forward runs (frozen; see the module docstring).

    fp8         False: the float parts (bf16/float32 GEMMs, the cache's reference attention) — the model as
                defined. True: FP8 e4m3 GEMMs with per-channel weight scales, activations quantized inside the
                fused residual/norm/modulation and SwiGLU kernels, the ring written by the fused QKV → ring
                kernel (chunk 0's sink included), attention per `attention`.
    attention   the FP8 parts' attention (AttentionBackend); must be torch with the float parts.
    kv_splits   image attention with every slot valid: the slots in this many parts per call, or "auto"
                (`auto_kv_splits`: enough parts to fill the GPU; 1 on a CPU).
    fast_accum  cuBLASLt FP8 fast accumulation in the four GEMMs (GPU only; the CPU twin ignores it).
    cuda_graphs every pass after chunk 0 replayed from a captured CUDA graph (needs fp8 and a CUDA device).
    ring        the FP8 parts' ring storage (RingFormat); bf16 needs attention "image" (the ring is the image).
    gemm        the fast parts' projections (GemmPrecision): fp8 as above, or bf16 GEMMs on the float projections
                with bf16 activations (the ring as `ring` says).
    o_gemm      the O projection alone, with gemm = fp8: fp8, or bf16 (attention's output rows stay unquantized and
                the O GEMM runs on the float weights). Why a choice for one projection: on the trained `ref` model the
                rounding of attention's output is one of the largest single causes of the served engine's difference
                from the float32 path, and the O GEMM is the smallest of the four at the 57b shapes
                (docs/BENCHMARKS.md, "Which FP8 rounding moves the trained model").
    fused_norm  True: residual + LayerNorm + modulation (+ the FP8 row quantization) and SwiGLU (+ quantization) as
                one kernel each (kernels/fused_quant.py; with bf16 GEMMs, `torch.compile` of the float parts on a
                GPU: the Triton kernels have no non-quantizing variant). False: the same arithmetic as separate
                torch ops, then `quant_rows` (fp8).
    cache_policy the fast parts' cache work (CachePolicy): the ring, or the whole window re-rotated per call and,
                with ring = fp8, re-quantized to FP8 per call (it keeps its own window; the ring stays unwritten).
    gemm_algorithms  the FP8 GEMMs' cuBLASLt algorithms (GemmAlgorithms): tuned = for each shape at the chunk's row
                count, the fastest configuration cuBLASLt accepts when it beats the heuristic's first answer by 3 %,
                timed on this GPU when the parts are installed (CUDA only; a CPU runs the float32 twin). Why: the
                heuristic gives every 57b GEMM a 128 × 128 tile, and the QKV GEMM's 288 tiles fill 2.18 waves of
                132 SMs (docs/BENCHMARKS.md).
    residual_in_gemm  True: the O and down GEMMs (FP8, unfused row-parallel step) add the gated residual in their
                epilogue — the gate folded into the weights' per-channel scales, the residual x as cuBLASLt's C — so
                the row kernel after them is LayerNorm + modulation + FP8 alone (x + gate·δ rounded once, δ never
                written). False: the GEMM writes δ and the fused residual kernel adds it. Why: the row kernel after
                the GEMM was the step's largest (476 calls per chunk) and half its traffic was δ and x; the fold,
                in place, measured 2.7 ms per 57b chunk faster (docs/BENCHMARKS.md, "The residual in the GEMM
                epilogue").
    gemm, o_gemm, fused_norm, cache_policy, gemm_algorithms and residual_in_gemm choose among the fast parts
    (fp8=True); the float parts take the defaults.
    """

    fp8: bool = False
    attention: AttentionBackend = AttentionBackend.TORCH
    kv_splits: int | Literal["auto"] = 1
    fast_accum: bool = False
    cuda_graphs: bool = False
    ring: RingFormat = RingFormat.FP8
    gemm: GemmPrecision = GemmPrecision.FP8
    o_gemm: GemmPrecision = GemmPrecision.FP8
    fused_norm: bool = True
    cache_policy: CachePolicy = CachePolicy.RING
    gemm_algorithms: GemmAlgorithms = GemmAlgorithms.HEURISTIC
    residual_in_gemm: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "attention", parse_choice(AttentionBackend, self.attention, "EngineOptions.attention"))
        object.__setattr__(self, "ring", parse_choice(RingFormat, self.ring, "EngineOptions.ring"))
        object.__setattr__(self, "gemm", parse_choice(GemmPrecision, self.gemm, "EngineOptions.gemm"))
        object.__setattr__(self, "o_gemm", parse_choice(GemmPrecision, self.o_gemm, "EngineOptions.o_gemm"))
        object.__setattr__(self, "cache_policy",
                           parse_choice(CachePolicy, self.cache_policy, "EngineOptions.cache_policy"))
        object.__setattr__(self, "gemm_algorithms",
                           parse_choice(GemmAlgorithms, self.gemm_algorithms, "EngineOptions.gemm_algorithms"))
        for name in ("fp8", "fast_accum", "cuda_graphs", "fused_norm", "residual_in_gemm"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"EngineOptions.{name} = {getattr(self, name)!r}; expected True or False")
        k = self.kv_splits
        if k != "auto" and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
            raise ValueError(f"EngineOptions.kv_splits = {k!r}; expected an int >= 1 or 'auto'")
        if self.ring is RingFormat.BF16 and not (self.fp8 and self.attention is AttentionBackend.IMAGE):
            raise ValueError("EngineOptions.ring = 'bf16' needs fp8=True and attention = 'image' (a bf16 ring is the "
                             "read image the FP8 parts' attention reads; the float parts choose their ring by "
                             "KVCache(fp8=...))")
        if not self.fp8:
            if self.attention is not AttentionBackend.TORCH:
                raise ValueError(f"EngineOptions.attention = {self.attention.value!r} needs fp8=True (the float parts "
                                 "attend through the cache's reference attention)")
            if self.cuda_graphs:
                raise ValueError("EngineOptions.cuda_graphs = True needs fp8=True (the float parts are not "
                                 "graph-capturable: they build tensors from host values per call)")
            for name, default in (("gemm", GemmPrecision.FP8), ("o_gemm", GemmPrecision.FP8), ("fused_norm", True),
                                  ("cache_policy", CachePolicy.RING),
                                  ("gemm_algorithms", GemmAlgorithms.HEURISTIC)):
                value = getattr(self, name)
                if value != default:
                    shown = value.value if isinstance(value, StrEnum) else value
                    raise ValueError(f"EngineOptions.{name} = {shown!r} needs fp8=True (a choice among "
                                     "the fast parts; the float parts are the model as defined)")


    @classmethod
    def reference(cls) -> EngineOptions:
        """The float parts: the model as defined (engine `model`)."""
        return cls()

    @classmethod
    def served(cls, device: str | torch.device) -> EngineOptions:
        """The fast parts as the worker serves them (engine `fast`): on CUDA, a bf16 ring read by image attention
        with split-KV 'auto', fast accumulation and CUDA graphs; on a CPU (tests), the kernels' float32 twins over
        the FP8 ring, eagerly. Why a bf16 ring: attention reads bf16 either way, and the FP8 ring's rounding of K/V
        is a large share of the served engine's difference from the float32 model on trained weights
        (docs/BENCHMARKS.md)."""
        import torch

        cuda = torch.device(device).type == "cuda"
        return cls(fp8=True, attention=AttentionBackend.IMAGE if cuda else AttentionBackend.TORCH,
                   kv_splits="auto" if cuda else 1, fast_accum=cuda, cuda_graphs=cuda,
                   ring=RingFormat.BF16 if cuda else RingFormat.FP8,
                   gemm_algorithms=GemmAlgorithms.TUNED if cuda else GemmAlgorithms.HEURISTIC)

    def replace(self, **changes: object) -> EngineOptions:
        return dataclasses.replace(self, **changes)


def engine_options(engine: EngineName | str, device: str | torch.device, mode: CacheMode | str) -> EngineOptions:
    """The options `vivant worker --engine` names: model → reference; fast → served (needs the optimized cache);
    auto → fast on a CUDA device with the optimized cache, else model."""
    engine = parse_choice(EngineName, engine, "engine")
    mode = parse_choice(CacheMode, mode, "mode")
    import torch

    cuda = torch.device(device).type == "cuda"
    if engine is EngineName.AUTO:
        engine = EngineName.FAST if cuda and mode is CacheMode.OPTIMIZED else EngineName.MODEL
    if engine is EngineName.MODEL:
        return EngineOptions.reference()
    if mode is not CacheMode.OPTIMIZED:
        raise ValueError(f"engine = 'fast' needs mode = 'optimized' (an FP8 ring cache), got mode = {mode.value!r}; "
                         "use engine = 'model' for the baseline")
    return EngineOptions.served(device)
