"""What the avatar publishes in the room, on the decoder rank: `RoomVideo`, the framework's `VideoGenerator` (the agent's
speech forwarded to rank 0, decoded chunks queued for the `AvatarRunner` frame by frame with their audio, muted after
an interrupt, and cut by a splice at a turn start), and its grid, stats and the splice's bookkeeping
(docs/ARCHITECTURE.md, "Rewind at a turn start"; the whole room: vivant.worker.serving.livekit_avatar).
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
from livekit import rtc
from livekit.agents.voice.avatar import AudioSegmentEnd, VideoGenerator
from vivant.worker.serving.room_feed import RoomEvent
from vivant.worker.stream.audio_in import ChunkGrid
from vivant.worker.stream.livekit_sink import pcm_to_audio_frame, rgb_to_video_frame

log = logging.getLogger(__name__)


class VideoGrid(ChunkGrid, Protocol):
    fps: int
    frames_per_chunk: int
    width: int
    height: int
    audio_sample_rate: int


@dataclass(frozen=True)
class RoomGrid:
    """The room's video grid: the model's timing (fps, frames per chunk, audio rate, chunk sample ranges) with the
    decoder's frame size (pixels; a decoder of other widths makes frames of another size than the preset's)."""

    model: ChunkGrid
    fps: int
    frames_per_chunk: int
    audio_sample_rate: int
    width: int
    height: int

    @classmethod
    def of(cls, model: VideoGrid, width: int, height: int) -> RoomGrid:
        return cls(model, model.fps, model.frames_per_chunk, model.audio_sample_rate, width, height)

    def chunk_sample_range(self, n: int) -> tuple[int, int]:
        return self.model.chunk_sample_range(n)


def audio_frame_to_mono(frame: rtc.AudioFrame) -> np.ndarray:
    """int16 interleaved PCM of an `rtc.AudioFrame` -> float32 mono in [-1, 1] (channels averaged)."""
    pcm = np.frombuffer(frame.data, dtype=np.int16).astype(np.float32) / 32768.0
    ch = frame.num_channels
    if ch > 1:
        pcm = pcm.reshape(-1, ch).mean(axis=1)
    return pcm


SYNC_QUEUE_MS = 100  # the AvatarRunner's AVSynchronizer video queue and AudioSource queue, ms (passed explicitly)


def frames_held_by_runner(fps: int, queue_ms: int = SYNC_QUEUE_MS) -> int:
    """Video frames the `AvatarRunner` holds ahead of `RoomVideo`'s queue whenever that queue is not empty (read from
    the SDK: `rtc.AVSynchronizer` bounds its video queue to max(1, int(fps · queue_ms / 1000)) frames, its capture
    task holds one more until its 1/fps slot, and the runner holds the one it is pushing into the full queue). They
    are published before any queued frame and cannot be cut at a frame (`AVSynchronizer.clear_queue` drops the whole
    queue and every queued audio sample), so a splice counts them as shown."""
    return max(1, int(fps * queue_ms / 1000)) + 2


@dataclass(frozen=True)
class ChunkMeta:
    """What rank 0 said of a chunk's audio in its CHUNK word: speech samples, whether it ends the agent's segment,
    and the clears rank 0 had applied when it took the audio (its epoch; older epochs are published muted)."""

    index: int
    speech_samples: int
    ends_segment: bool
    epoch: int


@dataclass
class VideoStats:
    chunks: int = 0
    speech_chunks: int = 0
    video_frames: int = 0
    audio_samples_out: int = 0
    clears: int = 0
    speech_samples_after_clear: int = 0  # speech published after the latest clear_buffer (should be 0)
    chunk_sizes: list[int] = field(default_factory=list)
    splices: list[tuple[int, int]] = field(default_factory=list)  # (m, k) of each splice
    spliced_frames: int = 0  # queued frames a splice dropped (never published)
    published: list[list[int]] = field(default_factory=list)  # frames handed to the runner: [first, last] runs
    # per speech segment: video frames handed to the runner from its first audio in to its first speech frame out
    turn_waits: list[int] = field(default_factory=list)

    def note_published(self, frame: int) -> None:
        if self.published and self.published[-1][1] + 1 == frame:
            self.published[-1][1] = frame
        else:
            self.published.append([frame, frame])


@dataclass
class _Queued:
    """An item waiting for the runner, with the generated frame index it belongs to (chunk · frames_per_chunk + j;
    a segment's end: its chunk's last frame; the close sentinel: −1)."""

    item: rtc.VideoFrame | rtc.AudioFrame | AudioSegmentEnd | None
    frame: int


class RoomVideo(VideoGenerator):
    """The avatar's `VideoGenerator` on the decoder rank (module docstring): the agent's audio is forwarded to
    rank 0; decoded chunks come in with `deliver` (on the event loop, in chunk order) and are read by the
    `AvatarRunner`; `splice` (on the event loop) cuts the queue at a turn start. `held_frames`: the frames the
    runner holds ahead of the queue (`frames_held_by_runner`)."""

    HANDOFF_TIMEOUT_S = 1.0  # an item's publication takes at most a frame interval (the synchronizer's pacing)

    def __init__(self, grid: VideoGrid, forward: Callable[[RoomEvent], None], *,
                 held_frames: int | None = None) -> None:
        self.grid, self.forward = grid, forward
        self.held_frames = frames_held_by_runner(grid.fps) if held_frames is None else held_frames
        if isinstance(self.held_frames, bool) or not isinstance(self.held_frames, int) or self.held_frames < 0:
            raise ValueError(f"RoomVideo held_frames = {held_frames!r}; expected an integer ≥ 0")
        self.stats = VideoStats()
        self._ready: asyncio.Queue[_Queued] = asyncio.Queue()
        self._clear_epoch = 0
        self._next_chunk = 0  # the chunk `deliver` takes next
        self._skip: tuple[int, int] | None = None  # (m, k): the next delivery of chunk m is queued from its frame k
        self._nothing_in_hand = asyncio.Event()  # clear while the runner publishes an item it took from us
        self._nothing_in_hand.set()
        self._handed = 0  # video frames handed to the runner
        self._segment_open = False
        self._turn_mark: int | None = None  # `_handed` when a segment's first audio came in, until its speech goes out

    async def push_audio(self, frame: rtc.AudioFrame | AudioSegmentEnd) -> None:
        if isinstance(frame, AudioSegmentEnd):
            self._segment_open = False
            self.forward(("segment_end",))
        else:
            if not self._segment_open:
                self._segment_open = True
                self._turn_mark = self._handed if self._turn_mark is None else self._turn_mark
            self.forward(("speech", audio_frame_to_mono(frame), frame.sample_rate))

    async def clear_buffer(self) -> None:
        """An interrupt (the runner awaits this before it reports `lk.playback_finished(interrupted=True)` and
        resets its playback position): forward it to rank 0, drop the speech queued here, then wait (at most
        `HANDOFF_TIMEOUT_S`) until the runner has published the item it already took from us, so that a speech
        frame taken before the interrupt counts toward the interrupted playback instead of starting a new one
        (a stray `lk.playback_started`)."""
        self.forward(("clear",))
        self._segment_open, self._turn_mark = False, None  # the speech waited for is not coming
        self._clear_epoch += 1
        self.stats.clears += 1
        self.stats.speech_samples_after_clear = 0
        for q in self._take_all():  # delivered but not yet published: keep the video, drop the speech
            if not isinstance(q.item, rtc.AudioFrame | AudioSegmentEnd):
                self._ready.put_nowait(q)
        try:
            await asyncio.wait_for(self._nothing_in_hand.wait(), self.HANDOFF_TIMEOUT_S)
        except TimeoutError:
            log.warning("interrupt: the avatar runner still publishes a frame after %.1fs", self.HANDOFF_TIMEOUT_S)

    def close(self) -> None:
        self._ready.put_nowait(_Queued(None, -1))

    @property
    def clear_epoch(self) -> int:
        return self._clear_epoch

    @property
    def next_chunk(self) -> int:
        """The chunk `deliver` takes next (after a splice: the chunk made again)."""
        return self._next_chunk

    def queued_items(self) -> int:
        return self._ready.qsize()

    def queued_frames(self) -> int:
        """Video frames queued (not yet handed to the runner)."""
        return sum(isinstance(q.item, rtc.VideoFrame) for q in self._ready._queue)  # noqa: SLF001 (on its loop)

    def deliver(self, index: int, frames: np.ndarray, pcm: np.ndarray, speech_samples: int, ends_segment: bool,
                epoch: int) -> None:
        """On the event loop: queue chunk `index`'s frames uint8 [frames_per_chunk, H, W, 3] and, for speech, each
        frame's 1/24 s of `pcm` — muted when `epoch` (the clears rank 0 had applied when it took the chunk's audio)
        is behind this generator's clears. Chunks come in order (ValueError naming `index` otherwise); the chunk
        made again after a splice at (m, k) is queued from its frame k (its frames < k were queued before), with
        audio only if its frames ≥ k carry speech."""
        g = self.grid
        if index != self._next_chunk:
            raise ValueError(f"deliver index = {index}: expected chunk {self._next_chunk} (chunks come in order; after "
                             "a splice, the chunk made again)")
        if frames.shape != (g.frames_per_chunk, g.height, g.width, 3):
            raise ValueError(f"decoded frames: expected [{g.frames_per_chunk}, {g.height}, {g.width}, 3], "
                             f"got {list(frames.shape)}")
        first = 0
        if self._skip is not None and self._skip[0] == index:
            first, self._skip = self._skip[1], None
        self._next_chunk = index + 1
        rate = g.audio_sample_rate
        current = epoch == self._clear_epoch
        start, _ = g.chunk_sample_range(index)
        f0 = index * g.frames_per_chunk + first
        # a chunk made again from frame k: its speech count includes the kept frames < k (never queued again), so
        # it is speech here only if its frames ≥ k carry any (after an interrupt's splice they are silence)
        speech = speech_samples > 0 and current and (first == 0 or bool(np.any(pcm[f0 * rate // g.fps - start:])))
        self.stats.chunks += 1
        self.stats.speech_chunks += int(speech_samples > 0)
        self.stats.chunk_sizes.append(len(pcm))
        for j in range(first, g.frames_per_chunk):
            f = index * g.frames_per_chunk + j  # this frame's sample span on the grid
            self._ready.put_nowait(_Queued(rgb_to_video_frame(frames[j]), f))
            self.stats.video_frames += 1
            a0, a1 = f * rate // g.fps - start, (f + 1) * rate // g.fps - start
            if speech:
                piece = pcm[a0:a1]
                self.stats.audio_samples_out += len(piece)
                if self.stats.clears:
                    self.stats.speech_samples_after_clear += int(np.count_nonzero(piece))
                self._ready.put_nowait(_Queued(pcm_to_audio_frame(piece, rate), f))
        if ends_segment and current:
            self._ready.put_nowait(_Queued(AudioSegmentEnd(), (index + 1) * g.frames_per_chunk - 1))

    # ---- the splice at a turn start (docs/ARCHITECTURE.md, "Rewind at a turn start") ----------------------------
    def splice(self, keep_s: float, *, oldest: int = 0, pending: Sequence[ChunkMeta] = (),
               next_chunk_s: float = 0.0) -> tuple[int, int]:
        """On the event loop: cut the queue where generation restarts for a new turn; returns (m, k), and the next
        delivery is chunk m, queued from its frame k.

        f* = the first queued frame published later than `keep_s` seconds from now, in chunk m (≥ `oldest`) at index
        k: the i-th queued frame is published about (held_frames + i) / fps from now (while the queue is not empty
        the runner waits on its full synchronizer, whose frames are counted as shown). Frames before f* stay; f* and
        every later queued frame are dropped (never published); frames are only ever cut behind the last queued speech
        — a splice drops no sample of the room's current playback and no segment end, so
        `lk.playback_started/finished` stay as they are. `pending`: the chunks still
        upstream (in the decoder stage), in order from `next_chunk`; when no queued frame is dropped they are judged
        whole, by the slot their first frame will get: one due within `keep_s`, or carrying speech of the current
        epoch, is kept (m moves past it); the caller drops those ≥ m. `next_chunk_s`: the producer's time for one
        more chunk after the remade one; frame k of chunk m qualifies as f* only if chunk m + 1, due (F − k) frames
        after it, is due later than `keep_s` + `next_chunk_s` (as `Pacer.splice_unshown`). ValueError naming
        `keep_s`, `next_chunk_s`, `oldest` or `pending` when they are not what is expected."""
        if not isinstance(keep_s, int | float) or not math.isfinite(keep_s) or keep_s < 0:
            raise ValueError(f"splice keep_s = {keep_s!r}; expected finite seconds ≥ 0")
        if not isinstance(next_chunk_s, int | float) or not math.isfinite(next_chunk_s) or next_chunk_s < 0:
            raise ValueError(f"splice next_chunk_s = {next_chunk_s!r}; expected finite seconds ≥ 0")
        if isinstance(oldest, bool) or not isinstance(oldest, int) or oldest < 0:
            raise ValueError(f"splice oldest = {oldest!r}; expected a chunk index ≥ 0")
        indices = [p.index for p in pending]
        if indices != list(range(self._next_chunk, self._next_chunk + len(indices))):
            raise ValueError(f"splice pending = chunks {indices}; expected consecutive chunks from {self._next_chunk} "
                             "(the next one to deliver)")
        if oldest > self._next_chunk + len(indices):
            raise ValueError(f"splice oldest = {oldest}; expected ≤ {self._next_chunk + len(indices)} (the chunk "
                             "after the last one delivered or pending)")
        fpc, fps = self.grid.frames_per_chunk, self.grid.fps
        queued = list(self._ready._queue)  # noqa: SLF001 (asyncio.Queue's deque, read in place on its own loop)
        plays = [(p.speech_samples > 0 or p.ends_segment) and p.epoch == self._clear_epoch for p in pending]
        floor = max((p + 1 for p, q in enumerate(queued) if isinstance(q.item, rtc.AudioFrame | AudioSegmentEnd)),
                    default=0)
        if any(plays):  # speech still upstream: everything queued plays before it
            floor = len(queued)
        ahead = 0  # queued frames before the one judged
        for p, q in enumerate(queued):
            if not isinstance(q.item, rtc.VideoFrame):
                continue
            due = (self.held_frames + ahead) / fps
            if (p >= floor and q.frame // fpc >= oldest and due > keep_s
                    and due + (fpc - q.frame % fpc) / fps > keep_s + next_chunk_s):
                return self.cut(*divmod(q.frame, fpc))
            ahead += 1
        m = max(self._next_chunk, oldest)
        k = self._skip[1] if self._skip is not None and self._skip[0] == m else 0
        last_playing = max((i for i, x in enumerate(plays) if x), default=-1)
        for i, meta in enumerate(pending):  # nothing queued is dropped: the chunks upstream, whole
            due = (self.held_frames + ahead) / fps
            if meta.index >= oldest and due > keep_s and due + fpc / fps > keep_s + next_chunk_s and i > last_playing:
                break
            skip = self._skip[1] if self._skip is not None and self._skip[0] == meta.index else 0
            m, k = max(m, meta.index + 1), 0
            ahead += fpc - skip
        return self.cut(m, k, upstream=len(pending))

    def cut(self, m: int, k: int, *, upstream: int = 0) -> tuple[int, int]:
        """On the event loop: drop the queued frames from frame k of chunk m on (and their audio); the next delivery
        is chunk m from its frame k. `upstream`: chunks on their way after the queued ones (m may be one of them,
        k = 0). ValueError naming `m` or `k` when frame k of chunk m is not queued or next to come, or lies before
        speech still queued (the current playback's, never cut)."""
        fpc = self.grid.frames_per_chunk
        if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k < fpc:
            raise ValueError(f"splice k = {k!r}; expected a frame index in [0, {fpc})")
        queued = self._take_all()
        try:
            frames = [q.frame for q in queued if isinstance(q.item, rtc.VideoFrame)]
            lo = frames[0] // fpc if frames else self._next_chunk
            hi = self._next_chunk + upstream
            if isinstance(m, bool) or not isinstance(m, int) or not lo <= m <= hi:
                raise ValueError(f"splice m = {m!r}; expected a chunk with a queued frame or still to come, "
                                 f"in [{lo}, {hi}]")
            f = m * fpc + k
            if m < self._next_chunk:
                if f not in frames:
                    raise ValueError(f"splice k = {k}: frame {k} of chunk {m} is not queued (queued frames "
                                     f"{frames[0]} … {frames[-1]}; those before were handed to the avatar runner)")
                at = next(p for p, q in enumerate(queued) if q.frame == f and isinstance(q.item, rtc.VideoFrame))
            else:
                skip = self._skip[1] if self._skip is not None and self._skip[0] == m else 0
                if k != skip:
                    raise ValueError(f"splice k = {k}: chunk {m} is still to come, so it is cut at frame {skip}")
                at = len(queued)
            if any(isinstance(q.item, rtc.AudioFrame | AudioSegmentEnd) for q in queued[at:]):
                raise ValueError(f"splice m = {m}, k = {k}: speech of the current playback is queued after frame {k} "
                                 f"of chunk {m}; a splice drops only frames behind it")
        except ValueError:
            for q in queued:
                self._ready.put_nowait(q)
            raise
        closed = [q for q in queued[at:] if q.item is None]
        for q in queued[:at] + closed:
            self._ready.put_nowait(q)
        dropped = sum(isinstance(q.item, rtc.VideoFrame) for q in queued[at:])
        if m <= self._next_chunk:
            self._next_chunk = m
            self._skip = (m, k) if k > 0 else None
        self.stats.splices.append((m, k))
        self.stats.spliced_frames += dropped
        return m, k

    def _take_all(self) -> list[_Queued]:
        out = []
        while not self._ready.empty():
            out.append(self._ready.get_nowait())
        return out

    def __aiter__(self) -> AsyncIterator[rtc.VideoFrame | rtc.AudioFrame | AudioSegmentEnd]:
        return self._from_queue()

    async def _from_queue(self) -> AsyncIterator[rtc.VideoFrame | rtc.AudioFrame | AudioSegmentEnd]:
        while True:
            q = await self._ready.get()
            if q.item is None:
                return
            if isinstance(q.item, rtc.VideoFrame):
                self.stats.note_published(q.frame)
                self._handed += 1
            elif isinstance(q.item, rtc.AudioFrame) and self._turn_mark is not None:
                self.stats.turn_waits.append(self._handed - self._turn_mark)
                self._turn_mark = None
            self._nothing_in_hand.clear()
            try:
                yield q.item
            finally:
                self._nothing_in_hand.set()
