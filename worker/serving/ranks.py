"""One rank of the worker: what every process of `vivant worker --tensor-parallel N` is given, how it joins the
process group, and the DiT ranks 1 … N−1, which follow rank 0's control (docs/multi_gpu.md).

`RankSpec` is the whole configuration a rank needs (frozen, picklable: it crosses the spawn); `join` forms the process
groups; `DitFollower` is a DiT rank r ≥ 1. A spawned rank's entry point is vivant.worker.serving.rank_main, which
builds either a `DitFollower` or the decoder rank (vivant.worker.serving.decoder_rank, which imports this module:
so the entry point lives in a module of its own, above both).

With `out_dir`, every rank writes `<out_dir>/<session>/rank<r>.jsonl`: one line per session event (begin, each
chunk with the row-parallel path it ran, end), so the ranks' chunk-by-chunk agreement can be checked after the
fact.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from datetime import timedelta
from enum import StrEnum
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist
from vivant.apis.feature_flags import FlagValues
from vivant.worker.model.cadence import PaddedGenerator
from vivant.worker.model.config import ModelConfig
from vivant.worker.model.generator import ChunkGenerator, build_generator
from vivant.worker.model.model import VideoDiT, init_random_
from vivant.worker.model.options import CacheMode, EngineName
from vivant.worker.model.tp import apply_tensor_parallel
from vivant.worker.model.weights import load_weights
from vivant.worker.serving.layout import NO_MULTICAST_ENV, RankLayout
from vivant.worker.serving.wire import Control, ControlBus, Op
from vivant.worker.stream.vae import VAEConfig

log = logging.getLogger(__name__)


class RunnerKind(StrEnum):
    """What a session's output is (`vivant worker --runner`, env VIVANT_RUNNER)."""

    GENERATOR = "generator"  # latents only: the decoder rank keeps them (under --out) and decodes nothing
    PIPELINE = "pipeline"  # decoder + pacer → an MP4 per session under --out, else a null sink
    LIVEKIT = "livekit"  # decoder + the assignment's LiveKit room: the agent's speech in, video and audio out


MAX_MIN_LEAD_CHUNKS = 5  # the generator's rewind_chunks (4) + 1: the largest lead a rewind still reaches


@dataclass(frozen=True)
class RankSpec:
    """Everything a rank needs (module docstring). weights: a safetensors checkpoint (absolute path) or None for
    random weights of the preset's shapes (`weights_seed`); vae_weights likewise for the decoder. vae: the decoder's
    sizes when they are not the preset's (`vae_config`: a decoder of other widths over the same latent grid).
    min_lead_chunks: the fewest chunks the pipeline runner's fitted lead goes down to (`LeadConfig.min_chunks`; 1 fits
    it to the measured jitter alone, more keeps rank 0 that far ahead of playout whatever the measurements say)."""

    layout: RankLayout
    init_method: str
    preset: str = "tiny"
    mode: CacheMode = CacheMode.OPTIMIZED
    engine: EngineName = EngineName.AUTO
    runner: RunnerKind = RunnerKind.GENERATOR
    weights: str | None = None
    weights_seed: int = 0
    vae_weights: str | None = None
    vae: VAEConfig | None = None  # None: the preset's (VAEConfig.for_model)
    out_dir: str | None = None
    speak: str | None = None  # rank 0: a speech file the character says at the start of every session
    timeout_s: float = 120.0  # one collective of a session (the ranks are ticked while idle)
    startup_timeout_s: float = 600.0  # joining the world and creating the groups (ranks import and load at their pace)
    cpu_threads: int = 1
    log_level: str = "INFO"
    min_lead_chunks: int = 1
    pad_chunk_ms: float = 0.0  # > 0: every chunk's diffusion takes at least this long (benchmarks; model/cadence.py)

    def __post_init__(self) -> None:
        n = self.min_lead_chunks
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_MIN_LEAD_CHUNKS:
            raise ValueError(f"RankSpec.min_lead_chunks = {n!r}; expected an integer in [1, {MAX_MIN_LEAD_CHUNKS}] "
                             "(a rewind reaches at most the generator's undo depth + 1 chunks)")
        if not 0 <= self.pad_chunk_ms < 10_000:
            raise ValueError(f"RankSpec.pad_chunk_ms = {self.pad_chunk_ms!r}; expected 0 (off) or a chunk time in ms "
                             "below 10000")

    def model_config(self) -> ModelConfig:
        return ModelConfig.from_name(self.preset)

    def vae_config(self) -> VAEConfig:
        """The decoder rank's VAE sizes: `vae`, or the preset's. ValueError naming the field when `vae` does not take
        the model's latents (channels, h, w) or does not make its frames per chunk."""
        cfg = self.model_config()
        if self.vae is None:
            return VAEConfig.for_model(cfg)
        v = self.vae
        for name, ours, theirs in (("latent_channels", v.latent_channels, cfg.latent_channels),
                                   ("latent_h", v.latent_h, cfg.latent_h), ("latent_w", v.latent_w, cfg.latent_w),
                                   ("temporal_factor", v.temporal_factor, cfg.frames_per_chunk)):
            if ours != theirs:
                raise ValueError(f"RankSpec.vae.{name} = {ours}; expected {theirs} (the {cfg.name!r} model's)")
        return v


class Groups(NamedTuple):
    tp: dist.ProcessGroup  # ranks 0 … tp−1
    link: dist.ProcessGroup  # rank 0 and the decoder rank


def join(spec: RankSpec, rank: int) -> Groups:
    """Join the world and create the groups (every rank, in the same order: group creation is collective), under
    the startup timeout; then the session's groups get the collective timeout (`timeout_s`)."""
    layout, startup = spec.layout, timedelta(seconds=spec.startup_timeout_s)
    os.environ.update(NO_MULTICAST_ENV)
    dist.init_process_group(layout.backend, init_method=spec.init_method, rank=rank, world_size=layout.world_size,
                            timeout=startup)
    tp = dist.new_group(layout.dit_ranks, timeout=startup)
    link = dist.new_group([0, layout.decoder_rank], backend=layout.link_backend, timeout=startup)
    for group, members in ((tp, layout.dit_ranks), (link, [0, layout.decoder_rank])):
        if rank in members:
            _set_collective_timeout(group, timedelta(seconds=spec.timeout_s))
    return Groups(tp, link)


def _set_collective_timeout(group: dist.ProcessGroup, timeout: timedelta) -> None:
    """torch has no public way to shorten a group's timeout after creation; its private `_set_pg_timeout` does.
    Without it (another torch) the group keeps the startup timeout, and dead ranks are still caught by the
    supervisor's watchdog."""
    setter = getattr(dist.distributed_c10d, "_set_pg_timeout", None)
    if setter is None:
        log.warning("this torch cannot shorten a process group's timeout; collectives keep the startup timeout")
        return
    setter(timeout, group)


def set_device(spec: RankSpec, rank: int) -> torch.device:
    dev = spec.layout.device_of(rank)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    else:
        torch.set_num_threads(spec.cpu_threads)
    return dev


def build_dit(spec: RankSpec, rank: int, tp_group: dist.ProcessGroup) -> ChunkGenerator:
    """This rank's shard of the DiT on the engine the spec names. Materializes the whole model on the host first
    (random weights of the preset, or the checkpoint) and slices it (worker/model/tp.py): right for the small
    presets; a 57b deployment needs a per-shard loader (meta init + per-rank materialization, as
    bench/harness.build_rank builds one rank)."""
    cfg = spec.model_config()
    model = init_random_(VideoDiT(cfg), seed=spec.weights_seed)
    if spec.weights is not None:
        load_weights(model, spec.weights)
    model = apply_tensor_parallel(model, rank, spec.layout.tp, group=tp_group)
    gen = build_generator(cfg, mode=spec.mode, device=spec.layout.device_of(rank), seed=spec.weights_seed,
                          engine=spec.engine, model=model)
    gen.warm_up()  # before the worker says warm: the first session captures no graphs
    return PaddedGenerator(gen, spec.pad_chunk_ms) if spec.pad_chunk_ms > 0 else gen


def session_dir(out_dir: str | None, session_id: str) -> Path | None:
    """`<out_dir>/<session id with / as _>/`, created; None without an out_dir."""
    if not out_dir:
        return None
    d = Path(out_dir) / session_id.replace("/", "_")
    d.mkdir(parents=True, exist_ok=True)
    return d


class SessionTrace:
    """`rank<r>.jsonl` in the session's folder (module docstring); does nothing without a folder."""

    def __init__(self, folder: Path | None, rank: int) -> None:
        self._f = open(folder / f"rank{rank}.jsonl", "a") if folder is not None else None  # noqa: SIM115

    def write(self, **event: object) -> None:
        if self._f is not None:
            self._f.write(json.dumps(event) + "\n")
            self._f.flush()

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None


class DitFollower:
    """DiT rank r ≥ 1: applies rank 0's control word by word — the same chunks, in the same order, with the same
    row-parallel step — and contributes its shard to every all-reduce. It keeps no latents: rank 0 sends them."""

    def __init__(self, spec: RankSpec, rank: int, groups: Groups) -> None:
        self.spec, self.rank = spec, rank
        self.cfg = spec.model_config()
        self.generator = build_dit(spec, rank, groups.tp)
        self.bus = ControlBus(self.cfg, groups.tp, spec.layout.tp, spec.layout.device_of(rank))
        self.trace = SessionTrace(None, rank)
        self.fused = False
        self.path = self.generator.engine.row_parallel_path

    def serve(self) -> None:
        while True:
            c = self.bus.receive()
            if c.op is Op.SHUTDOWN:
                return
            if c.op is Op.BEGIN:
                self.begin(c)
            elif c.op is Op.CHUNK:
                self.chunk(c)
            elif c.op is Op.REWIND:
                self.generator.rewind(c.chunk)
                self.trace.write(event="rewind", session=c.session, chunk=c.chunk)
            elif c.op is Op.END:
                self.trace.write(event="end", session=c.session, chunks=self.generator.chunk)
                self.trace.close()

    def begin(self, c: Control) -> None:
        session_id = (c.payload or {}).get("session_id", f"session-{c.session}")
        self.generator.reset_session(c.seed)
        self._apply(c.fused)
        self.trace = SessionTrace(session_dir(self.spec.out_dir, session_id), self.rank)
        self.trace.write(event="begin", session=c.session, session_id=session_id, path=self.path.value)

    def chunk(self, c: Control) -> None:
        if c.chunk != self.generator.chunk:
            raise RuntimeError(f"rank {self.rank} is at chunk {self.generator.chunk}, rank 0 sent chunk {c.chunk}: "
                               "the ranks are out of step")
        if c.fused != self.fused:
            self._apply(c.fused)
        self.generator.generate_chunk(c.pcm, self.cfg.audio_sample_rate)
        self.trace.write(event="chunk", session=c.session, chunk=c.chunk, path=self.path.value)

    def _apply(self, fused: bool) -> None:
        self.fused = fused
        self.path = self.generator.apply_flags(FlagValues(fusedGemmAllReduce=fused))
