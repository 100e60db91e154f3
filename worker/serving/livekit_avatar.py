"""The worker as a LiveKit avatar, across its ranks: the room on the decoder rank, the session's decisions on rank 0.

Why this shape: `livekit-agents` already defines how a voice agent hands its TTS audio to a separate avatar
participant (`livekit.agents.voice.avatar`): audio arrives as byte streams on topic `lk.audio_stream`, one per
speech segment (`DataStreamAudioReceiver`); the agent interrupts with the `lk.clear_buffer` RPC; the avatar
reports `lk.playback_started` / `lk.playback_finished` back. The framework's `AvatarRunner` wires a receiver to
a `VideoGenerator` and publishes what the generator yields through `rtc.AVSynchronizer` (video paced at fps,
audio in step). One room connection (the avatar's identity, from the operator's token) both receives and
publishes, and the frames are made on the decoder rank, so the room lives there (`RoomSession`); what the DiT
needs from it — the agent's speech, interrupts, the reasons a session ends — travels to rank 0 as small
events (`forward`), where `RoomFeed` (vivant.worker.serving.room_feed) applies them to the session between
chunks:

    decoder rank (RoomSession, RoomVideo)                     rank 0 (RoomFeed)
    agent speech (rtc.AudioFrame, any rate) ─ ("speech", pcm, rate) ─► AudioInput.push → chunked on the grid
    AudioSegmentEnd                          ─ ("segment_end",)     ─► AudioInput.end_segment
    lk.clear_buffer                          ─ ("clear",)           ─► AudioInput.clear_buffer
    agent left / END_CALL / disconnected     ─ ("end", reason)      ─► runner.end_reason → the service ends it
    ◄── per chunk, over the link: latents + the chunk's PCM + (speech samples, ends its segment) ──
    decoder stage → RoomVideo.deliver: per frame an RGBA rtc.VideoFrame and, for speech, its 1/24 s of audio;
    AudioSegmentEnd after a segment's last chunk (→ lk.playback_finished)

Interrupts: `RoomVideo.clear_buffer` drops the speech queued for publication (the video stays) and counts a clear
epoch; rank 0 drops the speech not yet taken and counts the clears it applied (`RoomFeed.clears`), which every
chunk carries over the link. A chunk whose audio rank 0 took before it applied the latest clear (one being
diffused or decoded when the interrupt came) is published muted, so no speech sample is heard after the
interrupt and the video returns to idle within the chunks in flight. `AvatarRunner` then reports
`lk.playback_finished(interrupted=True)`.

Turn starts and interrupts (docs/ARCHITECTURE.md, "Rewind at a turn start"): rank 0's REWIND reaches the decoder
rank, which splices the room's queue (`splice_room`): every queued item knows its chunk and frame;
`RoomVideo.splice` drops the queued frames published later than now + the keep horizon, from f* = frame k of chunk
m on, and the next delivery is chunk m made again, queued from its frame k (each frame with its own 1/24 s of
audio). The frames the `AvatarRunner` already took — the AVSynchronizer's video queue, the frame it paces and the
one being pushed (`frames_held_by_runner`) — count as shown: the SDK can clear that queue only whole
(`AVSynchronizer.clear_queue`, with every queued audio sample). Nothing behind queued speech or a segment end is
cut, so a splice drops only frames whose speech is not playing (silent frames made ahead, or frames an interrupt
muted: after `clear_buffer` the cut returns the face to idle sooner) and `lk.playback_started/finished` stay as they
are. The chunks still in the decoder stage are judged whole (kept when due within the horizon or carrying speech),
and the stage rewinds to m. The decoder rank's record gets the published frame indices (as runs) and the splices at
END.

`EndWatch` ends a session for one of five reasons: the agent left the room, an `END_CALL` data message
(`{"type": "END_CALL"}`, what hosted-avatar plugins send on agent shutdown), max duration, the CharacterSession
deleted (the service's `EndRequest`, passed on at END), or the room disconnected. `RoomSession`'s server-facing
parts are three methods (`_connect`, `_audio_receiver`, `_avatar_runner`), so tests run everything else with
real SDK objects and no server.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
from livekit import rtc
from livekit.agents.voice.avatar import (
    AudioSegmentEnd,
    AvatarOptions,
    AvatarRunner,
    DataStreamAudioReceiver,
    VideoGenerator,
)
from vivant.worker.serving.room_feed import RoomEvent
from vivant.worker.stream.audio_in import ChunkGrid
from vivant.worker.stream.livekit_sink import pcm_to_audio_frame, rgb_to_video_frame

if TYPE_CHECKING:
    from vivant.worker.stream.decoder_stage import DecoderStage

log = logging.getLogger(__name__)

END_CALL_TYPE = "END_CALL"


class EndReason(StrEnum):
    AGENT_LEFT = "AgentLeft"
    END_CALL = "EndCall"
    MAX_DURATION = "MaxDuration"
    DELETED = "Deleted"
    DISCONNECTED = "RoomDisconnected"


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


# ------------------------------------------------------------------------------------------ the decoder rank


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
    def splice(self, keep_s: float, *, oldest: int = 0, pending: Sequence[ChunkMeta] = ()) -> tuple[int, int]:
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
        epoch, is kept (m moves past it); the caller drops those ≥ m. ValueError naming `keep_s`, `oldest` or
        `pending` when they are not what is expected."""
        if not isinstance(keep_s, int | float) or not math.isfinite(keep_s) or keep_s < 0:
            raise ValueError(f"splice keep_s = {keep_s!r}; expected finite seconds ≥ 0")
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
            if p >= floor and q.frame // fpc >= oldest and (self.held_frames + ahead) / fps > keep_s:
                return self.cut(*divmod(q.frame, fpc))
            ahead += 1
        m = max(self._next_chunk, oldest)
        k = self._skip[1] if self._skip is not None and self._skip[0] == m else 0
        last_playing = max((i for i, x in enumerate(plays) if x), default=-1)
        for i, meta in enumerate(pending):  # nothing queued is dropped: the chunks upstream, whole
            due = (self.held_frames + ahead) / fps
            if meta.index >= oldest and due > keep_s and i > last_playing:
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


def splice_room(room: RoomSession, stage: DecoderStage, pending: dict[int, ChunkMeta], keep_s: float, *,
                oldest: int = 0) -> tuple[int, int]:
    """The livekit kind's splice on the decoder rank: under the decoder stage's lock (no chunk reaches the room
    meanwhile) the room cuts its queue (`RoomSession.splice`, the chunks still in the stage, `pending`, judged whole),
    then the stage drops the chunks ≥ m and returns its causal state to after m − 1; their entries leave `pending`
    (index → ChunkMeta of the chunks submitted to the stage and not yet delivered). Returns (m, k)."""
    with stage.lock:
        oldest = max(oldest, stage.oldest_rewind())
        m, k = room.splice(keep_s, oldest=oldest, pending=[pending[c] for c in sorted(pending)])
        stage.rewind(m)
        for c in [c for c in pending if c >= m]:
            del pending[c]
    return m, k


class EndWatch:
    """Collects the first reason to end a session; `wait` returns it (or MaxDuration at the deadline).
    `on_end(reason)` runs once, when the first reason is set."""

    def __init__(self, agent_identity: str, on_end: Callable[[EndReason], None] | None = None) -> None:
        self.agent_identity = agent_identity
        self.on_end = on_end
        self._done: asyncio.Future[EndReason] = asyncio.get_running_loop().create_future()

    @property
    def reason(self) -> EndReason | None:
        return self._done.result() if self._done.done() else None

    def stop(self, reason: EndReason | str) -> None:
        if not self._done.done():
            self._done.set_result(EndReason(reason))
            log.info("avatar session ends: %s", EndReason(reason).value)
            if self.on_end is not None:
                self.on_end(EndReason(reason))

    def handle_data(self, payload: bytes, sender_identity: str | None) -> None:
        """A data message: `{"type": "END_CALL"}` from the agent (or from the server API) ends the session."""
        if sender_identity is not None and sender_identity != self.agent_identity:
            return
        try:
            msg = json.loads(payload)
        except (ValueError, UnicodeDecodeError):
            return  # not for us: other data messages share the channel
        if isinstance(msg, dict) and msg.get("type") == END_CALL_TYPE:
            self.stop(EndReason.END_CALL)

    def participant_left(self, identity: str) -> None:
        if identity == self.agent_identity:
            self.stop(EndReason.AGENT_LEFT)

    def attach(self, room: rtc.Room) -> None:
        """Wire the room's events (real `rtc.Room` event names) to the rules above."""

        @room.on("data_received")
        def _on_data(packet: rtc.DataPacket) -> None:
            sender = packet.participant.identity if packet.participant is not None else None
            self.handle_data(packet.data, sender)

        @room.on("participant_disconnected")
        def _on_left(participant: rtc.RemoteParticipant) -> None:
            self.participant_left(participant.identity)

        @room.on("disconnected")
        def _on_disconnected(*_: Any) -> None:
            self.stop(EndReason.DISCONNECTED)

    async def wait(self, max_duration_s: float) -> EndReason:
        try:
            return await asyncio.wait_for(asyncio.shield(self._done), timeout=max_duration_s)
        except TimeoutError:
            self.stop(EndReason.MAX_DURATION)
            return self._done.result()


@dataclass(frozen=True)
class AvatarJoin:
    """Where and as whom to join; the token is a secret (kept out of repr and logs)."""

    url: str
    token: str = field(repr=False)
    agent_identity: str

    @classmethod
    def from_payload(cls, payload: dict) -> AvatarJoin:
        """From rank 0's BEGIN payload (vivant.worker.serving.runtime); a ValueError names a missing field."""
        missing = [k for k in ("livekit_url", "token", "agent_identity") if not payload.get(k)]
        if missing:
            raise ValueError(f"livekit session: the assignment lacks {', '.join(missing)}")
        return cls(url=payload["livekit_url"], token=payload["token"], agent_identity=payload["agent_identity"])


class RoomSession:
    """One session's LiveKit room on the decoder rank (module docstring).

    `start` runs an event loop in a thread, joins the room with the assignment's URL and token, and starts
    `AvatarRunner` with `DataStreamAudioReceiver` (it waits for the agent participant) and a `RoomVideo`; every
    room event for rank 0 goes to `forward`. `deliver` hands a decoded chunk to the loop; `wait_lead` holds the
    caller while more than `lead_chunks` chunks of frames wait for publication, counting those still in the decoder
    stage (the AVSynchronizer consumes them at real time; within rank 0's undo depth, `rewind_chunks` = 4, a turn's
    splice reaches every frame not handed to the runner), and fails when nothing was consumed for
    `stall_timeout_s`. `close` leaves the room."""

    def __init__(self, grid: VideoGrid, join: AvatarJoin, forward: Callable[[RoomEvent], None], *,
                 connect_timeout_s: float = 20.0, lead_chunks: int = 3, stall_timeout_s: float = 10.0) -> None:
        self.grid, self.join, self.forward = grid, join, forward
        self.connect_timeout_s, self.stall_timeout_s = connect_timeout_s, stall_timeout_s
        self.lead_frames = lead_chunks * grid.frames_per_chunk
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="livekit-room-loop", daemon=True)
        self._thread.start()
        self.room: rtc.Room | None = None
        self.video: RoomVideo | None = None
        self.end: EndWatch | None = None
        self.runner: AvatarRunner | None = None
        self.delivery_error: Exception | None = None  # the first chunk the room refused (raised by wait_lead)

    def _call(self, coro: Any, timeout: float | None = None) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def start(self) -> RoomSession:
        try:
            self._call(self._join(), timeout=2 * self.connect_timeout_s + 5)
        except BaseException:
            self._stop_loop()
            raise
        self.forward(("joined",))
        return self

    async def _join(self) -> None:
        room = rtc.Room()
        end = EndWatch(self.join.agent_identity, on_end=lambda reason: self.forward(("end", reason.value)))
        end.attach(room)
        try:
            await self._connect(room)
            video = RoomVideo(self.grid, self.forward, held_frames=frames_held_by_runner(self.grid.fps, SYNC_QUEUE_MS))
            runner = self._avatar_runner(room, self._audio_receiver(room), video)
            await asyncio.wait_for(runner.start(), self.connect_timeout_s)  # waits for the agent participant
        except BaseException:
            await room.disconnect()  # a session that cannot start leaves no connection behind
            raise
        self.room, self.end, self.video, self.runner = room, end, video, runner

    # The server-facing parts (a test without a LiveKit server replaces exactly these).
    async def _connect(self, room: rtc.Room) -> None:
        await asyncio.wait_for(room.connect(self.join.url, self.join.token), self.connect_timeout_s)

    def _audio_receiver(self, room: rtc.Room) -> Any:
        return DataStreamAudioReceiver(room, sender_identity=self.join.agent_identity)

    def _avatar_runner(self, room: rtc.Room, receiver: Any, video: RoomVideo) -> AvatarRunner:
        return AvatarRunner(room, audio_recv=receiver, video_gen=video, options=self.avatar_options(),
                            _queue_size_ms=SYNC_QUEUE_MS)

    def avatar_options(self) -> AvatarOptions:
        g = self.grid
        return AvatarOptions(video_width=g.width, video_height=g.height, video_fps=float(g.fps),
                             audio_sample_rate=g.audio_sample_rate, audio_channels=1)

    # ---- the decoder rank's side ------------------------------------------------------------------------
    @property
    def clear_epoch(self) -> int:
        return self.video.clear_epoch

    def wait_lead(self, upstream: int = 0) -> None:
        """Hold the caller while the frames queued for publication plus `upstream` chunks (on their way: the decoder
        stage's) exceed `lead_chunks` chunks (module docstring)."""
        waited_since = time.monotonic()
        if self.delivery_error is not None:
            raise RuntimeError(f"the room refused a decoded chunk: {self.delivery_error}")
        while self._call(self._queued()) + upstream * self.grid.frames_per_chunk > self.lead_frames:
            if self.end.reason is not None:
                return  # rank 0 is ending the session
            if time.monotonic() - waited_since > self.stall_timeout_s:
                raise RuntimeError(f"published video stalled: {self.video.queued_items()} frames queued and none "
                                   f"consumed for {self.stall_timeout_s:.0f}s")
            time.sleep(self.grid.frames_per_chunk / self.grid.fps / 4)

    async def _queued(self) -> int:
        return self.video.queued_frames()

    def deliver(self, index: int, frames: np.ndarray, pcm: np.ndarray, speech_samples: int, ends_segment: bool,
                epoch: int) -> None:
        """`RoomVideo.deliver` on the room's loop; a chunk it refuses fails the next `wait_lead`."""
        self.loop.call_soon_threadsafe(self._deliver, index, frames, pcm, speech_samples, ends_segment, epoch)

    def _deliver(self, *chunk: Any) -> None:
        try:
            self.video.deliver(*chunk)
        except ValueError as exc:  # out of order or the wrong shape: kept for the decoder rank's next wait_lead
            log.error("room delivery: %s", exc)
            self.delivery_error = self.delivery_error or exc

    def splice(self, keep_s: float, *, oldest: int = 0, pending: Sequence[ChunkMeta] = ()) -> tuple[int, int]:
        """`RoomVideo.splice` on the room's event loop, after every chunk `deliver` handed over before (the loop runs
        callbacks in order); the caller holds its decoder stage's lock, so no chunk is delivered meanwhile."""
        return self._call(self._splice(keep_s, oldest, pending), timeout=10)

    async def _splice(self, keep_s: float, oldest: int, pending: Sequence[ChunkMeta]) -> tuple[int, int]:
        return self.video.splice(keep_s, oldest=oldest, pending=pending)

    def close(self, reason: str = "") -> None:
        """Leave the room (after the last chunk was delivered); `reason`, when it is an EndReason (the operator's
        Deleted), is recorded as the session's (the first reason sticks)."""
        try:
            if self.room is not None:
                self._call(self._leave(reason), timeout=30)
        finally:
            self._stop_loop()

    async def _leave(self, reason: str) -> None:
        if reason in EndReason._value2member_map_:
            self.end.stop(reason)
        self.video.close()
        await self.runner.aclose()
        await self.room.disconnect()

    def _stop_loop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)
