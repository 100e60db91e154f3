"""The worker's process layout on one host: `tp` tensor-parallel DiT ranks + 1 decoder rank.

Why separate processes: the reference system runs the DiT on 4 GPUs in tensor parallel and the VAE
decoder on a fifth, so that decoding chunk n overlaps the diffusion of chunk n + 1 and the decoder's
memory traffic never competes with the DiT's. One process per GPU is how torch.distributed and NCCL
want it. The same code runs on CPU with the gloo backend (tests, any tp ≥ 1).

World (size tp + 1), by global rank:

    rank 0 … tp−1   role "dit"      device cuda:r (NCCL) or cpu (gloo); each holds 1/tp of the heads and
                                    of the SwiGLU width (worker/model/tp.py) and its own 1/tp of the KV cache
    rank tp         role "decoder"  device cuda:tp or cpu; the causal VAE (worker/stream/vae.py) and the frame sink

Process groups: the TP group (ranks 0 … tp−1: the all-reduces after O and down, and rank 0's per-chunk
control broadcast) and the pair group (rank 0, rank tp: latents handed over point to point).

Rank 0 owns the room I/O and the session's control: it reads the chunk's audio (the voice agent's speech),
decides the flags at each chunk boundary, and broadcasts a control word plus the audio to the TP group,
so every DiT rank switches the fused path at the same chunk boundary (the ranks must issue the same
collectives, or they deadlock). Per chunk n:

    rank 0:    control [n, samples, fused] + PCM [max_samples] ──broadcast──► DiT ranks
    DiT ranks: apply flags, generate (4 passes, TP all-reduces) → latents [C, h, w] float32 (replicated)
    rank 0:    isend [n, samples] + latents + PCM ──pair group──► decoder rank (chunk n+1 starts at once)
    decoder:   recv, hand to a DecoderStage thread (decode overlaps the next recv), frames
               uint8 [frames_per_chunk, H, W, 3] + PCM → the sink (pacer / LiveKit track in a deployment)

The session ends when rank 0 broadcasts control n = −1 and sends header n = −1 to the decoder; bad input
on rank 0 ends it the same way (what was sent is still decoded) and rank 0 then raises it.
`launch` spawns the world with torch.multiprocessing and returns one `RankReport` per rank.
Multicast/in-switch reduction stays off in every rank (NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1,
NVSHMEM_DISABLE_NVLS=1 are set before the process group exists).
"""

from __future__ import annotations

import enum
import os
import socket
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from itertools import pairwise
from pathlib import Path
from typing import Protocol

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from vivant.sessions.models import FlagValues
from vivant.worker.model.config import ConfigError, ModelConfig
from vivant.worker.model.generator import ChunkGenerator
from vivant.worker.model.model import VideoDiT, init_random_
from vivant.worker.model.tp import apply_tensor_parallel
from vivant.worker.stream.decoder_stage import DecoderStage, LatentChunk
from vivant.worker.stream.pacer import DecodedChunk
from vivant.worker.stream.vae import VAEConfig, build_vae_decoder

NO_MULTICAST_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
BACKENDS = ("gloo", "nccl")
STOP = -1


class RankRole(enum.StrEnum):
    DIT = "dit"
    DECODER = "decoder"


@dataclass(frozen=True)
class WorkerLayout:
    """tp DiT ranks + `decoder_ranks` (exactly 1) decoder rank on one host. backend: "nccl" (GPUs) or "gloo" (CPU)."""

    tp: int = 4
    decoder_ranks: int = 1
    backend: str = "nccl"

    def __post_init__(self) -> None:
        if not isinstance(self.tp, int) or self.tp < 1:
            raise ConfigError(f"WorkerLayout: tp = {self.tp!r}; expected a positive integer (DiT ranks)")
        if self.decoder_ranks != 1:
            raise ConfigError(f"WorkerLayout: decoder_ranks = {self.decoder_ranks!r}; expected 1 (the latents of DiT "
                              f"rank 0 go to one decoder rank, rank tp = {self.tp})")
        if self.backend not in BACKENDS:
            raise ConfigError(f"WorkerLayout: backend = {self.backend!r}; expected one of {BACKENDS}")

    @property
    def world_size(self) -> int:
        return self.tp + self.decoder_ranks

    @property
    def decoder_rank(self) -> int:
        return self.tp

    @property
    def io_rank(self) -> int:
        """The rank that owns the room I/O and the session's control (audio in, flags, end)."""
        return 0

    @property
    def dit_ranks(self) -> list[int]:
        return list(range(self.tp))

    def role(self, rank: int) -> RankRole:
        self._check_rank(rank)
        return RankRole.DECODER if rank == self.decoder_rank else RankRole.DIT

    def device(self, rank: int) -> torch.device:
        self._check_rank(rank)
        return torch.device("cuda", rank) if self.backend == "nccl" else torch.device("cpu")

    def check_world(self, world_size: int) -> None:
        """A launch with the wrong number of processes fails here, before any collective could hang."""
        if world_size == self.tp:
            raise ConfigError(f"world_size = {world_size} leaves no decoder rank: the layout needs tp = {self.tp} DiT "
                              f"ranks + 1 decoder rank = {self.world_size} processes")
        if world_size != self.world_size:
            raise ConfigError(f"world_size = {world_size}; the layout needs tp = {self.tp} DiT ranks + 1 decoder rank "
                              f"= {self.world_size} processes")

    def check_model(self, cfg: ModelConfig) -> None:
        cfg.shard_heads(self.tp)  # ConfigError naming n_heads or d_ff when tp does not divide them

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ConfigError(f"rank = {rank}; expected 0 ≤ rank < world_size = {self.world_size}")


@dataclass(frozen=True)
class TPRunConfig:
    """One session of `chunks` chunks on a WorkerLayout. Weights: random of the preset's exact shapes
    (`weights_seed`), or a safetensors checkpoint (`weights`); VAE random (`vae_seed`)."""

    layout: WorkerLayout
    preset: str = "tiny"
    chunks: int = 4
    seed: int = 0  # session seed: the noise of every chunk
    weights_seed: int = 11
    weights: str | None = None
    vae_seed: int = 0
    mode: str = "optimized"
    decoder_queue_chunks: int = 2
    cpu_threads: int = 1
    keep_latents: bool = False  # rank 0 reports the latents it sent, the decoder those it received

    def __post_init__(self) -> None:
        if self.chunks < 1:
            raise ConfigError(f"TPRunConfig: chunks = {self.chunks!r}; expected a positive integer")
        if self.cpu_threads < 1:
            raise ConfigError(f"TPRunConfig: cpu_threads = {self.cpu_threads!r}; expected a positive integer")
        self.layout.check_model(self.model_config())

    def model_config(self) -> ModelConfig:
        return ModelConfig.from_name(self.preset)


# ---- the callables the ranks are given (top-level classes: they cross a spawn) ----------------------------


class ChunkSink(Protocol):
    """Where the decoder rank's frames go (the pacer and the LiveKit track in a deployment)."""

    def write_chunk(self, chunk: DecodedChunk) -> None: ...

    def close(self) -> dict: ...


@dataclass
class CountingSink:
    """Counts frames and audio samples; reports them with a checksum of the frames (sum of bytes)."""

    frames: int = 0
    audio_samples: int = 0
    byte_sum: int = 0
    frame_shape: tuple = ()

    def write_chunk(self, chunk: DecodedChunk) -> None:
        self.frames += chunk.frames.shape[0]
        self.audio_samples += len(chunk.audio)
        self.byte_sum += int(chunk.frames.astype(np.int64).sum())
        self.frame_shape = tuple(chunk.frames.shape[1:])

    def close(self) -> dict:
        return {"frames": self.frames, "audio_samples": self.audio_samples, "byte_sum": self.byte_sum,
                "frame_shape": list(self.frame_shape)}


@dataclass
class SaveChunksSink(CountingSink):
    """Also writes each chunk's frames to `out_dir/frames_NNNNN.npy` (uint8 [frames, H, W, 3])."""

    out_dir: str = ""

    def write_chunk(self, chunk: DecodedChunk) -> None:
        super().write_chunk(chunk)
        Path(self.out_dir).mkdir(parents=True, exist_ok=True)
        np.save(Path(self.out_dir) / f"frames_{chunk.index:05d}.npy", chunk.frames)


def counting_sink(run: TPRunConfig) -> ChunkSink:
    return CountingSink()


@dataclass(frozen=True)
class SilenceAudio:
    """Audio for chunk n: silence of the chunk's exact sample count."""

    preset: str = "tiny"

    def __call__(self, n: int) -> np.ndarray:
        a, b = ModelConfig.from_name(self.preset).chunk_sample_range(n)
        return np.zeros(b - a, dtype=np.float32)


@dataclass(frozen=True)
class FlagsAt:
    """Flags per chunk: `fused_from` chunk index on, fusedGemmAllReduce is on (None: never; 0: always)."""

    fused_from: int | None = None

    def __call__(self, n: int) -> dict:
        return {"fusedGemmAllReduce": self.fused_from is not None and n >= self.fused_from}


# ---- reports ------------------------------------------------------------------------------------------------


@dataclass
class RankReport:
    rank: int
    role: str
    device: str
    chunks: int = 0
    paths: list[str] = field(default_factory=list)  # DiT: row-parallel path each chunk ran
    chunk_ms: list[float] = field(default_factory=list)  # DiT: generate; decoder: decode
    latents: torch.Tensor | None = None  # rank 0: sent; decoder: received ([chunks, C, h, w], keep_latents)
    sink: dict = field(default_factory=dict)  # decoder: what the sink reports
    overlap_chunks: int = 0  # decoder: chunks n whose decode was still running when chunk n + 1 arrived


# ---- one rank -----------------------------------------------------------------------------------------------


def _max_samples(cfg: ModelConfig) -> int:
    return -(-cfg.audio_sample_rate * cfg.frames_per_chunk // cfg.fps)


def make_groups(layout: WorkerLayout) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """(TP group, pair group). Every rank must call this, in the same order (group creation is collective)."""
    tp_group = dist.new_group(layout.dit_ranks)
    pair_group = dist.new_group([layout.io_rank, layout.decoder_rank])
    return tp_group, pair_group


def rank_main(rank: int, world_size: int, init_method: str, run: TPRunConfig,
              audio_source: Callable[[int], np.ndarray], flag_schedule: Callable[[int], dict],
              sink_factory: Callable[[TPRunConfig], ChunkSink], report_dir: str,
              model_factory: Callable[[TPRunConfig, int, dist.ProcessGroup], VideoDiT] | None = None) -> None:
    """Entry point of one process (the first argument is the rank, as torch.multiprocessing passes it)."""
    os.environ.update(NO_MULTICAST_ENV)
    layout = run.layout
    layout.check_world(world_size)
    device = layout.device(rank)
    if device.type == "cpu":
        os.environ["OMP_NUM_THREADS"] = str(run.cpu_threads)
        torch.set_num_threads(run.cpu_threads)
    else:
        torch.cuda.set_device(device)
    dist.init_process_group(layout.backend, init_method=init_method, rank=rank, world_size=world_size,
                            device_id=device if device.type == "cuda" else None)
    try:
        tp_group, pair_group = make_groups(layout)
        failure = None
        if layout.role(rank) is RankRole.DIT:
            report, failure = run_dit_rank(rank, run, tp_group, pair_group, audio_source, flag_schedule,
                                           model_factory or build_sharded_dit)
        else:
            report = run_decoder_rank(rank, run, pair_group, sink_factory)
        torch.save(asdict(report), os.path.join(report_dir, f"rank{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()
    if failure is not None:  # raised after every rank stopped in order, so it is the error the launcher sees
        raise failure


class LatentLink:
    """Rank 0 → decoder rank over the pair group: header int64 [2] (index or −1, samples), latents, PCM.

    Sends are asynchronous (isend) so rank 0 starts the next chunk at once; a send's buffers are kept
    until the next send waits on it."""

    def __init__(self, cfg: ModelConfig, peer: int, group: dist.ProcessGroup, device: torch.device) -> None:
        self.peer, self.group, self.device = peer, group, device
        self.shape = (cfg.latent_channels, cfg.latent_h, cfg.latent_w)
        self.max_samples = _max_samples(cfg)
        self._pending: list = []

    def _wait_pending(self) -> None:
        for work, _ in self._pending:
            work.wait()
        self._pending = []

    def send(self, index: int, latents: torch.Tensor | None, pcm: np.ndarray | None) -> None:
        self._wait_pending()
        header = torch.tensor([index, 0 if pcm is None else len(pcm)], dtype=torch.int64, device=self.device)
        tensors = [header]
        if index != STOP:
            if tuple(latents.shape) != self.shape:
                raise ValueError(f"latents: expected shape {list(self.shape)}, got {list(latents.shape)}")
            audio = torch.zeros(self.max_samples, dtype=torch.float32)
            audio[: len(pcm)] = torch.from_numpy(np.asarray(pcm, dtype=np.float32))
            tensors += [latents.to(torch.float32).contiguous(), audio.to(self.device)]
        self._pending = [(dist.isend(t, dst=self.peer, group=self.group), t) for t in tensors]
        if index == STOP:
            self._wait_pending()

    def recv(self) -> tuple[int, torch.Tensor | None, np.ndarray | None]:
        header = torch.empty(2, dtype=torch.int64, device=self.device)
        dist.recv(header, src=self.peer, group=self.group)
        index, samples = (int(v) for v in header.tolist())
        if index == STOP:
            return STOP, None, None
        latents = torch.empty(self.shape, dtype=torch.float32, device=self.device)
        audio = torch.empty(self.max_samples, dtype=torch.float32, device=self.device)
        dist.recv(latents, src=self.peer, group=self.group)
        dist.recv(audio, src=self.peer, group=self.group)
        return index, latents, audio[:samples].cpu().numpy()


def build_sharded_dit(run: TPRunConfig, rank: int, tp_group: dist.ProcessGroup) -> VideoDiT:
    """This rank's shard of the DiT, with the TP all-reduce installed. Materializes the whole model on the
    host first (random of the exact shapes, or the checkpoint) and then slices it: right for small presets;
    the 57b preset needs a per-shard builder (meta init + per-rank loading, as bench/gpu_step.py does),
    passed to `launch(model_factory=...)`."""
    cfg = run.model_config()
    model = init_random_(VideoDiT(cfg), seed=run.weights_seed)
    if run.weights is not None:
        from vivant.worker.model.weights import load_weights

        load_weights(model, run.weights)
    return apply_tensor_parallel(model, rank, run.layout.tp, group=tp_group)


def _room_input(cfg: ModelConfig, n: int, audio_source: Callable[[int], np.ndarray],
                flag_schedule: Callable[[int], dict]) -> tuple[np.ndarray, bool]:
    """Rank 0: chunk n's PCM (checked: float32 [exact sample count]) and its fusedGemmAllReduce flag."""
    pcm = np.asarray(audio_source(n), dtype=np.float32)
    a, b = cfg.chunk_sample_range(n)
    if pcm.ndim != 1 or len(pcm) != b - a:
        raise ValueError(f"audio for chunk {n}: expected float32 [{b - a}] samples, got {list(pcm.shape)}")
    return pcm, bool(flag_schedule(n).get("fusedGemmAllReduce", False))


def run_dit_rank(rank: int, run: TPRunConfig, tp_group: dist.ProcessGroup, pair_group: dist.ProcessGroup,
                 audio_source: Callable[[int], np.ndarray], flag_schedule: Callable[[int], dict],
                 model_factory: Callable[[TPRunConfig, int, dist.ProcessGroup], VideoDiT],
                 ) -> tuple[RankReport, Exception | None]:
    """Returns the report and, on rank 0, the error that ended the session early (bad input from the room
    or the flag source): the session is then stopped on every rank first, and what was sent is decoded."""
    layout, cfg = run.layout, run.model_config()
    device = layout.device(rank)
    model = model_factory(run, rank, tp_group)
    gen = ChunkGenerator(cfg, mode=run.mode, device=device, seed=run.seed, model=model)
    report = RankReport(rank=rank, role=RankRole.DIT.value, device=str(device))
    is_io = rank == layout.io_rank
    link = LatentLink(cfg, layout.decoder_rank, pair_group, device) if is_io else None
    control = torch.zeros(3, dtype=torch.int64, device=device)
    pcm_buf = torch.zeros(_max_samples(cfg), dtype=torch.float32, device=device)
    sent = []
    failure: Exception | None = None
    n = 0
    while True:
        if is_io:  # the session's decisions, taken on rank 0 only
            pcm, fused = None, False
            if n < run.chunks:
                try:
                    pcm, fused = _room_input(cfg, n, audio_source, flag_schedule)
                except Exception as exc:  # noqa: BLE001 (re-raised by rank_main once every rank has stopped)
                    failure = exc
            if pcm is None:
                control.copy_(torch.tensor([STOP, 0, 0]))
            else:
                control.copy_(torch.tensor([n, len(pcm), int(fused)]))
                pcm_buf.zero_()
                pcm_buf[: len(pcm)] = torch.from_numpy(pcm)
        dist.broadcast(control, src=layout.io_rank, group=tp_group)
        index, samples, fused = (int(v) for v in control.tolist())
        if index == STOP:
            break
        dist.broadcast(pcm_buf, src=layout.io_rank, group=tp_group)
        pcm = pcm_buf[:samples].cpu().numpy()
        report.paths.append(gen.apply_flags(FlagValues(fusedGemmAllReduce=bool(fused))))  # at the chunk boundary
        t = time.perf_counter()
        out = gen.generate_chunk(pcm, cfg.audio_sample_rate)
        report.chunk_ms.append((time.perf_counter() - t) * 1e3)
        if link is not None:
            link.send(index, out.latents, pcm)
            if run.keep_latents:
                sent.append(out.latents.detach().cpu().clone())
        report.chunks += 1
        n += 1
    if link is not None:
        link.send(STOP, None, None)
    if sent:
        report.latents = torch.stack(sent)
    return report, failure


def run_decoder_rank(rank: int, run: TPRunConfig, pair_group: dist.ProcessGroup,
                     sink_factory: Callable[[TPRunConfig], ChunkSink]) -> RankReport:
    layout, cfg = run.layout, run.model_config()
    device = layout.device(rank)
    vae = build_vae_decoder(VAEConfig.for_model(cfg), device=device, seed=run.vae_seed)
    sink = sink_factory(run)
    stage_times: list[dict[str, float]] = []

    def on_decoded(chunk: DecodedChunk) -> None:
        stage_times.append(chunk.times)
        sink.write_chunk(chunk)

    stage = DecoderStage(vae, on_decoded, queue_chunks=run.decoder_queue_chunks).start()
    link = LatentLink(cfg, layout.io_rank, pair_group, device)
    report = RankReport(rank=rank, role=RankRole.DECODER.value, device=str(device))
    received = []
    try:
        while True:
            index, latents, pcm = link.recv()
            if index == STOP:
                break
            if run.keep_latents:
                received.append(latents.detach().cpu().clone())
            stage.submit(LatentChunk(index, latents, pcm, {"received": time.monotonic()}))
            report.chunks += 1
    finally:
        stage.close()
        report.sink = sink.close()
    report.chunk_ms = list(stage.decode_ms)
    report.overlap_chunks = sum(nxt["received"] < cur["decoded"] for cur, nxt in pairwise(stage_times))
    if received:
        report.latents = torch.stack(received)
    return report


# ---- the launcher -------------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(run: TPRunConfig, *, audio_source: Callable[[int], np.ndarray] | None = None,
           flag_schedule: Callable[[int], dict] | None = None,
           sink_factory: Callable[[TPRunConfig], ChunkSink] | None = None,
           model_factory: Callable[[TPRunConfig, int, dist.ProcessGroup], VideoDiT] | None = None,
           nprocs: int | None = None) -> list[RankReport]:
    """Spawn the layout's processes on this host, run one session, return the ranks' reports (by rank).

    `model_factory(run, rank, tp_group)` builds a DiT rank's shard (default `build_sharded_dit`; a 57b
    deployment passes a per-shard builder). `nprocs` defaults to the layout's world size; another value is refused by every rank before any
    collective starts (the error names the count the layout needs)."""
    world = run.layout.world_size if nprocs is None else nprocs
    audio_source = audio_source or SilenceAudio(run.preset)
    flag_schedule = flag_schedule or FlagsAt(None)
    sink_factory = sink_factory or counting_sink
    with tempfile.TemporaryDirectory(prefix="vivant-tp-") as report_dir:
        mp.start_processes(rank_main, nprocs=world, join=True, start_method="spawn",
                           args=(world, f"tcp://127.0.0.1:{_free_port()}", run, audio_source, flag_schedule,
                                 sink_factory, report_dir, model_factory))
        return [RankReport(**torch.load(os.path.join(report_dir, f"rank{r}.pt"), weights_only=False))
                for r in range(world)]


def main(argv: list[str] | None = None) -> int:
    """`python -m vivant.worker.serving.tp_layout --tp 4 --backend nccl --chunks 360`: one session, a JSON summary."""
    import argparse
    import json

    p = argparse.ArgumentParser(description=main.__doc__)
    p.add_argument("--tp", type=int, default=4, help="DiT ranks (the decoder rank is added: world = tp + 1)")
    p.add_argument("--backend", choices=BACKENDS, default="nccl")
    p.add_argument("--preset", default="tiny")
    p.add_argument("--chunks", type=int, default=24)
    p.add_argument("--fused-from", type=int, default=None, help="chunk index from which fusedGemmAllReduce is on")
    args = p.parse_args(argv)
    run = TPRunConfig(WorkerLayout(tp=args.tp, backend=args.backend), preset=args.preset, chunks=args.chunks)
    reports = launch(run, flag_schedule=FlagsAt(args.fused_from))
    def medians(r: RankReport) -> dict[str, float]:
        by_path: dict[str, list[float]] = {}
        for path, ms in zip(r.paths or ["decode"] * len(r.chunk_ms), r.chunk_ms, strict=True):
            by_path.setdefault(path, []).append(ms)
        return {path: round(float(np.median(v)), 2) for path, v in by_path.items()}

    summary = [{"rank": r.rank, "role": r.role, "device": r.device, "chunks": r.chunks,
                "median_ms_by_path": medians(r), "overlap_chunks": r.overlap_chunks, "sink": r.sink} for r in reports]
    print(json.dumps({"layout": asdict(run.layout), "preset": run.preset, "ranks": summary}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
