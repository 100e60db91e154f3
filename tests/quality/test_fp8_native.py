"""`vivant train fp8-native` (worker/train/fp8_native.py): the ref DiT's projection weights put on the served FP8
grid. Checked: every rounded row re-quantizes to itself (the served FP8 GEMM then multiplies exactly the float32
model's weights), the rest of the checkpoint is untouched, the change is the e4m3 rounding (≈ 2.6 % RMS), the
record lands in train_log.json and the checksum is recorded; a missing source is named."""

from __future__ import annotations

import json

import pytest
import torch
from vivant.kernels.fp8_gemm import quantize_weight
from vivant.worker.model.config import ModelConfig
from vivant.worker.model.model import VideoDiT
from vivant.worker.model.ref_model import DIT_FILE, VAE_FILE, default_weights_dir
from vivant.worker.model.weights import load_weights
from vivant.worker.train import cli
from vivant.worker.train.fp8_native import ROLES, write_fp8_native


def _load(path):
    m = VideoDiT(ModelConfig.from_name("ref"))
    load_weights(m, path)  # checks the recorded SHA-256
    return m


@pytest.fixture(scope="module")
def native(tmp_path_factory):
    out = tmp_path_factory.mktemp("ref8")
    record = write_fp8_native(default_weights_dir(), out)
    return out, record


def test_projection_weights_are_on_the_served_grid_and_nothing_else_moved(native):
    out, record = native
    old, new = _load(default_weights_dir() / DIT_FILE), _load(out / DIT_FILE)
    roles = {f"blocks.{i}.{part}.{role}.weight" for i in range(len(new.blocks)) for part, role in ROLES}
    for name, w in new.state_dict().items():
        if name in roles:
            q, s = quantize_weight(w)
            back = q.float() * s[:, None]
            assert torch.equal(back, w.float()), f"{name}: re-quantizing the rounded weight changed it"
            rel = float((w.float() - old.state_dict()[name].float()).norm() / old.state_dict()[name].float().norm())
            assert 0.01 < rel < 0.05, f"{name}: changed by {rel:.4f} relative RMS; e4m3 rounding is about 0.026"
        else:
            assert torch.equal(w.float(), old.state_dict()[name].float()), f"{name} is not a projection but changed"
    assert set(record["weight_change_rel_rms"]) == {r for _, r in ROLES}
    assert (out / VAE_FILE).is_file(), "the VAE decoder must be copied beside the DiT"
    assert json.loads((out / "train_log.json").read_text())["fp8_native"] == record


def test_the_served_fp8_weights_equal_the_float_model(native):
    """The FP8 parts (CPU twins) of the FP8-native checkpoint hold exactly the float32 model's projection weights."""
    from vivant.worker.model.engine import Engine
    from vivant.worker.model.options import EngineOptions

    out, _ = native
    model = _load(out / DIT_FILE)
    fast = Engine.build(model, EngineOptions.served("cpu")).model
    for blk, fblk in zip(model.blocks, fast.blocks, strict=True):
        for part, role in ROLES:
            f8 = getattr(getattr(fblk, part), role)
            w = getattr(getattr(blk, part), role).weight.float()
            assert torch.equal(f8.w8.float() * f8.sw[:, None], w), f"{part}.{role}: served weight != float weight"


def test_a_missing_source_is_named(tmp_path):
    import argparse

    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    args = p.parse_args(["fp8-native", "--from", str(tmp_path / "nope"), "--out", str(tmp_path / "o")])
    with pytest.raises(ValueError, match=r"--from .*nope.*ref_dit.safetensors is missing"):
        cli.run(args)
