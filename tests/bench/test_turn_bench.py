"""`vivant bench turn` end to end on CPU (tiny preset, 3 turns: one interrupted, one after it): it runs the real
loop and writes the JSON the doc table is built from. A smoke test of the fields and their consistency; the
figures themselves depend on this machine's load, so they are checked for sense, not for a value."""

from __future__ import annotations

import json

import pytest
from vivant.cli import main

pytestmark = pytest.mark.slow


def test_bench_turn_tiny_writes_every_field(tmp_path, capsys):
    out = tmp_path / "turn.json"
    assert main(["bench", "turn", "--preset", "tiny", "--turns", "3", "--step-ms", "20", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    doc = json.loads(out.read_text())
    assert doc["preset"] == "tiny" and doc["device"] == "cpu" and doc["turns"] == 3 and doc["rewind"] is True
    assert doc["step_padded"] is True and doc["step_ms"] == 20 and "padded to 20.0 ms" in doc["step_note"]
    assert doc["chunk_stages_ms"]["diffuse"]["p50"] >= 20, "each diffusion is padded to at least --step-ms"
    assert doc["command"].startswith("vivant bench turn --preset tiny --turns 3")
    assert {"platform", "cores", "torch"} <= set(doc["machine"]) and doc["date"].startswith("20")
    assert "synthetic voiced" in doc["speech"]
    assert len(doc["script"]) == 3 and [t["interrupted"] for t in doc["script"]] == [False, True, False]
    stages = doc["stages_ms"]
    assert list(stages) == ["rewound", "diffused", "decoded", "published"]
    assert doc["turns_rewound"] == doc["rewinds"] == 3 and stages["rewound"]["n"] == 3
    assert len(doc["rewind_points"]) == 3 and all(0 <= k < 4 for _, k in doc["rewind_points"])
    assert len(doc["interrupt_points"]) == 1 and 0 <= doc["interrupt_points"][0][1] < 4, "the interrupt is spliced"
    assert stages["published"]["n"] == doc["turns_published"] >= 2
    assert stages["rewound"]["p50"] <= stages["diffused"]["p50"] <= stages["decoded"]["p50"] <= stages["published"]["p50"]
    assert doc["share_ms"] == stages["published"]
    assert doc["interrupted_turn"]["turn"] == 1 and doc["turn_after_interrupt"]["turn"] == 2
    assert doc["turn_after_interrupt"]["rewound_to"] is not None
    assert doc["stalls"] == sum(doc["stall_causes"].values())
    assert 1 <= doc["lead_chunks"] <= 5 and doc["lead_changes"][0] == [0, 3]
    assert doc["max_abs_av_offset_after_rewind_ms"] is not None and doc["max_abs_av_offset_after_rewind_ms"] < 1000 / 24
    assert doc["delivered_fps"] > 0 and doc["chunks_generated"] >= doc["chunks"]
    cuts = len(doc["rewind_points"]) + len(doc["interrupt_points"])
    assert 0 <= doc["discarded_frames"] <= (doc["chunks_generated"] - doc["chunks"]) * 4 + 3 * cuts, \
        "frames never shown: at most the old versions of the chunks made again, and a remake's frames < k per cut"
    assert "decoded frames never shown" in printed
    assert "share of a turn p50" in printed and "turn after interrupt: turn 2 rewound" in printed
    assert "rewinds 3, " in printed and "inside a chunk (frame k > 0)" in printed


@pytest.mark.parametrize("argv, match", [
    (["--turns", "2"], "--turns = 2; expected ≥ 3"),
    (["--step-ms", "0"], "--step-ms = 0.0; expected > 0 ms"),
])
def test_bench_turn_rejects_bad_options(argv, match):
    with pytest.raises(SystemExit, match=match):
        main(["bench", "turn", "--preset", "tiny", *argv])
