"""An FP8-native `ref` checkpoint: the four projections' weights put on the grid the served FP8 GEMMs use.

Why: the served engine multiplies e4m3 weights with one float32 scale per output channel (kernels/fp8_gemm.py
`quantize_weight`). A checkpoint whose projection weights already are such products — w = q · s with q on the
e4m3 grid and s = max|w_row| / 448 — is served exactly as the float32 model computes it: the weights' rounding,
the largest single cause of the served engine's difference from the float32 path on the trained model
(docs/BENCHMARKS.md, "Tried, and why not"), is then part of the model, not of the engine.
This is how FP8-native checkpoints are shipped; the model itself changes by the rounding (about 2.6 % RMS per
weight), which the quality gate's ground-truth figures (lip-sync against the audio, PSNR against the procedural
frames) show for the old and the new checkpoint.

Scope: the qkv, o, gate_up and down weights of every block (the FP8 GEMMs); embeddings, modulation, norms and
the head stay as trained. Re-quantizing a rounded row gives back its codes exactly (its largest value maps to
448); the bf16 cast the served engine makes first moves each channel's scale by at most 2^-8 (the bf16 rounding of
that largest value) and leaves the codes as they are. At tensor
parallelism > 1 the row-parallel O and down weights are quantized per shard (a slice of each row) and are then
rounded again; `ref` is served at TP = 1.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import torch
from vivant.kernels.fp8 import quantize_rows_ref
from vivant.worker.model.config import ModelConfig
from vivant.worker.model.model import VideoDiT
from vivant.worker.model.ref_model import DIT_FILE, ENCODER_FILE, VAE_FILE
from vivant.worker.model.weights import load_weights
from vivant.worker.train.common import save_tensors

ROLES = (("attn", "qkv"), ("attn", "o"), ("mlp", "gate_up"), ("mlp", "down"))


def fp8_grid(w: torch.Tensor) -> torch.Tensor:
    """w [N, K] → float32 [N, K]: each output channel's values rounded to e4m3 under its served scale (the value
    the FP8 GEMM multiplies with)."""
    q, s = quantize_rows_ref(w.float())
    return q.float() * s[:, None]


@torch.no_grad()
def make_fp8_native(model: VideoDiT) -> dict[str, float]:
    """Round the projection weights of `model` in place; returns each role's relative RMS change."""
    change = {}
    for part, role in ROLES:
        num = den = 0.0
        for blk in model.blocks:
            lin = getattr(getattr(blk, part), role)
            w = lin.weight.data
            g = fp8_grid(w)
            num += float((g - w.float()).pow(2).sum())
            den += float(w.float().pow(2).sum())
            w.copy_(g.to(w.dtype))
        change[role] = (num / den) ** 0.5
    return change


def write_fp8_native(src: Path, out: Path) -> dict:
    """Read the `ref` weights in `src`, write the FP8-native DiT (and copies of the VAE files) to `out`, and add a
    record to `out`/train_log.json. Returns the record."""
    cfg = ModelConfig.from_name("ref")
    model = VideoDiT(cfg)
    load_weights(model, src / DIT_FILE)
    change = make_fp8_native(model)
    out.mkdir(parents=True, exist_ok=True)
    # float32: a rounded weight is an e4m3 code (4 significant bits) times a float32 scale; float16 would round it
    save_tensors({k: v.float() for k, v in model.state_dict().items()}, out / DIT_FILE,
                 {"preset": cfg.name, "fp8_native": "qkv,o,gate_up,down per output channel"})
    for name in (VAE_FILE, ENCODER_FILE):
        if (src / name).is_file() and src.resolve() != out.resolve():
            shutil.copyfile(src / name, out / name)
    record = {"command": f"vivant train fp8-native --from {src.name} --out {out.name}",
              "date": time.strftime("%Y-%m-%d"), "roles": [r for _, r in ROLES],
              "scale": "one float32 scale per output channel, max|w| / 448 (kernels/fp8_gemm.py quantize_weight)",
              "weight_change_rel_rms": {k: round(v, 5) for k, v in change.items()}}
    log_path = out / "train_log.json"
    log = json.loads(log_path.read_text()) if log_path.is_file() else (
        json.loads((src / "train_log.json").read_text()) if (src / "train_log.json").is_file() else {})
    log["fp8_native"] = record
    log_path.write_text(json.dumps(log, indent=1))
    return record
