"""The 24 fps playout clock: a bounded jitter buffer of decoded chunks, frames out at exact 1/fps steps.

Why: the generator delivers a chunk (4 frames, 166.7 ms of video) at a time with jitter, a viewer
needs one frame every 41.67 ms. The pacer sits between them:

* start-up: nothing leaves until `start_chunks` chunks are buffered; that instant is t0.
* cadence: output slot k is due at exactly t0 + k / fps (computed from k, never accumulated, so no
  drift); its stream timestamp is k / fps.
* stall: a slot falls due and no generated frame is ready. The pacer repeats the last frame with
  silence (the live track keeps its cadence), records the stall (first slot, due time, length in
  frames), and never blocks or drops anything: the late chunk's frames play in order when they arrive.
* bounded: at most `buffer_chunks` chunks wait. `push` on a full buffer raises `PacerFull` (the
  producer is ahead of real time and should wait with `wait_for_space`); a chunk out of order raises.
  Every generated frame is published exactly once; repeats are marked `repeated=True`.
* interruption: with rewinds, an interrupt is a splice (`splice_unshown(..., interrupt=True)`, below): the frames
  from f* on are dropped and the producer makes chunk m again from silence, so the face stops talking at f* without a
  held frame; the drop is recorded (`stats().discards`) and a gap at the cut (the remade chunk late) is a stall of
  cause "interrupt" (a late generator's stall elsewhere has cause "late"). Without rewinds,
  `discard_speech_before(n)` drops the not-yet-started chunks with index < n that carry speech (the chunk on
  screen finishes) and nothing is made again: the gap until the next chunk is a stall of cause "interrupt".
* discarded frames: `stats().discarded_frames` counts the frames the pacer received and never published (dropped by a
  cut or an interruption, and a remade chunk's frames before its k); chunks dropped upstream never became frames.
* rewind: `drop_unstarted(keep_until_s)` drops every buffered chunk not begun and due after `keep_until_s`, so a
  speech turn's chunks can be generated again in their place (docs/ARCHITECTURE.md, "Rewind at a turn start"); a
  chunk with at least one frame published is shown and plays to its end (the half-shown rule); chunks still upstream
  (`pending_until`) are judged by the slots they will get, and one due within `keep_until_s` is kept.
* splice: `splice_unshown(keep_until_s)` is the same cut at a frame: f*, the first buffered frame due later than
  `keep_until_s`, in chunk m at index k. Frames of m before k stay (the chunk on screen is cut at k, not played to its
  end); frames k.. of m and every later chunk are dropped; the next chunk pushed is m again (made again) and only its
  frames k.. are published, with their audio slots, so A/V stays aligned.
* audio: each slot carries its share of the chunk's PCM (slot k ends at sample floor((k+1)*sr/fps));
  a repeated slot carries silence up to that boundary, so published audio and video never drift. The
  A/V offset of every generated frame (where its first audio sample lands minus its video timestamp)
  is measured and kept.

The clock is injectable (`Clock`): tests drive the pacer with `FakeClock` and no sleeping; the live
playout loop uses `MonotonicClock`. Times are seconds; audio is float32 mono at `audio_sample_rate`.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np


class PacerFull(RuntimeError):
    """The jitter buffer holds `buffer_chunks` chunks; the producer must wait (it is ahead of real time)."""


class Clock(Protocol):
    def now(self) -> float: ...

    def sleep_until(self, t: float) -> None: ...


class MonotonicClock:
    """Wall clock for live playout (time.monotonic seconds)."""

    def now(self) -> float:
        return time.monotonic()

    def sleep_until(self, t: float) -> None:
        delay = t - time.monotonic()
        if delay > 0:
            time.sleep(delay)


class FakeClock:
    """A clock that moves only when told to: `advance(dt)`, `set(t)`, or `sleep_until(t)` (instant)."""

    def __init__(self, start: float = 0.0) -> None:
        self.t = float(start)

    def now(self) -> float:
        return self.t

    def set(self, t: float) -> None:
        if t < self.t:
            raise ValueError(f"FakeClock.set: time must not go back (now {self.t}, asked {t})")
        self.t = float(t)

    def advance(self, dt: float) -> None:
        self.set(self.t + dt)

    def sleep_until(self, t: float) -> None:
        self.t = max(self.t, float(t))


@dataclass(frozen=True)
class PacerConfig:
    fps: int = 24
    frames_per_chunk: int = 4
    audio_sample_rate: int = 16_000
    buffer_chunks: int = 3  # capacity of the jitter buffer, in chunks
    start_chunks: int = 2  # chunks buffered before the first frame leaves

    def __post_init__(self) -> None:
        for name in ("fps", "frames_per_chunk", "audio_sample_rate", "buffer_chunks", "start_chunks"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"PacerConfig.{name} = {getattr(self, name)!r}; expected a positive integer")
        if self.start_chunks > self.buffer_chunks:
            raise ValueError(
                f"PacerConfig.start_chunks = {self.start_chunks}; expected ≤ buffer_chunks = {self.buffer_chunks}"
            )

    @classmethod
    def for_model(cls, cfg, **overrides) -> PacerConfig:
        """Timing fields from a ModelConfig (fps, frames_per_chunk, audio_sample_rate)."""
        return cls(fps=cfg.fps, frames_per_chunk=cfg.frames_per_chunk, audio_sample_rate=cfg.audio_sample_rate,
                   **overrides)

    def frame_sample(self, f: int) -> int:
        """First audio sample of video frame f (exact integer arithmetic)."""
        return (f * self.audio_sample_rate) // self.fps

    def chunk_sample_range(self, n: int) -> tuple[int, int]:
        return self.frame_sample(n * self.frames_per_chunk), self.frame_sample((n + 1) * self.frames_per_chunk)


@dataclass
class DecodedChunk:
    """One chunk ready for playout: frames uint8 [frames_per_chunk, H, W, 3] and its audio (float32 1-D)."""

    index: int
    frames: np.ndarray
    audio: np.ndarray
    times: dict[str, float] = field(default_factory=dict)  # wall timestamps of the chunk's stages (s)


@dataclass
class PublishedFrame:
    slot: int  # live timeline index; stream timestamp = slot / fps
    pts_s: float
    chunk_index: int  # chunk of the frame shown (for a repeat: of the frame repeated)
    content_index: int  # generated frame index (chunk_index * frames_per_chunk + j)
    repeated: bool  # True: a stall slot showing the previous frame again, with silence
    rgb: np.ndarray
    audio: np.ndarray  # this slot's published PCM
    due_s: float  # when the slot was due (t0 + slot / fps)
    published_s: float  # clock time when the pacer released it
    av_offset_s: float | None  # generated frames: audio position of its first sample minus its pts
    first_of_chunk: bool = False  # the first frame shown of this version of its chunk (frame k of a remade one)
    chunk_times: dict[str, float] | None = None  # that version's stage timestamps (DecodedChunk.times); None: repeats


@dataclass
class Stall:
    first_slot: int
    due_s: float  # when the first missing frame was due
    frames: int = 0  # slots filled with repeats
    ended_s: float | None = None  # when a generated frame was published again
    cause: str = "late"  # "late": generation fell behind; "interrupt": speech discarded by an interruption


@dataclass
class Discard:
    """Chunks of speech dropped because the speech was interrupted (`discard_speech_before`)."""

    at_s: float
    chunks: list[int]


@dataclass
class Rewind:
    """One rewind at a turn start: when (clock s), the chunk generation restarted at, and the chunks dropped
    (decoded ones from the pacer's buffer, and ones still in the decoder stage). `frame`: the splice's k, the first
    frame of `to_chunk` replaced (0: the whole chunk; k > 0: its frames < k were kept, and `dropped` lists
    `to_chunk` for its frames ≥ k). `cause`: why the stream was cut there."""

    at_s: float
    to_chunk: int
    dropped: list[int]
    frame: int = 0
    cause: str = "turn"  # "turn": a speech turn starts; "interrupt": `clear_buffer` (the speech is cut at the frame)


@dataclass
class _Entry:
    """A buffered chunk and the frames of it that play, [first, stop): a splice cuts a buffered chunk at stop = k and
    the chunk made again in its place starts at first = k (otherwise first = 0, stop = frames_per_chunk)."""

    chunk: DecodedChunk
    first: int
    stop: int

    @property
    def frames(self) -> int:
        return self.stop - self.first


@dataclass
class PacerStats:
    frames_published: int
    generated_frames_published: int
    repeated_frames: int
    chunks_received: int
    stalls: list[Stall]
    max_abs_av_offset_s: float
    depth_history: list[tuple[float, int]]  # (clock s, chunks buffered) at each push and chunk start
    t0: float | None
    discards: list[Discard]
    frames_per_chunk: int
    discarded_frames: int = 0  # frames received and never published (module docstring, "discarded frames")

    @property
    def stall_count(self) -> int:
        return len(self.stalls)


class Pacer:
    """Thread-safe: `push` from the decoder side, `poll` from the playout loop (see module doc)."""

    def __init__(self, config: PacerConfig | None = None, clock: Clock | None = None,
                 depth_history: int = 100_000) -> None:
        self.config = config or PacerConfig()
        self.clock = clock or MonotonicClock()
        self._cond = threading.Condition()
        self._chunks: deque[_Entry] = deque()
        self._frame_in_chunk = 0  # frames of _chunks[0] published (its next one is first + this)
        self._skip: tuple[int, int] | None = None  # (m, k): the next push of chunk m plays from its frame k
        self._next_chunk = 0  # index the next push must carry
        self._input_closed = False
        self.t0: float | None = None
        self._slot = 0
        self._audio_out = 0  # samples published so far
        self._last: PublishedFrame | None = None
        self._stalls: list[Stall] = []
        self._generated = 0
        self._repeated = 0
        self._max_offset = 0.0
        self._depth: deque[tuple[float, int]] = deque(maxlen=depth_history)
        self._discards: list[Discard] = []
        self._discard_below = 0  # speech chunks with a smaller index are dropped on arrival
        self._retired = -1  # highest chunk index that started playing or was discarded
        self._interrupted = False  # an interruption emptied the buffer; the next stall is its gap
        self._interrupt_cut: int | None = None  # an interrupt's splice frame f*, until a frame ≥ f* is published
        self._discarded_frames = 0  # frames received and never published

    # ---- producer side ------------------------------------------------------------------------------
    def depth(self) -> int:
        """Chunks in the buffer (a partly played chunk counts)."""
        with self._cond:
            return len(self._chunks)

    def buffered_indices(self) -> list[int]:
        """Indices of the chunks in the buffer, oldest first (a partly played chunk included)."""
        with self._cond:
            return [e.chunk.index for e in self._chunks]

    def space(self) -> int:
        with self._cond:
            return self.config.buffer_chunks - len(self._chunks)

    def push(self, chunk: DecodedChunk) -> None:
        """Queue the next chunk. Raises PacerFull when full, ValueError on a bad or out-of-order chunk."""
        c = self.config
        start, stop = c.chunk_sample_range(chunk.index)
        if chunk.frames.ndim != 4 or chunk.frames.shape[0] != c.frames_per_chunk or chunk.frames.shape[3] != 3:
            raise ValueError(f"chunk {chunk.index} frames: expected shape [{c.frames_per_chunk}, H, W, 3], "
                             f"got {list(chunk.frames.shape)}")
        if chunk.audio.ndim != 1 or len(chunk.audio) != stop - start:
            raise ValueError(f"chunk {chunk.index} audio: expected {stop - start} samples "
                             f"(samples [{start}, {stop}) at {c.audio_sample_rate} Hz), got shape {list(chunk.audio.shape)}")
        with self._cond:
            if self._input_closed:
                raise ValueError(f"chunk {chunk.index}: the pacer's input was closed")
            if chunk.index != self._next_chunk:
                raise ValueError(f"chunk index: expected {self._next_chunk} (chunks arrive in order), got {chunk.index}")
            first = self._skip[1] if self._skip is not None and chunk.index == self._skip[0] else 0
            if chunk.index < self._discard_below and chunk.audio.any():
                self._skip = None
                self._next_chunk += 1
                self._discards[-1].chunks.append(chunk.index)
                self._discarded_frames += c.frames_per_chunk
                self._cond.notify_all()
                return
            if len(self._chunks) >= c.buffer_chunks:
                raise PacerFull(f"jitter buffer full ({c.buffer_chunks} chunks); chunk {chunk.index} not taken")
            # the splice's k holds until its chunk is taken (a refused push keeps it for the retry)
            self._skip = None
            self._discarded_frames += first  # a remade chunk's frames before its k are never shown
            self._chunks.append(_Entry(chunk, first, c.frames_per_chunk))
            self._next_chunk += 1
            self._depth.append((self.clock.now(), len(self._chunks)))
            self._cond.notify_all()

    def discard_speech_before(self, index: int) -> list[int]:
        """Interruption: drop every chunk carrying speech with chunk index < `index` that has not started
        playing (buffered now, or arriving later); the chunk on screen finishes. Recorded, never silent:
        `stats().discards` lists the chunks, and the gap until the next chunk is a stall of cause
        "interrupt". Returns the indices dropped from the buffer now."""
        with self._cond:
            self._discard_below = max(self._discard_below, index)
            self._retired = max(self._retired, index - 1)
            keep: deque[_Entry] = deque()
            dropped = []
            for i, entry in enumerate(self._chunks):
                started = i == 0 and self._frame_in_chunk > 0
                if entry.chunk.index < index and entry.chunk.audio.any() and not started:
                    dropped.append(entry.chunk.index)
                    self._discarded_frames += entry.frames
                else:
                    keep.append(entry)
            self._chunks = keep
            self._discards.append(Discard(self.clock.now(), dropped))
            self._interrupted = True
            self._depth.append((self.clock.now(), len(self._chunks)))
            self._cond.notify_all()
            return dropped

    def drop_unstarted(self, keep_until_s: float, *, oldest: int = 0, pending_until: int | None = None) -> int:
        """Drop every buffered chunk whose first frame has not been published and is due later than `keep_until_s`
        (clock seconds), and every later one; returns r, the index of the first chunk dropped or not yet pushed —
        the rewind point: the next chunk pushed after the producer rewound is r.

        `pending_until`: chunks [next to push, pending_until) are upstream (being decoded) and will be pushed in
        order. When no buffered chunk is dropped, each of them is judged by its due time too (the slot its first
        frame gets if playout does not stall): one due within `keep_until_s` is kept (r moves past it), for it
        cannot be made again before its slot. Without this a chunk still in the decoder at a rewind was always
        made again, and was late whenever it was due sooner than one diffuse + decode.

        The half-shown rule: a chunk with ≥ 1 frame published is shown and plays to its end (it is kept, whatever
        its remaining frames' due times). Before playout has started (no t0) nothing is shown and no due time is
        known, so every buffered chunk is dropped. Chunks below r that are kept play as they would have. Chunks
        below `oldest` are always kept (the producer cannot rewind further than its undo logs hold)."""
        return self._cut(keep_until_s, oldest, pending_until, frames=False)[0]

    def splice_unshown(self, keep_until_s: float, *, oldest: int = 0, pending_until: int | None = None,
                       interrupt: bool = False, next_chunk_s: float = 0.0) -> tuple[int, int]:
        """`drop_unstarted` at a frame (module docstring, "splice"): f* = the first buffered frame not published and
        due later than `keep_until_s`, in chunk m (≥ `oldest`) at index k. Frames of m before k stay, frames k.. of m
        and every later chunk are dropped; returns (m, k). The next chunk pushed is m; when k > 0 only its frames
        k.. are published (its frames < k are discarded, never shown). k = 0 is `drop_unstarted`'s cut.

        Chunks upstream (`pending_until`, no buffered frame dropped) are judged whole, as by `drop_unstarted`: one
        whose first frame is due within `keep_until_s` is kept entire (its decode is under way; cutting it would
        need the decoder to deliver it and then rewind behind it). Before playout has started every buffered chunk
        is dropped: (first buffered, 0).

        `interrupt`: the cut is an interruption's (the producer makes chunk m again from silence from frame k): the
        buffered chunks that lost frames are recorded as a `Discard`, and a gap right at the cut (the last frame
        published is f* − 1 and the remade frame f* is not there) is a stall of cause "interrupt".

        `next_chunk_s`: the time the producer needs for one more chunk after the remade one (its diffuse time). A
        frame j qualifies as f* only if the chunk after the remade one can be ready too: the remade chunk m shows
        frames j … F − 1, so chunk m + 1 is due (F − j) frames after frame j, and it must be due later than
        `keep_until_s` + `next_chunk_s`. Without this a cut at the last frame of a chunk leaves one frame's time for a
        whole chunk whenever a chunk takes longer than a frame period to make (the late stalls of a slow step)."""
        if not (next_chunk_s >= 0 and math.isfinite(next_chunk_s)):
            raise ValueError(f"splice_unshown next_chunk_s = {next_chunk_s!r}; expected finite seconds ≥ 0")
        return self._cut(keep_until_s, oldest, pending_until, frames=True, interrupt=interrupt,
                         next_chunk_s=next_chunk_s)

    def _cut(self, keep_until_s: float, oldest: int, pending_until: int | None, *,
             frames: bool, interrupt: bool = False, next_chunk_s: float = 0.0) -> tuple[int, int]:
        """The rewind's cut, (m, k) (see `drop_unstarted` and `splice_unshown`); `frames` False: only whole chunks
        not begun are dropped (k is then the dropped entry's own first frame, 0 unless it was spliced)."""
        c = self.config
        with self._cond:
            if pending_until is not None and pending_until < self._next_chunk:
                raise ValueError(f"{'splice_unshown' if frames else 'drop_unstarted'} pending_until = {pending_until}; "
                                 f"expected ≥ {self._next_chunk} (the "
                                 f"next chunk to push: the chunks upstream come after those pushed)")
            keep: deque[_Entry] = deque()
            r = max(self._next_chunk, oldest)  # nothing buffered dropped: the first frame not pushed (or oldest)
            cut = (r, self._skip[1] if self._skip is not None and self._skip[0] == r else 0)
            ahead = 0  # unpublished frames before the entry judged (the next slot is the first of them)
            head_done = False  # the head entry's published frames are all it keeps: it is finished
            lost: list[int] = []  # buffered chunks that lose frames
            for i, entry in enumerate(self._chunks):
                done = self._frame_in_chunk if i == 0 else 0
                j = None if entry.chunk.index < oldest else self._first_due_after(entry, done, ahead, keep_until_s,
                                                                                  next_chunk_s)
                if j is not None and not frames and not (done == 0 and j == entry.first):
                    j = None  # whole chunks only: one begun (half shown) or with its first frame due soon stays
                if j is None:
                    keep.append(entry)
                    ahead += entry.frames - done
                    continue
                if j > entry.first + done:
                    keep.append(_Entry(entry.chunk, entry.first, j))  # its frames < j play, then the remade chunk
                elif done:
                    head_done = True
                cut = (entry.chunk.index, j)
                later = list(self._chunks)[i + 1:]
                self._discarded_frames += entry.stop - j + sum(e.frames for e in later)
                lost = [entry.chunk.index] + [e.chunk.index for e in later]
                break
            else:  # nothing buffered dropped: the chunks upstream, in order, until one is due after the horizon
                if self.t0 is not None and pending_until is not None:
                    for index in range(self._next_chunk, pending_until):
                        due = self.t0 + (self._slot + ahead) / c.fps
                        if (index >= oldest and due > keep_until_s
                                and due + c.frames_per_chunk / c.fps > keep_until_s + next_chunk_s):
                            break
                        cut = (max(cut[0], index + 1), 0)
                        skip = self._skip[1] if self._skip is not None and self._skip[0] == index else 0
                        ahead += c.frames_per_chunk - skip
            m, k = cut
            self._chunks = keep
            if head_done:
                self._frame_in_chunk = 0
            self._next_chunk = min(self._next_chunk, m)
            if k > 0:
                self._skip = (m, k)
            elif self._skip is not None and self._skip[0] >= m:
                self._skip = None
            self._discard_below = min(self._discard_below, m)
            self._retired = min(self._retired, m if k > 0 else m - 1)  # m's frames < k stay shown (or to show)
            if interrupt:
                self._discards.append(Discard(self.clock.now(), lost))
                self._interrupt_cut = m * c.frames_per_chunk + k
            self._depth.append((self.clock.now(), len(self._chunks)))
            self._cond.notify_all()
            return m, k

    def _first_due_after(self, entry: _Entry, done: int, ahead: int, keep_until_s: float,
                         next_chunk_s: float = 0.0) -> int | None:
        """Index (within its chunk) of the entry's first unpublished frame due later than `keep_until_s` and after
        which the next chunk is due later than `keep_until_s` + `next_chunk_s` (`splice_unshown`), None if there is
        none; before start-up (no t0) its first unpublished frame (nothing has a due time)."""
        if self.t0 is None:
            return entry.first + done
        c = self.config
        for j in range(entry.first + done, entry.stop):
            due = self.t0 + (self._slot + ahead + j - entry.first - done) / c.fps
            if due > keep_until_s and due + (c.frames_per_chunk - j) / c.fps > keep_until_s + next_chunk_s:
                return j
        return None

    def wait_for_space(self, timeout: float | None = None) -> bool:
        """Block (real time) until a chunk fits; True if it does. Only a producer ahead of playout waits."""
        with self._cond:
            return self._cond.wait_for(lambda: len(self._chunks) < self.config.buffer_chunks, timeout)

    def close_input(self) -> None:
        """No more chunks: the buffer plays out, and running dry after that is the end, not a stall."""
        with self._cond:
            self._input_closed = True
            self._cond.notify_all()

    # ---- playout side -------------------------------------------------------------------------------
    @property
    def drained(self) -> bool:
        with self._cond:
            return self._input_closed and not self._chunks

    def next_due(self) -> float | None:
        """Clock time the next slot is due, or None before start-up."""
        with self._cond:
            return None if self.t0 is None else self.t0 + self._slot / self.config.fps

    def wait_for_start(self, timeout: float | None = None) -> bool:
        """Block (real time) until enough chunks are buffered to start (or input closed)."""
        with self._cond:
            return self._cond.wait_for(
                lambda: self.t0 is not None or len(self._chunks) >= self.config.start_chunks or self._input_closed,
                timeout)

    def poll(self, now: float | None = None) -> list[PublishedFrame]:
        """Release every slot due at or before `now` (default: the clock's now), in order."""
        c = self.config
        out: list[PublishedFrame] = []
        with self._cond:
            now = self.clock.now() if now is None else now
            if self.t0 is None:
                if len(self._chunks) >= c.start_chunks or (self._input_closed and self._chunks):
                    self.t0 = now
                else:
                    return out
            while True:
                due = self.t0 + self._slot / c.fps
                if due > now + 1e-9:
                    break
                if self._chunks:
                    out.append(self._publish_generated(due, now))
                elif self._input_closed:
                    break
                else:
                    out.append(self._publish_repeat(due, now))
                self._slot += 1
            if out:
                self._cond.notify_all()
        return out

    def _slot_audio_end(self, slot: int) -> int:
        return self.config.frame_sample(slot + 1)

    def _publish_generated(self, due: float, now: float) -> PublishedFrame:
        c = self.config
        entry = self._chunks[0]
        chunk = entry.chunk
        j = entry.first + self._frame_in_chunk
        f = chunk.index * c.frames_per_chunk + j
        chunk_start, _ = c.chunk_sample_range(chunk.index)
        audio = chunk.audio[c.frame_sample(f) - chunk_start: c.frame_sample(f + 1) - chunk_start]
        pts = self._slot / c.fps
        offset = self._audio_out / c.audio_sample_rate - pts
        self._max_offset = max(self._max_offset, abs(offset))
        self._audio_out += len(audio)
        if self._stalls and self._stalls[-1].ended_s is None:
            self._stalls[-1].ended_s = now
        frame = PublishedFrame(self._slot, pts, chunk.index, f, False, chunk.frames[j], audio, due, now, offset,
                               first_of_chunk=self._frame_in_chunk == 0, chunk_times=chunk.times)
        if j == entry.first:  # a chunk starts: any gap after this one is the generator's, not the interruption's
            self._interrupted = False
        if self._interrupt_cut is not None and f >= self._interrupt_cut:
            self._interrupt_cut = None  # the remade frame f* (or a later one) is out: the interrupt left no gap
        self._retired = max(self._retired, chunk.index)
        self._generated += 1
        self._frame_in_chunk += 1
        if self._frame_in_chunk == entry.frames:
            self._chunks.popleft()
            self._frame_in_chunk = 0
            self._depth.append((now, len(self._chunks)))
        self._last = frame
        return frame

    def _publish_repeat(self, due: float, now: float) -> PublishedFrame:
        last = self._last
        assert last is not None, "a stall before the first frame cannot happen: start-up waits for chunks"
        if not self._stalls or self._stalls[-1].ended_s is not None:
            at_cut = self._interrupt_cut is not None and last.content_index == self._interrupt_cut - 1
            self._stalls.append(Stall(first_slot=self._slot, due_s=due,
                                      cause="interrupt" if self._interrupted or at_cut else "late"))
        self._stalls[-1].frames += 1
        n = max(0, self._slot_audio_end(self._slot) - self._audio_out)
        self._audio_out += n
        self._repeated += 1
        return PublishedFrame(self._slot, self._slot / self.config.fps, last.chunk_index, last.content_index, True,
                              last.rgb, np.zeros(n, np.float32), due, now, None)

    def wait_until_started(self, chunks: int, timeout: float | None = None) -> bool:
        """Block (real time) until chunk `chunks - 1` (or a later one) has started playing or was discarded
        (True), or the timeout passes (False). The generator's lead limit."""
        with self._cond:
            return self._cond.wait_for(lambda: self._retired >= chunks - 1 or self._input_closed, timeout)

    def stall_count(self) -> int:
        with self._cond:
            return len(self._stalls)

    def stats(self) -> PacerStats:
        with self._cond:
            return PacerStats(
                frames_published=self._slot,
                generated_frames_published=self._generated,
                repeated_frames=self._repeated,
                chunks_received=self._next_chunk,
                stalls=[Stall(s.first_slot, s.due_s, s.frames, s.ended_s, s.cause) for s in self._stalls],
                max_abs_av_offset_s=self._max_offset,
                depth_history=list(self._depth),
                t0=self.t0,
                discards=[Discard(d.at_s, list(d.chunks)) for d in self._discards],
                frames_per_chunk=self.config.frames_per_chunk,
                discarded_frames=self._discarded_frames,
            )

