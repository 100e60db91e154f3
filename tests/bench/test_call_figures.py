"""The call benchmark's figures (bench/call_recorder.py, bench/livekit_call.py) on recordings built by hand:
per-minute rates and freezes, turn-latency percentiles, which targets a call holds, a round's summary, the
worker memory's drift, and the options' errors."""

from __future__ import annotations

import numpy as np
import pytest
from vivant.bench.call_recorder import CallMeasurement, Recording, main, per_minute
from vivant.bench.livekit_call import TARGETS, holds, memory_per_minute, parse_calls, summary


def arrivals(seconds: float, fps: float = 24.0, gaps_at: tuple[float, ...] = (), gap_s: float = 0.2) -> np.ndarray:
    """Frame arrival times at `fps`, with a stall of `gap_s` inserted at each time in `gaps_at`."""
    t, out = 1000.0, []
    while t < 1000.0 + seconds:
        out.append(t)
        t += 1 / fps
        if any(abs((t - 1000.0) - g) < 0.5 / fps for g in gaps_at):
            t += gap_s
    return np.asarray(out)


def test_per_minute_counts_each_minutes_frames_and_freezes():
    vt = arrivals(150.0, gaps_at=(70.0,))
    minutes = per_minute(vt)
    assert [m["minute"] for m in minutes] == [0, 1, 2]
    assert minutes[0]["freezes"] == 0 and minutes[0]["received_fps"] == pytest.approx(24.0, abs=0.05)
    assert minutes[1]["freezes"] == 1 and minutes[1]["longest_gap_ms"] > 200
    assert minutes[1]["received_fps"] < 24.0
    assert minutes[2]["seconds"] == pytest.approx(30.0, abs=0.5)
    assert per_minute(vt[:1]) == []


def frames_with_mouth(n: int, open_at: set[int]) -> list[np.ndarray]:
    """96×96 frames of a light face whose mouth box (vivant.worker.quality.lipsync) is dark when open."""
    from vivant.worker.train.dataset import mouth_box

    y0, y1, x0, x1 = mouth_box(96, 96)
    out = []
    for i in range(n):
        img = np.full((96, 96, 3), 200, np.uint8)
        if i in open_at:
            img[y0:y1, x0:x1] = 10
        out.append(img)
    return out


def test_turn_latency_percentiles_and_a_turn_whose_mouth_never_moved():
    n = 24 * 20
    vt = list(1000.0 + np.arange(n) / 24)
    sent = [1002.0, 1008.0, 1014.0]
    # the mouth opens 0.25 s after the first two turns, never after the third
    open_at = {i for i in range(n) for s in sent[:2] if s + 0.25 <= vt[i] < s + 2.0}
    rec = Recording(video_t=vt, video=frames_with_mouth(n, open_at),
                    turns=[{"audio_sent_at": s} for s in sent])
    m = CallMeasurement.from_recording(rec)
    assert m.turn_latency_s[2] is None and m.turns_without_motion == 1
    assert m.turn_latency_p50_s == pytest.approx(0.25, abs=1 / 24)
    assert m.turn_latency_p99_s == pytest.approx(0.25, abs=1 / 24)


def measurement(**over) -> dict:
    base = {"received_fps": 24.0, "turns_sent": 2, "freezes": 0, "av_offset_ms": 20.0, "av_offset_r": 0.8, "turn_latency_p50_s": 0.3,
            "turn_latency_p99_s": 0.45, "turns_without_motion": 0, "longest_gap_ms": 60.0,
            "turn_latency_s": [0.3, 0.45], "minutes": [{"received_fps": 24.0, "seconds": 60.0}]}
    return base | over


@pytest.mark.parametrize(("over", "failing"), [
    ({}, None),
    ({"minutes": [{"received_fps": 24.0, "seconds": 60.0}, {"received_fps": 23.0, "seconds": 60.0}]}, "minute_fps"),
    ({"freezes": 1}, "freezes"),
    ({"av_offset_ms": -60.0}, "av_offset"),
    ({"av_offset_ms": None}, "av_offset"),
    ({"turn_latency_p50_s": 0.36}, "turn_latency_p50"),
    ({"turn_latency_p99_s": 0.51}, "turn_latency_p99"),
    ({"turns_without_motion": 1}, "turn_latency_p99"),
])
def test_holds_names_the_target_a_call_misses(over, failing):
    result = holds(measurement(**over))
    assert result["all"] is (failing is None)
    assert [k for k, v in result.items() if k != "all" and not v] == ([failing] if failing else [])
    assert TARGETS["minute_fps_min"] == 23.5


def test_a_rounds_summary_is_its_worst_call_and_all_its_turns():
    calls = [{"measurement": measurement(), "holds": {"all": True}},
             {"measurement": measurement(received_fps=22.0, freezes=3, av_offset_ms=-10.0,
                                         turn_latency_s=[0.2, None], turns_without_motion=1),
              "holds": {"all": False}}]
    s = summary(calls)
    assert s["calls"] == 2 and s["calls_holding"] == 1
    assert s["received_fps_min"] == 22.0 and s["freezes_total"] == 3
    assert s["turns_measured"] == 3 and s["turns_sent"] == 4 and s["turns_without_motion"] == 1
    assert s["av_offset_ms_range"] == [-10.0, 20.0]


def test_memory_drift_is_measured_from_minute_two():
    samples = [{"t_s": t, "worker_rss_mb": {"w": 1000.0 + (50.0 if t >= 240 else 0.0)}, "worker_gpu_mb": {"w": 500.0},
                "gpu_util_pct": 10.0, "cpu_pct": 50.0} for t in range(0, 360, 5)]
    mem = memory_per_minute(samples, ["w"])
    assert [r["minute"] for r in mem["per_minute"]] == [0, 1, 2, 3, 4, 5]
    assert mem["drift_from_minute_2"]["worker_rss_mb"]["w"] == pytest.approx(0.05)
    assert mem["drift_from_minute_2"]["worker_gpu_mb"]["w"] == 0.0


@pytest.mark.parametrize("text", ["", "0", "4,x", "65"])
def test_calls_option_errors_name_the_option(text):
    with pytest.raises(ValueError, match="calls: expected comma-separated counts"):
        parse_calls(text)
    assert parse_calls("4,8,16") == [4, 8, 16]


def test_the_recorder_refuses_to_start_without_its_token(monkeypatch, tmp_path, capsys):
    monkeypatch.delenv("VIVANT_USER_TOKEN", raising=False)
    assert main(["--url", "ws://127.0.0.1:1", "--avatar-identity", "a", "--max-seconds", "5",
                 "--out", str(tmp_path / "x.json")]) == 2
    assert "VIVANT_USER_TOKEN" in capsys.readouterr().err
