"""bench/quality_compare.py: a candidate checkpoint's `vivant eval quality` report against the shipped one's. Checked
on the committed H200 report of the shipped checkpoint and edited copies of it: equal reports pass; a float32
lip-sync drop beyond the gate's 1 % fails (exit 1, named in the output), one within it passes; the served-engine goals
of issue #19 are read off each report; a missing file or a report without the needed fields is named (exit 2)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
from vivant.bench.quality_compare import compare, main

SHIPPED = Path(__file__).resolve().parents[2] / "bench" / "results" / "quality_ref_cuda_h200_2026-12-02_fp8-native.json"


@pytest.fixture()
def shipped() -> dict:
    return json.loads(SHIPPED.read_text())


def _write(path: Path, report: dict) -> str:
    path.write_text(json.dumps(report))
    return str(path)


def test_equal_reports_pass_and_the_served_goals_are_read(tmp_path, shipped, capsys):
    out = tmp_path / "cmp.json"
    assert main([str(SHIPPED), str(SHIPPED), "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    ls = r["float32_ground_truth"]["lip_sync"]
    assert ls["relative_drop"] == 0 and ls["ok"] and ls["shipped"] == shipped["lip_sync_reference"]
    goals = r["served_vs_float32"]["shipped"]
    # the shipped checkpoint's served engine misses the latent goal (19.6 % > 10 %) and grows over the quarters
    assert goals["latent_rel_rms_max"] == shipped["latent_rel_rms_max"] and not goals["latent_max_ok"]
    assert goals["psnr_ok"] and goals["lip_sync_ok"] and not goals["no_quarter_growth"]
    assert "lip-sync r 0.8456 -> 0.8456" in capsys.readouterr().out


@pytest.mark.parametrize(("drop", "rc"), [(0.005, 0), (0.02, 1)])
def test_a_float32_lip_sync_drop_beyond_the_gate_fails(tmp_path, shipped, capsys, drop, rc):
    cand = copy.deepcopy(shipped)
    cand["lip_sync_reference"] = shipped["lip_sync_reference"] * (1 - drop)
    cand["psnr_vs_procedural_db"]["reference"] = shipped["psnr_vs_procedural_db"]["reference"] + 0.5
    assert main([str(SHIPPED), _write(tmp_path / "c.json", cand)]) == rc
    printed = capsys.readouterr().out
    assert ("WORSE" in printed) == (rc == 1), printed
    r = compare(shipped, cand)
    assert r["float32_ground_truth"]["lip_sync"]["relative_drop"] == pytest.approx(drop, abs=1e-5)
    assert r["float32_ground_truth"]["psnr_vs_procedural_db"]["change"] == pytest.approx(0.5)


def test_bad_inputs_are_named(tmp_path, shipped, capsys):
    assert main([str(SHIPPED), str(tmp_path / "nope.json")]) == 2
    assert "candidate" in (err := capsys.readouterr().err) and "nope.json" in err and "no such file" in err
    (tmp_path / "bad.json").write_text("{not json")
    assert main([str(tmp_path / "bad.json"), str(SHIPPED)]) == 2
    assert "shipped" in (err := capsys.readouterr().err) and "not JSON" in err
    cand = {k: v for k, v in shipped.items() if k != "lip_sync_reference"}
    assert main([str(SHIPPED), _write(tmp_path / "c.json", cand)]) == 2
    assert "candidate: no 'lip_sync_reference'" in capsys.readouterr().err
