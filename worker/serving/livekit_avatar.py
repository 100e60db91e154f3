"""The worker as a LiveKit avatar, across its ranks: the room on the decoder rank, the session's decisions on rank 0.

Why this shape: `livekit-agents` already defines how a voice agent hands its TTS audio to a separate avatar
participant (`livekit.agents.voice.avatar`): audio arrives as byte streams on topic `lk.audio_stream`, one per
speech segment (`DataStreamAudioReceiver`); the agent interrupts with the `lk.clear_buffer` RPC; the avatar
reports `lk.playback_started` / `lk.playback_finished` back. The framework's `AvatarRunner` wires a receiver to
a `VideoGenerator` and publishes what the generator yields through `rtc.AVSynchronizer` (video paced at fps,
audio in step); the worker runs it as `PublishingAvatarRunner` (publishing.py), which names the video track's
frame rate. One room connection (the avatar's identity, from the operator's token) both receives and
publishes, and the frames are made on the decoder rank, so the room lives there (`RoomSession`); what the DiT
needs from it — the agent's speech, interrupts, the reasons a session ends — travels to rank 0 as small
events (`forward`), where `RoomFeed` (vivant.worker.serving.room_feed) applies them to the session between
chunks:

    decoder rank (RoomSession, RoomVideo: room_video.py)      rank 0 (RoomFeed)
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
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Any

import numpy as np
from livekit import rtc
from livekit.agents.voice.avatar import (
    AvatarOptions,
    AvatarRunner,
    DataStreamAudioReceiver,
)
from vivant.worker.serving.publishing import PublishingAvatarRunner
from vivant.worker.serving.room_feed import RoomEvent
from vivant.worker.serving.room_video import (
    SYNC_QUEUE_MS,
    ChunkMeta,
    RoomVideo,
    VideoGrid,
    frames_held_by_runner,
)

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


# ------------------------------------------------------------------------------------------ the decoder rank


def splice_room(room: RoomSession, stage: DecoderStage, pending: dict[int, ChunkMeta], keep_s: float, *,
                oldest: int = 0, next_chunk_s: float = 0.0) -> tuple[int, int]:
    """The livekit kind's splice on the decoder rank: under the decoder stage's lock (no chunk reaches the room
    meanwhile) the room cuts its queue (`RoomSession.splice`, the chunks still in the stage, `pending`, judged whole),
    then the stage drops the chunks ≥ m and returns its causal state to after m − 1; their entries leave `pending`
    (index → ChunkMeta of the chunks submitted to the stage and not yet delivered); `next_chunk_s` as for
    `RoomVideo.splice`. Returns (m, k)."""
    with stage.lock:
        oldest = max(oldest, stage.oldest_rewind())
        m, k = room.splice(keep_s, oldest=oldest, pending=[pending[c] for c in sorted(pending)],
                           next_chunk_s=next_chunk_s)
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
        return PublishingAvatarRunner(room, audio_recv=receiver, video_gen=video, options=self.avatar_options(),
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

    def splice(self, keep_s: float, *, oldest: int = 0, pending: Sequence[ChunkMeta] = (),
               next_chunk_s: float = 0.0) -> tuple[int, int]:
        """`RoomVideo.splice` on the room's event loop, after every chunk `deliver` handed over before (the loop runs
        callbacks in order); the caller holds its decoder stage's lock, so no chunk is delivered meanwhile."""
        return self._call(self._splice(keep_s, oldest, pending, next_chunk_s), timeout=10)

    async def _splice(self, keep_s: float, oldest: int, pending: Sequence[ChunkMeta],
                      next_chunk_s: float) -> tuple[int, int]:
        return self.video.splice(keep_s, oldest=oldest, pending=pending, next_chunk_s=next_chunk_s)

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
