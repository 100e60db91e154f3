"""Which engine a serving worker runs its denoising passes on (`vivant worker --engine`).

Why: `ChunkGenerator` alone runs the float `VideoDiT`, even on CUDA; the GPU engine (`FastDiT`) was only
reached by the benchmarks. A worker on GPUs should run the fast engine.

  model  the float VideoDiT (worker/model/model.py), any device and cache mode: the reference path.
  fast   FastDiT (worker/model/fast_dit.py) over the same weights: FP8 GEMMs (fast accumulation on CUDA), fused
         kernels, attention over the FP8 ring's bf16 read image (cuDNN SDPA), CUDA graphs; bf16 on CUDA.
         On CPU it runs its kernels' float32 twins, eagerly (tests). Needs mode "optimized" (FP8 ring).
  auto   fast on CUDA with mode "optimized", else model.

Imports torch lazily, so `vivant worker`'s CLI (vivant.worker.serving.cli) can name ENGINES without loading it.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from vivant.worker.model.config import ModelConfig
    from vivant.worker.model.generator import ChunkGenerator

log = logging.getLogger(__name__)

ENGINES = ("auto", "fast", "model")


def build_generator(cfg: ModelConfig, *, mode: str = "optimized", device: str | torch.device = "cpu",
                    seed: int = 0, weights: str | Path | None = None, engine: str = "auto") -> ChunkGenerator:
    """A `ChunkGenerator` for `cfg` running on `engine` (one of ENGINES); see the module docstring."""
    import torch
    from vivant.worker.model.generator import ChunkGenerator

    if engine not in ENGINES:
        raise ValueError(f"engine = {engine!r}; expected one of {', '.join(ENGINES)}")
    dev = torch.device(device)
    cuda = dev.type == "cuda"
    if engine == "auto":
        engine = "fast" if cuda and mode == "optimized" else "model"
        why = ("CUDA device and optimized mode" if engine == "fast"
               else f"device {dev.type}" if not cuda else f"mode {mode!r} (the fast engine needs 'optimized')")
        log.info("engine auto -> %s (%s)", engine, why)
    if engine == "model":
        return ChunkGenerator(cfg, mode=mode, device=dev, seed=seed, weights=weights)
    if mode != "optimized":
        raise ValueError(f"engine = 'fast' needs mode = 'optimized' (an FP8 ring cache), got mode = {mode!r}; "
                         "use engine = 'model' for the baseline")

    from vivant.kernels.fp8_gemm import prefer_static_gemm_schedule
    from vivant.worker.model.fast_dit import FastDiT
    from vivant.worker.model.model import VideoDiT, init_random_
    from vivant.worker.model.weights import load_weights

    dtype = torch.bfloat16 if cuda else torch.float32
    if cuda:  # before the first cuBLASLt GEMM of this process (kernels/fp8_gemm.py says why)
        log.info("cuBLASLt workspace %s KiB", prefer_static_gemm_schedule())
    model = init_random_(VideoDiT(cfg), seed=seed)  # as ChunkGenerator builds it
    if weights is not None:
        load_weights(model, weights)
    model = model.to(device=dev, dtype=dtype).eval()
    fast = FastDiT(model, attn_backend="image" if cuda else "torch", use_graphs=cuda)
    fast.fast_accum = cuda  # cuBLASLt FP8 fast accumulation: −4.5 ms per 57b chunk on an H200, 2.6e-3 GEMM error
    log.info("engine fast: FastDiT on %s, %s, attention %s, CUDA graphs %s, fast accumulation %s", dev, dtype,
             fast.attn_backend, fast.use_graphs, fast.fast_accum)
    return ChunkGenerator(cfg, mode="optimized", device=dev, dtype=dtype, seed=seed, model=fast)
