"""The `vivant` entry point: `bench step` prints its JSON contract; `demo` writes a playable MP4 of the
requested length at 24 fps."""

from __future__ import annotations

import json
import subprocess
import sys

import av


def vivant(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "vivant", *args], capture_output=True, text=True, timeout=300)


def test_bench_step_tiny_json_contract():
    res = vivant("bench", "step", "--preset", "tiny", "--chunks", "6", "--warmup", "1", "--json")
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    for key in ("preset", "tp", "rank", "torch", "baseline_ms", "optimized_ms", "baseline_p99_ms",
                "optimized_p99_ms", "speedup", "max_rel_rms"):
        assert key in doc, f"bench step JSON lacks {key!r}: {sorted(doc)}"
    assert doc["preset"] == "tiny" and len(doc["optimized_per_chunk_ms"]) == 6
    assert doc["baseline_ms"] > 0 and doc["optimized_ms"] > 0
    assert doc["max_rel_rms"] < 0.02


def test_unknown_command_and_preset_errors():
    res = vivant("nope")
    assert res.returncode == 2 and "unknown command 'nope'" in res.stderr
    res = vivant("bench", "step", "--preset", "huge")
    assert res.returncode != 0 and "unknown preset 'huge'" in res.stderr


def test_bench_step_attn_kv_splits_named_when_bad():
    for bad in ("0", "two"):
        res = vivant("bench", "step", "--preset", "tiny", "--attn-kv-splits", bad)
        assert res.returncode == 2 and "--attn-kv-splits must be an int >= 1 or 'auto'" in res.stderr, res.stderr


def test_demo_writes_requested_seconds_at_24fps(tmp_path):
    out = tmp_path / "demo.mp4"
    res = vivant("demo", "--seconds", "1", "--out", str(out))
    assert res.returncode == 0, res.stderr + res.stdout
    with av.open(str(out)) as c:
        v = c.streams.video[0]
        frames = sum(1 for _ in c.decode(v))
        assert v.average_rate == 24, f"video rate {v.average_rate}"
    assert frames == 24, f"1 s at 24 fps should be 24 frames, got {frames}"
