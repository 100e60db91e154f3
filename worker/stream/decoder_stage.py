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


@dataclass
class _Handoff:
    chunk: LatentChunk
    ready: torch.cuda.Event | None  # CUDA: the copy to the decoder device is done when this fires


_STOP = object()


class DecoderStage:
    """Decodes `LatentChunk`s in order on `vae`'s device, in a thread; results go to `on_decoded`.

    `on_decoded` runs on the decoder thread (e.g. the pipeline's push into the pacer, waiting for
    space when the pacer is full). `decode_ms` keeps every chunk's decode time."""

    def __init__(self, vae: VAEDecoder, on_decoded: Callable[[DecodedChunk], None], queue_chunks: int = 2,
                 now: Callable[[], float] = time.monotonic) -> None:
        if queue_chunks < 1:
            raise ValueError(f"DecoderStage.queue_chunks = {queue_chunks}; expected a positive integer")
        self.vae = vae
        self.device = next(vae.parameters()).device
        self.on_decoded = on_decoded
        self.now = now
        self._queue: queue.Queue = queue.Queue(maxsize=queue_chunks)
        self._cache = vae.new_cache()
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._copy_streams: dict[int, torch.cuda.Stream] = {}
        self._decode_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.decode_ms: list[float] = []
        self.submit_wait_ms: list[float] = []

    def start(self) -> DecoderStage:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="vivant-decoder", daemon=True)
            self._thread.start()
        return self

    def reset_session(self) -> None:
        """A new session: fresh temporal cache. Call only while the queue is empty."""
        self._cache = self.vae.new_cache()

    def submit(self, chunk: LatentChunk) -> float:
        """Hand a chunk over (returns seconds spent waiting for queue space)."""
        self._raise_if_failed()
        self.vae.check_chunk_latents(chunk.latents)
        handoff = self._async_copy(chunk) if self.device.type == "cuda" else _Handoff(chunk, None)
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
        moved = LatentChunk(chunk.index, latents, chunk.audio, dict(chunk.times))
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

    def _decode_one(self, item: _Handoff) -> None:
        chunk = item.chunk
        t_start = self.now()
        t = time.perf_counter()
        if self._decode_stream is not None:
            with torch.cuda.stream(self._decode_stream):
                if item.ready is not None:
                    self._decode_stream.wait_event(item.ready)
                frames = self.vae.decode_chunk(chunk.latents, self._cache)
                host = frames.to("cpu", non_blocking=False)
        else:
            host = self.vae.decode_chunk(chunk.latents, self._cache)
        ms = (time.perf_counter() - t) * 1e3
        self.decode_ms.append(ms)
        times = dict(chunk.times)
        times["decode_start"] = t_start
        times["decoded"] = self.now()
        self.on_decoded(DecodedChunk(chunk.index, host.numpy(), chunk.audio, times))
