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

`LiveKitSessionRunner` is the same session behind the worker service's step-per-chunk `SessionRunner`
interface (the service's thread renders, the event loop publishes); `vivant worker --runner livekit`
serves sessions with it. A room-side end (agent left, END_CALL, disconnected) shows as its
`end_reason` (or `SessionEnded` from `step`), which the service reports and then releases the worker.
Its server-facing parts are three methods (`_connect`, `_audio_receiver`, `_avatar_runner`), so tests
can run everything else with real SDK objects and no server.

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
from vivant.worker.serving.runner import ChunkReport, SessionEnded
from vivant.worker.stream.audio_in import AudioInput, ChunkAudio, ChunkGrid
from vivant.worker.stream.livekit_sink import pcm_to_audio_frame, rgb_to_video_frame

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

    def reset(self, seed: int = 0) -> None:
        """A new session: fresh generator state (KV cache, chunk counter) and decoder cache."""
        self.generator.reset_session(seed)
        self._cache = self.vae.new_cache()


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
    """vivant's chunk loop behind livekit-agents' `VideoGenerator` interface (see module doc).

    Two drivers: `external=False` (default) renders chunks itself in a worker thread as the runner
    consumes them; `external=True` leaves rendering to a caller thread (`render_next`, e.g. the worker
    service's chunk loop) that hands results in with `deliver` (on the event loop)."""

    def __init__(self, renderer: ChunkRenderer, grid: VideoGrid, *, idle: bool = True, external: bool = False) -> None:
        self.renderer = renderer
        self.grid = grid
        self.idle = idle
        self.external = external
        self.audio_in = AudioInput(grid)
        self.stats = GeneratorStats()
        self._wake = asyncio.Event()
        self._ready: asyncio.Queue[rtc.VideoFrame | rtc.AudioFrame | AudioSegmentEnd | None] = asyncio.Queue()
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
        kept = []  # delivered but not yet published (external driver): keep the video, drop the speech
        while not self._ready.empty():
            item = self._ready.get_nowait()
            if not isinstance(item, rtc.AudioFrame | AudioSegmentEnd):
                kept.append(item)
        for item in kept:
            self._ready.put_nowait(item)
        self._wake.set()

    def close(self) -> None:
        self._closed = True
        self._ready.put_nowait(None)
        self._wake.set()

    @property
    def clear_epoch(self) -> int:
        return self._clear_epoch

    def render_next(self) -> tuple[ChunkAudio, np.ndarray]:
        """Take the next chunk of audio (speech or silence) and render it; safe off the event loop."""
        g = self.grid
        chunk = self.audio_in.next_chunk()
        frames = self.renderer.render(chunk.samples, g.audio_sample_rate)
        if frames.shape[0] != g.frames_per_chunk or frames.shape[1:] != (g.height, g.width, 3):
            raise ValueError(f"renderer output: expected [{g.frames_per_chunk}, {g.height}, {g.width}, 3], "
                             f"got {list(frames.shape)}")
        return chunk, frames

    def deliver(self, chunk: ChunkAudio, frames: np.ndarray, epoch: int) -> None:
        """On the event loop: queue a rendered chunk's frames (muted if an interrupt landed since `epoch`)."""
        for item in self._items(chunk, frames, epoch):
            self._ready.put_nowait(item)

    def queued_items(self) -> int:
        return self._ready.qsize()

    def _items(self, chunk: ChunkAudio, frames: np.ndarray,
               epoch: int) -> list[rtc.VideoFrame | rtc.AudioFrame | AudioSegmentEnd]:
        g = self.grid
        rate = g.audio_sample_rate
        speech = chunk.speech_samples > 0 and epoch == self._clear_epoch  # interrupted mid-render: mute
        self.stats.chunks += 1
        self.stats.speech_chunks += int(chunk.speech_samples > 0)
        self.stats.chunk_sizes.append(len(chunk.samples))
        start, _ = g.chunk_sample_range(chunk.index)
        out: list[rtc.VideoFrame | rtc.AudioFrame | AudioSegmentEnd] = []
        for j in range(g.frames_per_chunk):
            out.append(rgb_to_video_frame(frames[j]))
            self.stats.video_frames += 1
            f = chunk.index * g.frames_per_chunk + j  # this frame's sample span on the grid
            a0, a1 = f * rate // g.fps - start, (f + 1) * rate // g.fps - start
            if speech:
                piece = chunk.samples[a0:a1]
                self.stats.audio_samples_out += len(piece)
                if self.stats.clears:
                    self.stats.speech_samples_after_clear += int(np.count_nonzero(piece))
                out.append(pcm_to_audio_frame(piece, rate))
        if self._segment_end_pending and self.audio_in.pending_samples() == 0:
            self._segment_end_pending = False
            out.append(AudioSegmentEnd())
        return out

    def __aiter__(self) -> AsyncIterator[rtc.VideoFrame | rtc.AudioFrame | AudioSegmentEnd]:
        return self._from_queue() if self.external else self._frames()

    async def _from_queue(self) -> AsyncIterator[rtc.VideoFrame | rtc.AudioFrame | AudioSegmentEnd]:
        while True:
            item = await self._ready.get()
            if item is None:
                return
            yield item

    async def _frames(self) -> AsyncIterator[rtc.VideoFrame | rtc.AudioFrame | AudioSegmentEnd]:
        while not self._closed:
            if not self.idle and self.audio_in.pending_samples() == 0 and not self._segment_end_pending:
                self._wake.clear()
                await self._wake.wait()
                continue
            epoch = self._clear_epoch
            chunk, frames = await asyncio.to_thread(self.render_next)
            for item in self._items(chunk, frames, epoch):
                yield item
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


# ------------------------------------------------------------------------------------------ worker service


class LiveKitSessionRunner:
    """The worker service's `SessionRunner` for LiveKit sessions (vivant.worker.serving.runner).

    `begin` starts (once) an event-loop thread, resets the renderer (if it has `reset(seed)`), joins the
    assignment's room with its URL and token and starts `AvatarRunner` with an externally driven
    `VivantVideoGenerator`; `step` renders one chunk on the service's thread and hands it to the loop
    (waiting while more than `lead_chunks` chunks are queued, so the AVSynchronizer's real-time
    consumption paces the loop; if nothing is consumed for `stall_timeout_s` the step fails);
    `end_reason` is set once the room ends the session (agent left, END_CALL, disconnected) for the
    service to stop on, and a `step` waiting when that happens raises `SessionEnded`; `end` leaves the
    room. Joining (`_connect`) and the agent's audio (`DataStreamAudioReceiver`, which waits for the agent
    participant) need a LiveKit server, which cannot run in this project's CI: tests replace `_connect`,
    `_audio_receiver` and the track publication of `_avatar_runner` and nothing else.
    """

    def __init__(self, renderer: ChunkRenderer, grid: VideoGrid, *, connect_timeout_s: float = 20.0,
                 lead_chunks: int = 3, stall_timeout_s: float = 10.0) -> None:
        self.renderer, self.grid = renderer, grid
        self.frames_per_chunk = grid.frames_per_chunk
        self.chunk_seconds = grid.frames_per_chunk / grid.fps
        self.connect_timeout_s = connect_timeout_s
        self.stall_timeout_s = stall_timeout_s
        self.lead_items = lead_chunks * grid.frames_per_chunk * 2
        self._loop: asyncio.AbstractEventLoop | None = None
        self._session: dict[str, Any] = {}

    def _ensure_loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            import threading

            self._loop = asyncio.new_event_loop()
            threading.Thread(target=self._loop.run_forever, name="livekit-avatar-loop", daemon=True).start()
        return self._loop

    def _call(self, coro: Any, timeout: float | None = None) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._ensure_loop()).result(timeout)

    def begin(self, assignment: Any, flags: Any) -> None:
        join = AvatarJoin(url=assignment.livekit_url, token=assignment.token.get_secret_value(),
                          agent_identity=assignment.agent_identity, max_duration_s=assignment.max_duration_s)
        reset = getattr(self.renderer, "reset", None)
        if reset is not None:
            reset(assignment.seed)
        self.apply_flags(flags)  # sets kernel_path, which the service reports after begin
        self._call(self._join(join), timeout=2 * self.connect_timeout_s + 5)

    async def _join(self, join: AvatarJoin) -> None:
        room = rtc.Room()
        end = EndWatch(join.agent_identity)
        end.attach(room)
        try:
            await self._connect(room, join)
            gen = VivantVideoGenerator(self.renderer, self.grid, external=True)
            runner = self._avatar_runner(room, self._audio_receiver(room, join), gen)
            await asyncio.wait_for(runner.start(), self.connect_timeout_s)  # waits for the agent participant
        except BaseException:
            await room.disconnect()  # a session that cannot start leaves no connection behind
            raise
        self._session = {"room": room, "end": end, "gen": gen, "runner": runner}

    # The server-facing parts (a test without a LiveKit server replaces exactly these).
    async def _connect(self, room: rtc.Room, join: AvatarJoin) -> None:
        await asyncio.wait_for(room.connect(join.url, join.token), self.connect_timeout_s)

    def _audio_receiver(self, room: rtc.Room, join: AvatarJoin) -> Any:
        return DataStreamAudioReceiver(room, sender_identity=join.agent_identity)

    def _avatar_runner(self, room: rtc.Room, receiver: Any, gen: VivantVideoGenerator) -> AvatarRunner:
        return AvatarRunner(room, audio_recv=receiver, video_gen=gen, options=self.avatar_options())

    def avatar_options(self) -> AvatarOptions:
        g = self.grid
        return AvatarOptions(video_width=g.width, video_height=g.height, video_fps=float(g.fps),
                             audio_sample_rate=g.audio_sample_rate, audio_channels=1)

    def apply_flags(self, flags: Any) -> str | None:
        """Returns the kernel path in effect (what the service reports), None when the generator has no hook."""
        hook = getattr(getattr(self.renderer, "generator", None), "apply_flags", None)
        self.kernel_path = hook(flags) if hook is not None else None
        return self.kernel_path

    @property
    def end_reason(self) -> str | None:
        end: EndWatch | None = self._session.get("end")
        return end.reason.value if end is not None and end.reason is not None else None

    def step(self) -> Any:
        gen: VivantVideoGenerator = self._session["gen"]
        waited_since = time.monotonic()
        while self._call(self._queued(gen)) > self.lead_items:
            if self.end_reason is not None:
                raise SessionEnded(self.end_reason)
            if time.monotonic() - waited_since > self.stall_timeout_s:
                raise RuntimeError(f"published video stalled: {gen.queued_items()} frames queued and none consumed "
                                   f"for {self.stall_timeout_s:.0f}s")
            time.sleep(self.chunk_seconds / 4)
        epoch = gen.clear_epoch
        t0 = time.perf_counter()
        chunk, frames = gen.render_next()
        ms = (time.perf_counter() - t0) * 1e3
        self._ensure_loop().call_soon_threadsafe(gen.deliver, chunk, frames, epoch)
        return ChunkReport(index=chunk.index, compute_ms=ms, frames=self.frames_per_chunk)

    @staticmethod
    async def _queued(gen: VivantVideoGenerator) -> int:
        return gen.queued_items()

    def end(self, reason: str) -> None:
        if self._session:
            self._call(self._leave(reason), timeout=30)
        self._session = {}

    async def _leave(self, reason: str) -> None:
        s = self._session  # the service records its own reason (max duration, EndRequest, shutdown)
        if reason in EndReason._value2member_map_:
            s["end"].stop(reason)  # e.g. the operator's "Deleted": the first reason sticks
        s["gen"].close()
        await s["runner"].aclose()
        await s["room"].disconnect()
