"""The GPU step's profile arithmetic (bench/step_gpu.py) on CPU: the kernel categories docs/BENCHMARKS.md reports
(GEMMs, attention, fused row kernels, other) are those of the committed H200 profile, and the device's idle gaps are
summed and split at 20 µs as the page reads them. The profile itself needs CUDA (bench/run_gpu.sh)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from vivant.bench.step_gpu import categorize, device_gaps

STEP = Path(__file__).resolve().parents[2] / "bench" / "results" / "step_57b_tp4_rank0_h200.json"


def test_the_committed_profiles_kernels_fall_in_the_categories_it_reports():
    """Each category's top kernels, re-categorized by name, fit in the category total the run recorded (the top 25
    are a subset of all kernels), and the served engine's GEMM, attention and row kernels land where the page says."""
    profile = json.loads(STEP.read_text())["optimized_profile"]
    totals = profile["ms_per_chunk_by_category"]
    by_category: dict[str, float] = {}
    for name, kernel in profile["top_kernels_ms_per_chunk"].items():
        by_category[categorize(name)] = by_category.get(categorize(name), 0.0) + kernel["ms"]
    for category, ms in by_category.items():
        assert ms <= totals[category] + 1e-6, f"{category}: top kernels {ms:.3f} ms > the recorded {totals[category]:.3f}"
    assert by_category["gemms"] == pytest.approx(totals["gemms"], rel=0.01), (by_category, totals)
    assert categorize("nvjet_sm90_qqtst_96x128_128x7_2x1_v_ssched_bz_ovscale_TNN") == "gemms"
    assert categorize("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7") == "attention"
    assert categorize("_qkv_ring_kernel") == categorize("_ln_mod_quant_kernel") == "fused_kernels"
    assert categorize("Memset (Unknown)") == "other"


def test_device_gaps_are_summed_per_chunk_and_split_at_20_us():
    # µs: a, then b 2 µs after a ends, c overlapping b, d 30 µs after c ends; two chunks profiled
    spans = [(0.0, 10.0, "a"), (12.0, 20.0, "b"), (15.0, 25.0, "c"), (55.0, 60.0, "d")]
    gaps = device_gaps(spans, chunks=2)
    assert gaps["ms_per_chunk"] == pytest.approx(0.016)  # (2 + 30) µs over 2 chunks
    assert gaps["under_20us_ms_per_chunk"] == pytest.approx(0.001)
    assert gaps["under_20us_count_per_chunk"] == 0.5
    assert gaps["over_20us_ms_per_chunk"] == pytest.approx(0.015)
    assert gaps["largest"] == [{"us": 30.0, "after": "c", "before": "d"}]
