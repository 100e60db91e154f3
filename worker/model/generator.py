"""The chunk loop: audio in, latents out, `passes` denoising passes per chunk over a ring KV cache.

`build_generator` (`vivant worker --engine`) builds the generator a worker serves with:
  model  EngineOptions.reference(): the float parts — the model as defined, any device and cache mode.
  fast   EngineOptions.served(device): the FP8 parts (worker/model/fast_parts.py) over the same weights; on CUDA
         bf16 weights, image attention with split-KV, fast accumulation and CUDA graphs; on a CPU the kernels'
         float32 twins, eagerly (tests). Needs the optimized (ring) cache.
  auto   fast on CUDA with the optimized cache, else model.

Sampler: rectified flow. A chunk starts from Gaussian noise (seeded per session and chunk, so runs
repeat) at sigma = sigmas[0] = 1 and takes one Euler step per pass, x ← x + (σ_next − σ)·v, ending at
σ = 0. Every pass writes the chunk's K/V into its ring slots (the last pass's stay), so 4 passes =
4 attention calls per layer per chunk, as in the reference system (60 layers × 4 = 240 calls).

Before a chunk whose temporal index would reach `t_limit`, the position frame shifts back by
Δ = t_limit − W and cached window keys are delta-rotated once (see worker/model/positions.py).

Rewind (`rewind`): at a speech turn's start the session returns to an earlier chunk boundary (at most
`rewind_chunks` back) and generates from there with the new audio; the result equals a session that had that audio
at that chunk from the start, because the noise is seeded per (seed, chunk) and the cache and position frame are
restored exactly (docs/ARCHITECTURE.md, "Rewind at a turn start").

A numerical fault (a chunk whose latents hold NaN/Inf) restarts the model's state — the cache cleared, positions
from 0 — but not the session's chunk count: `chunk` goes on (the audio, the decoder and the pacer count the
session's chunks), and the next chunk is the model's first again (`origin` = that chunk: sink tokens, ring slots,
positions and noise are taken at `chunk − origin`), so it equals chunk 0 of a fresh session given the same audio.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from vivant.apis.feature_flags import FlagValues
from vivant.kernels.fp8_gemm import prefer_static_gemm_schedule
from vivant.kernels.rope import rope_angles
from vivant.worker.model.audio_features import AudioFeaturizer
from vivant.worker.model.config import ModelConfig
from vivant.worker.model.engine import Engine
from vivant.worker.model.kv_cache import KVCache, StepState
from vivant.worker.model.model import VideoDiT, init_random_
from vivant.worker.model.options import (
    CacheMode,
    EngineName,
    EngineOptions,
    RowParallelPath,
    engine_options,
    parse_choice,
)
from vivant.worker.model.positions import PositionFrame, RingLayout, chunk_positions, sink_positions
from vivant.worker.model.weights import load_weights

log = logging.getLogger(__name__)


@dataclass
class HostInputs:
    """A chunk's inputs that do not depend on its audio, built on the host while the previous chunk's passes run
    (`ChunkGenerator.generate_chunk` prepares chunk n + 1 before it waits for chunk n), in pinned memory on a GPU
    so the chunk's start copies them without waiting. Valid for `key` = (chunk, origin, frame offset, frame resets,
    seed) only: a rewind, a reset, a fault's restart or a new session changes the key and the chunk builds its inputs
    afresh."""

    key: tuple[int, int, int, int, int]
    pos_t: int  # the chunk's temporal index in the position frame
    pos: torch.Tensor  # int64 [T, 3]
    slots: torch.Tensor  # int64 [T]
    valid: torch.Tensor  # bool [S]
    noise: torch.Tensor  # float32 [C, latent_h, latent_w]: the chunk's starting latents (sigma = 1)
    cos: torch.Tensor  # float32 [T, D/2]: the rotary angles of pos (kernels.rope.rope_angles), as cos and sin
    sin: torch.Tensor


@dataclass
class ChunkOutput:
    index: int
    latents: torch.Tensor  # float32 [C, latent_h, latent_w]
    timings_ms: dict[str, float] = field(default_factory=dict)
    position_t: int = 0  # the chunk's temporal index in the position frame
    reset: bool = False  # a position reset happened before this chunk
    finite: bool = True  # False: the latents hold NaN/Inf (a numerical fault; the model restarts at the next chunk)


class ChunkGenerator:
    """One session's chunk loop on one rank. The passes run on `engine` (worker/model/engine.py); without one, the
    generator builds `Engine.build(model, options)` from `model` (default: random weights of `cfg`, `seed`, or
    the checkpoint `weights`), cast to `device` and `dtype`. The ring's dtype follows the engine (bf16 for the FP8
    parts, float32 for the float parts); `fp8` is the baseline cache's per-call FP8 quantization of K/V."""

    def __init__(self, cfg: ModelConfig, *, mode: CacheMode | str = CacheMode.OPTIMIZED,
                 device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32, seed: int = 0,
                 fp8: bool = True, weights: str | Path | None = None, model: VideoDiT | None = None,
                 options: EngineOptions = EngineOptions(), engine: Engine | None = None,
                 kernel_backend: str = "auto", rewind_chunks: int = 4):
        if isinstance(rewind_chunks, bool) or not isinstance(rewind_chunks, int) or rewind_chunks < 0:
            raise ValueError(f"ChunkGenerator rewind_chunks = {rewind_chunks!r}; expected an integer ≥ 0 (0: no rewind)")
        if rewind_chunks >= cfg.t_limit - cfg.window_chunks:
            raise ValueError(f"ChunkGenerator rewind_chunks = {rewind_chunks}: expected < t_limit − window_chunks = "
                             f"{cfg.t_limit - cfg.window_chunks} (position resets are that many chunks apart; the undo "
                             "log holds one reset)")
        self._rewind_chunks = rewind_chunks
        self._frames: dict[int, tuple[int, int]] = {}  # chunk → (offset, resets) of the frame after it
        self.cfg, self.mode, self.fp8 = cfg, parse_choice(CacheMode, mode, "mode"), fp8
        self.device, self.dtype = torch.device(device), dtype
        self.kernel_backend = kernel_backend
        if engine is None:
            if model is None:
                model = init_random_(VideoDiT(cfg), seed=seed)
                if weights is not None:
                    load_weights(model, weights)
            engine = Engine.build(model.to(device=self.device, dtype=dtype).eval(), options)
        self.engine = engine
        self.cache: KVCache | None = None
        self.layout = RingLayout(cfg.sink_tokens, cfg.tokens_per_chunk, cfg.window_chunks)
        self.featurize = AudioFeaturizer(sample_rate=cfg.audio_sample_rate, tokens=max(cfg.audio_tokens, 1),
                                         features=cfg.audio_feature_dim,
                                         nominal_samples=cfg.chunk_sample_range(0)[1])
        self._pinned_sets: list[dict[str, torch.Tensor]] | None = None  # `_staging`'s two sets, at first use
        self.reset_session(seed)

    def apply_flags(self, flags: FlagValues) -> RowParallelPath:
        """Between chunks only (on every TP rank at the same boundary): the `fusedGemmAllReduce` flag swaps the
        O/down step between GEMM + all-reduce and the fused step (worker/model/fused_tp.py). Returns the path in
        effect: fused_gemm_all_reduce, gemm_then_all_reduce, or no_tp when there is nothing to fuse (TP = 1)."""
        return self.engine.set_row_parallel_path(fused=flags.fusedGemmAllReduce)

    @property
    def local_heads(self) -> int:
        return self.engine.local_heads

    @property
    def rewind_chunks(self) -> int:
        """How many chunks back `rewind` can go (the undo log's depth; 0: rewinding is off)."""
        return self._rewind_chunks

    def oldest_rewind(self) -> int:
        """The earliest session chunk `rewind` can return to now: the cache's undo depth, and never before the chunk a
        numerical fault restarted the model at (`origin`)."""
        return self.origin + self.cache.oldest_rewind()

    def rewind(self, to_chunk: int) -> None:
        """Return to the chunk boundary before `to_chunk`: afterwards the next `generate_chunk` produces chunk
        `to_chunk`, and the cache, the position frame and `chunk` equal the state right after chunk `to_chunk` − 1
        was generated. `to_chunk == chunk` is a no-op; ValueError naming `to_chunk` unless
        `max(origin, chunk − rewind_chunks) ≤ to_chunk ≤ chunk` (on every tensor-parallel rank at the same boundary;
        a numerical fault's restart is as far back as a rewind goes: the state before it is what went wrong)."""
        lo = self.oldest_rewind()
        if isinstance(to_chunk, bool) or not isinstance(to_chunk, int) or not lo <= to_chunk <= self.chunk:
            raise ValueError(f"rewind to_chunk = {to_chunk!r}: expected an integer in [{lo}, {self.chunk}] (the next "
                             f"chunk is {self.chunk}; at most rewind_chunks = {self.rewind_chunks} back)")
        if to_chunk == self.chunk:
            return
        if to_chunk == self.origin:
            self._restart(self.seed, self.origin)
            return
        self.cache.rewind(to_chunk - self.origin)
        self.frame.offset, self.frame.resets = self._frames[to_chunk - 1]
        self._frames = {c: f for c, f in self._frames.items() if c < to_chunk}
        self.chunk = to_chunk
        self._next = None

    def reset_session(self, seed: int = 0) -> None:
        """A new session: chunk 0, a cleared cache, positions from 0, noise seeded by `seed`."""
        self._restart(seed, 0)

    def _restart(self, seed: int, at: int) -> None:
        """The model's state afresh from session chunk `at` (= the next chunk and the new `origin`)."""
        cfg = self.cfg
        self.seed = seed
        self.chunk = self.origin = at
        self._frames = {}
        self._next: HostInputs | None = None
        self.frame = PositionFrame(cfg.t_limit, cfg.window_chunks)
        if self.cache is not None:  # a warm worker keeps its preallocated cache across sessions
            self.cache.clear()
            return
        # the FP8 parts write the served bf16 ring; the float parts a float32 one (the reference)
        ring_dtype = torch.bfloat16 if self.engine.options.fp8 else torch.float32
        self.cache = KVCache(layers=cfg.n_layers, heads=self.local_heads, head_dim=cfg.head_dim, layout=self.layout,
                             rope_dims=cfg.rope_dims, rope_theta=cfg.rope_theta, mode=self.mode, fp8=self.fp8,
                             ring_dtype=ring_dtype, device=self.device, kernel_backend=self.kernel_backend,
                             rewind_chunks=self.rewind_chunks)

    @torch.no_grad()
    def warm_up(self) -> int:
        """Run, before the first session, everything a session runs for the first time: silent chunks until one
        ran with every ring slot valid and one began with a position reset — so every CUDA graph (keyed by
        all-slots-valid; the ring is reused across sessions, so they stay valid) is captured and the reset's
        kernels are compiled — then the session is forgotten. Returns the chunks run (0 when the engine
        captures no graphs). On every tensor-parallel rank at the same point: the chunks' collectives pair up."""
        if not self.engine.options.cuda_graphs:
            return 0
        self.reset_session(self.seed)
        silence = np.zeros(self.cfg.chunk_sample_range(0)[1], dtype=np.float32)
        n, all_valid, reset = 0, False, False
        while not (all_valid and reset) and n < 4 * (self.cfg.window_chunks + self.cfg.t_limit):
            reset |= self.generate_chunk(silence, self.cfg.audio_sample_rate).reset
            all_valid |= self.cache.step.all_valid
            n += 1
        self.reset_session(self.seed)
        return n

    def noise(self, chunk: int) -> torch.Tensor:
        """Session chunk `chunk`'s starting latents [C, latent_h, latent_w] on the generator's device (seeded per
        session and model chunk, `chunk − origin`)."""
        return self._host_noise(chunk - self.origin).to(self.device)

    def _host_noise(self, chunk: int) -> torch.Tensor:
        g = torch.Generator(device="cpu").manual_seed(self.seed * 1_000_003 + chunk)
        c = self.cfg
        return torch.randn(c.latent_channels, c.latent_h, c.latent_w, generator=g)

    def _staging(self, n: int) -> dict[str, torch.Tensor] | None:
        """Chunk n's page-locked host buffers on a GPU (None elsewhere): two sets, by chunk parity, allocated once.
        A copy from pinned memory does not make the host wait; the set chunk n + 1 is prepared into while chunk n
        runs is not the one chunk n's copies read, and chunk n − 1's copies from it ended with chunk n − 1's wait."""
        if self.device.type != "cuda":
            return None
        if self._pinned_sets is None:
            c = self.cfg

            def pinned(shape, dtype):
                return torch.empty(shape, dtype=dtype, pin_memory=True)

            self._pinned_sets = [
                {"pos": pinned((c.tokens_per_chunk, 3), torch.int64), "slots": pinned(c.tokens_per_chunk, torch.int64),
                 "valid": pinned(self.layout.slots, torch.bool),
                 "noise": pinned((c.latent_channels, c.latent_h, c.latent_w), torch.float32),
                 "cos": pinned((c.tokens_per_chunk, c.head_dim // 2), torch.float32),
                 "sin": pinned((c.tokens_per_chunk, c.head_dim // 2), torch.float32),
                 "feats": pinned((c.audio_tokens, c.audio_feature_dim), torch.float32),
                 "finite": pinned((), torch.bool)} for _ in range(2)]
        return self._pinned_sets[n % 2]

    def host_inputs(self, n: int) -> HostInputs | None:
        """Session chunk n's audio-independent inputs in the current position frame (in its pinned staging set on a
        GPU); None when a position reset must come first (the chunk then builds them after the reset)."""
        m = n - self.origin  # the model's chunk
        if self.frame.needs_reset(m):
            return None
        cfg, pos_t = self.cfg, self.frame.t_of(m)
        pos = chunk_positions(pos_t, cfg.grid_h, cfg.grid_w, cfg.audio_tokens)
        angles = rope_angles(pos, cfg.rope_dims, cfg.rope_theta)  # on the host: the chunk start only copies them
        t = {"pos": pos, "slots": self.layout.chunk_slots(m), "valid": self.layout.valid_mask(m),
             "noise": self._host_noise(m), "cos": angles.cos(), "sin": angles.sin()}
        stage = self._staging(n)
        if stage is not None:
            t = {k: stage[k].copy_(v) for k, v in t.items()}
        return HostInputs(key=self._inputs_key(n), pos_t=pos_t, **t)

    def _inputs_key(self, n: int) -> tuple[int, int, int, int, int]:
        return (n, self.origin, self.frame.offset, self.frame.resets, self.seed)

    @torch.no_grad()
    def generate_chunk(self, audio: np.ndarray | torch.Tensor, sample_rate: int) -> ChunkOutput:
        """Chunk `chunk` from its audio: the passes, then the next chunk's host inputs (`host_inputs`) while the
        device still runs them, then one wait for the device; a non-finite result restarts the model's state at the next
        chunk (module docstring)."""
        cfg, n, dev = self.cfg, self.chunk, self.device
        m = n - self.origin  # the model's chunk (the session's since its start or its last numerical fault)
        t0 = time.perf_counter()
        stage = self._staging(n)
        feats = self.featurize(audio, sample_rate)[: cfg.audio_tokens]
        if stage is not None and cfg.audio_tokens:
            feats = stage["feats"].copy_(feats)
        feats = feats.to(dev, non_blocking=True)
        reset = False
        if self.frame.needs_reset(m):
            delta = self.frame.reset()
            resident = [c for c in self.layout.resident_chunks(m) if c != m]
            slots = torch.cat([self.layout.chunk_slots(c) for c in resident]) if resident else torch.empty(0, dtype=torch.int64)
            self.cache.shift_positions(delta, slots)
            reset = True
        t_cache = time.perf_counter()
        inputs, self._next = self._next, None
        if inputs is None or inputs.key != self._inputs_key(n):
            inputs = self.host_inputs(n)
        pos = inputs.pos.to(dev, non_blocking=True)
        state = StepState(chunk=m, pos=pos, slots=inputs.slots, valid=inputs.valid,
                          sink_pos=sink_positions(inputs.pos, cfg.sink_tokens).to(dev) if m == 0 and cfg.sink_tokens else None,
                          cos=inputs.cos, sin=inputs.sin)
        self.cache.begin_chunk(state)
        x = inputs.noise.to(dev, non_blocking=True)
        sigmas = list(cfg.sigmas) + [0.0]
        for i in range(cfg.passes):
            v = self.engine(x, sigmas[i], feats, self.cache)
            x = x + (sigmas[i + 1] - sigmas[i]) * v.float()
        self.cache.end_chunk()
        finite = torch.isfinite(x).all()
        if stage is not None:  # lands with the wait below: no second round trip to the device
            finite = stage["finite"].copy_(finite, non_blocking=True)
        t_launched = time.perf_counter()
        self.chunk += 1
        self._frames[n] = (self.frame.offset, self.frame.resets)
        self._frames.pop(n - self.rewind_chunks - 1, None)
        self._next = self.host_inputs(n + 1)  # host work while the device runs this chunk's passes
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t1 = time.perf_counter()
        finite = bool(finite)
        if not finite:
            # NaN/Inf reached the cache: every later chunk would attend it. Start the model's state afresh
            # (cache cleared, positions from 0) at the next chunk; this chunk is reported as it is (a numerical
            # fault) and the session's chunk count goes on.
            self._restart(self.seed, n + 1)
        return ChunkOutput(index=n, latents=x, position_t=inputs.pos_t, reset=reset, finite=finite,
                           timings_ms={"total": (t1 - t0) * 1e3, "reset": (t_cache - t0) * 1e3,
                                       "passes": (t1 - t_cache) * 1e3, "host_launch": (t_launched - t0) * 1e3})


def build_generator(cfg: ModelConfig, *, mode: CacheMode | str = CacheMode.OPTIMIZED,
                    device: str | torch.device = "cpu", seed: int = 0, weights: str | Path | None = None,
                    engine: EngineName | str = EngineName.AUTO, model: VideoDiT | None = None) -> ChunkGenerator:
    """A `ChunkGenerator` for `cfg` running the engine `engine` names (module docstring). `model`: already built
    (e.g. a tensor-parallel shard, worker/model/tp.py); default random weights of the preset (`seed`), or the
    safetensors checkpoint `weights`."""
    dev = torch.device(device)
    mode = parse_choice(CacheMode, mode, "mode")
    options = engine_options(engine, dev, mode)
    log.info("engine %s -> %s on %s (mode %s)", EngineName(engine).value, options, dev, mode.value)
    cuda = dev.type == "cuda"
    if cuda and options.fp8:  # before the first cuBLASLt GEMM of this process (kernels/fp8_gemm.py says why)
        log.info("cuBLASLt workspace %s KiB", prefer_static_gemm_schedule())
    if model is None:
        model = init_random_(VideoDiT(cfg), seed=seed)
        if weights is not None:
            load_weights(model, weights)
    dtype = torch.bfloat16 if cuda and options.fp8 else torch.float32
    model = model.to(device=dev, dtype=dtype).eval()
    return ChunkGenerator(cfg, mode=mode, device=dev, dtype=dtype, seed=seed,
                          engine=Engine.build(model, options, inplace=True))
