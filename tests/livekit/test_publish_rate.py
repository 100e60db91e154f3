"""The character's video reaches a subscriber at its frame rate: a real livekit-server on loopback, the worker's
own track publication (`PublishingAvatarRunner._publish_track`, the options of vivant.worker.serving.publishing)
at the `ref` character's frame size, frames captured at 24 fps on an absolute schedule for 5 s, the rate
measured at the subscribing participant after the first second (the encoder's start-up)."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
from livekit import api, rtc
from livekit.agents.voice.avatar import AvatarOptions
from vivant.devcluster.livekit import LiveKitState
from vivant.worker.model.config import ModelConfig
from vivant.worker.serving.publishing import PublishingAvatarRunner, video_bitrate, video_publish_options

pytestmark = pytest.mark.timeout(120)

FPS = 24
SECONDS = 5.0
SETTLE_S = 1.0


def token(state: LiveKitState, room: str, identity: str) -> str:
    grants = api.VideoGrants(room_join=True, room=room, can_subscribe=True, can_publish=True)
    return api.AccessToken(state.api_key, state.api_secret).with_identity(identity).with_grants(grants).to_jwt()


def moving_frames(width: int, height: int, n: int = 24) -> list[rtc.VideoFrame]:
    """A bar sweeping across the frame, so every frame differs from the one before (an encoder may drop repeats)."""
    frames = []
    for i in range(n):
        rgba = np.full((height, width, 4), 40, np.uint8)
        x = i * width // n
        rgba[:, x: x + max(width // 8, 1), :3] = 220
        rgba[..., 3] = 255
        frames.append(rtc.VideoFrame(width, height, rtc.VideoBufferType.RGBA, rgba.tobytes()))
    return frames


async def test_the_published_character_track_arrives_at_the_frame_rate(livekit_server: LiveKitState) -> None:
    cfg = ModelConfig.from_name("ref")
    width, height = cfg.width, cfg.height
    room_name = "publish-rate"
    avatar, user = rtc.Room(), rtc.Room()
    arrivals: list[float] = []
    sizes: set[tuple[int, int]] = set()

    @user.on("track_subscribed")
    def _on_track(track: rtc.Track, *_: object) -> None:
        if track.kind != rtc.TrackKind.KIND_VIDEO:
            return

        async def read() -> None:
            async for event in rtc.VideoStream(track):
                arrivals.append(time.monotonic())
                sizes.add((event.frame.width, event.frame.height))
        asyncio.ensure_future(read())

    await user.connect(livekit_server.url, token(livekit_server, room_name, "user"))
    await avatar.connect(livekit_server.url, token(livekit_server, room_name, "avatar"))
    runner = PublishingAvatarRunner(avatar, audio_recv=None, video_gen=None, options=AvatarOptions(
        video_width=width, video_height=height, video_fps=float(FPS), audio_sample_rate=16000, audio_channels=1))
    runner._room_connected_fut.set_result(None)
    try:
        await asyncio.wait_for(runner._publish_track(), 20)  # the user subscribes to the speech, then the video
        frames = moving_frames(width, height)
        t0 = time.monotonic()
        for i in range(int(SECONDS * FPS)):
            runner._video_source.capture_frame(frames[i % len(frames)])
            await asyncio.sleep(max(0.0, t0 + (i + 1) / FPS - time.monotonic()))
        await asyncio.sleep(0.3)  # the last frames in flight
    finally:
        await avatar.disconnect()
        await user.disconnect()
    assert sizes == {(width, height)}, sizes
    measured = [t for t in arrivals if t >= t0 + SETTLE_S]
    assert len(measured) > 10, f"{len(arrivals)} frames arrived, {len(measured)} after the first second"
    fps = (len(measured) - 1) / (measured[-1] - measured[0])
    assert fps >= 23.0, (f"received {fps:.2f} fps at {width}x{height} ({len(measured)} frames after the first "
                         f"{SETTLE_S:.0f} s); published at {FPS}")


def test_the_video_options_name_the_frame_rate_one_layer_and_a_bitrate() -> None:
    opts = video_publish_options(96, 96, 24)
    assert opts.video_encoding.max_framerate == 24.0
    assert opts.simulcast is False
    assert opts.video_encoding.max_bitrate == video_bitrate(96, 96, 24) >= 300_000
    assert opts.source == rtc.TrackSource.SOURCE_CAMERA
    assert video_bitrate(1088, 704, 24) > video_bitrate(256, 256, 24) > 0
    with pytest.raises(ValueError, match="expected positive"):
        video_bitrate(0, 96, 24)
