"""The engine's choices, each named once: which parts run a `VideoDiT` forward, and the names the worker,
its metrics and its command line use for them.

Why one frozen object: the model is defined once (worker/model/model.py); what makes a forward fast is which
implementation of each part is installed (FP8 GEMMs, fused kernels, attention over the bf16 ring, CUDA
graphs). `EngineOptions` says which, is validated when built (a bad value names its field), and is handed to
`install_parts` / `Engine` at construction — nothing is switched by setting attributes afterwards. The one
thing that changes while a worker serves is the tensor-parallel row-parallel step, and it changes through the
`fusedGemmAllReduce` flag at a chunk boundary (`Engine.set_row_parallel_path`), not through these options.

Names (StrEnum, so they compare equal to the strings the CLI, Redis and Prometheus carry):
  CacheMode        optimized (the ring: write-time RoPE, K/V rounded once to bf16, docs/ARCHITECTURE.md) |
                   baseline (per-call whole-cache work, kept to measure against and to check numerics)
  AttentionBackend what the FP8 parts attend with: image (cuDNN SDPA over the bf16 ring, split-KV when it helps;
                   a GPU) | torch (the float32 reference twin; a CPU)
  EngineName       `vivant worker --engine`: model (float parts: the reference forward) | fast (FP8 parts,
                   image attention, CUDA graphs on a GPU) | auto (fast on CUDA with the optimized cache, else model)
  GemmAlgorithms   which cuBLASLt algorithm each FP8 GEMM shape runs: heuristic (cuBLASLt's first answer, what
                   torch._scaled_mm takes) | tuned (the fastest configuration cuBLASLt accepts for the chunk's row
                   count, timed when the engine is built on this GPU; kernels/cublaslt.py)
  RowParallelPath  `vivant_worker_kernel_path_info{path}`: the O/down step in effect — fused_gemm_all_reduce,
                   gemm_then_all_reduce, or no_tp (nothing to fuse: TP = 1 or the one-GPU stand-in reduce)

The variants the ablation measures against (whole-window cache, bf16 GEMMs, the unfused norm) are not choices
here: bench/ablation_parts.py swaps them into a built engine.
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
    TORCH = "torch"


class EngineName(StrEnum):
    AUTO = "auto"
    FAST = "fast"
    MODEL = "model"


class GemmAlgorithms(StrEnum):
    HEURISTIC = "heuristic"
    TUNED = "tuned"


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
                fused residual/norm/modulation and SwiGLU kernels, the bf16 ring written by the fused QKV → ring
                kernel (chunk 0's sink included), attention per `attention`.
    attention   the FP8 parts' attention (AttentionBackend); must be torch with the float parts.
    kv_splits   image attention with every slot valid: the slots in this many parts per call, or "auto"
                (`auto_kv_splits`: enough parts to fill the GPU; 1 on a CPU).
    fast_accum  cuBLASLt FP8 fast accumulation in the four GEMMs (GPU only; the CPU twin ignores it).
    cuda_graphs every pass after chunk 0 replayed from a captured CUDA graph (needs fp8 and a CUDA device).
    gemm_algorithms  the FP8 GEMMs' cuBLASLt algorithms (GemmAlgorithms): tuned = for each shape at the chunk's row
                count, the fastest configuration cuBLASLt accepts when it beats the heuristic's first answer by 3 %,
                timed on this GPU when the parts are installed (CUDA only; a CPU runs the float32 twin). Why: the
                heuristic's 128 × 128 tile leaves the last wave of tiles partly empty at some 57b shapes
                (docs/ARCHITECTURE.md, "GEMM algorithms").
    residual_in_gemm  True: the O and down GEMMs (FP8, unfused row-parallel step) add the gated residual in their
                epilogue — the gate folded into the weights' per-channel scales, the residual x as cuBLASLt's C — so
                the row kernel after them is LayerNorm + modulation + FP8 alone (x + gate·δ rounded once, δ never
                written). False: the GEMM writes δ and the fused residual kernel adds it. Why: the row kernel after
                the GEMM reads x and δ [T, d] and writes x; folding the add into the GEMM drops δ's write and read.
    gemm_algorithms and residual_in_gemm choose among the fast parts (fp8=True); the float parts take the defaults.
    """

    fp8: bool = False
    attention: AttentionBackend = AttentionBackend.TORCH
    kv_splits: int | Literal["auto"] = 1
    fast_accum: bool = False
    cuda_graphs: bool = False
    gemm_algorithms: GemmAlgorithms = GemmAlgorithms.HEURISTIC
    residual_in_gemm: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "attention", parse_choice(AttentionBackend, self.attention, "EngineOptions.attention"))
        object.__setattr__(self, "gemm_algorithms",
                           parse_choice(GemmAlgorithms, self.gemm_algorithms, "EngineOptions.gemm_algorithms"))
        for name in ("fp8", "fast_accum", "cuda_graphs", "residual_in_gemm"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"EngineOptions.{name} = {getattr(self, name)!r}; expected True or False")
        k = self.kv_splits
        if k != "auto" and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
            raise ValueError(f"EngineOptions.kv_splits = {k!r}; expected an int >= 1 or 'auto'")
        if not self.fp8:
            if self.attention is not AttentionBackend.TORCH:
                raise ValueError(f"EngineOptions.attention = {self.attention.value!r} needs fp8=True (the float parts "
                                 "attend through the cache's reference attention)")
            if self.cuda_graphs:
                raise ValueError("EngineOptions.cuda_graphs = True needs fp8=True (the float parts are not "
                                 "graph-capturable: they build tensors from host values per call)")
            if self.gemm_algorithms is not GemmAlgorithms.HEURISTIC:
                raise ValueError(f"EngineOptions.gemm_algorithms = {self.gemm_algorithms.value!r} needs fp8=True (a "
                                 "choice among the fast parts; the float parts are the model as defined)")

    @classmethod
    def reference(cls) -> EngineOptions:
        """The float parts: the model as defined (engine `model`)."""
        return cls()

    @classmethod
    def served(cls, device: str | torch.device) -> EngineOptions:
        """The fast parts as the worker serves them (engine `fast`): on CUDA, image attention over the bf16 ring
        with split-KV 'auto', fast accumulation, tuned GEMM algorithms and CUDA graphs; on a CPU (tests), the
        kernels' float32 twins over the same bf16 ring, eagerly."""
        import torch

        cuda = torch.device(device).type == "cuda"
        return cls(fp8=True, attention=AttentionBackend.IMAGE if cuda else AttentionBackend.TORCH,
                   kv_splits="auto" if cuda else 1, fast_accum=cuda, cuda_graphs=cuda,
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
        raise ValueError(f"engine = 'fast' needs mode = 'optimized' (the ring cache), got mode = {mode.value!r}; "
                         "use engine = 'model' for the baseline")
    return EngineOptions.served(device)
