"""bench/fp8_sensitivity.py on a few chunks of the held-out speech: every variant is reported against the float32
reference, the float model on a float ring reproduces it, FP8 rounding moves it, and the weight-rounding table
says what the shipped checkpoint is: FP8-native (worker/train/fp8_native.py), so its per-channel rounding is 0 while
a finer 1×32 grid would round it again by a few per cent."""

from __future__ import annotations

import json

import pytest
from vivant.bench.fp8_sensitivity import ROLES, main


def test_sensitivity_report_on_three_chunks(tmp_path):
    out = tmp_path / "sens.json"
    with pytest.raises(SystemExit, match="--only .*no variant's name contains it"):
        main(["--seconds", "0.5", "--only", "no such variant", "--out", str(out)])
    assert main(["--seconds", "0.5", "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    rows = {v["variant"]: v for v in r["variants"]}
    activations = ["FP8 parts, FP8 ring, o activations unquantized (o_gemm = bf16)",
                   "FP8 parts, FP8 ring, down activations unquantized",
                   "FP8 parts, FP8 ring, qkv+gate_up activations unquantized"]  # the CPU twins' ring is FP8
    assert r["chunks"] == 3 and len(rows) == 3 + len(ROLES) + 1 + len(activations), sorted(rows)
    for name in activations:  # one GEMM's activations unrounded moves the result (the rest stays FP8)
        assert 0 < rows[name]["max"] and rows[name]["median"] != rows["FP8 parts (as served)"]["median"], rows[name]
    assert rows["float parts, float ring"]["max"] < 1e-4, rows["float parts, float ring"]
    served = rows["FP8 parts (as served)"]["max"]
    assert served > 10 * max(rows["float parts, float ring"]["max"], 1e-6), "FP8 rounding moved nothing"
    # the FP8-native weights are what the float32 weights are: keeping them in float32 removes no rounding; what
    # differs is the projections' output (float32 here, the twin's bf16), so the two stay of one size
    assert rows["FP8 parts, all weights float32"]["max"] <= 2 * served, rows
    for role, e in r["weight_rounding_rel_rms"].items():
        assert e["per_channel"] == 0 and 0.005 < e["per_32_block"] < 0.05, (role, e)
