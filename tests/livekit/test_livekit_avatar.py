"""The worker's LiveKit side with real SDK objects and no server.

What runs for real here: `rtc.VideoSource`/`rtc.AudioSource`, local tracks and an `rtc.VideoStream` on
them (frames come back out of the native SDK), `rtc.AudioFrame`s in, livekit-agents' `AvatarRunner`,
`QueueAudioOutput` (the framework's in-process AudioOutput + AudioReceiver), `rtc.Room` event dispatch,
vivant's tiny model as the renderer in one test.

What is NOT exercised, because no LiveKit server can run in this project's CI (no binary in any
reachable registry): `rtc.Room.connect`, `DataStreamAudioReceiver` (it waits for the agent participant
to join and reads `lk.audio_stream` byte streams off a connected room), the `lk.clear_buffer` RPC
arriving over the wire, and the `lk.playback_*` RPCs leaving. The receiver's output type
(`rtc.AudioFrame` | `AudioSegmentEnd`, 100 ms frames at the sender's rate) is fed here directly, and
the interrupt path is driven through `AvatarRunner` with `QueueAudioOutput`, which emits the same
`clear_buffer` event and receives the same `notify_playback_finished(interrupted=...)` call.

Most tests use `RecordingRenderer`, a renderer that paints each chunk a flat colour and records the audio
it was given (the model's pixels are not what these tests are about); one test uses the real model.
"""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Any

import numpy as np
import pytest
from livekit import rtc
from livekit.agents.voice.avatar import AudioSegmentEnd, AvatarOptions, AvatarRunner, QueueAudioOutput
from vivant.worker.model.config import ModelConfig
from vivant.worker.serving.livekit_avatar import EndReason, EndWatch, ModelRenderer, VivantVideoGenerator
from vivant.worker.stream.livekit_sink import LiveKitSink
from vivant.worker.stream.pacer import PublishedFrame

CFG = ModelConfig.from_name("tiny")  # 192x128, 24 fps, 4 frames per chunk, 16 kHz
pytestmark = pytest.mark.timeout(120)


class RecordingRenderer:
    def __init__(self, grid: Any) -> None:
        self.grid = grid
        self.inputs: list[np.ndarray] = []
        self.started = threading.Event()
        self.release = threading.Event()
        self.release.set()

    def render(self, samples: np.ndarray, sample_rate: int) -> np.ndarray:
        assert sample_rate == self.grid.audio_sample_rate
        self.inputs.append(samples.copy())
        self.started.set()
        self.release.wait(10)
        level = int(min(255, 1000 * float(np.abs(samples).mean())))
        return np.full((self.grid.frames_per_chunk, self.grid.height, self.grid.width, 3), level, np.uint8)


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


async def take(gen: VivantVideoGenerator, until: Any, limit: int = 400) -> list[Any]:
    out: list[Any] = []
    it = gen.__aiter__()
    while len(out) < limit:
        item = await it.__anext__()
        out.append(item)
        if until(out):
            break
    return out


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
async def test_receiver_frames_become_chunk_aligned_audio(rate: int, channels: int) -> None:
    renderer = RecordingRenderer(CFG)
    gen = VivantVideoGenerator(renderer, CFG, idle=False)
    for f in frames_of(tone(0.5, rate, channels), rate, channels):
        await gen.push_audio(f)
    await gen.push_audio(AudioSegmentEnd())
    out = await take(gen, lambda o: isinstance(o[-1], AudioSegmentEnd))

    sizes = [len(x) for x in renderer.inputs]
    expected = [CFG.chunk_sample_range(n)[1] - CFG.chunk_sample_range(n)[0] for n in range(len(sizes))]
    assert sizes == expected, f"chunk sizes {sizes} are not the 16 kHz chunk grid {expected}"
    speech = np.concatenate(renderer.inputs)
    voiced = int(np.count_nonzero(np.abs(speech) > 1e-3))
    assert abs(voiced - 8000) <= 64, f"0.5 s of speech should give ~8000 voiced samples at 16 kHz, got {voiced}"
    if rate == 16000 and channels == 1:
        ref = tone(0.5, 16000).astype(np.float32) / 32768
        assert np.array_equal(speech[:8000], ref), "16 kHz mono speech must reach the renderer unchanged"
    videos = [o for o in out if isinstance(o, rtc.VideoFrame)]
    audios = [o for o in out if isinstance(o, rtc.AudioFrame)]
    assert len(videos) == 4 * len(sizes) and all((v.width, v.height) == (192, 128) for v in videos)
    assert sum(a.samples_per_channel for a in audios) == sum(sizes), "published audio must cover the speech chunks"
    assert {a.sample_rate for a in audios} == {16000} and isinstance(out[-1], AudioSegmentEnd)


async def test_model_renderer_plugs_in_as_the_video_generator() -> None:
    """vivant's tiny DiT + VAE decoder as the renderer: two chunks of real generated frames."""
    from vivant.worker.model.generator import ChunkGenerator
    from vivant.worker.stream.vae import VAEConfig, build_vae_decoder

    gen = VivantVideoGenerator(ModelRenderer(ChunkGenerator(CFG), build_vae_decoder(VAEConfig.for_model(CFG))), CFG)
    for f in frames_of(tone(0.3, 16000), 16000, 1):
        await gen.push_audio(f)
    out = await take(gen, lambda o: sum(isinstance(x, rtc.AudioFrame) for x in o) == 8)
    videos = [o for o in out if isinstance(o, rtc.VideoFrame)]
    assert [(v.width, v.height, v.type) for v in videos] == [(192, 128, rtc.VideoBufferType.RGBA)] * 8
    pixels = np.frombuffer(videos[0].data, np.uint8).reshape(128, 192, 4)
    assert pixels[..., :3].std() > 0, "the model's frame should not be a flat image"
    assert sum(isinstance(o, rtc.AudioFrame) for o in out) == 8, "each speech frame carries its 1/24 s of audio"


async def test_idle_chunks_are_rendered_without_audio() -> None:
    gen = VivantVideoGenerator(RecordingRenderer(CFG), CFG, idle=True)
    out = await take(gen, lambda o: len(o) == 8)
    assert all(isinstance(o, rtc.VideoFrame) for o in out), "no speech: video only, the character listens"


# ------------------------------------------------------------------------------------------ interrupt


async def test_clear_buffer_cuts_speech_within_one_chunk() -> None:
    renderer = RecordingRenderer(CFG)
    gen = VivantVideoGenerator(renderer, CFG, idle=True)
    for f in frames_of(tone(2.0, 16000), 16000, 1):
        await gen.push_audio(f)
    it = gen.__aiter__()
    for _ in range(2 * 8):  # two speech chunks out (4 video + 4 audio frames each)
        await it.__anext__()
    renderer.release.clear()
    pending = asyncio.ensure_future(it.__anext__())  # chunk 2 starts rendering ...
    await asyncio.to_thread(renderer.started.wait, 5)
    gen.clear_buffer()  # ... and the interrupt lands mid-render
    renderer.release.set()
    rest = [await pending]
    while len(rest) < 4 * 4:
        rest.append(await it.__anext__())
    assert gen.stats.speech_samples_after_clear == 0, "speech was published after the interrupt"
    assert not any(isinstance(o, rtc.AudioFrame) for o in rest), "the chunk rendering at the interrupt must be muted"
    later = renderer.inputs[3:]
    assert later and all(not np.any(x) for x in later), "chunks after the interrupt must be rendered from silence"
    assert gen.audio_in.cleared_samples > 16000 - 3 * 2667, "the rest of the speech must have been dropped"


async def test_clear_buffer_through_avatar_runner_reports_interrupted() -> None:
    """AvatarRunner (livekit-agents) with QueueAudioOutput as receiver and vivant's generator.

    The room is a real `rtc.Room` that is not connected (no server): the runner's lazy track publication
    waits for a connection, so video forwarding stalls, but audio reading and the clear_buffer handler run.
    """
    audio_out = QueueAudioOutput(sample_rate=16000)
    gen = VivantVideoGenerator(RecordingRenderer(CFG), CFG, idle=False)
    runner = AvatarRunner(rtc.Room(), audio_recv=audio_out, video_gen=gen, options=AvatarOptions(
        video_width=CFG.width, video_height=CFG.height, video_fps=24.0, audio_sample_rate=16000, audio_channels=1))
    finished: list[Any] = []
    audio_out.on("playback_finished", finished.append)
    await runner.start()
    for f in frames_of(tone(1.0, 16000), 16000, 1):
        await audio_out.capture_frame(f)
    for _ in range(100):
        if gen.audio_in.pending_samples() > 0:
            break
        await asyncio.sleep(0.01)
    assert gen.audio_in.pending_samples() > 0, "the runner did not forward the agent's audio to the generator"
    audio_out.clear_buffer()  # what the lk.clear_buffer RPC triggers in DataStreamAudioReceiver
    for _ in range(100):
        if finished:
            break
        await asyncio.sleep(0.01)
    await runner.aclose()
    assert finished and finished[0].interrupted is True, f"expected playback_finished(interrupted=True), got {finished}"
    assert gen.audio_in.pending_samples() == 0 and gen.stats.clears == 1


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


async def test_externally_driven_generator_mutes_queued_speech_on_clear() -> None:
    """The worker service's driver: chunks rendered on another thread, delivered to the loop, then read by
    the runner. An interrupt drops the speech already delivered but not yet published, keeps the video."""
    renderer = RecordingRenderer(CFG)
    gen = VivantVideoGenerator(renderer, CFG, external=True)
    for f in frames_of(tone(1.0, 16000), 16000, 1):
        await gen.push_audio(f)
    for _ in range(2):
        epoch = gen.clear_epoch
        chunk, frames = await asyncio.to_thread(gen.render_next)
        gen.deliver(chunk, frames, epoch)
    assert gen.queued_items() == 16, "two chunks: 4 video + 4 audio frames each"
    gen.clear_buffer()
    epoch = gen.clear_epoch
    chunk, frames = await asyncio.to_thread(gen.render_next)
    gen.deliver(chunk, frames, epoch)
    gen.close()
    items = [item async for item in gen]
    assert [type(i) for i in items] == [rtc.VideoFrame] * 12, f"expected 12 silent video frames, got {items}"
    assert not np.any(renderer.inputs[2]), "the chunk after the interrupt is rendered from silence"
