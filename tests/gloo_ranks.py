"""Spawned torch.distributed ranks on the gloo backend for the tensor-parallel tests (CPU, loopback only).

`run_ranks(fn, world, out_dir)` starts `world` processes running `fn(rank, world, out_dir)` inside a gloo
group and returns what each rank saved to `out_dir/rank{r}.pt`. Each rank runs with one CPU thread and NVLink
multicast disabled (the symmetric-memory code paths check it). Ranks meet at a barrier before the group is torn
down: a rank tearing gloo down while its peer is still in a collective can abort the process ("terminate called
without an active exception", seen once in CI).
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_entry(rank: int, fn, world: int, port: int, out_dir: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        fn(rank, world, out_dir)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_ranks(fn, world: int, out_dir: str | Path) -> list:
    """Run `fn(rank, world, out_dir)` on `world` gloo ranks; returns each rank's `rank{r}.pt` contents."""
    mp.start_processes(_rank_entry, args=(fn, world, _free_port(), str(out_dir)), nprocs=world, join=True,
                       start_method="spawn")
    return [torch.load(Path(out_dir) / f"rank{r}.pt") for r in range(world)]
