"""The decoder stage: the VAE runs on its own device so decode(n) overlaps diffuse(n + 1).

Why: in the reference system the DiT ranks must start chunk n + 1 the moment chunk n's latents exist;
decoding them (tens of ms at 704x1088) happens elsewhere. Hand-over, by deployment:

* CPU (tests, demo): a decoder thread fed by a bounded queue (`queue_chunks`). torch releases the GIL
  inside its kernels, so the generator thread and the decoder thread run at the same time.
* one process, two GPUs (generator on cuda:0, decoder on cuda:1): `submit` queues an async copy of the
  latents to the decoder GPU on a side stream of the source GPU (ordered after the generator's stream
  by an event, the source tensor's memory held with `record_stream`); the decoder thread waits on that
  event on its own stream, so the generator's stream never waits for the decoder.
* separate processes with a decoder rank (`vivant worker`): DiT rank 0 sends the latents point to point
  (vivant.worker.serving.wire) and the decoder rank runs a `DecoderStage` on what it received.

The queue is bounded: when the decoder falls behind (or the pacer's buffer is full because everything
is ahead of real time), `submit` waits and reports how long; nothing is dropped. Errors raised in the
decoder thread are re-raised on the next `submit`/`close`.

Rewind (`rewind(r)`, at a speech turn's start, docs/ARCHITECTURE.md "Rewind at a turn start"): chunks ≥ r that are
queued or being decoded are dropped (never reach `on_decoded`), and the next chunk decoded, r, starts from the causal
state after chunk r − 1: the stage keeps that state (`DecoderCache.snapshot`, no copies of tensors) after each of the
last `rewind_chunks` decoded chunks. A decode finishes and delivers under the stage's lock, so a rewind waits for a
delivery in progress (at most until the pacer has room for it) and a chunk decoded while the rewind came is
discarded by its epoch.

A chunk whose latents are not finite (`LatentChunk.finite` False: the generator found it, once, on its device, and
restarts its model state) is not decoded: its causal state would make every later frame NaN (black) for the rest of
the session. Its frames hold
the last frame delivered (black before any), and the decoder restarts with the generator: a fresh causal state for
the next chunk (`nonfinite_chunks` lists them).

Shapes: latents [C, h, w] float; decoded frames uint8 [frames_per_chunk, H, W, 3] in host memory.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
from vivant.worker.stream.pacer import DecodedChunk
from vivant.worker.stream.vae import VAEDecoder


@dataclass
class LatentChunk:
    """One diffused chunk on its way to the decoder."""

    index: int
    latents: torch.Tensor  # [C, h, w]
    audio: np.ndarray  # the chunk's PCM (float32), carried along for playout
    times: dict[str, float] = field(default_factory=dict)  # wall timestamps (s) of earlier stages
    finite: bool = True  # False: the generator found NaN/Inf in the latents (not decoded; the last frame is held)


@dataclass
class _Handoff:
    chunk: LatentChunk
    ready: torch.cuda.Event | None  # CUDA: the copy to the decoder device is done when this fires
    epoch: int = 0  # the stage's rewind epoch when it was submitted


_STOP = object()


class _HandoffQueue(queue.Queue):
    """The stage's bounded queue; `taken` is the item `get` handed out last, recorded under the queue's own mutex
    (the `_get` hook `queue.PriorityQueue` overrides too), so a rewind holding that mutex sees every chunk either
    queued or taken, never between the two. The stage clears `taken` under its lock once the item is delivered or
    found stale."""

    def __init__(self, maxsize: int) -> None:
        super().__init__(maxsize)
        self.taken: object | None = None

    def _get(self) -> object:
        self.taken = item = self.queue.popleft()
        return item


class DecoderStage:
    """Decodes `LatentChunk`s in order on `vae`'s device, in a thread; results go to `on_decoded`.

    `on_decoded` runs on the decoder thread (e.g. the pipeline's push into the pacer, waiting for
    space when the pacer is full). `decode_ms` keeps every chunk's decode time."""

    def __init__(self, vae: VAEDecoder, on_decoded: Callable[[DecodedChunk], None], queue_chunks: int = 2,
                 now: Callable[[], float] = time.monotonic, rewind_chunks: int = 8) -> None:
        if queue_chunks < 1:
            raise ValueError(f"DecoderStage.queue_chunks = {queue_chunks}; expected a positive integer")
        if isinstance(rewind_chunks, bool) or not isinstance(rewind_chunks, int) or rewind_chunks < 0:
            raise ValueError(f"DecoderStage.rewind_chunks = {rewind_chunks!r}; expected an integer ≥ 0")
        self.rewind_chunks = rewind_chunks
        self.lock = threading.RLock()  # held while a decoded chunk is delivered, and by a rewind
        self._epoch = 0  # rewinds so far
        self._cuts: list[int] = []  # rewind e + 1 dropped the chunks ≥ _cuts[e] submitted before it
        self._last_done = -1  # index of the last chunk decoded into the cache
        self._inflight: int | None = None  # index of the chunk being decoded
        self._snapshots: dict[int, object] = {}  # chunk → the causal state right after it
        self.rewind_dropped: list[int] = []  # the chunks the latest rewind dropped (queued, or taken and not delivered)
        self.vae = vae
        self.device = next(vae.parameters()).device
        self.on_decoded = on_decoded
        self.now = now
        self._queue = _HandoffQueue(queue_chunks)  # .taken: the item the thread took and has not delivered
        self._cache = vae.new_cache()
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._copy_streams: dict[int, torch.cuda.Stream] = {}
        self._decode_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.decode_ms: list[float] = []
        self.submit_wait_ms: list[float] = []
        self.nonfinite_chunks: list[int] = []  # chunks whose latents were not finite: held frames, state restarted
        self._last_frame: np.ndarray | None = None  # [H, W, 3] uint8: the last frame delivered

    def start(self) -> DecoderStage:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="vivant-decoder", daemon=True)
            self._thread.start()
        return self

    def reset_session(self) -> None:
        """A new session: fresh temporal cache. Call only while the queue is empty."""
        with self.lock:
            self._cache = self.vae.new_cache()
            self._last_done = -1
            self._snapshots = {}
            self._last_frame = None

    def oldest_rewind(self) -> int:
        """The earliest chunk `rewind` can return to now (its causal state is kept, or nothing was decoded since)."""
        with self.lock:
            done = self._last_done if self._inflight is None else max(self._last_done, self._inflight)
            if done < 0 or 0 in self._snapshots:
                return 0
            return min(self._snapshots) + 1 if self._snapshots else done + 1

    def rewind(self, to_chunk: int) -> None:
        """Drop the chunks ≥ `to_chunk` queued or being decoded and make the causal state the one after chunk
        `to_chunk` − 1 (module docstring); `rewind_dropped` lists the indices dropped (queued, or taken by the thread
        and not delivered). ValueError naming `to_chunk` when that state is no longer kept (more than `rewind_chunks`
        decoded chunks back) or is in the future of what was decoded. Callers that deliver into a pacer hold `lock` around the pacer's drop and this call."""
        if isinstance(to_chunk, bool) or not isinstance(to_chunk, int) or to_chunk < 0:
            raise ValueError(f"decoder stage rewind to_chunk = {to_chunk!r}; expected an integer ≥ 0")
        with self.lock:  # re-entrant: Playout.rewind holds it already
            undo = self._last_done >= to_chunk or (self._inflight is not None and self._inflight >= to_chunk)
            if undo and to_chunk > 0 and (to_chunk - 1) not in self._snapshots:
                kept = sorted(self._snapshots)
                raise ValueError(f"decoder stage rewind to_chunk = {to_chunk}: the causal state after chunk "
                                 f"{to_chunk - 1} is no longer kept (kept: after chunks {kept}; rewind_chunks = "
                                 f"{self.rewind_chunks})")
            self._epoch += 1
            self._cuts.append(to_chunk)
            with self._queue.mutex:  # queue.Queue's own lock over its deque: drop the stale items in place
                kept_items = [h for h in self._queue.queue if h is _STOP or h.chunk.index < to_chunk]
                dropped = [h.chunk.index for h in self._queue.queue if h is not _STOP and h.chunk.index >= to_chunk]
                self._queue.queue.clear()
                self._queue.queue.extend(kept_items)
                self._queue.not_full.notify_all()
                taken = self._queue.taken
                if taken is not None and taken is not _STOP and taken.chunk.index >= to_chunk:
                    dropped.insert(0, taken.chunk.index)  # taken from the queue: discarded by its epoch
            if self._last_done >= to_chunk or (self._inflight is not None and self._inflight >= to_chunk):
                # a fresh object: a decode in flight keeps writing into the old one, and is then discarded
                self._cache = self._snapshots[to_chunk - 1].snapshot() if to_chunk > 0 else self.vae.new_cache()
                self._last_done = to_chunk - 1
            self._snapshots = {c: v for c, v in self._snapshots.items() if c < to_chunk}
            self.rewind_dropped = dropped

    def submit(self, chunk: LatentChunk) -> float:
        """Hand a chunk over (returns seconds spent waiting for queue space)."""
        self._raise_if_failed()
        self.vae.check_chunk_latents(chunk.latents)
        handoff = self._async_copy(chunk) if self.device.type == "cuda" else _Handoff(chunk, None)
        handoff.epoch = self._epoch
        t = time.perf_counter()
        while True:
            try:
                self._queue.put(handoff, timeout=0.5)
                break
            except queue.Full:
                self._raise_if_failed()
        waited = time.perf_counter() - t
        self.submit_wait_ms.append(waited * 1e3)
        return waited

    def close(self, timeout: float | None = None) -> None:
        """Decode what is queued, then stop the thread; re-raises a decoder error."""
        if self._thread is not None:
            while self._thread.is_alive():
                try:
                    self._queue.put(_STOP, timeout=0.5)
                    break
                except queue.Full:
                    continue
            self._thread.join(timeout)
            self._thread = None
        self._raise_if_failed()

    # ---- internals ----------------------------------------------------------------------------------
    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"decoder stage failed: {self._error!r}") from self._error

    def _async_copy(self, chunk: LatentChunk) -> _Handoff:
        """CUDA hand-over; the returned event fires when the latents are on the decoder device."""
        src_dev = chunk.latents.device
        key = -1 if src_dev.type == "cpu" else int(src_dev.index or 0)
        if src_dev == self.device:
            # Same GPU: order the decoder's stream after the generator's, and keep the memory alive for it.
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(src_dev))
            chunk.latents.record_stream(self._decode_stream)
            return _Handoff(chunk, ready)
        if src_dev.type == "cpu":
            latents = chunk.latents.pin_memory().to(self.device, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.device))
        else:
            stream = self._copy_streams.get(key)
            if stream is None:
                stream = self._copy_streams[key] = torch.cuda.Stream(src_dev)
            stream.wait_stream(torch.cuda.current_stream(src_dev))
            with torch.cuda.stream(stream):
                latents = chunk.latents.to(self.device, non_blocking=True)
                ready = torch.cuda.Event()
                ready.record(stream)
            chunk.latents.record_stream(stream)
        moved = LatentChunk(chunk.index, latents, chunk.audio, dict(chunk.times), chunk.finite)
        return _Handoff(moved, ready)

    def _run(self) -> None:
        try:
            while True:
                item = self._queue.get()
                if item is _STOP:
                    return
                self._decode_one(item)
        except BaseException as exc:  # noqa: BLE001 (re-raised on the producer's side)
            self._error = exc
            while True:  # unblock a producer waiting on a full queue
                try:
                    self._queue.get_nowait()
                except queue.Empty:
                    break

    def _stale(self, item: _Handoff) -> bool:
        """Submitted before a rewind that dropped its index (any rewind since, not only the latest)."""
        return any(item.chunk.index >= cut for cut in self._cuts[item.epoch:])

    def _decode_one(self, item: _Handoff) -> None:
        chunk = item.chunk
        with self.lock:
            if self._stale(item):
                self._queue.taken = None
                return
            cache = self._cache
            self._inflight = chunk.index
        t_start = self.now()
        t = time.perf_counter()
        host = None  # a chunk that is not finite is not decoded: held frames below
        if chunk.finite and self._decode_stream is not None:
            with torch.cuda.stream(self._decode_stream):
                if item.ready is not None:
                    self._decode_stream.wait_event(item.ready)
                host = self.vae.decode_chunk(chunk.latents, cache).to("cpu", non_blocking=False)
        elif chunk.finite:
            host = self.vae.decode_chunk(chunk.latents, cache)
        elif item.ready is not None:
            item.ready.synchronize()  # not decoded: the copy must still end before its memory can be reused
        frames = host.numpy() if host is not None else self._held_frames()
        ms = (time.perf_counter() - t) * 1e3
        times = dict(chunk.times)
        times["decode_start"] = t_start
        times["decoded"] = self.now()
        with self.lock:
            self._inflight = None
            self._queue.taken = None
            if self._stale(item) or cache is not self._cache:  # a rewind came while it was decoded
                return
            self.decode_ms.append(ms)
            self._last_done = chunk.index
            if host is None:  # not finite: the next chunk starts the decoder afresh, as the generator does
                self._cache = cache = self.vae.new_cache()
                self.nonfinite_chunks.append(chunk.index)
            if self.rewind_chunks:
                self._snapshots[chunk.index] = cache.snapshot()
                self._snapshots.pop(chunk.index - self.rewind_chunks, None)
            self._last_frame = frames[-1]
            self.on_decoded(DecodedChunk(chunk.index, frames, chunk.audio, times))

    def _held_frames(self) -> np.ndarray:
        """A not-finite chunk's frames: the last frame delivered, held for the chunk (black before any)."""
        c = self.vae.cfg
        if self._last_frame is None:
            return np.zeros((c.temporal_factor, c.out_h, c.out_w, 3), dtype=np.uint8)
        return np.repeat(self._last_frame[None], c.temporal_factor, axis=0)
