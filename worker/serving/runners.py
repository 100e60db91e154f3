"""The session runners `vivant worker --runner` names, and how the CLI builds one (after the worker registered
as loading, so a worker loading weights for minutes is counted as `loading`, not dead).

  generator  `GeneratorRunner`: the chunk generator fed with silence, latents to a null or file sink;
  pipeline   `vivant.worker.serving.pipeline_runner.PipelineRunner`: the full stream pipeline;
  livekit    `vivant.worker.serving.livekit_avatar.LiveKitSessionRunner`: joins the assignment's room.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
from vivant.apis.feature_flags import FlagValues
from vivant.sessions.models import Assignment
from vivant.worker.serving.runner import ChunkReport, SessionRunner


class GeneratorRunner:
    """The real chunk generator (loaded once, warm) fed with silence, writing latents to a null sink or,
    with `out_dir`, to `out_dir/<session>/chunk_NNNNN.npy` (float32 [C, latent_h, latent_w]). `engine`
    (worker/model/engine.py): "auto" runs FastDiT on CUDA in optimized mode, the float VideoDiT otherwise."""

    def __init__(self, preset: str = "tiny", *, mode: str = "optimized", device: str = "cpu",
                 out_dir: str | Path | None = None, seed: int = 0, weights: str | Path | None = None,
                 engine: str = "auto") -> None:
        from vivant.worker.model.config import ModelConfig
        from vivant.worker.model.engine import build_generator

        self.cfg = ModelConfig.from_name(preset)
        self.generator = build_generator(self.cfg, mode=mode, device=device, seed=seed, weights=weights,
                                         engine=engine)
        self.frames_per_chunk = self.cfg.frames_per_chunk
        self.chunk_seconds = self.cfg.chunk_seconds
        self.out_dir = Path(out_dir) if out_dir else None
        self.flags = FlagValues()
        self.kernel_path: str | None = None  # what the generator's apply_flags last returned
        self._session_dir: Path | None = None

    def begin(self, assignment: Assignment, flags: FlagValues) -> None:
        self.generator.reset_session(assignment.seed)
        self.apply_flags(flags)
        if self.out_dir is not None:
            self._session_dir = self.out_dir / assignment.session_id.replace("/", "_")
            self._session_dir.mkdir(parents=True, exist_ok=True)

    def apply_flags(self, flags: FlagValues) -> str | None:
        self.flags = flags
        self.kernel_path = self.generator.apply_flags(flags)
        return self.kernel_path

    def step(self) -> ChunkReport:
        n = self.generator.chunk
        start, stop = self.cfg.chunk_sample_range(n)
        audio = np.zeros(stop - start, dtype=np.float32)
        t0 = time.perf_counter()
        out = self.generator.generate_chunk(audio, self.cfg.audio_sample_rate)
        ms = (time.perf_counter() - t0) * 1e3
        fault = not bool(np.isfinite(out.latents.cpu().numpy()).all())
        if self._session_dir is not None:
            np.save(self._session_dir / f"chunk_{out.index:05d}.npy", out.latents.cpu().numpy())
        return ChunkReport(index=out.index, compute_ms=ms, frames=self.frames_per_chunk, numerical_fault=fault)

    def end(self, reason: str) -> None:
        self._session_dir = None


def checkpoint_path(checkpoint: str) -> Path | None:
    """`--checkpoint` -> a local safetensors path, or None for random weights. Weights are never fetched
    at run time: a remote URI must be mounted as a volume first."""
    if not checkpoint or checkpoint.startswith("random://"):  # e.g. random://tiny in a WorkerPool spec
        return None
    if checkpoint.startswith("/"):
        return Path(checkpoint)
    raise ValueError(f"checkpoint: expected an absolute path (a mounted volume) or random://, got {checkpoint!r}; "
                     "weights are not fetched at run time")


RUNNERS = ("generator", "pipeline", "livekit")


def build_runner(args: argparse.Namespace, weights: Path | None) -> SessionRunner:
    """The runner `--runner` names, with the model loaded (called after the worker registered as loading).

    `livekit` joins each assignment's room with the assignment's URL and token; without a reachable
    LiveKit server its sessions fail at `begin` (reported as Failed with the join error)."""
    engine = getattr(args, "engine", "auto")  # a Namespace built by hand (tests) may not have it
    if args.runner == "generator":
        return GeneratorRunner(args.preset, mode=args.mode, device=args.device, out_dir=args.out, weights=weights,
                               engine=engine)
    from vivant.worker.model.config import ModelConfig
    from vivant.worker.model.engine import build_generator
    from vivant.worker.stream.vae import VAEConfig, build_vae_decoder, load_vae_decoder

    cfg = ModelConfig.from_name(args.preset)
    generator = build_generator(cfg, mode=args.mode, device=args.device, weights=weights, engine=engine)
    vae_cfg = VAEConfig.for_model(cfg)
    vae = (load_vae_decoder(vae_cfg, args.vae_weights, device=args.device) if args.vae_weights
           else build_vae_decoder(vae_cfg, device=args.device))
    if args.runner == "pipeline":
        from vivant.worker.serving.pipeline_runner import PipelineRunner

        return PipelineRunner(generator, vae, out_dir=args.out)
    from vivant.worker.serving.livekit_avatar import LiveKitSessionRunner, ModelRenderer

    return LiveKitSessionRunner(ModelRenderer(generator, vae), cfg)
