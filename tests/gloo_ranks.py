"""Spawned torch.distributed ranks on the gloo backend for the tensor-parallel tests (CPU, loopback only).

`run_ranks(fn, world, out_dir)` starts `world` processes running `fn(rank, world, out_dir)` inside a gloo
group and returns what each rank saved to `out_dir/rank{r}.pt`. Each rank runs with one CPU thread and NVLink
multicast disabled (the symmetric-memory code paths check it). Ranks meet at a barrier before the group is torn
down: a rank tearing gloo down while its peer is still in a collective can abort the process ("terminate called
without an active exception", seen once in CI).

Every call starts fresh processes (nothing is shared between calls), forked from multiprocessing's fork server,
which imports torch and the model modules once per test session (`PRELOAD`): a spawned rank paid that import
(3.5 s for one rank, 7 s for four on two cores) on every call. The fork server's sys.path and environment are the
ones of the moment it started, so each rank takes the caller's sys.path (pytest adds test folders as it goes)
and environment before it unpickles `fn`.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from vivant.ports import free_port

# Imported once by the fork server (a module missing here is skipped by multiprocessing, not an error).
PRELOAD = ["torch", "torch.distributed", "gloo_ranks", "numpy", "pytest", "vivant.worker.model.model",
           "vivant.worker.model.generator", "vivant.worker.model.engine", "vivant.worker.model.tp",
           "vivant.worker.model.fused_tp", "vivant.worker.model.fast_parts", "vivant.kernels.fp8"]


def _rank_entry(rank: int, fn_pickle: bytes, sys_path: list[str], environ: dict[str, str], world: int, port: int,
                out_dir: str) -> None:
    sys.path[:] = sys_path
    os.environ.clear()
    os.environ.update(environ)
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
    torch.set_num_threads(1)
    fn = pickle.loads(fn_pickle)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        fn(rank, world, out_dir)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_ranks(fn, world: int, out_dir: str | Path) -> list:
    """Run `fn(rank, world, out_dir)` on `world` gloo ranks; returns each rank's `rank{r}.pt` contents."""
    multiprocessing.get_context("forkserver").set_forkserver_preload(PRELOAD)  # used when the server starts
    mp.start_processes(_rank_entry, args=(pickle.dumps(fn), list(sys.path), dict(os.environ), world, free_port(),
                                          str(out_dir)), nprocs=world, join=True, start_method="forkserver")
    return [torch.load(Path(out_dir) / f"rank{r}.pt") for r in range(world)]
