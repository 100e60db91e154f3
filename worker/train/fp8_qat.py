"""Quantization-aware fine-tuning of `ref` (`vivant train fp8-qat`): make the model robust to the served FP8 GEMMs.

Why: with the FP8-native checkpoint (worker/train/fp8_native.py) the served engine multiplies exactly the float32
model's weights, so what still separates it from the float32 path is the activations' per-row e4m3 rounding before
each FP8 GEMM (qkv, o, gate_up, down): about 2.6 % RMS per value whatever the scale granularity, amplified by the
autoregressive rollout (docs/BENCHMARKS.md, the quality gate). bf16 GEMMs would remove it at a step time the gate does
not allow; instead the model learns to tolerate it. The shipped `ref` DiT is fine-tuned at a low learning rate with
the teacher-forced training forward of worker/train/train_dit.py (same data, mask and loss), where every block's four
projections compute what the served FP8 GEMM computes (`Fp8FakeQuantLinear`): the input rounded per row to e4m3 under
`quantize_rows_ref`'s scale (max|row| / 448), the weight per output channel on the same grid (`fp8_grid`), the product
in float32, the result rounded to bf16 (the GEMM's output dtype; the K/V the ring stores are then bf16 as served).
Gradients are straight-through: the rounding counts as the identity, so the input's gradient is g·W8 and the weight's
gᵀ·A8 (the rounded operands). After training the projections are put on the FP8 grid exactly as `make_fp8_native`
does, so the shipped checkpoint stays FP8-native.

Outputs in --out: ref_dit.safetensors (float32, like fp8-native), copies of the VAE files, and train_log.json (the
source's log with an `fp8_qat` record: settings, the loss before and after on fixed batches under the served rounding
and in float32, seconds, device, torch version).
"""

from __future__ import annotations

import copy
import json
import math
import platform
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
from vivant.kernels.fp8 import dequantize_rows, quantize_rows_ref
from vivant.worker.model.config import ModelConfig
from vivant.worker.model.fused_tp import SummedProduct
from vivant.worker.model.model import VideoDiT
from vivant.worker.model.ref_model import DIT_FILE, ENCODER_FILE, VAE_FILE
from vivant.worker.model.weights import load_weights
from vivant.worker.stream.vae import VAEConfig
from vivant.worker.train.common import Log, save_tensors
from vivant.worker.train.dataset import first_clips, load_dataset, render_dataset_frames
from vivant.worker.train.encoder import load_chunk_encoder
from vivant.worker.train.fp8_native import ROLES, fp8_grid, make_fp8_native
from vivant.worker.train.train_dit import WindowBatch, batch_loss, draw_batch, stream_mask, stream_positions
from vivant.worker.train.train_vae import encode_all

SERVED_OUT_DTYPE = torch.bfloat16
"""What the served FP8 GEMM returns (kernels/fp8_gemm.py `fp8_linear`, out_dtype)."""


class _ServedFp8Product(torch.autograd.Function):
    """a [M, K], w [N, K] float32 → [M, N] float32 = fp8_linear_ref of their per-row e4m3 roundings; the backward is
    the straight-through one (the rounding is treated as the identity)."""

    @staticmethod
    def forward(ctx, a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        a8 = dequantize_rows(*quantize_rows_ref(a))
        w8 = fp8_grid(w)
        ctx.save_for_backward(a8, w8)
        return a8 @ w8.t()

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a8, w8 = ctx.saved_tensors
        g = g.float()
        return g @ w8, g.t() @ a8


class Fp8FakeQuantLinear(nn.Module, SummedProduct):
    """A bias-free linear whose forward is the served FP8 GEMM's arithmetic on a float master weight (trained).

    x [..., K] (any float dtype) → [..., N] in `out_dtype`: each row of x (one token) rounded to e4m3 with scale
    max|row| / 448, the weight [N, K] per output channel likewise, the product of the dequantized operands in float32
    (autocast off), then cast to `out_dtype`. Same parameter name as nn.Linear (`weight`), so a model's state dict
    keeps its keys while the module is installed."""

    def __init__(self, weight: nn.Parameter, *, out_dtype: torch.dtype = SERVED_OUT_DTYPE) -> None:
        super().__init__()
        if weight.dim() != 2:
            raise ValueError(f"Fp8FakeQuantLinear: weight must be [N, K], got shape {tuple(weight.shape)}")
        self.weight = weight
        self.out_dtype = out_dtype
        self.out_features, self.in_features = weight.shape

    @classmethod
    def from_linear(cls, linear: nn.Linear, *, out_dtype: torch.dtype = SERVED_OUT_DTYPE) -> Fp8FakeQuantLinear:
        if linear.bias is not None:
            raise ValueError("Fp8FakeQuantLinear: the DiT's projections have no bias; got a linear with one")
        return cls(linear.weight, out_dtype=out_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"Fp8FakeQuantLinear: input's last dim must be {self.in_features}, got {tuple(x.shape)}")
        with torch.autocast(x.device.type, enabled=False):
            y = _ServedFp8Product.apply(x.reshape(-1, self.in_features).float(), self.weight.float())
        return y.to(self.out_dtype).reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, out_dtype={self.out_dtype}"


def install_fp8_fake_quant(model: VideoDiT, *, out_dtype: torch.dtype = SERVED_OUT_DTYPE) -> VideoDiT:
    """Replace every block's qkv, o, gate_up and down (fp8_native.ROLES) by an `Fp8FakeQuantLinear` sharing the same
    weight Parameter, in place; returns the model. The state dict's keys do not change."""
    for blk in model.blocks:
        for part, role in ROLES:
            owner = getattr(blk, part)
            setattr(owner, role, Fp8FakeQuantLinear.from_linear(getattr(owner, role), out_dtype=out_dtype))
    return model


@dataclass(frozen=True)
class QatSettings:
    """The fine-tune's settings; each field is the CLI option of the same name (`vivant train fp8-qat`).

    steps: optimizer steps at most; seconds: wall-clock cap of the training loop (whichever ends first; the learning
    rate's cosine follows the larger fraction of the two, so a slow machine still ends at the low rate); lr: peak AdamW
    rate (a fine-tune: 1/10 of the peak `ref` was trained with); batch, window: windows of chunks per step (as
    `vivant train ref`); eval_batches: fixed batches the loss before/after is measured on."""

    steps: int = 4000
    lr: float = 5e-5
    seconds: float = 240.0
    batch: int = 64
    window: int = 16
    seed: int = 0
    warmup_steps: int = 50
    eval_batches: int = 4

    def __post_init__(self) -> None:
        for name in ("steps", "batch", "window", "eval_batches"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"--{name.replace('_', '-')} = {v!r}; expected an integer ≥ 1")
        for name in ("lr", "seconds"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise ValueError(f"--{name} = {v!r}; expected a number > 0")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps = {self.warmup_steps}; expected ≥ 0")

    def lr_at(self, step: int, elapsed_s: float) -> float:
        """The learning rate at `step`: linear warm-up over `warmup_steps` (at most a tenth of `steps`), then a cosine
        from lr to 0.1·lr over the spent fraction of the run."""
        frac = min(1.0, max(step / self.steps, elapsed_s / self.seconds))
        ramp = min(self.warmup_steps, self.steps // 10)  # short runs warm up over their first tenth
        warm = min(1.0, (step + 1) / ramp) if ramp else 1.0
        return self.lr * warm * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


def check_source(src: Path) -> None:
    """A ValueError naming --weights and the missing file when `src` is not a `ref` weights directory."""
    for name in (DIT_FILE, ENCODER_FILE):
        if not (src / name).is_file():
            raise ValueError(f"--weights {str(src)!r}: {name} is missing; expected a `ref` weights directory "
                             f"(the output of `vivant train ref`, e.g. weights/ref)")


@torch.no_grad()
def training_latents(src: Path, data: dict[str, np.ndarray], cfg: ModelConfig,
                     device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The dataset's chunks encoded by the VAE encoder in `src`: latents [chunks, C, h, w] (unit scale) and audio
    features [chunks, A, F], float32 on `device` — what `vivant train ref` trained the DiT on."""
    vcfg = VAEConfig.for_model(cfg)
    enc = load_chunk_encoder(src / ENCODER_FILE, vcfg).to(device)
    frames = render_dataset_frames(data, cfg, device=device)
    latents = encode_all(enc, frames, vcfg, device)
    return latents, torch.from_numpy(data["features"].astype(np.float32)).to(device)


@torch.no_grad()
def mean_loss(model: VideoDiT, batches: list[WindowBatch], mask: torch.Tensor, pos: torch.Tensor, *, amp: bool) -> float:
    """The mean of `batch_loss` over `batches`, without gradients."""
    return float(np.mean([float(batch_loss(model, b, mask, pos, amp=amp)) for b in batches]))


def finetune(model: VideoDiT, draw: Callable[[], WindowBatch], fixed: list[WindowBatch], settings: QatSettings, *,
             log: Log) -> tuple[VideoDiT, dict]:
    """Fine-tune `model` (float32, on the batches' device) with the served FP8 rounding in its projections, one
    batch from `draw()` per step; the loss before and after is measured on the `fixed` batches (same window length).
    Returns the model with its projections on the FP8 grid (plain modules again, float32, CPU) and the figures."""
    cfg, device = model.cfg, fixed[0].xt.device
    amp = device.type == "cuda"
    window = fixed[0].xt.shape[1] // 2
    mask = stream_mask(cfg, window).to(device)
    pos = stream_positions(cfg, window, 2).to(device)
    model.eval()  # no dropout in the DiT; eval only pins the mode
    float_before = mean_loss(model, fixed, mask, pos, amp=amp)
    install_fp8_fake_quant(model)
    served_before = mean_loss(model, fixed, mask, pos, amp=amp)
    log(f"fp8-qat: loss on {len(fixed)} fixed batches before: served rounding {served_before:.5f}, "
        f"float32 {float_before:.5f}")
    opt = torch.optim.AdamW(model.parameters(), lr=settings.lr, weight_decay=0.0, betas=(0.9, 0.98))
    t0 = time.perf_counter()
    step, avg, last_print = 0, None, -1e9
    while step < settings.steps and (step == 0 or time.perf_counter() - t0 < settings.seconds):
        for g in opt.param_groups:
            g["lr"] = settings.lr_at(step, time.perf_counter() - t0)
        loss = batch_loss(model, draw(), mask, pos, amp=amp)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        val = float(loss.detach())
        avg = val if avg is None else 0.98 * avg + 0.02 * val
        elapsed = time.perf_counter() - t0
        if elapsed - last_print >= 10 or step == settings.steps:
            last_print = elapsed
            log(f"fp8-qat step {step}: loss {avg:.5f} (lr {opt.param_groups[0]['lr']:.2e})",
                stage="fp8_qat", step=step, loss=avg)
    seconds = time.perf_counter() - t0
    shipped = VideoDiT(cfg)
    shipped.load_state_dict({k: v.detach().float().cpu() for k, v in model.state_dict().items()})
    change = make_fp8_native(shipped)
    shipped = shipped.to(device).eval()
    float_after = mean_loss(shipped, fixed, mask, pos, amp=amp)
    served_after = mean_loss(install_fp8_fake_quant(copy.deepcopy(shipped)), fixed, mask, pos, amp=amp)
    log(f"fp8-qat done: {step} steps in {seconds:.0f} s; loss after: served rounding {served_after:.5f}, "
        f"float32 {float_after:.5f}")
    info = {"steps": step, "seconds": round(seconds, 1), "window_chunks": window,
            "loss_fixed_batches": {"batches": len(fixed),
                                   "served_rounding": {"before": round(served_before, 6), "after": round(served_after, 6)},
                                   "float32": {"before": round(float_before, 6), "after": round(float_after, 6)}},
            "train_loss_last": avg, "grid_rounding_rel_rms": {k: round(v, 5) for k, v in change.items()}}
    return shipped.cpu(), info


def write_fp8_qat(src: Path, out: Path, settings: QatSettings, *, device: torch.device, data_path: Path,
                  max_clips: int | None = None, log: Log | None = None) -> dict:
    """Fine-tune the `ref` DiT in `src` (module docstring), write it FP8-native to `out` with copies of the VAE files,
    and add an `fp8_qat` record to `out`/train_log.json (the source's log otherwise). Returns the record."""
    log = log or Log()
    check_source(src)
    t_start = time.perf_counter()
    cfg = ModelConfig.from_name("ref")
    data = load_dataset(data_path, cfg)
    if max_clips is not None:
        data = first_clips(data, max_clips, cfg)
    clip_chunks = data["clip_chunks"].astype(np.int64)
    latents, feats = training_latents(src, data, cfg, device)
    log(f"fp8-qat: {len(clip_chunks)} clips, {latents.shape[0]} chunks encoded on {device}")
    model = VideoDiT(cfg)
    load_weights(model, src / DIT_FILE)
    source_state = {k: v.float().clone() for k, v in model.state_dict().items()}
    window = min(settings.window, int(clip_chunks.max()))
    torch.manual_seed(settings.seed)
    rng = np.random.default_rng(settings.seed + 1)
    eval_gen = torch.Generator(device=device).manual_seed(settings.seed + 7)
    eval_rng = np.random.default_rng(settings.seed + 7)
    fixed = [draw_batch(eval_rng, latents, feats, clip_chunks, cfg, window=window, batch=settings.batch,
                        generator=eval_gen) for _ in range(settings.eval_batches)]

    def draw() -> WindowBatch:
        return draw_batch(rng, latents, feats, clip_chunks, cfg, window=window, batch=settings.batch)

    model, info = finetune(model.float().to(device), draw, fixed, settings, log=log)
    moved = {}
    for part, role in ROLES:
        keys = [f"blocks.{i}.{part}.{role}.weight" for i in range(cfg.n_layers)]
        state = model.state_dict()
        num = sum(float((state[k].float() - source_state[k]).pow(2).sum()) for k in keys)
        den = sum(float(source_state[k].pow(2).sum()) for k in keys)
        moved[role] = round((num / den) ** 0.5, 5)
    out.mkdir(parents=True, exist_ok=True)
    save_tensors({k: v.float() for k, v in model.state_dict().items()}, out / DIT_FILE,
                 {"preset": cfg.name, "fp8_native": "qkv,o,gate_up,down per output channel",
                  "fp8_qat": f"fine-tuned {info['steps']} steps under the served FP8 rounding"})
    for name in (VAE_FILE, ENCODER_FILE):
        if (src / name).is_file() and src.resolve() != out.resolve():
            shutil.copyfile(src / name, out / name)
    record = {"command": (f"vivant train fp8-qat --weights {src.name} --out {out.name} --device {device.type} "
                          f"--steps {settings.steps} --lr {settings.lr} --seconds {settings.seconds} "
                          f"--batch {settings.batch} --window {settings.window} --seed {settings.seed}"
                          + (f" --max-clips {max_clips}" if max_clips is not None else "")),
              "date": time.strftime("%Y-%m-%d"), "settings": asdict(settings), **info,
              "weight_change_rel_rms_vs_source": moved, "dataset": {"path": data_path.name,
                                                                     "clips": len(clip_chunks)},
              "device": str(device),
              "device_name": (torch.cuda.get_device_name(device) if device.type == "cuda"
                              else platform.processor() or "cpu"),
              "torch": torch.__version__, "total_seconds": round(time.perf_counter() - t_start, 1)}
    log_path = out / "train_log.json"
    source_log = log_path if log_path.is_file() else src / "train_log.json"
    train_log = json.loads(source_log.read_text()) if source_log.is_file() else {}
    train_log["fp8_qat"] = record
    log_path.write_text(json.dumps(train_log, indent=1))
    return record
