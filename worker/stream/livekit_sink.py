"""`LiveKitSink`: a `FrameSink` that hands paced frames to LiveKit's `rtc.VideoSource` and `rtc.AudioSource`.

Why: `StreamPipeline` already paces frames at exact 1/fps steps (its `Pacer`); publishing them into a
room is then only a format change. Each `PublishedFrame` becomes
* an `rtc.VideoFrame` of type RGBA (uint8 [H, W, 4], alpha 255; the SDK converts to I420 for the
  encoder), captured with `timestamp_us = slot * 1e6 / fps` on the live timeline, and
* an `rtc.AudioFrame` of that slot's PCM as int16 mono at the pipeline's rate (16 kHz: 666 or 667
  samples per 1/24 s slot), silence included, so audio and video stay on one clock.

`write` runs on the pipeline's playout thread; `VideoSource.capture_frame` is synchronous, while
`AudioSource.capture_frame` is a coroutine, so it is scheduled on the event loop that owns the room
(`asyncio.run_coroutine_threadsafe`) and the futures are awaited in `close`. `captured` records what
was handed to the SDK (timestamps, sizes, samples) so the publication rate is observable.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from dataclasses import dataclass, field

import numpy as np
from livekit import rtc
from vivant.worker.stream.pacer import PublishedFrame


@dataclass
class CaptureLog:
    """What the sink handed to the SDK: one entry per video frame, samples of audio in total."""

    video_timestamps_us: list[int] = field(default_factory=list)
    video_sizes: set[tuple[int, int]] = field(default_factory=set)
    video_types: set[int] = field(default_factory=set)
    audio_samples: int = 0


def rgb_to_video_frame(rgb: np.ndarray) -> rtc.VideoFrame:
    """uint8 [H, W, 3] -> an RGBA `rtc.VideoFrame` (alpha 255)."""
    if rgb.ndim != 3 or rgb.shape[2] != 3 or rgb.dtype != np.uint8:
        raise ValueError(f"frame rgb: expected uint8 [H, W, 3], got {rgb.dtype} {list(rgb.shape)}")
    h, w, _ = rgb.shape
    rgba = np.empty((h, w, 4), np.uint8)
    rgba[..., :3] = rgb
    rgba[..., 3] = 255
    return rtc.VideoFrame(w, h, rtc.VideoBufferType.RGBA, rgba.tobytes())


def pcm_to_audio_frame(pcm: np.ndarray, sample_rate: int) -> rtc.AudioFrame:
    """float32 mono in [-1, 1] -> an int16 mono `rtc.AudioFrame`."""
    x = np.asarray(pcm, np.float32).reshape(-1)
    s16 = (np.clip(x, -1.0, 1.0) * 32767.0).round().astype(np.int16)
    return rtc.AudioFrame(s16.tobytes(), sample_rate, 1, len(s16))


class LiveKitSink:
    """FrameSink -> `rtc.VideoSource` / `rtc.AudioSource` (the tracks built on them are published by the caller)."""

    def __init__(self, video: rtc.VideoSource, audio: rtc.AudioSource | None, *, width: int, height: int,
                 fps: int, sample_rate: int, loop: asyncio.AbstractEventLoop | None = None) -> None:
        if fps <= 0 or sample_rate <= 0:
            raise ValueError(f"LiveKitSink: expected fps > 0 and sample_rate > 0, got {fps}, {sample_rate}")
        if audio is not None and loop is None:
            raise ValueError("LiveKitSink: an audio source needs the event loop that owns the room (loop=)")
        self.video, self.audio, self.loop = video, audio, loop
        self.width, self.height, self.fps, self.sample_rate = width, height, fps, sample_rate
        self.captured = CaptureLog()
        self._pending: list[concurrent.futures.Future[None]] = []
        self.closed = False

    def write(self, frame: PublishedFrame) -> None:
        if self.closed:
            raise RuntimeError("LiveKitSink.write after close")
        if frame.rgb.shape[:2] != (self.height, self.width):
            raise ValueError(f"LiveKitSink frame: expected [{self.height}, {self.width}, 3], got {list(frame.rgb.shape)}")
        vf = rgb_to_video_frame(np.ascontiguousarray(frame.rgb))
        ts = round(frame.slot * 1_000_000 / self.fps)
        self.video.capture_frame(vf, timestamp_us=ts)
        self.captured.video_timestamps_us.append(ts)
        self.captured.video_sizes.add((vf.width, vf.height))
        self.captured.video_types.add(int(vf.type))
        if self.audio is not None and len(frame.audio):
            af = pcm_to_audio_frame(frame.audio, self.sample_rate)
            assert self.loop is not None
            self._pending.append(asyncio.run_coroutine_threadsafe(self.audio.capture_frame(af), self.loop))
            for fut in [f for f in self._pending if f.done()]:
                fut.result()  # surface a failed capture here, on the playout thread
            self._pending = [f for f in self._pending if not f.done()]
            self.captured.audio_samples += af.samples_per_channel

    def close(self) -> None:
        """Wait for queued audio captures (from a thread other than the loop's)."""
        if self.closed:
            return
        self.closed = True
        for fut in self._pending:
            fut.result(timeout=10)
        self._pending.clear()
