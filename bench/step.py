"""The DiT chunk step: baseline vs optimized, same weights, same process; per-chunk median and p99 ms.

On CPU (the `tiny` preset) this is a correctness harness: both modes run the same chunks and the
relative RMS error of their latents is reported next to the timings. On a GPU with another preset
(`vivant bench step --preset 57b --tp 4 --rank 0 --device cuda`) it times the served engine on one rank
(bench/step_gpu.py); `--ablation` times each engine choice against its absence (bench/ablation.py).

JSON fields: command, date, preset, tp, rank, device, torch, chunks, passes, baseline_ms/optimized_ms (median per
chunk), *_p99_ms, *_per_chunk_ms, speedup (baseline / optimized), max_rel_rms (optimized vs baseline latents).

torch, numpy and the model are imported when the bench runs, after its arguments and preset are checked.
"""

from __future__ import annotations

import argparse
import platform
import shlex
import sys
import time
from typing import TYPE_CHECKING

from vivant.worker.model.config import ModelConfig
from vivant.worker.model.options import CacheMode

if TYPE_CHECKING:
    import torch


def _splits(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"--attn-kv-splits must be an int >= 1 or 'auto', got {text!r}")
    return value


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", default="tiny", help="model preset (tiny | 57b)")
    p.add_argument("--mode", default="both", choices=[*(m.value for m in CacheMode), "both"])
    p.add_argument("--chunks", type=int, default=30, help="chunks timed per mode (after warm-up)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size whose one rank is measured")
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--device", default="cpu")
    p.add_argument("--no-fp8", action="store_true",
                   help="the baseline cache without its per-call FP8 quantization of K/V")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--init", default="scaled", choices=["unit", "scaled"],
                   help="GPU: random init of the rank (scaled: residual-writing projections / sqrt(2·layers))")
    p.add_argument("--attn-kv-splits", type=_splits, default="auto",
                   help="GPU: slots in this many parts per attention call (kernels/split_kv.py), "
                        "or auto (worker/model/fast_parts.py auto_kv_splits)")
    p.add_argument("--numerics-chunks", type=int, default=0, help="GPU: also compare modes over this many chunks")
    p.add_argument("--numerics-t-limit", type=int, default=40, help="GPU: t_limit for the numerics run (forces resets)")
    p.add_argument("--ablation", action="store_true",
                   help="time the optimized engine and the engine with one choice undone at a time (bench/ablation.py)")
    p.add_argument("--ablation-rows", default=None,
                   help="with --ablation: only these rows (comma-separated; baseline and optimized always run)")
    p.add_argument("--json", action="store_true", help="print only the JSON document")
    p.add_argument("--out", help="also write the JSON to this file")


def measure(cfg: ModelConfig, mode: CacheMode, args) -> tuple[list[float], list[torch.Tensor]]:
    from vivant.bench.harness import time_chunks
    from vivant.worker.model.generator import ChunkGenerator
    from vivant.worker.model.model import VideoDiT, init_random_
    from vivant.worker.model.tp import apply_tensor_parallel

    model = init_random_(VideoDiT(cfg), seed=args.seed)
    if args.tp > 1:
        model = apply_tensor_parallel(model, args.rank, args.tp, reduce="simulated")
    gen = ChunkGenerator(cfg, mode=mode, device=args.device, seed=args.seed, fp8=not args.no_fp8, model=model)
    return time_chunks(gen, cfg, args.warmup, args.chunks)


def run(args: argparse.Namespace) -> int:
    cfg = ModelConfig.from_name(args.preset)
    if args.ablation_rows is not None and not args.ablation:
        raise SystemExit("--ablation-rows applies to --ablation only; the step benchmark times the served engine")
    if args.ablation:
        from vivant.bench.ablation import run as run_ablation

        return run_ablation(args)
    if args.device.startswith("cuda") and args.preset != "tiny":
        from vivant.bench import step_gpu  # the served engine on one GPU rank (FP8 GEMMs, graphs)

        return step_gpu.run(args)
    import numpy as np
    import torch

    modes = [CacheMode.BASELINE, CacheMode.OPTIMIZED] if args.mode == "both" else [CacheMode(args.mode)]
    result = {
        "bench": "step", "command": "vivant " + shlex.join(sys.argv[1:]), "preset": cfg.name, "tp": args.tp,
        "rank": args.rank, "device": args.device,
        "cpu": platform.processor() or platform.machine(), "torch": torch.__version__, "chunks": args.chunks,
        "passes": cfg.passes, "fp8": not args.no_fp8, "date": time.strftime("%Y-%m-%d"),
    }
    latents = {}
    for mode in modes:
        times, lat = measure(cfg, mode, args)
        latents[mode] = lat
        result[f"{mode.value}_ms"] = float(np.median(times))
        result[f"{mode.value}_p99_ms"] = float(np.percentile(times, 99))
        result[f"{mode.value}_per_chunk_ms"] = [round(t, 3) for t in times]
    if len(modes) == 2:
        result["speedup"] = result["baseline_ms"] / result["optimized_ms"]
        errs = [float((a - b).norm() / b.norm())
                for a, b in zip(latents[CacheMode.OPTIMIZED], latents[CacheMode.BASELINE], strict=True)]
        result["max_rel_rms"] = max(errs)
    from vivant.bench.harness import emit_result

    emit_result(result, args.out, args.json)
    if args.json:
        return 0
    print(f"{'mode':<10} {'median ms':>10} {'p99 ms':>10}")
    for mode in modes:
        print(f"{mode.value:<10} {result[f'{mode.value}_ms']:>10.2f} {result[f'{mode.value}_p99_ms']:>10.2f}")
    if len(modes) == 2:
        print(f"speedup (baseline/optimized) {result['speedup']:.2f}×, max rel RMS {result['max_rel_rms']:.2e}")
    sys.stdout.flush()
    return 0
