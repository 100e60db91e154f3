"""A/V sync in the MP4 sink: decode the file back with PyAV and compare stream timestamps.

A marker (a white frame, and an audio burst starting at that frame's first sample) is placed in the
generated content; after encoding (H.264 + AAC) and decoding, the marker's video time and audio time
must agree within one frame, on the content timeline and on the live timeline with stalls.
"""

from __future__ import annotations

import av
import numpy as np
import pytest
from vivant.worker.stream.pacer import DecodedChunk, FakeClock, Pacer, PacerConfig
from vivant.worker.stream.sinks import FrameSink, Mp4Sink, NullSink

W, H = 64, 48
MARK = 30  # generated frame index of the marker (chunk 7, frame 2)
CHUNKS = 12


def marked_chunk(cfg: PacerConfig, n: int) -> DecodedChunk:
    frames = np.full((cfg.frames_per_chunk, H, W, 3), 40, np.uint8)
    start, stop = cfg.chunk_sample_range(n)
    audio = np.full(stop - start, 0.01, np.float32)  # quiet "speech", so an interrupt can discard it
    for j in range(cfg.frames_per_chunk):
        if n * cfg.frames_per_chunk + j == MARK:
            frames[j] = 250
            a = cfg.frame_sample(MARK) - start
            audio[a:a + 400] = 0.8
    return DecodedChunk(n, frames, audio)


def stream_into(sink: FrameSink, late_chunk: int | None = None, late_s: float = 0.0, interrupt_at: int | None = None):
    """Push CHUNKS chunks through a pacer on a fake clock; `late_chunk` arrives `late_s` after it was due;
    an interruption before chunk `interrupt_at` discards the unplayed chunks up to and including it."""
    cfg = PacerConfig()
    clock = FakeClock()
    pacer = Pacer(cfg, clock)
    pacer.push(marked_chunk(cfg, 0))
    pacer.push(marked_chunk(cfg, 1))
    published = []
    for n in range(2, CHUNKS):
        while pacer.space() == 0 or (n == late_chunk and clock.now() < pacer.stats().t0 + n / 6 + late_s):
            published += pacer.poll(clock.now())
            clock.advance(1 / 96)
        if n == interrupt_at:
            pacer.discard_speech_before(n + 1)
        pacer.push(marked_chunk(cfg, n))
    pacer.close_input()
    while not pacer.drained:
        published += pacer.poll(clock.now())
        clock.advance(1 / 96)
    for f in published:
        sink.write(f)
    sink.close()
    return pacer.stats(), published


def marker_times(path) -> tuple[float, float, list[float], dict]:
    with av.open(str(path)) as c:
        vs, aus = c.streams.video[0], c.streams.audio[0]
        info = {"video": vs.codec_context.name, "audio": aus.codec_context.name, "rate": aus.rate,
                "fps": vs.average_rate}
        video_times, v_mark = [], None
        for frame in c.decode(vs):
            t = float(frame.pts * frame.time_base)
            video_times.append(t)
            if v_mark is None and frame.to_ndarray(format="rgb24").mean() > 150:
                v_mark = t
    with av.open(str(path)) as c:
        a_mark = None
        for frame in c.decode(audio=0):
            x = frame.to_ndarray().reshape(-1)
            hit = np.flatnonzero(np.abs(x) > 0.3)
            if a_mark is None and hit.size:
                a_mark = float(frame.pts * frame.time_base) + hit[0] / frame.sample_rate
    assert v_mark is not None and a_mark is not None, "marker not found in the decoded file"
    return v_mark, a_mark, video_times, info


def test_content_mp4_has_every_frame_at_exact_steps_and_av_within_one_frame(tmp_path):
    path = tmp_path / "content.mp4"
    stats, published = stream_into(Mp4Sink(path, W, H, timeline="content"), late_chunk=5, late_s=0.2)
    assert stats.stall_count == 1, "the scenario must stall the live clock once"
    v, a, times, info = marker_times(path)
    assert info["video"] == "h264" and info["audio"] == "aac" and info["rate"] == 16000 and info["fps"] == 24
    assert len(times) == CHUNKS * 4, f"content file has {len(times)} frames, expected every generated frame"
    assert times == [pytest.approx(k / 24, abs=1e-6) for k in range(CHUNKS * 4)], "video pts not at k/24 s"
    assert v == pytest.approx(MARK / 24, abs=1e-6)
    assert abs(a - v) < 1 / 24, f"A/V offset {(a - v) * 1e3:.2f} ms, must be under one frame (41.7 ms)"


def test_content_mp4_after_an_interrupt_stays_in_sync(tmp_path):
    path = tmp_path / "interrupted.mp4"
    stats, _ = stream_into(Mp4Sink(path, W, H, timeline="content"), interrupt_at=4)
    assert stats.discarded_frames > 0 and MARK // 4 not in stats.discards[0].chunks
    v, a, times, _ = marker_times(path)
    assert len(times) == CHUNKS * 4 - stats.discarded_frames
    assert times == [pytest.approx(k / 24, abs=1e-6) for k in range(len(times))], "video pts not back to back"
    assert abs(a - v) < 1 / 24, f"A/V offset after discarded chunks {(a - v) * 1e3:.2f} ms, must be under one frame"


def test_live_mp4_with_stall_repeats_stays_in_sync(tmp_path):
    path = tmp_path / "live.mp4"
    stats, published = stream_into(Mp4Sink(path, W, H, timeline="live"), late_chunk=5, late_s=0.2)
    repeats = stats.repeated_frames
    assert stats.stall_count == 1 and repeats > 0
    v, a, times, _ = marker_times(path)
    assert len(times) == CHUNKS * 4 + repeats, "the live file holds every slot, repeats included"
    mark_slot = next(f.slot for f in published if f.content_index == MARK and not f.repeated)
    assert mark_slot == MARK + repeats, "the stall comes before the marker and shifts it by the repeats"
    assert v == pytest.approx(mark_slot / 24, abs=1e-6)
    assert abs(a - v) < 1 / 24, f"A/V offset after a stall {(a - v) * 1e3:.2f} ms, must be under one frame"
    assert stats.max_abs_av_offset_s < 1 / 24


def test_sinks_follow_the_protocol_and_reject_bad_frames(tmp_path):
    assert isinstance(NullSink(), FrameSink) and issubclass(Mp4Sink, FrameSink)
    null = NullSink()
    stats, _ = stream_into(null)
    assert null.frames == stats.frames_published and null.closed
    with pytest.raises(ValueError, match="timeline: expected 'live' or 'content', got 'both'"):
        Mp4Sink(tmp_path / "x.mp4", W, H, timeline="both")
    with pytest.raises(ValueError, match="expected even width and height"):
        Mp4Sink(tmp_path / "y.mp4", 63, 48)
    sink = Mp4Sink(tmp_path / "z.mp4", W, H)
    cfg = PacerConfig()
    pacer = Pacer(cfg, FakeClock())
    pacer.push(marked_chunk(cfg, 0))
    pacer.close_input()
    frame = pacer.poll(0.0)[0]
    frame.rgb = np.zeros((H, W + 2, 3), np.uint8)
    with pytest.raises(ValueError, match=r"expected uint8 \[48, 64, 3\], got uint8 \[48, 66, 3\]"):
        sink.write(frame)
    sink.close()
