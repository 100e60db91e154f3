"""bench/fp8_sensitivity.py on a few chunks of the held-out speech: every variant is reported against the float32
reference, the float model on a float ring reproduces it, FP8 rounding moves it, and the weight-rounding table
says what the shipped checkpoint is: FP8-native (worker/train/fp8_native.py), so its per-channel rounding is 0 while
a finer 1×32 grid would round it again by a few per cent."""

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
    # the FP8-native weights are what the float32 weights are: keeping them in float32 changes nothing
    assert rows["FP8 parts, all weights float32"]["max"] <= served, rows
    for role, e in r["weight_rounding_rel_rms"].items():
        assert e["per_channel"] == 0 and 0.005 < e["per_32_block"] < 0.05, (role, e)
