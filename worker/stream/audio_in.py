"""Audio in: speech PCM arriving in segments, cut on interruption, aligned to the chunk grid.

Why: the voice agent sends the character's speech as PCM segments (faster or slower than real time,
with gaps), and may interrupt it at any moment ("clear buffer"). The generator needs, for every
chunk n, exactly the samples of that chunk, `cfg.chunk_sample_range(n)` (2666 or 2667 at 16 kHz),
and silence when nobody speaks: idle chunks are still generated so the character listens and breathes.

`AudioInput` keeps the not-yet-consumed speech in a FIFO. `next_chunk()` takes the chunk's samples
from its front and pads the rest with zeros. `clear_buffer()` discards everything not yet consumed,
so at most the chunk already handed to the generator carries speech after an interruption: the cut
lands within one chunk. A turn starts at the first segment after start-up, `end_segment()` or
`clear_buffer()`; its first sample is traced (clock time pushed, chunk and stream sample where it
landed) for the turn-latency report.

Rewind (`rewind(r)`): when a turn starts, the chunks taken ahead of playback are dropped and generation restarts at
chunk r (docs/ARCHITECTURE.md, "Rewind at a turn start"); the next `next_chunk()` is chunk r again. The speech those
chunks took goes back to the front of the queue (so chunk r takes what it would have taken had it never been
taken), unless an interruption (`clear_buffer`) came after it was taken: then it is discarded, as the interruption
discarded everything pending. A turn whose first sample was in a dropped chunk is placed again when that sample is
taken again. The last `history_chunks` chunks can be rewound.

Splice (`rewind(m, keep_samples=K)`, the rewind at a frame): chunk m was partly shown, so the samples it took for its
first frames, [0, K) of the chunk, stay as they were (speech and silence alike) and are taken again by chunk m; the
speech it took from sample K on goes back to the queue, and the queued speech fills chunk m from sample K. An
interrupt is spliced the same way: the speech taken before `clear_buffer` is discarded, not queued again (it counts in
`cleared_samples`), so chunk m is made again with its kept prefix and silence from sample K.

Rates: PCM at the configured rate (16 kHz default) is taken as is; other rates are resampled with
libswresample (PyAV) when `resample=True`, else rejected with an error naming the expected rate.
Samples are float32 in [-1, 1] or int16 (scaled by 1/32768), mono (1-D or [n, 1]).
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np
from vivant.worker.stream.pacer import Clock, MonotonicClock


class SampleRateError(ValueError):
    """PCM at a sample rate this input does not take."""


class AudioBufferFull(RuntimeError):
    """More speech pending than `max_pending_s`; the sender must slow down (nothing was dropped)."""


class ChunkGrid(Protocol):
    audio_sample_rate: int

    def chunk_sample_range(self, n: int) -> tuple[int, int]: ...


@dataclass(frozen=True)
class AudioInConfig:
    resample: bool = True  # other rates: resample (True) or reject with SampleRateError (False)
    max_pending_s: float = 120.0  # bound on speech waiting to be consumed

    def __post_init__(self) -> None:
        if not self.max_pending_s > 0:
            raise ValueError(f"AudioInConfig.max_pending_s = {self.max_pending_s!r}; expected > 0 seconds")


@dataclass
class TurnStart:
    turn: int
    pushed_s: float  # clock time its first segment was pushed
    chunk_index: int | None = None  # chunk that carries its first sample (set when consumed)
    stream_sample: int | None = None  # that sample's position on the chunk grid


@dataclass
class ChunkAudio:
    index: int
    samples: np.ndarray  # float32 [stop - start]
    speech_samples: int  # how many came from pushed speech (the rest is silence)
    turns: list[TurnStart] = field(default_factory=list)  # turns whose first sample is in this chunk


@dataclass
class _Segment:
    pcm: np.ndarray
    turn: TurnStart | None  # set on the first segment of a turn


@dataclass
class _Taken:
    """What one chunk took from the queue, so a rewind can put it back: the pieces in order, each with the turn it
    started (if any), and the interruptions applied before it was taken."""

    index: int
    pieces: list[_Segment]
    clears: int
    offsets: list[int] = field(default_factory=list)  # each piece's first sample within the chunk


class AudioInput:
    """Thread-safe: the transport pushes and clears, the generation loop calls `next_chunk()`."""

    def __init__(self, grid: ChunkGrid, config: AudioInConfig | None = None, clock: Clock | None = None,
                 history_chunks: int = 8) -> None:
        if isinstance(history_chunks, bool) or not isinstance(history_chunks, int) or history_chunks < 0:
            raise ValueError(f"AudioInput history_chunks = {history_chunks!r}; expected an integer ≥ 0")
        self.grid = grid
        self.history_chunks = history_chunks
        self._taken: deque[_Taken] = deque(maxlen=history_chunks or None)
        self._clears = 0
        self._last_had_speech = False  # the chunk taken last carried speech
        self.config = config or AudioInConfig()
        self.clock = clock or MonotonicClock()
        self.sample_rate = int(grid.audio_sample_rate)
        self._lock = threading.Lock()
        self._pending: deque[_Segment] = deque()
        self._pending_samples = 0
        self._next = 0
        self._turns: list[TurnStart] = []
        self._turn_open = False
        self._resamplers: dict[int, object] = {}
        self.cleared_samples = 0  # speech discarded by clear_buffer, in total
        self.last_cut_chunk: int | None = None  # first chunk taken after the latest clear_buffer
        self._kept: _Taken | None = None  # a splice's prefix: pieces the next chunk takes again (index: that chunk)
        self._kept_samples = 0  # its length in samples (the new speech starts there)

    # ---- transport side -----------------------------------------------------------------------------
    def push(self, pcm: np.ndarray, sample_rate: int) -> int:
        """Append a speech segment; returns the samples queued (at this input's rate)."""
        x = self._as_float_mono(pcm)
        if int(sample_rate) != self.sample_rate:
            if not self.config.resample:
                raise SampleRateError(
                    f"audio sample_rate: expected {self.sample_rate} Hz, got {sample_rate} Hz (resampling is off)"
                )
            if not 4000 <= int(sample_rate) <= 192_000:
                raise SampleRateError(
                    f"audio sample_rate: expected {self.sample_rate} Hz (or 4000–192000 Hz to resample), "
                    f"got {sample_rate} Hz"
                )
            x = self._resample(x, int(sample_rate))
        with self._lock:
            limit = int(self.config.max_pending_s * self.sample_rate)
            if self._pending_samples + len(x) > limit:
                raise AudioBufferFull(
                    f"audio input: {self._pending_samples + len(x)} samples would be pending, more than "
                    f"max_pending_s = {self.config.max_pending_s} s ({limit} samples); segment not taken"
                )
            turn = None
            if not self._turn_open and len(x):
                turn = TurnStart(turn=len(self._turns), pushed_s=self.clock.now())
                self._turns.append(turn)
                self._turn_open = True
            if len(x):
                self._pending.append(_Segment(x, turn))
                self._pending_samples += len(x)
            return len(x)

    def end_segment(self) -> None:
        """The current turn's speech is complete; the next push starts a new turn."""
        with self._lock:
            self._turn_open = False
        for rate in list(self._resamplers):
            tail = self._resample(np.zeros(0, np.float32), rate, flush=True)
            with self._lock:
                if len(tail):
                    self._pending.append(_Segment(tail, None))
                    self._pending_samples += len(tail)

    def clear_buffer(self) -> int:
        """Interrupt: discard all speech not yet consumed; returns the samples discarded."""
        with self._lock:
            dropped = self._pending_samples
            self._pending.clear()
            self._pending_samples = 0
            self._turn_open = False
            self._resamplers.clear()
            self.cleared_samples += dropped
            self.last_cut_chunk = self._next
            self._clears += 1
            self._last_had_speech = False  # the speech ahead was interrupted: a new turn may rewind over it
            return dropped

    def rewind(self, to_chunk: int, keep_samples: int = 0) -> None:
        """Make chunk `to_chunk` the next one taken (module docstring): the chunks taken since are forgotten, their
        speech returns to the front of the queue unless an interruption came after it was taken (then it counts in
        `cleared_samples`). `keep_samples` > 0 (a splice): chunk `to_chunk`'s first `keep_samples` samples, as it
        took them, are kept and taken again by it; its speech from there on returns to the queue. ValueError naming
        `to_chunk` outside [next − history_chunks, next], or `keep_samples` outside [0, chunk length) or > 0 for a
        chunk not taken."""
        with self._lock:
            lo = self._next - len(self._taken)  # the history holds chunks lo … next − 1
            if isinstance(to_chunk, bool) or not isinstance(to_chunk, int) or not lo <= to_chunk <= self._next:
                raise ValueError(f"audio input rewind to_chunk = {to_chunk!r}: expected an integer in "
                                 f"[{lo}, {self._next}] (the next chunk is {self._next}; the last "
                                 f"history_chunks = {self.history_chunks} chunks can be taken again)")
            start, stop = self.grid.chunk_sample_range(to_chunk)
            if isinstance(keep_samples, bool) or not isinstance(keep_samples, int) or \
                    not 0 <= keep_samples < stop - start or (keep_samples and to_chunk == self._next):
                raise ValueError(f"audio input rewind keep_samples = {keep_samples!r}: expected an integer in "
                                 f"[0, {stop - start}) (chunk {to_chunk}'s samples), and 0 unless chunk {to_chunk} "
                                 f"was taken (next chunk: {self._next})")
            if self._kept is not None:  # an earlier splice's prefix not taken yet: it is undone first
                self._give_back(self._kept.pieces, self._kept.clears)
                self._kept = None
            while self._taken and self._taken[-1].index >= to_chunk:
                taken = self._taken.pop()
                pieces = taken.pieces
                if taken.index == to_chunk and keep_samples:
                    kept, kept_at, pieces = [], [], []
                    for piece, at in zip(taken.pieces, taken.offsets, strict=True):
                        head = max(0, min(len(piece.pcm), keep_samples - at))
                        if head:
                            kept.append(_Segment(piece.pcm[:head], piece.turn))
                            kept_at.append(at)
                        if head < len(piece.pcm):
                            pieces.append(_Segment(piece.pcm[head:], None if head else piece.turn))
                    self._kept = _Taken(to_chunk, kept, taken.clears, kept_at)
                self._give_back(pieces, taken.clears)
            self._kept_samples = keep_samples
            self._next = to_chunk
            # the chunk now last taken spoke, and was not interrupted since (after clear_buffer a new turn may rewind)
            self._last_had_speech = bool(self._taken) and self._taken[-1].clears == self._clears and \
                any(len(p.pcm) for p in self._taken[-1].pieces)
            if self.last_cut_chunk is not None and self.last_cut_chunk > to_chunk:
                self.last_cut_chunk = to_chunk

    def _give_back(self, pieces: list[_Segment], clears: int) -> None:
        """Put pieces a chunk took back at the front of the queue, in order (under the lock); discarded instead when
        an interruption came after they were taken (`clears` then differs)."""
        for piece in reversed(pieces):
            if piece.turn is not None:
                piece.turn.chunk_index = piece.turn.stream_sample = None
            if clears != self._clears:  # interrupted after it was taken: stays discarded
                self.cleared_samples += len(piece.pcm)
                continue
            self._pending.appendleft(piece)
            self._pending_samples += len(piece.pcm)

    # ---- generation side ----------------------------------------------------------------------------
    @property
    def next_index(self) -> int:
        return self._next

    @property
    def clears(self) -> int:
        """How many interrupts (`clear_buffer` calls) this input has had: a generation loop on another thread than
        the transport compares it between chunks to splice at an interrupt (vivant.worker.serving.runtime)."""
        with self._lock:
            return self._clears

    def turn_starts_next(self) -> bool:
        """Whether the next chunk begins with a new turn's first sample (the front of the queue starts a turn) and
        the chunk before it was silent, so what was made ahead of playback was made from silence: where a served
        session rewinds (docs/ARCHITECTURE.md, "Rewind at a turn start"). A turn queued right behind speech still
        playing continues it: no rewind; after `clear_buffer` the interrupted speech ahead may be rewound over."""
        with self._lock:
            return bool(self._pending) and self._pending[0].turn is not None and not self._last_had_speech

    def oldest_rewind(self) -> int:
        """The earliest chunk `rewind` can return to now."""
        with self._lock:
            return self._next - len(self._taken)

    def pending_samples(self) -> int:
        with self._lock:
            return self._pending_samples

    def next_chunk(self) -> ChunkAudio:
        """The next chunk's samples: pending speech from the front, zeros for the rest."""
        with self._lock:
            n = self._next
            start, stop = self.grid.chunk_sample_range(n)
            need = stop - start
            out = np.zeros(need, np.float32)
            pieces: list[_Segment] = []
            offsets: list[int] = []
            pos = 0  # where the queued speech starts: after a splice's kept prefix
            kept_speech = 0
            kept, self._kept = self._kept, None
            if kept is not None:  # the prefix was shown already: its turns were placed then, not again
                pos = self._kept_samples
                for piece, at in zip(kept.pieces, kept.offsets, strict=True):
                    out[at:at + len(piece.pcm)] = piece.pcm
                    kept_speech += len(piece.pcm)
                pieces, offsets = list(kept.pieces), list(kept.offsets)
            got = 0
            turns: list[TurnStart] = []
            while pos + got < need and self._pending:
                seg = self._pending[0]
                at = pos + got
                take = min(need - at, len(seg.pcm))
                pieces.append(_Segment(seg.pcm[:take], seg.turn))
                offsets.append(at)
                if seg.turn is not None:
                    seg.turn.chunk_index = n
                    seg.turn.stream_sample = start + at
                    turns.append(seg.turn)
                    seg.turn = None
                out[at:at + take] = seg.pcm[:take]
                got += take
                if take == len(seg.pcm):
                    self._pending.popleft()
                else:
                    seg.pcm = seg.pcm[take:]
            self._pending_samples -= got
            if self.history_chunks:
                self._taken.append(_Taken(n, pieces, self._clears, offsets))
            self._last_had_speech = got > 0 or (kept_speech > 0 and kept.clears == self._clears)
            self._next += 1
            return ChunkAudio(index=n, samples=out, speech_samples=got + kept_speech, turns=turns)

    def turns(self) -> list[TurnStart]:
        with self._lock:
            return list(self._turns)

    # ---- helpers ------------------------------------------------------------------------------------
    @staticmethod
    def _as_float_mono(pcm: np.ndarray) -> np.ndarray:
        a = np.asarray(pcm)
        if a.ndim == 2 and a.shape[1] == 1:
            a = a[:, 0]
        if a.ndim != 1:
            raise ValueError(f"audio pcm: expected mono samples, shape [n] or [n, 1], got shape {list(a.shape)}")
        if a.dtype == np.int16:
            return a.astype(np.float32) / 32768.0
        if a.dtype in (np.float32, np.float64):
            return a.astype(np.float32, copy=False)
        raise ValueError(f"audio pcm: expected dtype float32 or int16, got {a.dtype}")

    def _resample(self, x: np.ndarray, rate: int, flush: bool = False) -> np.ndarray:
        import av

        resampler = self._resamplers.get(rate)
        if resampler is None:
            if flush:
                return np.zeros(0, np.float32)
            resampler = self._resamplers[rate] = av.AudioResampler(format="flt", layout="mono", rate=self.sample_rate)
        if flush:
            frames = resampler.resample(None)
            del self._resamplers[rate]
        else:
            frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(x).reshape(1, -1), format="flt", layout="mono")
            frame.sample_rate = rate
            frames = resampler.resample(frame)
        parts = [f.to_ndarray().reshape(-1) for f in frames]
        return np.concatenate(parts).astype(np.float32) if parts else np.zeros(0, np.float32)


def read_audio(path: str | Path) -> tuple[np.ndarray, int]:
    """Any audio file PyAV reads → (float32 mono samples, sample rate); a ValueError names the file when it cannot
    be read or holds no samples."""
    import av

    try:
        with av.open(str(path)) as container:
            if not container.streams.audio:
                raise ValueError(f"audio file {str(path)!r}: no audio stream")
            stream = container.streams.audio[0]
            rate = stream.rate
            resampler = av.AudioResampler(format="flt", layout="mono", rate=rate)
            parts = [f.to_ndarray().reshape(-1) for frame in container.decode(stream) for f in resampler.resample(frame)]
            parts += [f.to_ndarray().reshape(-1) for f in resampler.resample(None)]
    except av.error.FFmpegError as exc:
        raise ValueError(f"audio file {str(path)!r}: not readable ({exc})") from exc
    if not parts:
        raise ValueError(f"audio file {str(path)!r}: holds no audio samples")
    return np.concatenate(parts).astype(np.float32), int(rate)
