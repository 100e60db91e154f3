"""The call's figures at the receiver (bench/call_recorder.py) on recordings whose answers are known: frames at
set arrival times with the reference character's mouth box dark (open) on set frames, audio loud on set spans."""

from __future__ import annotations

import numpy as np
import pytest
from vivant.bench.call_recorder import CallMeasurement, Recording, write_mp4
from vivant.worker.train.dataset import mouth_box

FPS = 24
T0 = 1_000_000.0


def face(open_mouth: bool, size: int = 96) -> np.ndarray:
    img = np.full((size, size, 3), 200, np.uint8)
    if open_mouth:
        y0, y1, x0, x1 = mouth_box(size, size)
        img[y0:y1, x0:x1] = 10
    return img


def recording(open_frames: set[int], arrivals: np.ndarray, sent: list[float], loud: list[tuple[float, float]],
              audio_lag_s: float = 0.0) -> Recording:
    rec = Recording(audio_rate=16000)
    for i, t in enumerate(arrivals):
        rec.video_t.append(float(t))
        rec.video.append(face(i in open_frames))
    for k in range(int((arrivals[-1] - T0) / 0.01)):  # 10 ms audio frames
        t = T0 + k * 0.01
        on = any(a <= t - audio_lag_s < b for a, b in loud)
        rec.audio_t.append(t)
        rec.audio.append(np.full(160, 8000 if on else 0, np.int16))
    rec.turns = [{"type": "turn", "turn": i, "audio_sent_at": t} for i, t in enumerate(sent)]
    return rec


def test_fps_freezes_turn_latency_and_av_offset_are_what_was_recorded():
    n = 240
    arrivals = T0 + np.arange(n) / FPS
    arrivals[120:] += 0.5  # one 0.5417 s gap between frames 119 and 120: one freeze
    # speech on frames 48..95 and 168..215 (by arrival), turns sent 0.25 s before each starts
    open_frames = set(range(48, 96)) | set(range(168, 216))
    loud = [(arrivals[48], arrivals[96]), (arrivals[168], arrivals[216])]
    rec = recording(open_frames, arrivals, [arrivals[48] - 0.25, arrivals[168] - 0.25], loud)
    m = CallMeasurement.from_recording(rec)
    assert m.frames_received == n
    assert m.freezes == 1 and m.longest_gap_ms == pytest.approx((1 / FPS + 0.5) * 1000, abs=0.2)
    assert m.received_fps == pytest.approx((n - 1) / (arrivals[-1] - arrivals[0]), abs=1e-3)
    assert m.mouth_baseline == 0.0 and m.turns_sent == 2
    assert m.turn_latency_s == [pytest.approx(0.25, abs=1e-3), pytest.approx(0.25, abs=1e-3)]
    assert m.av_offset_ms == pytest.approx(0.0, abs=20) and m.av_offset_r > 0.9


def test_a_mouth_that_follows_the_sound_late_gives_a_positive_offset_and_a_turn_without_movement_none():
    n = 240
    arrivals = T0 + np.arange(n) / FPS
    open_frames = set(range(60, 110))  # the mouth opens 12 frames (0.5 s) after the sound starts
    loud = [(arrivals[48], arrivals[98])]
    rec = recording(open_frames, arrivals, [arrivals[48], arrivals[200]], loud)
    m = CallMeasurement.from_recording(rec)
    assert m.av_offset_ms == pytest.approx(500, abs=20), m
    assert m.turn_latency_s == [pytest.approx(0.5, abs=1e-3), None]


def test_the_received_call_is_written_as_an_mp4(tmp_path):
    import av

    arrivals = T0 + np.arange(48) / FPS
    rec = recording(set(range(10, 20)), arrivals, [], [(arrivals[10], arrivals[20])])
    path = write_mp4(rec, tmp_path / "call.mp4")
    with av.open(str(path)) as c:
        frames = sum(1 for _ in c.decode(video=0))
        assert c.streams.audio[0].sample_rate == 16000
    assert frames == 48
    assert write_mp4(Recording(), tmp_path / "none.mp4") is None
