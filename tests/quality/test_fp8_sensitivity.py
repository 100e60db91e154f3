"""bench/fp8_sensitivity.py on a few chunks of the held-out speech: every variant is reported against the float32
reference, the float model on a float ring reproduces it, FP8 rounding moves it, and the weight-rounding table
holds e4m3's precision (a few per cent per element, whatever the scale granularity)."""

from __future__ import annotations

import json

from vivant.bench.fp8_sensitivity import ROLES, main


def test_sensitivity_report_on_three_chunks(tmp_path):
    out = tmp_path / "sens.json"
    assert main(["--seconds", "0.5", "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    rows = {v["variant"]: v for v in r["variants"]}
    assert r["chunks"] == 3 and len(rows) == 3 + len(ROLES) + 1, sorted(rows)
    assert rows["float parts, float ring"]["max"] < 1e-4, rows["float parts, float ring"]
    served = rows["FP8 parts (as served)"]["max"]
    assert served > 10 * max(rows["float parts, float ring"]["max"], 1e-6), "FP8 rounding moved nothing"
    assert rows["FP8 parts, all weights float32"]["max"] < served, rows
    for role, e in r["weight_rounding_rel_rms"].items():
        assert 0.005 < e["per_32_block"] <= e["per_channel"] < 0.05, (role, e)
