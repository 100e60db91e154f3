"""Two GPUs of one host (NCCL): the tensor-parallel FP8 engine at TP = 2 with a real all-reduce, unfused vs
the fused GEMM + all-reduce paths, and the all-reduce itself timed — what a 2-GPU machine can show of the
multi-GPU issue (its 4 + 1 runs need 5 GPUs).

Per rank r on cuda:r: the 57b block shapes at TP = 2 (32 heads, QKV N = 12288, O K = 4096, gate+up N = 27648,
down K = 13824) with `--layers` layers (default 12, so both ranks' FP8 + bf16 weights fit), random weights,
CUDA graphs; the same chunks run unfused, fused ("auto": symmetric memory on CUDA) and fused ("chunked_overlap").
Rank 0 writes the JSON. NVLink multicast stays off (NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1).

torchrun-free: python bench/gpu_tp2.py --out tp2.json  (spawns one process per visible GPU, at most 2)
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import time
import traceback

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

for _k, _v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ[_k] = _v


def _chunks(gen, cfg, n, warmup):
    from vivant.bench.gpu_step import _audio

    gen.reset_session(7)
    times, lat = [], []
    for i in range(n):
        a = _audio(cfg, i)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = gen.generate_chunk(a, cfg.audio_sample_rate)
        end.record()
        torch.cuda.synchronize()
        if i >= warmup:
            times.append(start.elapsed_time(end))
        lat.append(out.latents.cpu())
    return float(np.median(times)), lat


def _rank(rank: int, world: int, port: int, args, out: str) -> None:
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            device_id=torch.device("cuda", rank))
    res: dict = {"rank": rank, "world": world}
    try:
        from vivant.apis.feature_flags import FlagValues
        from vivant.bench.gpu_step import build_rank
        from vivant.worker.model.config import ModelConfig
        from vivant.worker.model.engine import Engine
        from vivant.worker.model.generator import ChunkGenerator
        from vivant.worker.model.options import AttentionBackend, CacheMode, EngineOptions

        cfg = ModelConfig.from_name("57b", n_layers=args.layers)
        x = torch.randn(cfg.tokens_per_chunk, cfg.d_model, device="cuda", dtype=torch.bfloat16)
        for _ in range(5):
            dist.all_reduce(x)
        torch.cuda.synchronize()
        ts = []
        for _ in range(50):
            s_, e_ = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s_.record()
            dist.all_reduce(x)
            e_.record()
            torch.cuda.synchronize()
            ts.append(s_.elapsed_time(e_))
        res["allreduce_757x8192_bf16_ms"] = float(np.median(ts))
        model = build_rank(cfg, world, rank, keep_bf16=False, reduce="dist", device=f"cuda:{rank}")
        fast = Engine.build(model, EngineOptions(fp8=True, attention=AttentionBackend.SDPA, cuda_graphs=True),
                            inplace=True)
        gen = ChunkGenerator(cfg, mode=CacheMode.OPTIMIZED, device=f"cuda:{rank}", dtype=torch.bfloat16, engine=fast,
                             seed=7)
        runs = {}
        res["path_unfused"] = gen.apply_flags(FlagValues(fusedGemmAllReduce=False))
        runs["unfused"] = _chunks(gen, cfg, args.chunks, args.warmup)
        for method in ("auto", "chunked_overlap"):
            try:
                res[f"path_{method}"] = fast.set_row_parallel_path(fused=True, method=method)
                runs[method] = _chunks(gen, cfg, args.chunks, args.warmup)
            except Exception as exc:  # record what failed; the other paths still report
                res[f"error_{method}"] = f"{type(exc).__name__}: {exc}"[:2000]
                res[f"traceback_{method}"] = traceback.format_exc()[-3000:]
        base = runs["unfused"][1]
        for name, (ms, lat) in runs.items():
            res[f"{name}_ms"] = ms
            res[f"{name}_rel_rms_vs_unfused_max"] = max(float((a - b).norm() / b.norm()) for a, b in zip(lat, base, strict=True))
        torch.save({k: v[1] for k, v in runs.items()}, os.path.join(out, f"lat{rank}.pt"))
    except Exception as exc:
        res["error"] = f"{type(exc).__name__}: {exc}"
        res["traceback"] = traceback.format_exc()[-4000:]
    finally:
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump(res, f, indent=2)
        dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--chunks", type=int, default=16)
    p.add_argument("--warmup", type=int, default=9)
    p.add_argument("--out", default="tp2.json")
    args = p.parse_args()
    world = min(2, torch.cuda.device_count())
    tmp = os.path.dirname(os.path.abspath(args.out)) or "."
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.time()
    mp.start_processes(_rank, args=(world, port, args, tmp), nprocs=world, join=True, start_method="spawn")
    ranks = [json.load(open(os.path.join(tmp, f"rank{r}.json"))) for r in range(world)]
    doc = {"bench": "tp2", "gpus": world, "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
           "date": time.strftime("%Y-%m-%d"), "layers": args.layers, "chunks": args.chunks, "warmup": args.warmup,
           "wall_s": time.time() - t0, "ranks": ranks}
    if world == 2 and all(os.path.exists(os.path.join(tmp, f"lat{r}.pt")) for r in range(2)):
        l0, l1 = (torch.load(os.path.join(tmp, f"lat{r}.pt")) for r in range(2))
        doc["ranks_bitwise_equal"] = {k: all(torch.equal(a, b) for a, b in zip(l0[k], l1[k], strict=True)) for k in l0 if k in l1}
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=2)
    print(json.dumps({k: v for k, v in doc.items() if k != "ranks"}, indent=1))
    for r in ranks:
        print({k: v for k, v in r.items() if not k.startswith("traceback")})


if __name__ == "__main__":
    main()
