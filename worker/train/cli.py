"""`vivant train ref`: build (or read) the procedural dataset, train the VAE, then the DiT, write weights + log.

    vivant train ref --device cuda --minutes 6 --seed 0 --out weights/ref

The time budget is split: `--vae-share` of it (default 0.3) for the VAE, the rest for the DiT, after
rendering the frames on the training device. Outputs in --out: ref_vae.safetensors (decoder),
ref_vae_encoder.safetensors, ref_dit.safetensors (float16), train_log.json (every setting, the
dataset's seed, losses over time, steps, seconds, device, torch version). The dataset is read from
--data (default weights/ref/data/ref_data.npz, shipped); when that file is missing it is built here
(needs espeak-ng and sox) and written there.

`vivant train fp8-native` and `vivant train fp8-qat` start from trained weights instead
(worker/train/fp8_native.py, worker/train/fp8_qat.py; docs/reference_model.md).
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import numpy as np
import torch
from vivant.worker.model.config import ModelConfig
from vivant.worker.model.model import VideoDiT
from vivant.worker.model.ref_model import DIT_FILE, ENCODER_FILE, VAE_FILE, default_weights_dir
from vivant.worker.stream.vae import VAEConfig
from vivant.worker.train.common import Log, pick_device, save_tensors
from vivant.worker.train.dataset import (
    build_dataset,
    first_clips,
    load_dataset,
    render_dataset_frames,
    save_dataset,
)
from vivant.worker.train.train_dit import train_dit
from vivant.worker.train.train_vae import encode_all, train_vae


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("what", choices=["ref", "fp8-native", "fp8-qat"],
                   help="ref: train the reference character; fp8-native: put the ref DiT's projection weights on the "
                        "served FP8 grid (worker/train/fp8_native.py); fp8-qat: fine-tune the ref DiT under the "
                        "served FP8 rounding, then put it on that grid (worker/train/fp8_qat.py)")
    p.add_argument("--from", dest="source", default=None,
                   help="fp8-native: the ref weights to start from (default weights/ref)")
    p.add_argument("--weights", default=None, help="fp8-qat: the ref weights to fine-tune (default weights/ref)")
    p.add_argument("--steps", type=int, default=None, help="fp8-qat: optimizer steps at most (default 4000)")
    p.add_argument("--lr", type=float, default=None, help="fp8-qat: peak learning rate (default 5e-5)")
    p.add_argument("--seconds", type=float, default=None,
                   help="fp8-qat: wall-clock cap of the fine-tune loop (default 240)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--minutes", type=float, default=6.0, help="training wall-clock budget (VAE + DiT)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, help="directory for the weights and train_log.json")
    p.add_argument("--data", default=None, help="dataset .npz (default: weights/ref/data/ref_data.npz)")
    p.add_argument("--clips", type=int, default=240, help="clips to speak when the dataset must be built")
    p.add_argument("--vae-share", type=float, default=0.3, help="fraction of the budget for the VAE")
    p.add_argument("--batch", type=int, default=None, help="DiT batch (default 64 on cuda, 4 on cpu)")
    p.add_argument("--window", type=int, default=16, help="chunks per DiT training window")
    p.add_argument("--max-clips", type=int, default=None, help="train on the first N clips only (quick CPU runs)")
    p.add_argument("--build-data", action="store_true", help="only build the dataset file, then exit")


def default_data_path() -> Path:
    return default_weights_dir() / "data" / "ref_data.npz"


def _fp8_qat(args: argparse.Namespace) -> int:
    from vivant.worker.train.fp8_qat import QatSettings, check_source, write_fp8_qat

    given = {k: getattr(args, k) for k in ("steps", "lr", "seconds", "batch") if getattr(args, k) is not None}
    device = pick_device(args.device)
    if device.type == "cpu" and args.batch is None:
        given["batch"] = 4
    settings = QatSettings(**given, window=args.window, seed=args.seed)
    src = Path(args.weights) if args.weights else default_weights_dir()
    check_source(src)
    data_path = Path(args.data) if args.data else default_data_path()
    if not data_path.is_file():
        raise ValueError(f"--data {str(data_path)!r}: no such file; expected the dataset .npz "
                         f"(weights/ref/data/ref_data.npz is shipped)")
    record = write_fp8_qat(src, Path(args.out), settings, device=device, data_path=data_path,
                           max_clips=args.max_clips)
    print(json.dumps(record, indent=1))
    return 0


def run(args: argparse.Namespace) -> int:
    if args.what == "fp8-native":
        from vivant.worker.train.fp8_native import write_fp8_native

        src = Path(args.source) if args.source else default_weights_dir()
        if not (src / DIT_FILE).is_file():
            raise ValueError(f"--from {str(src)!r}: {DIT_FILE} is missing; expected the output of `vivant train ref`")
        record = write_fp8_native(src, Path(args.out))
        print(json.dumps(record, indent=1))
        return 0
    if args.what == "fp8-qat":
        return _fp8_qat(args)
    if not args.minutes > 0:
        raise ValueError(f"--minutes = {args.minutes}; expected > 0")
    if not 0 < args.vae_share < 1:
        raise ValueError(f"--vae-share = {args.vae_share}; expected a fraction in (0, 1)")
    cfg = ModelConfig.from_name("ref")
    vcfg = VAEConfig.for_model(cfg)
    log = Log()
    data_path = Path(args.data) if args.data else default_data_path()
    if args.build_data or not data_path.is_file():
        log(f"building the dataset: {args.clips} clips (espeak-ng), seed {args.seed}")
        save_dataset(build_dataset(cfg, clips=args.clips, seed=args.seed, progress=log), data_path)
        log(f"wrote {data_path} ({data_path.stat().st_size / 1e6:.1f} MB)")
        if args.build_data:
            return 0
    device = pick_device(args.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    t_start = time.perf_counter()
    data = load_dataset(data_path, cfg)
    if args.max_clips is not None:
        data = first_clips(data, args.max_clips, cfg)
    meta = json.loads(str(data["meta"]))
    clip_chunks = data["clip_chunks"].astype(np.int64)
    frames = render_dataset_frames(data, cfg, device=device)
    log(f"dataset {data_path.name}: {len(clip_chunks)} clips, {int(clip_chunks.sum())} chunks, "
        f"{frames.shape[0]} frames {tuple(frames.shape[1:])} rendered on {device}")
    budget = args.minutes * 60.0 - (time.perf_counter() - t_start)
    enc, dec, vae_info = train_vae(frames, clip_chunks, vcfg, seconds=args.vae_share * budget, seed=args.seed,
                                   device=device, log=log, batch=32 if device.type == "cuda" else 2)
    latents = encode_all(enc, frames, vcfg, device)
    del frames
    feats = torch.from_numpy(data["features"].astype(np.float32))
    remaining = args.minutes * 60.0 - (time.perf_counter() - t_start) - 5.0
    batch = args.batch or (64 if device.type == "cuda" else 4)
    dit, dit_info = train_dit(latents, feats, clip_chunks, cfg, seconds=max(remaining, 1.0), seed=args.seed,
                              device=device, log=log, batch=batch, window=args.window)
    out = Path(args.out)
    meta_st = {"preset": cfg.name, "seed": str(args.seed)}
    save_tensors(dec.state_dict(), out / VAE_FILE, meta_st)
    save_tensors(enc.state_dict(), out / ENCODER_FILE, meta_st)
    save_tensors({k: v.half() for k, v in dit.state_dict().items()}, out / DIT_FILE, meta_st)
    assert isinstance(dit, VideoDiT)
    record = {
        "command": (f"vivant train ref --device {args.device} --minutes {args.minutes} --seed {args.seed} "
                    f"--window {args.window} --vae-share {args.vae_share}"
                    + (f" --batch {args.batch}" if args.batch else "")
                    + (f" --max-clips {args.max_clips}" if args.max_clips is not None else "")),
        "preset": cfg.to_dict(), "vae_preset": vcfg.name, "seed": args.seed, "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__, "dataset": {"path": data_path.name, "seed": meta.get("seed"),
                                                "clips": len(clip_chunks), "chunks": int(clip_chunks.sum())},
        "vae": vae_info, "dit": dit_info, "total_seconds": round(time.perf_counter() - t_start, 1),
        "log": log.records,
    }
    (out / "train_log.json").write_text(json.dumps(record, indent=1))
    sizes = ", ".join(f"{n} {(out / n).stat().st_size / 1e6:.1f} MB" for n in (DIT_FILE, VAE_FILE, ENCODER_FILE))
    log(f"wrote {out}: {sizes}, train_log.json; total {record['total_seconds']} s")
    return 0
