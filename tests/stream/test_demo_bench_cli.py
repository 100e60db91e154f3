"""`vivant demo` (full loop on espeak-ng speech → MP4 with muxed audio + report) and `vivant bench decode`."""

from __future__ import annotations

import json
import shutil

import av
import numpy as np
import pytest
from vivant.cli import main

pytestmark = pytest.mark.slow


@pytest.mark.skipif(shutil.which("espeak-ng") is None, reason="espeak-ng missing (make sysdeps installs it)")
def test_demo_writes_mp4_with_speech_and_prints_the_report(tmp_path, capsys):
    out, report_json = tmp_path / "demo.mp4", tmp_path / "report.json"
    rc = main(["demo", "--seconds", "2", "--out", str(out), "--json", str(report_json), "--preset", "tiny",
               "--text", "Hello there, how are you?"])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    for needle in ("fps delivered", "stalls", "buffer depth", "p50 ms", "real-time factor", "turn 0: first sample in"):
        assert needle in printed, f"report lacks {needle!r}:\n{printed}"
    report = json.loads(report_json.read_text())
    assert report["chunks"] == 12 and report["generated_frames_published"] == 48
    with av.open(str(out)) as c:
        assert c.streams.video[0].codec_context.name == "h264" and c.streams.audio[0].codec_context.name == "aac"
        frames = [f for f in c.decode(video=0)]
        assert len(frames) == 48 and (frames[0].width, frames[0].height) == (192, 128)
    with av.open(str(out)) as c:
        audio = np.concatenate([f.to_ndarray().reshape(-1) for f in c.decode(audio=0)])
    assert np.abs(audio).max() > 0.05, "the espeak-ng speech must be muxed into the MP4"


def test_demo_rejects_bad_seconds(tmp_path):
    with pytest.raises(SystemExit, match="--seconds = 0.0; expected > 0"):
        main(["demo", "--seconds", "0", "--out", str(tmp_path / "x.mp4")])


def test_bench_decode_prints_json_with_decode_and_two_stage_timings(capsys):
    rc = main(["bench", "decode", "--preset", "tiny", "--chunks", "3", "--warmup", "1", "--json"])
    assert rc == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["out_hw"] == [128, 192] and doc["frames_per_chunk"] == 4
    assert len(doc["decode_ms"]["per_chunk"]) == 3 and doc["decode_ms"]["median"] > 0
    two = doc["two_stage"]
    assert len(two["intervals_ms"]) == 3 and two["serial_ms_per_chunk"] > 0 and two["pipelined_ms_per_chunk"] > 0
    for ds, de, ks, ke in two["intervals_ms"]:
        assert ds <= de <= ks <= ke, "a chunk is decoded after it is diffused"


def test_demo_without_espeak_ng_fails_with_a_clear_error(tmp_path, monkeypatch):
    import vivant.worker.stream.demo as demo

    monkeypatch.setattr(demo.shutil, "which", lambda name: None)
    with pytest.raises(SystemExit, match="espeak-ng not found; install it .* or pass --wav FILE"):
        main(["demo", "--seconds", "1", "--out", str(tmp_path / "x.mp4")])
