"""What runs a chunk's denoising passes: a `VideoDiT` with the parts `EngineOptions` chose, eagerly or replayed
from CUDA graphs (`Engine`). The generator a worker serves with is built by `build_generator`
(worker/model/generator.py, `vivant worker --engine`).

`Engine` adds no forward of its own: eagerly it calls `VideoDiT.forward` (float parts) or `modulation` +
`denoise`; with `cuda_graphs` it captures `denoise` once per (cache, all-slots-valid) and replays it, every
input copied first into static buffers (the chunk's positions live in the cache's `StepBuffers`). The host
never reads device memory between passes (that would make it wait for each pass before launching the next).
The modulation of each noise level is a pure function of sigma; with fixed FP8 weights it is computed once per
level. Chunk 0 (which also writes the sink) and baseline-cache passes run eagerly.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch
from vivant.worker.model.fast_parts import install_parts
from vivant.worker.model.options import CacheMode, EngineOptions, RowParallelPath

if TYPE_CHECKING:
    from vivant.worker.model.fused_tp import FusedMethod
    from vivant.worker.model.kv_cache import KVCache
    from vivant.worker.model.model import VideoDiT

log = logging.getLogger(__name__)


class Engine:
    """Runs `model` (whose parts `install_parts(model, options)` installed) one pass at a time:
    `engine(latents [C, h, w], sigma, feats [A, F], cache) -> velocity [C, h, w]`, VideoDiT's signature."""

    def __init__(self, model: VideoDiT, options: EngineOptions) -> None:
        device = next(model.parameters()).device
        if options.cuda_graphs and device.type != "cuda":
            raise ValueError(f"EngineOptions.cuda_graphs = True needs the model on a CUDA device, got {device}")
        self.model, self.options, self.device = model, options, device
        self.cfg = model.cfg
        self._graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._static: dict[str, torch.Tensor] | None = None
        self._mods: dict[float, tuple[torch.Tensor, torch.Tensor]] = {}
        self.graph_replays = 0
        self.eager_calls = 0
        self.row_parallel_path = model.set_row_parallel_path(fused=False)

    @classmethod
    def build(cls, model: VideoDiT, options: EngineOptions, *, inplace: bool = False) -> Engine:
        """Install `options`' parts into `model` (or a fork of it, worker/model/fast_parts.py) and wrap it."""
        return cls(install_parts(model, options, inplace=inplace), options)

    @property
    def local_heads(self) -> int:
        return self.model.blocks[0].attn.local_heads

    # ---- the row-parallel step (between chunks only) ---------------------------------------------------
    def set_row_parallel_path(self, *, fused: bool, method: str | FusedMethod | None = None,
                              chunks: int = 4) -> RowParallelPath:
        """Swap the O/down step (VideoDiT.set_row_parallel_path); a change drops the captured CUDA graphs (they hold
        the old step's kernels and collectives), so the next pass captures the new one. Returns the path."""
        before = self.model.row_parallel_step
        kw = {} if method is None else {"method": method}
        path = self.model.set_row_parallel_path(fused=fused, chunks=chunks, **kw)
        if self.model.row_parallel_step != before and self._graphs:
            log.info("row-parallel step now %s: dropping %d captured CUDA graph(s)", path.value, len(self._graphs))
            self._graphs.clear()
        self.row_parallel_path = path
        return path

    # ---- one pass ----------------------------------------------------------------------------------------
    @torch.no_grad()
    def __call__(self, latents: torch.Tensor, sigma: float, feats: torch.Tensor, cache: KVCache) -> torch.Tensor:
        if not self.options.fp8:
            self.eager_calls += 1
            return self.model(latents, sigma, feats, cache)
        if cache.mode is CacheMode.OPTIMIZED and cache.k.dtype != torch.bfloat16:
            raise ValueError(f"the FP8 parts write and read a bf16 ring, got a {cache.k.dtype} one "
                             "(KVCache(ring_dtype=...))")
        mods, final = self._modulation(sigma)
        step = cache.step
        if not self.options.cuda_graphs or cache.mode is CacheMode.BASELINE or step.writes_sink:
            self.eager_calls += 1
            return self.model.denoise(latents, feats, mods, final, cache)
        s = self._fill(latents, feats, mods, final)
        key = (id(cache.k), step.all_valid)
        if key not in self._graphs:
            self._graphs[key] = self._capture(s, cache)
        graph, out = self._graphs[key]
        graph.replay()
        self.graph_replays += 1
        return out.clone()

    def _modulation(self, sigma: float) -> tuple[torch.Tensor, torch.Tensor]:
        """VideoDiT.modulation(sigma), computed once per level: a session has `passes` of them; the bound only
        guards against a caller sweeping sigma."""
        hit = self._mods.get(sigma)
        if hit is None:
            if len(self._mods) >= 32:
                self._mods.pop(next(iter(self._mods)))
            hit = self._mods[sigma] = self.model.modulation(sigma)
        return hit

    def _fill(self, latents, feats, mods, final) -> dict[str, torch.Tensor]:
        if self._static is None:
            cfg, dev = self.cfg, self.device
            self._static = {"lat": torch.empty(cfg.latent_channels, cfg.latent_h, cfg.latent_w, device=dev),
                            "feats": torch.empty(cfg.audio_tokens, cfg.audio_feature_dim, device=dev),
                            "mods": torch.empty_like(mods), "final": torch.empty_like(final)}
        s = self._static
        s["lat"].copy_(latents)
        s["feats"].copy_(feats[: self.cfg.audio_tokens])
        s["mods"].copy_(mods)
        s["final"].copy_(final)
        return s

    def _capture(self, s: dict[str, torch.Tensor], cache: KVCache):
        def run() -> torch.Tensor:
            return self.model.denoise(s["lat"], s["feats"], s["mods"], s["final"], cache)

        side = torch.cuda.Stream(device=self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):  # warm-up: kernel compilation, autotuning, cuBLAS handles, symm-mem workspaces
                run()
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = run()
        log.info("captured a CUDA graph of one denoising pass (%d layers)", self.cfg.n_layers)
        return graph, out
