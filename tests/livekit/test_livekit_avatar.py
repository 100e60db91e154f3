"""The worker's LiveKit side with real SDK objects and no server: the room on the decoder rank (`RoomVideo`,
`RoomSession`, `EndWatch`) and what rank 0 makes of its events (`RoomFeed`), in one process here (the ranks'
queue between them is a list).

What runs for real here: `rtc.VideoSource`/`rtc.AudioSource`, local tracks and an `rtc.VideoStream` on
them (frames come back out of the native SDK), `rtc.AudioFrame`s in, livekit-agents' `AvatarRunner`,
`QueueAudioOutput` (the framework's in-process AudioOutput + AudioReceiver), `rtc.Room` event dispatch,
vivant's tiny model and VAE decoder for the frames in one test.

What is NOT exercised, because no LiveKit server can run in this project's CI (no binary in any
reachable registry): `rtc.Room.connect`, `DataStreamAudioReceiver` (it waits for the agent participant
to join and reads `lk.audio_stream` byte streams off a connected room), the `lk.clear_buffer` RPC
arriving over the wire, and the `lk.playback_*` RPCs leaving. The receiver's output type
(`rtc.AudioFrame` | `AudioSegmentEnd`, 100 ms frames at the sender's rate) is fed here directly, and
the interrupt path is driven through `AvatarRunner` with `QueueAudioOutput`, which emits the same
`clear_buffer` event and receives the same `notify_playback_finished(interrupted=...)` call.

`RoomSession`'s three server-facing methods are replaced in its tests (`OfflineRoom`): `_connect` records the
join, `_audio_receiver` is `QueueAudioOutput`, and the runner publishes its tracks locally.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import numpy as np
import pytest
from livekit import rtc
from livekit.agents.voice.avatar import AudioSegmentEnd, AvatarOptions, AvatarRunner, QueueAudioOutput
from vivant.worker.model.config import ModelConfig
from vivant.worker.serving.livekit_avatar import AvatarJoin, EndReason, EndWatch, RoomSession
from vivant.worker.serving.room_feed import RoomFeed
from vivant.worker.serving.room_video import RoomVideo
from vivant.worker.stream.audio_in import AudioInput
from vivant.worker.stream.livekit_sink import LiveKitSink
from vivant.worker.stream.pacer import PublishedFrame

CFG = ModelConfig.from_name("tiny")  # 192x128, 24 fps, 4 frames per chunk, 16 kHz
pytestmark = pytest.mark.timeout(120)


def tone(seconds: float, rate: int, channels: int = 1, freq: float = 220.0) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    x = (0.5 * np.sin(2 * np.pi * freq * t) * 32767).astype(np.int16)
    return np.repeat(x[:, None], channels, axis=1).reshape(-1)


def frames_of(pcm: np.ndarray, rate: int, channels: int, ms: int = 100) -> list[rtc.AudioFrame]:
    """Cut interleaved int16 PCM into `rtc.AudioFrame`s the way DataStreamAudioReceiver does (100 ms)."""
    n = rate * ms // 1000
    per = pcm.reshape(-1, channels)
    return [rtc.AudioFrame(per[i:i + n].reshape(-1).tobytes(), rate, channels, len(per[i:i + n]))
            for i in range(0, len(per), n)]


def flat(level: int) -> np.ndarray:
    return np.full((CFG.frames_per_chunk, CFG.height, CFG.width, 3), level, np.uint8)


async def drain(video: RoomVideo) -> list[Any]:
    video.close()
    return [item async for item in video]


# ------------------------------------------------------------------------------------------ video out


def _published(slot: int, rgb: np.ndarray, audio: np.ndarray) -> PublishedFrame:
    return PublishedFrame(slot=slot, pts_s=slot / 24, chunk_index=slot // 4, content_index=slot, repeated=False,
                          rgb=rgb, audio=audio, due_s=slot / 24, published_s=slot / 24, av_offset_s=0.0)


async def test_sink_hands_24fps_frames_of_the_right_size_to_video_source() -> None:
    video = rtc.VideoSource(CFG.width, CFG.height)
    audio = rtc.AudioSource(CFG.audio_sample_rate, 1, queue_size_ms=2000)
    stream = rtc.VideoStream(rtc.LocalVideoTrack.create_video_track("avatar_video", video))
    sink = LiveKitSink(video, audio, width=CFG.width, height=CFG.height, fps=24,
                       sample_rate=CFG.audio_sample_rate, loop=asyncio.get_running_loop())
    rgb = np.zeros((CFG.height, CFG.width, 3), np.uint8)

    def playout() -> None:  # the pipeline's playout thread: 24 slots = 1 s
        for slot in range(24):
            span = (slot * 16000 // 24, (slot + 1) * 16000 // 24)
            sink.write(_published(slot, rgb, np.zeros(span[1] - span[0], np.float32)))
        sink.close()

    await asyncio.to_thread(playout)
    ts = np.array(sink.captured.video_timestamps_us)
    steps = set(np.diff(ts).tolist())
    assert len(ts) == 24 and steps <= {41666, 41667}, f"expected 24 frames 1/24 s apart, got steps {steps}"
    assert ts[-1] - ts[0] == round(23 * 1e6 / 24)
    assert sink.captured.video_sizes == {(CFG.width, CFG.height)}
    assert sink.captured.video_types == {int(rtc.VideoBufferType.RGBA)}
    assert sink.captured.audio_samples == 16000, f"1 s of audio expected, got {sink.captured.audio_samples} samples"
    event = await asyncio.wait_for(stream.__anext__(), 5)  # the native SDK really took the frames
    assert (event.frame.width, event.frame.height) == (CFG.width, CFG.height)
    await stream.aclose()


def test_sink_rejects_wrong_frame_size() -> None:
    sink = LiveKitSink(rtc.VideoSource(CFG.width, CFG.height), None, width=CFG.width, height=CFG.height, fps=24,
                       sample_rate=16000)
    with pytest.raises(ValueError, match=r"expected \[128, 192, 3\]"):
        sink.write(_published(0, np.zeros((64, 64, 3), np.uint8), np.zeros(0, np.float32)))


# ------------------------------------------------------------------------------------------ audio in


@pytest.mark.parametrize(("rate", "channels"), [(16000, 1), (48000, 2), (24000, 1)])
async def test_the_agents_speech_reaches_rank0_on_the_chunk_grid(rate: int, channels: int) -> None:
    """Receiver frames → RoomVideo (decoder rank) → forwarded events → RoomFeed + AudioInput (rank 0)."""
    events: list[tuple] = []
    video = RoomVideo(CFG, events.append)
    for f in frames_of(tone(0.5, rate, channels), rate, channels):
        await video.push_audio(f)
    await video.push_audio(AudioSegmentEnd())
    feed = RoomFeed(AudioInput(CFG))
    for e in events:
        feed.apply(e)
    chunks, ends = [], []
    while feed.audio_in.pending_samples() or not chunks:
        chunks.append(feed.audio_in.next_chunk())
        ends.append(feed.ends_segment(chunks[-1]))
    sizes = [len(c.samples) for c in chunks]
    assert sizes == [CFG.chunk_sample_range(n)[1] - CFG.chunk_sample_range(n)[0] for n in range(len(sizes))], sizes
    speech = np.concatenate([c.samples for c in chunks])
    voiced = int(np.count_nonzero(np.abs(speech) > 1e-3))
    assert abs(voiced - 8000) <= 64, f"0.5 s of speech should give ~8000 voiced samples at 16 kHz, got {voiced}"
    if rate == 16000 and channels == 1:
        ref = tone(0.5, 16000).astype(np.float32) / 32768
        assert np.array_equal(speech[:8000], ref), "16 kHz mono speech must reach rank 0 unchanged"
    assert ends == [False] * (len(chunks) - 1) + [True], f"the segment's end belongs to its last chunk: {ends}"
    assert all(c.speech_samples > 0 for c in chunks), "every chunk taken carries speech"


async def test_delivered_chunks_publish_video_and_speech_audio() -> None:
    video = RoomVideo(CFG, lambda e: None)
    size = [CFG.chunk_sample_range(n)[1] - CFG.chunk_sample_range(n)[0] for n in range(3)]
    speech = (0.3 * np.sin(np.arange(2667) * 0.05)).astype(np.float32)
    video.deliver(0, flat(10), speech[:size[0]], size[0], False, video.clear_epoch)
    video.deliver(1, flat(20), np.zeros(size[1], np.float32), 0, False, video.clear_epoch)  # idle: video only
    video.deliver(2, flat(30), speech[:size[2]], 1000, True, video.clear_epoch)
    out = await drain(video)
    kinds = [type(o).__name__ for o in out]
    assert kinds == ["VideoFrame", "AudioFrame"] * 4 + ["VideoFrame"] * 4 + ["VideoFrame", "AudioFrame"] * 4 + \
        ["AudioSegmentEnd"], kinds
    videos = [o for o in out if isinstance(o, rtc.VideoFrame)]
    assert {(v.width, v.height, v.type) for v in videos} == {(CFG.width, CFG.height, rtc.VideoBufferType.RGBA)}
    audio = [o for o in out if isinstance(o, rtc.AudioFrame)]
    assert sum(a.samples_per_channel for a in audio[:4]) == size[0] and {a.sample_rate for a in audio} == {16000}
    with pytest.raises(ValueError, match=r"decoded frames: expected \[4, 128, 192, 3\]"):
        video.deliver(3, np.zeros((4, 8, 8, 3), np.uint8), speech, 0, False, 0)


async def test_the_models_decoded_frames_are_published() -> None:
    """vivant's tiny DiT + VAE decoder make the frames: two chunks of real generated video with speech."""
    from vivant.worker.model.generator import ChunkGenerator
    from vivant.worker.stream.vae import VAEConfig, build_vae_decoder

    gen, vae = ChunkGenerator(CFG), build_vae_decoder(VAEConfig.for_model(CFG))
    cache, video = vae.new_cache(), RoomVideo(CFG, lambda e: None)
    pcm = tone(0.34, 16000).astype(np.float32) / 32768
    start = 0
    for n in range(2):
        a, b = CFG.chunk_sample_range(n)
        samples = pcm[start:start + b - a]
        start += b - a
        frames = vae.decode_chunk(gen.generate_chunk(samples, 16000).latents, cache).numpy()
        video.deliver(n, frames, samples, len(samples), n == 1, video.clear_epoch)
    out = await drain(video)
    videos = [o for o in out if isinstance(o, rtc.VideoFrame)]
    assert [(v.width, v.height) for v in videos] == [(192, 128)] * 8
    pixels = np.frombuffer(videos[0].data, np.uint8).reshape(128, 192, 4)
    assert pixels[..., :3].std() > 0, "the model's frame should not be a flat image"
    assert sum(isinstance(o, rtc.AudioFrame) for o in out) == 8 and isinstance(out[-1], AudioSegmentEnd)


# ------------------------------------------------------------------------------------------ interrupt


async def test_clear_buffer_mutes_queued_and_in_flight_speech_and_rank0_drops_the_rest() -> None:
    events: list[tuple] = []
    video = RoomVideo(CFG, events.append)
    for f in frames_of(tone(2.0, 16000), 16000, 1):
        await video.push_audio(f)
    feed = RoomFeed(AudioInput(CFG))
    for e in events:
        feed.apply(e)
    events.clear()
    taken = [feed.audio_in.next_chunk() for _ in range(3)]  # chunks 0, 1 delivered; 2 is being decoded
    epoch_of_2 = feed.clears  # what rank 0 sends with each chunk: the clears it had applied when it took it
    for c in taken[:2]:
        video.deliver(c.index, flat(50), c.samples, c.speech_samples, False, feed.clears)
    assert video.queued_items() == 16, "two speech chunks: 4 video + 4 audio frames each"
    await video.clear_buffer()  # the agent interrupts
    assert events == [("clear",)], f"the interrupt must reach rank 0: {events}"
    feed.apply(events[0])
    video.deliver(2, flat(50), taken[2].samples, taken[2].speech_samples, False, epoch_of_2)
    after = feed.audio_in.next_chunk()
    video.deliver(3, flat(50), after.samples, after.speech_samples, False, feed.clears)
    out = await drain(video)
    assert [type(o) for o in out] == [rtc.VideoFrame] * 16, "after an interrupt only (silent) video may remain"
    assert video.stats.speech_samples_after_clear == 0, "speech was published after the interrupt"
    assert after.speech_samples == 0 and not np.any(after.samples), "the chunk after the interrupt is silence"
    assert feed.audio_in.cleared_samples > 32000 - 3 * 2667 - 100, "rank 0 must drop the rest of the speech"


async def test_clear_buffer_returns_once_the_runner_published_the_frame_it_holds() -> None:
    """`AvatarRunner` resets its playback position when `clear_buffer` returns; a speech frame it took before the
    interrupt and is still pushing must be done by then, or it would start a new playback (`lk.playback_started`
    with no speech from the agent)."""
    video = RoomVideo(CFG, lambda e: None)
    speech = (0.3 * np.sin(np.arange(2666) * 0.05)).astype(np.float32)
    video.deliver(0, flat(10), speech, len(speech), False, video.clear_epoch)
    frames = video.__aiter__()
    assert isinstance(await anext(frames), rtc.VideoFrame)
    assert isinstance(await anext(frames), rtc.AudioFrame)  # the runner holds this one, pushing it
    clear = asyncio.ensure_future(video.clear_buffer())
    await asyncio.sleep(0.05)
    assert not clear.done(), "clear_buffer returned while the runner still held a speech frame"
    assert isinstance(await anext(frames), rtc.VideoFrame), "the interrupt keeps the video"  # the runner is back
    await asyncio.wait_for(clear, 1.0)
    assert [type(o) for o in await drain(video)] == [rtc.VideoFrame] * 2, "the queued speech is dropped"


async def test_clear_buffer_through_avatar_runner_reports_interrupted() -> None:
    """AvatarRunner (livekit-agents) with QueueAudioOutput as receiver and vivant's RoomVideo.

    The room is a real `rtc.Room` that is not connected (no server): the runner's lazy track publication
    waits for a connection, so video forwarding stalls, but audio reading and the clear_buffer handler run.
    """
    audio_out = QueueAudioOutput(sample_rate=16000)
    events: list[tuple] = []
    video = RoomVideo(CFG, events.append)
    runner = AvatarRunner(rtc.Room(), audio_recv=audio_out, video_gen=video, options=AvatarOptions(
        video_width=CFG.width, video_height=CFG.height, video_fps=24.0, audio_sample_rate=16000, audio_channels=1))
    finished: list[Any] = []
    audio_out.on("playback_finished", finished.append)
    await runner.start()
    for f in frames_of(tone(1.0, 16000), 16000, 1):
        await audio_out.capture_frame(f)
    for _ in range(100):
        if any(e[0] == "speech" for e in events):
            break
        await asyncio.sleep(0.01)
    assert any(e[0] == "speech" for e in events), "the runner did not forward the agent's audio"
    audio_out.clear_buffer()  # what the lk.clear_buffer RPC triggers in DataStreamAudioReceiver
    for _ in range(100):
        if finished:
            break
        await asyncio.sleep(0.01)
    await runner.aclose()
    assert finished and finished[0].interrupted is True, f"expected playback_finished(interrupted=True), got {finished}"
    assert ("clear",) in events and video.stats.clears == 1


# ------------------------------------------------------------------------------------------ session end


async def test_end_call_message_through_room_events_ends_the_session() -> None:
    room = rtc.Room()
    end = EndWatch("agent-1")
    end.attach(room)
    room.emit("data_received", rtc.DataPacket(data=b'{"type": "HELLO"}', kind=1, participant=None))
    room.emit("data_received", rtc.DataPacket(data=b"\xff not json", kind=1, participant=None))
    assert end.reason is None, "other data messages must not end the session"
    room.emit("data_received", rtc.DataPacket(data=json.dumps({"type": "END_CALL"}).encode(), kind=1,
                                              participant=None))
    assert await end.wait(5) == EndReason.END_CALL


@pytest.mark.parametrize(("action", "expected"), [
    (lambda e: e.participant_left("agent-1"), EndReason.AGENT_LEFT),
    (lambda e: e.stop("Deleted"), EndReason.DELETED),
    (lambda e: None, EndReason.MAX_DURATION),
])
async def test_end_reasons(action: Any, expected: EndReason) -> None:
    end = EndWatch("agent-1")
    end.participant_left("someone-else")
    end.handle_data(b'{"type": "END_CALL"}', "someone-else")  # only the agent may end the call
    action(end)
    assert await end.wait(0.05) == expected
    end.stop(EndReason.END_CALL)
    assert end.reason == expected, "the first reason sticks"


async def test_the_first_end_reason_is_forwarded_once() -> None:
    seen: list[EndReason] = []
    end = EndWatch("agent-1", on_end=seen.append)
    end.participant_left("agent-1")
    end.stop(EndReason.DELETED)
    assert seen == [EndReason.AGENT_LEFT] and end.reason == EndReason.AGENT_LEFT


def test_room_feed_keeps_the_first_end_reason_and_refuses_unusable_audio() -> None:
    feed = RoomFeed(AudioInput(CFG))
    feed.apply(("end", "EndCall"))
    feed.apply(("end", "AgentLeft"))
    assert feed.end_reason == "EndCall"
    with pytest.raises(ValueError, match="sample_rate"):
        feed.apply(("speech", np.zeros(100, np.float32), 1000))


# ------------------------------------------------------------------------------------------ the room


class LocalTracksAvatarRunner(AvatarRunner):
    """The framework's AvatarRunner; only the track publication is local (publishing needs a connected
    room). A `rtc.VideoStream` on the local video track reads back what reached the native SDK."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.video_out: list[tuple[int, int]] = []
        self._stream: rtc.VideoStream | None = None
        self._reader: asyncio.Task[None] | None = None

    async def _publish_track(self) -> None:
        if self._stream is None:
            self._stream = rtc.VideoStream(rtc.LocalVideoTrack.create_video_track("avatar_video", self._video_source))
            rtc.LocalAudioTrack.create_audio_track("avatar_audio", self._audio_source)
            self._reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        assert self._stream is not None
        async for event in self._stream:
            self.video_out.append((event.frame.width, event.frame.height))

    async def aclose(self) -> None:
        await super().aclose()
        if self._reader is not None:
            self._reader.cancel()
            await self._stream.aclose()  # type: ignore[union-attr]


class OfflineRoom(RoomSession):
    """The real `RoomSession` with its server-facing parts replaced (module docstring)."""

    def __init__(self, events: list[tuple], **kw: Any) -> None:
        super().__init__(CFG, AvatarJoin(url="wss://lk.example", token="secret-tok", agent_identity="agent-1"),
                         events.append, connect_timeout_s=5, **kw)
        self.connected: list[tuple[str, str]] = []

    async def _connect(self, room: rtc.Room) -> None:
        self.connected.append((self.join.url, self.join.token))

    def _audio_receiver(self, room: rtc.Room) -> Any:
        return QueueAudioOutput(sample_rate=CFG.audio_sample_rate)

    def _avatar_runner(self, room: rtc.Room, receiver: Any, video: RoomVideo) -> AvatarRunner:
        return LocalTracksAvatarRunner(room, audio_recv=receiver, video_gen=video, options=self.avatar_options())

    def emit(self, event: str, *args: Any) -> None:
        """A room event as the SDK delivers it: on the room's event loop."""
        self.loop.call_soon_threadsafe(self.room.emit, event, *args)


def wait_until(cond: Any, timeout: float = 10.0) -> Any:
    import time

    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if value := cond():
            return value
        time.sleep(0.02)
    raise AssertionError("timed out")


def test_room_session_publishes_decoded_chunks_and_forwards_end_call() -> None:
    events: list[tuple] = []
    room = OfflineRoom(events).start()
    try:
        assert room.connected == [("wss://lk.example", "secret-tok")] and events == [("joined",)], events
        for n in range(6):
            room.wait_lead()
            room.deliver(n, flat(40 + n), np.zeros(2666, np.float32), 0, False, room.clear_epoch)
        wait_until(lambda: len(room.runner.video_out) >= 8)
        assert set(room.runner.video_out) == {(CFG.width, CFG.height)}, set(room.runner.video_out)
        room.emit("data_received", rtc.DataPacket(data=b'{"type": "HELLO"}', kind=1, participant=None))
        room.emit("data_received", rtc.DataPacket(data=json.dumps({"type": "END_CALL"}).encode(), kind=1,
                                                  participant=None))
        wait_until(lambda: ("end", "EndCall") in events)
        assert [e for e in events if e[0] == "end"] == [("end", "EndCall")], events
    finally:
        room.close("Deleted")
    assert room.end.reason == EndReason.END_CALL, "the room's own reason came first and sticks"


def test_room_session_records_the_operators_deletion_on_close() -> None:
    events: list[tuple] = []
    room = OfflineRoom(events).start()
    room.close("Deleted")
    assert room.end.reason == EndReason.DELETED and ("end", "Deleted") in events


def test_video_never_consumed_fails_the_wait_with_the_reason() -> None:
    """Joined but the tracks never publish (the framework's own AvatarRunner on a room that never connects, so its
    lazy publication waits forever): waiting for room to publish gives up after `stall_timeout_s`."""

    class NeverPublishes(OfflineRoom):
        def _avatar_runner(self, room: rtc.Room, receiver: Any, video: RoomVideo) -> AvatarRunner:
            return RoomSession._avatar_runner(self, room, receiver, video)

    room = NeverPublishes([], stall_timeout_s=1.0).start()
    try:
        with pytest.raises(RuntimeError, match="published video stalled"):
            for n in range(20):
                room.wait_lead()
                room.deliver(n, flat(1), np.zeros(2666, np.float32), 0, False, room.clear_epoch)
    finally:
        room.close()


def test_a_join_without_the_assignments_fields_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="lacks token, agent_identity"):
        AvatarJoin.from_payload({"livekit_url": "wss://x"})
