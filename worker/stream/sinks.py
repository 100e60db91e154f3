"""Where paced frames go: one `FrameSink` protocol, an MP4 file sink (demo) and a null sink.

Why one protocol: the pipeline hands every `PublishedFrame` (RGB + that slot's PCM + timestamps) to
its sinks the same way, whether the sink is a file, a LiveKit video/audio track (the LiveKit sink
lives with the LiveKit I/O code behind this same protocol) or nothing at all.

Two timelines, chosen per sink:
* `live`: every slot the pacer released, stall repeats included, at pts = slot / fps, with the slot's
  audio (silence during a stall). This is what a viewer of the live stream saw.
* `content`: only generated frames (stall repeats left out), back to back at pts = n / fps for the n-th
  frame written, each with its own audio. On a machine slower than real time the live clock stalls,
  but the content file still has every frame at an exact 1/fps step, lip-synced: it is the video the
  model made (less any speech chunks an interruption discarded, which the pacer reports).

`Mp4Sink` writes H.264 (libx264, yuv420p) and AAC (mono, the pipeline's sample rate) with PyAV.
Video pts are in 1/fps units and audio pts in samples, so the muxer keeps them exactly aligned.
"""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path
from typing import Literal, Protocol, runtime_checkable

import numpy as np
from vivant.worker.stream.pacer import PublishedFrame

Timeline = Literal["live", "content"]


@runtime_checkable
class FrameSink(Protocol):
    """Receives frames in slot order from the playout loop (one thread); `close` flushes."""

    def write(self, frame: PublishedFrame) -> None: ...

    def close(self) -> None: ...


class NullSink:
    """Counts what it is given and keeps nothing (benchmarks, tests of the loop)."""

    def __init__(self) -> None:
        self.frames = 0
        self.repeated = 0
        self.audio_samples = 0
        self.closed = False

    def write(self, frame: PublishedFrame) -> None:
        self.frames += 1
        self.repeated += int(frame.repeated)
        self.audio_samples += len(frame.audio)

    def close(self) -> None:
        self.closed = True


class Mp4Sink:
    """H.264 + AAC MP4 file. `timeline` picks live slots or generated frames (see module doc)."""

    def __init__(self, path: str | Path, width: int, height: int, fps: int = 24, sample_rate: int = 16_000,
                 timeline: Timeline = "content", crf: int = 23, preset: str = "veryfast") -> None:
        import av

        if timeline not in ("live", "content"):
            raise ValueError(f"Mp4Sink timeline: expected 'live' or 'content', got {timeline!r}")
        if width % 2 or height % 2:
            raise ValueError(f"Mp4Sink size: expected even width and height for yuv420p, got {width}x{height}")
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.timeline = timeline
        self.fps = fps
        self.sample_rate = sample_rate
        self.width, self.height = width, height
        self._container = av.open(str(self.path), mode="w")
        v = self._container.add_stream("libx264", rate=fps)
        v.width, v.height, v.pix_fmt = width, height, "yuv420p"
        v.codec_context.time_base = Fraction(1, fps)
        v.options = {"crf": str(crf), "preset": preset}
        a = self._container.add_stream("aac", rate=sample_rate)
        a.layout = "mono"
        self._v, self._a = v, a
        self._audio_pts = 0
        self.frames_written = 0
        self._closed = False

    def write(self, frame: PublishedFrame) -> None:
        import av

        if self.timeline == "content" and frame.repeated:
            return
        rgb = np.ascontiguousarray(frame.rgb)
        if rgb.shape != (self.height, self.width, 3) or rgb.dtype != np.uint8:
            raise ValueError(f"Mp4Sink frame: expected uint8 [{self.height}, {self.width}, 3], "
                             f"got {rgb.dtype} {list(rgb.shape)}")
        vf = av.VideoFrame.from_ndarray(rgb, format="rgb24")
        vf.pts = self.frames_written if self.timeline == "content" else frame.slot
        vf.time_base = Fraction(1, self.fps)
        for packet in self._v.encode(vf):
            self._container.mux(packet)
        if len(frame.audio):
            af = av.AudioFrame.from_ndarray(
                np.ascontiguousarray(frame.audio, dtype=np.float32).reshape(1, -1), format="flt", layout="mono")
            af.sample_rate = self.sample_rate
            af.pts = self._audio_pts
            af.time_base = Fraction(1, self.sample_rate)
            self._audio_pts += len(frame.audio)
            for packet in self._a.encode(af):
                self._container.mux(packet)
        self.frames_written += 1

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for stream in (self._v, self._a):
            for packet in stream.encode(None):
                self._container.mux(packet)
        self._container.close()
