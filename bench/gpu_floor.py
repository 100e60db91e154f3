"""How much does the random-weight 57b rank shard amplify a rounding-sized perturbation?

Runs the optimized FP8 engine twice on the same weights and audio, the second time with every chunk's initial
noise perturbed by a relative 2⁻⁸ (one bf16 rounding step), and reports the per-chunk relative RMS between the
two latent streams. This is the floor under any optimized-vs-baseline comparison on these weights: two paths
that differ only by bf16/FP8 rounding cannot be expected to agree closer than this.

python bench/gpu_floor.py --chunks 40 --out bench/results/floor_57b_tp4_rank0_h200.json
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch
from vivant.bench.gpu_step import _audio, build_rank
from vivant.worker.model.config import ModelConfig
from vivant.worker.model.engine import Engine
from vivant.worker.model.generator import ChunkGenerator
from vivant.worker.model.options import AttentionBackend, CacheMode, EngineOptions


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--chunks", type=int, default=40)
    p.add_argument("--out")
    p.add_argument("--init", default="scaled", choices=["unit", "scaled"], help="random init (bench/gpu_step.py)")
    p.add_argument("--attn-backend", default=AttentionBackend.IMAGE.value,
                   choices=[AttentionBackend.IMAGE.value, AttentionBackend.SDPA.value])
    args = p.parse_args()
    cfg = ModelConfig.from_name("57b", t_limit=40)
    model = build_rank(cfg, 4, 0, keep_bf16=False, init=args.init)
    options = EngineOptions(fp8=True, attention=args.attn_backend, kv_splits="auto", fast_accum=True, cuda_graphs=True)
    fast = Engine.build(model, options, inplace=True)
    kw = dict(mode=CacheMode.OPTIMIZED, device="cuda", dtype=torch.bfloat16, seed=7)
    a = ChunkGenerator(cfg, engine=fast, **kw)
    lat_a = [a.generate_chunk(_audio(cfg, n), cfg.audio_sample_rate).latents for n in range(args.chunks)]
    b = ChunkGenerator(cfg, engine=Engine(fast.model, options), **kw)
    base_noise = b.noise

    def perturbed(chunk: int) -> torch.Tensor:
        x = base_noise(chunk)
        g = torch.Generator(device="cpu").manual_seed(10_000 + chunk)
        return x * (1 + 2.0**-8 * torch.randn(x.shape, generator=g).to(x.device))

    b.noise = perturbed
    lat_b = [b.generate_chunk(_audio(cfg, n), cfg.audio_sample_rate).latents for n in range(args.chunks)]
    in_err = float(np.mean([float((perturbed(n) - base_noise(n)).norm() / base_noise(n).norm()) for n in range(3)]))
    errs = [float((x - y).norm() / y.norm()) for x, y in zip(lat_a, lat_b, strict=True)]
    res = {"bench": "floor", "preset": "57b", "tp": 4, "rank": 0, "init": args.init, "gpu": torch.cuda.get_device_name(0),
           "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"), "chunks": args.chunks,
           "input_rel_perturbation": in_err, "max_rel_rms": max(errs), "median_rel_rms": float(np.median(errs)),
           "rel_rms_per_chunk": [round(e, 6) for e in errs]}
    text = json.dumps(res, indent=2)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(f"input perturbation {in_err:.2e} → output relative RMS max {max(errs):.3e}, median {np.median(errs):.3e}")


if __name__ == "__main__":
    main()
