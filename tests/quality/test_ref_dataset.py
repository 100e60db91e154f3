"""The procedural training set of the `ref` character: deterministic, shaped for the preset, shipped,
and refused with a clear error when it does not fit."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from vivant.worker.model.config import ModelConfig
from vivant.worker.train.cli import default_data_path
from vivant.worker.train.dataset import (
    HELD_OUT_WORDS,
    TRAIN_WORDS,
    DatasetError,
    build_dataset,
    load_dataset,
    mouth_box,
    render_dataset_frames,
    render_faces,
    save_dataset,
)

CFG = ModelConfig.from_name("ref")
needs_espeak = pytest.mark.skipif(shutil.which("espeak-ng") is None or shutil.which("sox") is None,
                                  reason="espeak-ng/sox missing (make sysdeps installs them)")


@needs_espeak
def test_same_seed_gives_identical_clips_and_another_seed_differs():
    a = build_dataset(CFG, clips=2, seed=7)
    b = build_dataset(CFG, clips=2, seed=7)
    c = build_dataset(CFG, clips=2, seed=8)
    for k in ("features", "opening", "eyes", "sway_x", "sway_y", "clip_chunks"):
        assert np.array_equal(a[k], b[k]), f"array {k!r} differs between two builds with seed 7"
    assert json.loads(str(a["meta"]))["texts"] != json.loads(str(c["meta"]))["texts"], "seed 8 spoke the same text"
    chunks = int(a["clip_chunks"].sum())
    assert a["features"].shape == (chunks, CFG.audio_tokens, CFG.audio_feature_dim)
    assert a["opening"].shape == (chunks * CFG.frames_per_chunk,)
    assert 0 < float(a["opening"].astype(np.float32).max()) <= 1.0, "no frame opens the mouth while speaking"
    assert float(a["opening"][:6].astype(np.float32).max()) == 0.0, "the clip starts idle with a closed mouth"


def test_shipped_dataset_fits_the_preset_and_holds_idle_and_speech():
    data = load_dataset(default_data_path(), CFG)
    meta = json.loads(str(data["meta"]))
    assert meta["preset"] == "ref" and meta["clips"] == len(data["clip_chunks"]) >= 200
    opening = data["opening"].astype(np.float32)
    idle = float((opening == 0).mean())
    assert 0.2 < idle < 0.8, f"fraction of closed-mouth (idle/pause) frames {idle:.2f}; expected a mix"
    assert default_data_path().stat().st_size <= 20e6
    texts = " ".join(meta["texts"]).lower()
    assert not any(f" {w} " in f" {texts} " for w in HELD_OUT_WORDS), "a held-out word is in the training texts"
    assert set(TRAIN_WORDS).isdisjoint(HELD_OUT_WORDS)


def test_rendered_frames_are_96px_and_the_mouth_box_darkens_with_opening():
    n = 3
    f = render_faces(torch.tensor([0.0, 0.5, 1.0]), torch.ones(n), torch.zeros(n), torch.zeros(n))
    assert f.shape == (n, 3, CFG.height, CFG.width) and f.min() >= -1 and f.max() <= 1
    y0, y1, x0, x1 = mouth_box(CFG.height, CFG.width)
    dark = [(f[i, :, y0:y1, x0:x1].mean(0) < -0.5).float().mean().item() for i in range(n)]
    assert dark[0] < dark[1] < dark[2], f"dark fraction in the mouth box by opening 0, .5, 1: {dark}"


def test_load_refuses_a_file_for_another_preset_or_with_missing_arrays(tmp_path):
    data = load_dataset(default_data_path(), CFG)
    small = {k: v for k, v in data.items()}
    small["meta"] = np.array(json.dumps({**json.loads(str(data["meta"])), "preset": "tiny"}))
    with pytest.raises(DatasetError, match="preset = 'tiny'; expected 'ref'"):
        load_dataset(save_dataset(small, tmp_path / "a.npz"), CFG)
    del small["eyes"]
    with pytest.raises(DatasetError, match=r"missing arrays \['eyes'\]"):
        load_dataset(save_dataset(small, tmp_path / "b.npz"), CFG)
    with pytest.raises(DatasetError, match="does not exist"):
        load_dataset(tmp_path / "none.npz", CFG)


def test_render_dataset_frames_is_uint8_per_frame():
    data = load_dataset(default_data_path(), CFG)
    n = int(data["clip_chunks"][0]) * CFG.frames_per_chunk
    part = {k: data[k][:n] for k in ("opening", "eyes", "sway_x", "sway_y")}
    frames = render_dataset_frames(part, CFG, batch=64)
    assert frames.dtype == torch.uint8 and frames.shape == (n, 3, 96, 96)
