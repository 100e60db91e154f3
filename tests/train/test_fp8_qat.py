"""`vivant train fp8-qat` (worker/train/fp8_qat.py): quantization-aware fine-tuning of `ref` under the served FP8
rounding. Checked: the fake-quant linear computes what the served FP8 GEMM's float32 reference computes
(kernels/fp8_gemm.py `fp8_linear_ref` on `quantize_rows_ref` activations and `quantize_weight` weights) at the `ref`
projections' shapes; its gradient is the straight-through one; installing it swaps exactly the four projections and
keeps the state dict; a few steps on one fixed batch lower that batch's loss under the served rounding; the command
runs end to end on CPU (shipped `ref` weights and dataset, a few clips) and writes an FP8-native checkpoint with its
record; bad options are named."""

from __future__ import annotations

import argparse
import io
import json

import numpy as np
import pytest
import torch
from vivant.kernels.fp8 import quantize_rows_ref
from vivant.kernels.fp8_gemm import fp8_linear_ref, quantize_weight
from vivant.worker.model.config import ModelConfig
from vivant.worker.model.model import VideoDiT, init_random_
from vivant.worker.model.ref_model import DIT_FILE, ENCODER_FILE, VAE_FILE, default_weights_dir
from vivant.worker.model.weights import load_weights
from vivant.worker.train import cli
from vivant.worker.train.common import Log
from vivant.worker.train.fp8_native import ROLES, fp8_grid
from vivant.worker.train.fp8_qat import Fp8FakeQuantLinear, QatSettings, finetune, install_fp8_fake_quant
from vivant.worker.train.train_dit import draw_batch

REF = ModelConfig.from_name("ref")
# (in, out) of the ref projections: qkv, o, gate_up, down
SHAPES = [(REF.d_model, 3 * REF.n_heads * REF.head_dim), (REF.n_heads * REF.head_dim, REF.d_model),
          (REF.d_model, 2 * REF.d_ff), (REF.d_ff, REF.d_model)]


def _errors(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    """(relative RMS, max abs) of a against b."""
    a, b = a.detach(), b.detach()
    return float((a - b).norm() / b.norm()), float((a - b).abs().max())


def _activations(rows: int, k: int, seed: int) -> torch.Tensor:
    """Rows of mixed magnitude with a few outlier channels, as trained activations have."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g) * torch.exp(torch.randn(rows, 1, generator=g))
    x[:, :3] *= 20.0
    return x


@pytest.mark.parametrize(("k", "n"), SHAPES)
def test_fake_quant_forward_equals_the_served_gemms_reference(k, n):
    torch.manual_seed(k + n)
    lin = torch.nn.Linear(k, n, bias=False)
    x = _activations(2 * 40, k, seed=n).view(2, 40, k)
    a, sa = quantize_rows_ref(x.reshape(-1, k))
    w, sw = quantize_weight(lin.weight.data)
    want = fp8_linear_ref(a, sa, w, sw).view(2, 40, n)
    got = Fp8FakeQuantLinear.from_linear(lin, out_dtype=torch.float32)(x)
    rel, mx = _errors(got, want)
    assert got.shape == (2, 40, n) and got.dtype == torch.float32
    assert rel <= 1e-6 and mx <= 1e-5 * float(want.abs().max()), f"[{k}→{n}] relative RMS {rel:.2e}, max error {mx:.2e}"
    served = Fp8FakeQuantLinear.from_linear(lin)(x)  # the served GEMM's output dtype
    assert served.dtype == torch.bfloat16
    rel, mx = _errors(served.float(), want.to(torch.bfloat16).float())
    assert rel == 0.0, f"[{k}→{n}] bf16 output differs from the reference rounded to bf16: rel {rel:.2e}, max {mx:.2e}"
    # the rounding is really there: the float product differs by e4m3's few per cent
    rel_float, _ = _errors(got, lin(x))
    assert 0.005 < rel_float < 0.1, f"[{k}→{n}] fake-quant vs float linear: relative RMS {rel_float:.4f}"


def test_fake_quant_runs_in_float32_under_autocast():
    """Under bf16 autocast (GPU training) the product still is the float32 reference, not a bf16 GEMM."""
    k, n = SHAPES[0]
    torch.manual_seed(1)
    lin = torch.nn.Linear(k, n, bias=False)
    x = _activations(40, k, seed=2)
    want = Fp8FakeQuantLinear.from_linear(lin, out_dtype=torch.float32)(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = Fp8FakeQuantLinear.from_linear(lin, out_dtype=torch.float32)(x)
    rel, mx = _errors(got, want)
    assert rel == 0.0, f"autocast changed the product: relative RMS {rel:.2e}, max {mx:.2e}"


@pytest.mark.parametrize(("k", "n"), SHAPES[:2])
def test_gradient_is_straight_through(k, n):
    torch.manual_seed(k)
    w = torch.nn.Parameter(torch.randn(n, k) * 0.05)
    x = _activations(40, k, seed=k).requires_grad_(True)
    g = torch.randn(40, n)
    (Fp8FakeQuantLinear(w, out_dtype=torch.float32)(x) * g).sum().backward()
    qa, sa = quantize_rows_ref(x.detach())
    a8, w8 = qa.float() * sa[:, None], fp8_grid(w.detach())
    for name, got, want in (("input", x.grad, g @ w8), ("weight", w.grad, g.t() @ a8)):
        rel, mx = _errors(got, want)
        assert float(got.abs().max()) > 0, f"{name} gradient is zero"
        assert rel < 1e-6, f"{name} gradient is not g·(rounded operand): relative RMS {rel:.2e}, max {mx:.2e}"
    # values already on the grid: the fake-quant linear is the float linear, gradients included
    xg = a8.clone().requires_grad_(True)
    wq = torch.nn.Parameter(w8.clone())
    wf = torch.nn.Parameter(w8.clone())
    xf = a8.clone().requires_grad_(True)
    (Fp8FakeQuantLinear(wq, out_dtype=torch.float32)(xg) * g).sum().backward()
    (torch.nn.functional.linear(xf, wf) * g).sum().backward()
    for name, got, want in (("input", xg.grad, xf.grad), ("weight", wq.grad, wf.grad)):
        rel, mx = _errors(got, want)
        assert rel < 1e-6, f"on-grid values: {name} gradient differs from the float linear's: rel {rel:.2e}, max {mx:.2e}"


def test_install_swaps_the_four_projections_and_keeps_the_state_dict():
    model = init_random_(VideoDiT(REF), seed=0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    params = {name: p for name, p in model.named_parameters()}
    install_fp8_fake_quant(model)
    for blk in model.blocks:
        for part, role in ROLES:
            assert isinstance(getattr(getattr(blk, part), role), Fp8FakeQuantLinear), f"{part}.{role} not swapped"
    assert not isinstance(model.time_mod, Fp8FakeQuantLinear) and not isinstance(model.out, Fp8FakeQuantLinear)
    after = model.state_dict()
    assert list(after) == list(before), "the state dict's keys changed"
    assert all(torch.equal(after[k], before[k]) for k in before), "installing changed a tensor"
    assert all(p is params[name] for name, p in model.named_parameters()), "the Parameters must be the same objects"
    with pytest.raises(ValueError, match="no bias"):
        Fp8FakeQuantLinear.from_linear(torch.nn.Linear(4, 4, bias=True))


def test_a_few_steps_lower_the_served_loss_on_a_fixed_batch():
    """Shipped ref weights, synthetic latents: fine-tune on one fixed batch, which must then have a lower loss under
    the served rounding; the returned model is plain, on the grid, and its record is complete."""
    model = VideoDiT(REF)
    load_weights(model, default_weights_dir() / DIT_FILE)
    g = torch.Generator().manual_seed(0)
    chunks = 12
    latents = torch.randn(chunks, REF.latent_channels, REF.latent_h, REF.latent_w, generator=g)
    feats = torch.randn(chunks, REF.audio_tokens, REF.audio_feature_dim, generator=g)
    batch = draw_batch(np.random.default_rng(0), latents, feats, np.array([chunks]), REF, window=4, batch=2,
                       generator=torch.Generator().manual_seed(1))
    settings = QatSettings(steps=6, lr=3e-4, seconds=600.0, batch=2, window=4)
    shipped, info = finetune(model, lambda: batch, [batch], settings, log=Log(stream=io.StringIO()))
    loss = info["loss_fixed_batches"]["served_rounding"]
    assert info["steps"] == 6
    assert loss["after"] < loss["before"], f"served-rounding loss did not fall on the fixed batch: {loss}"
    for blk in shipped.blocks:
        for part, role in ROLES:
            lin = getattr(getattr(blk, part), role)
            assert type(lin).__name__ == "Linear", f"{part}.{role} is still {type(lin).__name__}"
            q, s = quantize_weight(lin.weight.data)
            assert torch.equal(q.float() * s[:, None], lin.weight.data), f"{part}.{role} is not on the FP8 grid"


def _parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    return p.parse_args(["fp8-qat", *argv])


def test_the_command_runs_on_cpu_and_writes_an_fp8_native_checkpoint(tmp_path):
    out = tmp_path / "qat"
    rc = cli.run(_parse("--out", str(out), "--steps", "2", "--batch", "1", "--window", "4", "--max-clips", "2"))
    assert rc == 0
    for name in (DIT_FILE, VAE_FILE, ENCODER_FILE, "train_log.json"):
        assert (out / name).is_file(), f"{name} missing from the output"
    model = VideoDiT(REF)
    load_weights(model, out / DIT_FILE)  # checks the recorded checksum
    source = VideoDiT(REF)
    load_weights(source, default_weights_dir() / DIT_FILE)
    for i, blk in enumerate(model.blocks):
        for part, role in ROLES:
            w = getattr(getattr(blk, part), role).weight.data
            q, s = quantize_weight(w)
            again, s2 = quantize_weight(q.float() * s[:, None])
            assert torch.equal(again.view(torch.uint8), q.view(torch.uint8)) and torch.equal(q.float() * s[:, None], w), \
                f"blocks.{i}.{part}.{role}: the saved weight is not on the FP8 grid"
    log = json.loads((out / "train_log.json").read_text())
    rec = log["fp8_qat"]
    assert "fp8_native" in log and "dit" in log, "the source's log must be kept beside the new record"
    assert rec["steps"] == 2 and rec["settings"]["lr"] == QatSettings().lr and rec["device"] == "cpu"
    assert rec["torch"] == torch.__version__ and rec["seconds"] >= 0
    for kind in ("served_rounding", "float32"):
        assert all(np.isfinite(rec["loss_fixed_batches"][kind][w]) for w in ("before", "after")), rec
    assert set(rec["weight_change_rel_rms_vs_source"]) == {r for _, r in ROLES}
    assert rec["dataset"]["clips"] == 2


@pytest.mark.parametrize(("argv", "message"), [
    (("--steps", "0"), r"--steps = 0; expected an integer ≥ 1"),
    (("--steps", "-3"), r"--steps = -3; expected an integer ≥ 1"),
    (("--lr", "0"), r"--lr = 0.0; expected a number > 0"),
    (("--lr=-1e-4",), r"--lr = -0.0001; expected a number > 0"),
    (("--seconds", "0"), r"--seconds = 0.0; expected a number > 0"),
    (("--batch", "0"), r"--batch = 0; expected an integer ≥ 1"),
])
def test_bad_options_are_named(tmp_path, argv, message):
    with pytest.raises(ValueError, match=message):
        cli.run(_parse("--out", str(tmp_path / "o"), *argv))
    assert not (tmp_path / "o").exists(), "nothing may be written after a refused option"


def test_a_missing_weights_dir_is_named(tmp_path):
    with pytest.raises(ValueError, match=r"--weights .*nope.*ref_dit.safetensors is missing"):
        cli.run(_parse("--weights", str(tmp_path / "nope"), "--out", str(tmp_path / "o")))
    only_dit = tmp_path / "only_dit"
    only_dit.mkdir()
    (only_dit / DIT_FILE).write_bytes((default_weights_dir() / DIT_FILE).read_bytes())
    with pytest.raises(ValueError, match=r"--weights .*only_dit.*ref_vae_encoder.safetensors is missing"):
        cli.run(_parse("--weights", str(only_dit), "--out", str(tmp_path / "o")))
    with pytest.raises(ValueError, match=r"--data .*missing.npz.*no such file"):
        cli.run(_parse("--data", str(tmp_path / "missing.npz"), "--out", str(tmp_path / "o")))
