"""The worker as a LiveKit avatar: join the session's room, turn the agent's speech into talking video.

Why this shape: `livekit-agents` already defines how a voice agent hands its TTS audio to a separate
avatar participant (`livekit.agents.voice.avatar`): audio arrives as byte streams on topic
`lk.audio_stream`, one per speech segment (`DataStreamAudioReceiver`); the agent interrupts with the
`lk.clear_buffer` RPC; the avatar reports `lk.playback_started` / `lk.playback_finished` back. The
framework's `AvatarRunner` wires a receiver to a `VideoGenerator` and publishes what the generator
yields through `rtc.AVSynchronizer` (video paced at fps, audio in step). vivant therefore supplies
only the `VideoGenerator` (`VivantVideoGenerator`) and the end-of-session rules (`EndWatch`); the
protocol is the framework's.

`VivantVideoGenerator`
* `push_audio(rtc.AudioFrame)`: int16 PCM at any rate and channel count -> mono float32 -> the
  worker's `AudioInput`, which resamples to the model rate (16 kHz) and cuts it on the chunk grid
  (4 frames / 24 fps = 166.7 ms = 2666 or 2667 samples per chunk).
* iteration: for each chunk, `ChunkRenderer.render(samples)` (the DiT + VAE decoder in production,
  `ModelRenderer`) runs in a thread and returns uint8 [4, H, W, 3]; the generator yields per frame an
  RGBA `rtc.VideoFrame` and, while speech plays, that frame's 1/24 s of audio as an int16
  `rtc.AudioFrame`; after the last chunk of a segment it yields `AudioSegmentEnd` (-> the runner
  reports `lk.playback_finished`). With nobody speaking it keeps rendering idle chunks (silence in,
  video only out) so the character listens; `AVSynchronizer.push` blocks at real time, which paces it.
* `clear_buffer()`: speech not yet rendered is dropped (`AudioInput.clear_buffer`); a chunk already
  rendering when the interrupt lands still shows its video but its audio is not published, so no
  speech sample is heard after the interrupt and the video returns to idle within one chunk. The
  runner then reports `lk.playback_finished` with `interrupted: true`.

`EndWatch` ends a session for one of five reasons: the agent left the room, an `END_CALL` data message
(`{"type": "END_CALL"}`, what hosted-avatar plugins send on agent shutdown), max duration, the
CharacterSession deleted (the service's `EndRequest` -> `stop("Deleted")`), or the room disconnected.

`run_avatar_session` joins for real (`rtc.Room.connect` with the token the operator minted, or the
caller's token from the session API). No LiveKit server can run in this project's CI, so that join is
exercised only against a real deployment; the tests drive everything after it with real SDK objects.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Protocol

import numpy as np
from livekit import rtc
from livekit.agents.voice.avatar import (
    AudioSegmentEnd,
    AvatarOptions,
    AvatarRunner,
    DataStreamAudioReceiver,
    VideoGenerator,
)
from vivant.worker.audio_in import AudioInput, ChunkGrid
from vivant.worker.livekit_sink import pcm_to_audio_frame, rgb_to_video_frame

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


class ChunkRenderer(Protocol):
    """One chunk of audio (float32 mono at the grid's rate) -> uint8 frames [frames_per_chunk, H, W, 3]."""

    def render(self, samples: np.ndarray, sample_rate: int) -> np.ndarray: ...


class ModelRenderer:
    """vivant's model as a renderer: `ChunkGenerator.generate_chunk` then the causal VAE decoder."""

    def __init__(self, generator: Any, vae: Any) -> None:
        self.generator, self.vae = generator, vae
        self._cache = vae.new_cache()

    def render(self, samples: np.ndarray, sample_rate: int) -> np.ndarray:
        out = self.generator.generate_chunk(samples, sample_rate)
        return self.vae.decode_chunk(out.latents, self._cache).cpu().numpy()


def audio_frame_to_mono(frame: rtc.AudioFrame) -> np.ndarray:
    """int16 interleaved PCM of an `rtc.AudioFrame` -> float32 mono in [-1, 1] (channels averaged)."""
    pcm = np.frombuffer(frame.data, dtype=np.int16).astype(np.float32) / 32768.0
    ch = frame.num_channels
    if ch > 1:
        pcm = pcm.reshape(-1, ch).mean(axis=1)
    return pcm


@dataclass
class GeneratorStats:
    chunks: int = 0
    speech_chunks: int = 0
    video_frames: int = 0
    audio_samples_out: int = 0
    clears: int = 0
    speech_samples_after_clear: int = 0  # speech published after the latest clear_buffer (should be 0)
    chunk_sizes: list[int] = field(default_factory=list)


class VivantVideoGenerator(VideoGenerator):
    """vivant's chunk loop behind livekit-agents' `VideoGenerator` interface (see module doc)."""

    def __init__(self, renderer: ChunkRenderer, grid: VideoGrid, *, idle: bool = True) -> None:
        self.renderer = renderer
        self.grid = grid
        self.idle = idle
        self.audio_in = AudioInput(grid)
        self.stats = GeneratorStats()
        self._wake = asyncio.Event()
        self._segment_open = False
        self._segment_end_pending = False
        self._clear_epoch = 0
        self._closed = False

    async def push_audio(self, frame: rtc.AudioFrame | AudioSegmentEnd) -> None:
        if isinstance(frame, AudioSegmentEnd):
            self.audio_in.end_segment()
            if self._segment_open:
                self._segment_end_pending = True
                self._segment_open = False
        else:
            self.audio_in.push(audio_frame_to_mono(frame), frame.sample_rate)
            self._segment_open = True
        self._wake.set()

    def clear_buffer(self) -> None:
        self.audio_in.clear_buffer()
        self._clear_epoch += 1
        self._segment_open = False
        self._segment_end_pending = False
        self.stats.clears += 1
        self.stats.speech_samples_after_clear = 0
        self._wake.set()

    def close(self) -> None:
        self._closed = True
        self._wake.set()

    def __aiter__(self) -> AsyncIterator[rtc.VideoFrame | rtc.AudioFrame | AudioSegmentEnd]:
        return self._frames()

    async def _frames(self) -> AsyncIterator[rtc.VideoFrame | rtc.AudioFrame | AudioSegmentEnd]:
        g = self.grid
        rate = g.audio_sample_rate
        while not self._closed:
            if not self.idle and self.audio_in.pending_samples() == 0 and not self._segment_end_pending:
                self._wake.clear()
                await self._wake.wait()
                continue
            epoch = self._clear_epoch
            chunk = self.audio_in.next_chunk()
            frames = await asyncio.to_thread(self.renderer.render, chunk.samples, rate)
            if frames.shape[0] != g.frames_per_chunk or frames.shape[1:] != (g.height, g.width, 3):
                raise ValueError(f"renderer output: expected [{g.frames_per_chunk}, {g.height}, {g.width}, 3], "
                                 f"got {list(frames.shape)}")
            speech = chunk.speech_samples > 0 and epoch == self._clear_epoch  # interrupted mid-render: mute
            self.stats.chunks += 1
            self.stats.speech_chunks += int(chunk.speech_samples > 0)
            self.stats.chunk_sizes.append(len(chunk.samples))
            start, _ = g.chunk_sample_range(chunk.index)
            for j in range(g.frames_per_chunk):
                yield rgb_to_video_frame(frames[j])
                self.stats.video_frames += 1
                f = chunk.index * g.frames_per_chunk + j  # this frame's sample span on the grid
                a0, a1 = f * rate // g.fps - start, (f + 1) * rate // g.fps - start
                if speech:
                    piece = chunk.samples[a0:a1]
                    self.stats.audio_samples_out += len(piece)
                    if self.stats.clears:
                        self.stats.speech_samples_after_clear += int(np.count_nonzero(piece))
                    yield pcm_to_audio_frame(piece, rate)
            if self._segment_end_pending and self.audio_in.pending_samples() == 0:
                self._segment_end_pending = False
                yield AudioSegmentEnd()
            await asyncio.sleep(0)  # let push_audio / clear_buffer in between chunks


# ------------------------------------------------------------------------------------------ session end


class EndWatch:
    """Collects the first reason to end a session; `wait` returns it (or MaxDuration at the deadline)."""

    def __init__(self, agent_identity: str) -> None:
        self.agent_identity = agent_identity
        self._done: asyncio.Future[EndReason] = asyncio.get_running_loop().create_future()

    @property
    def reason(self) -> EndReason | None:
        return self._done.result() if self._done.done() else None

    def stop(self, reason: EndReason | str) -> None:
        if not self._done.done():
            self._done.set_result(EndReason(reason))
            log.info("avatar session ends: %s", EndReason(reason).value)

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


# ------------------------------------------------------------------------------------------ the session


@dataclass(frozen=True)
class AvatarJoin:
    """Where and as whom to join; the token is a secret (kept out of repr and logs)."""

    url: str
    token: str = field(repr=False)
    agent_identity: str
    max_duration_s: float


@dataclass
class AvatarResult:
    reason: EndReason
    seconds: float
    stats: GeneratorStats


async def run_avatar_session(join: AvatarJoin, renderer: ChunkRenderer, grid: VideoGrid,
                             end: EndWatch | None = None) -> AvatarResult:
    """Join the room, run AvatarRunner with vivant's generator until an end reason, leave cleanly.

    Needs a reachable LiveKit server (not available in this project's CI)."""
    t0 = time.monotonic()
    room = rtc.Room()
    end = end or EndWatch(join.agent_identity)
    end.attach(room)
    await room.connect(join.url, join.token)
    gen = VivantVideoGenerator(renderer, grid)
    receiver = DataStreamAudioReceiver(room, sender_identity=join.agent_identity)
    runner = AvatarRunner(room, audio_recv=receiver, video_gen=gen, options=AvatarOptions(
        video_width=grid.width, video_height=grid.height, video_fps=float(grid.fps),
        audio_sample_rate=grid.audio_sample_rate, audio_channels=1))
    try:
        await runner.start()
        reason = await end.wait(join.max_duration_s)
    finally:
        gen.close()
        await runner.aclose()
        await room.disconnect()
    return AvatarResult(reason=reason, seconds=time.monotonic() - t0, stats=gen.stats)
