"""How the character's tracks go into the room: the video track is published with its frame rate named.

Why: the rtc SDK picks the video encoding itself when `TrackPublishOptions` leave it out, and for small frames
(the `ref` character's 96×96, 256×256) that encoding runs at 15 fps, so a 24 fps character reaches the user at
15 fps whatever the generator does (docs/livekit.md, "Publishing at the frame rate"). Naming the frame rate and a
bitrate in `video_encoding`, with one layer (no simulcast: a single 1:1 conversation has one subscriber, and a
lower layer would only halve the rate again), keeps every frame.

`PublishingAvatarRunner` is livekit-agents' `AvatarRunner` (the avatar protocol: audio segments in,
`lk.clear_buffer`, `lk.playback_*` out, the AVSynchronizer) with only its track publication changed: the
framework publishes with the defaults and has no option for it, so its `_publish_track` is replaced here (the
pinned livekit-agents release, requirements/).
"""

from __future__ import annotations

from livekit import rtc
from livekit.agents.voice.avatar import AvatarRunner

MIN_VIDEO_BITRATE = 300_000  # bit/s: a floor for tiny frames, where the per-pixel rule below gives too little
BITS_PER_PIXEL = 0.15  # bit per pixel per frame: the encoder's target at the character's frame rate


def video_bitrate(width: int, height: int, fps: float) -> int:
    """The video track's maximum bitrate in bit/s for frames of `width` × `height` pixels at `fps`."""
    if width <= 0 or height <= 0 or fps <= 0:
        raise ValueError(f"video size and rate: expected positive values, got {width}x{height} at {fps} fps")
    return max(MIN_VIDEO_BITRATE, int(width * height * fps * BITS_PER_PIXEL))


def video_publish_options(width: int, height: int, fps: float) -> rtc.TrackPublishOptions:
    """Options for the character's video track: camera source, one layer, the frame rate and a bitrate named."""
    return rtc.TrackPublishOptions(
        source=rtc.TrackSource.SOURCE_CAMERA, simulcast=False,
        video_encoding=rtc.VideoEncoding(max_framerate=float(fps), max_bitrate=video_bitrate(width, height, fps)))


def audio_publish_options() -> rtc.TrackPublishOptions:
    """Options for the character's speech track (the agent's voice, published on its behalf)."""
    return rtc.TrackPublishOptions(source=rtc.TrackSource.SOURCE_MICROPHONE)


class PublishingAvatarRunner(AvatarRunner):
    """`AvatarRunner` whose video track carries `video_publish_options` (module docstring). Like the framework's
    own publication it publishes the speech first and the video once the speech has a subscriber."""

    async def _publish_track(self) -> None:
        async with self._lock:
            await self._room_connected_fut
            participant = self._room.local_participant
            audio = rtc.LocalAudioTrack.create_audio_track("avatar_audio", self._audio_source)
            self._audio_publication = await participant.publish_track(audio, audio_publish_options())
            await self._audio_publication.wait_for_subscription()
            options = self._options
            video = rtc.LocalVideoTrack.create_video_track("avatar_video", self._video_source)
            self._video_publication = await participant.publish_track(
                video, video_publish_options(options.video_width, options.video_height, options.video_fps))
