"""`vivant eval quality` on a short held-out clip (10 s of weights/ref/data/held_out.wav) on CPU with the
shipped `ref` weights: the same audio through the reference path (baseline cache, FP8 off) and the
optimized one (ring FP8, delta rotation); the JSON contract, position resets inside the clip, the
issue's lip-sync bar for the shipped weights, and the gate's decisions."""

from __future__ import annotations

import contextlib
import io
import json
import math

import numpy as np
import pytest
import torch
from vivant.cli import main
from vivant.worker.model.ref_model import default_weights_dir
from vivant.worker.quality import eval_cli
from vivant.worker.quality.eval_cli import judge

HELD_OUT_WAV = default_weights_dir() / "data" / "held_out.wav"


@pytest.fixture(scope="module")
def minute():
    """`vivant eval quality --json --seconds 60` (its exit code and JSON report), and what it generated."""
    made = []
    real = eval_cli.generate
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(eval_cli, "generate", lambda *a, **kw: made.append(real(*a, **kw)) or made[-1])
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            rc = main(["eval", "quality", "--json", "--seconds", "60", "--wav", str(HELD_OUT_WAV)])
    assert len(made) == 1
    return rc, json.loads(buf.getvalue()), made[0]


@pytest.fixture(scope="module")
def report(minute):
    """The report over the first 10 s (60 chunks) of that minute: the session `--seconds 10` generates, since
    generation is causal and both paths restart from the seed (test_the_first_chunks_are_the_session_of_their_audio);
    the report itself (ground truth, lip-sync, quarters, gate) is computed over those 10 s alone."""
    _, _, generated = minute
    return eval_cli.score(generated, chunks=60)


def test_the_first_chunks_are_the_session_of_their_audio(minute):
    """What lets the 10 s report come from the minute: 1 s generated alone equals the minute's first 6 chunks."""
    _, _, g = minute
    alone = eval_cli.generate(None, 1.0, 0, wav=str(HELD_OUT_WAV))
    n, f = alone.chunks, len(alone.vid_ref)
    assert n == 6 and alone.resets == g.resets[:n]
    assert np.array_equal(alone.audio, g.audio[: len(alone.audio)])
    for name in ("lat_ref", "lat_opt"):
        assert torch.equal(getattr(alone, name), getattr(g, name)[:n]), f"{name} of 1 s alone differs from the minute's"
    for name in ("vid_ref", "vid_opt"):
        assert np.array_equal(getattr(alone, name), getattr(g, name)[:f]), f"{name} of 1 s alone differs"
    assert eval_cli.score(alone) == eval_cli.score(g, chunks=n)


def test_cli_exit_code_is_the_gate(minute):
    """`vivant eval quality` exits 0 when the gate passed, 1 when it failed."""
    rc, r, _ = minute
    assert r["chunks"] == 360
    assert rc == (0 if r["gate"]["passed"] else 1), f"exit code {rc} disagrees with the gate {r['gate']}"


def test_json_reports_both_paths_and_the_comparison(report):
    r = report
    assert r["chunks"] == 60 and r["position_resets"] >= 2, "10 s of ref = 60 chunks, resets every 10 (t_limit 16)"
    for k in ("lip_sync_reference", "lip_sync_optimized", "lip_sync_ground_truth", "psnr_reference_vs_optimized_db",
              "latent_rel_rms_last_quarter"):
        assert isinstance(r[k], float) and math.isfinite(r[k]), f"{k} = {r[k]!r}"
    assert len(r["latent_rel_rms_per_chunk"]) == 60
    assert r["lip_sync_ground_truth"] >= 0.8, "the proxy on the procedural ground truth of the same audio"
    assert max(r["latent_rel_rms_per_chunk"]) > 0, "FP8 ring vs full-precision baseline cannot be bit-identical"
    assert r["psnr_reference_vs_optimized_db"] > 20, f"the two paths' videos differ: {r['psnr_reference_vs_optimized_db']} dB"


def test_shipped_weights_lip_sync_on_held_out_speech(report):
    """The issue's bar: reference path r ≥ 0.6 on held-out sentences, optimized within 1 % of it."""
    r = report
    ref, opt = r["lip_sync_reference"], r["lip_sync_optimized"]
    assert ref >= 0.6, f"reference-path lip-sync r = {ref:.4f} on held-out speech; expected ≥ 0.6"
    assert opt >= ref * 0.99, f"optimized r = {opt:.4f} is more than 1 % below reference {ref:.4f}"


def test_shipped_weights_hold_identity_over_a_minute(minute):
    """The issue's ≥ 60 s bar (≥ 2 position resets): identity and flicker compared between the first and the last
    15 s, on both paths. Quarters of a 10 s clip (2.5 s) swing by ±2.5 dB with what is being said, so identity
    is judged on the minute only."""
    rc, r, _ = minute
    assert r["position_resets"] >= 2, f"60 s crossed only {r['position_resets']} position resets"
    assert rc == 0 and r["gate"]["passed"], f"the gate failed over 60 s: {r['gate']}"
    for path in ("reference", "optimized"):
        s = r["stability"][path]
        assert s["identity_psnr_last_quarter_db"] > s["identity_psnr_first_quarter_db"] - 1.0, f"{path}: identity drifts: {s}"
        assert s["flicker_last_quarter"] < 1.25 * s["flicker_first_quarter"], f"{path}: flicker grows: {s}"


def test_gate_fails_on_a_lipsync_drop_over_one_percent_and_on_drift():
    flat = [0.01] * 12
    assert judge(0.70, 0.695, flat)["failures"] == [], "a 0.7 % drop passes"
    fails = judge(0.70, 0.68, flat)["failures"]
    assert len(fails) == 1 and "2.86 % below reference" in fails[0]
    growing = [0.01] * 3 + [0.02] * 6 + [0.2] * 3
    fails = judge(0.7, 0.7, growing)["failures"]
    assert len(fails) == 1 and fails[0].startswith("drift: latent relative RMS over the last quarter 0.2000 > limit 0.0500")
    assert judge(0.7, 0.72, flat)["failures"] == [], "a better optimized path is not a degradation"


def test_eval_rejects_bad_arguments(tmp_path, capsys):
    assert main(["eval", "quality", "--seconds", "0"]) == 2
    assert "--seconds = 0.0; expected > 0" in capsys.readouterr().err
    assert main(["eval", "quality", "--weights", str(tmp_path), "--seconds", "1"]) == 2
    assert "ref_dit.safetensors is missing" in capsys.readouterr().err
