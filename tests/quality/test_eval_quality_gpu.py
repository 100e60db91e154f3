"""`vivant eval quality --device cuda` on the shipped `ref` weights (GPU machine only, marked ``gpu``): the engine a
worker serves with (FP8 GEMMs, the bf16 ring, CUDA graphs) against the float32 path over 20 s of held-out speech.
The gate itself (lip-sync drop ≤ 1 %, no drift) must pass, and the served engine on the FP8-native checkpoint must
stay near its measured quality (docs/BENCHMARKS.md: 41.6 dB over 60 s; bounds here leave room for the shorter
clip, not for a regression to the 30 dB of the FP8 ring on the trained weights)."""

from __future__ import annotations

import contextlib
import io
import json

import pytest
import torch
from vivant.cli import main
from vivant.worker.model.ref_model import default_weights_dir

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_served_engine_on_ref_passes_the_gate_near_its_measured_quality():
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = main(["eval", "quality", "--device", "cuda", "--json", "--seconds", "20",
                   "--wav", str(default_weights_dir() / "data" / "held_out.wav")])
    r = json.loads(buf.getvalue())
    assert r["device"] == "cuda" and r["chunks"] == 120, r
    assert rc == 0 and r["gate"]["passed"], f"the quality gate failed on the served engine: {r['gate']}"
    assert r["psnr_reference_vs_optimized_db"] >= 36.0, \
        f"served engine vs float32: {r['psnr_reference_vs_optimized_db']} dB (measured 41.6 dB over 60 s)"
    assert r["lip_sync_relative_drop"] <= 0.01, r["lip_sync_relative_drop"]
