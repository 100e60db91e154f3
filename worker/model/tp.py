"""Tensor parallelism as a transform over a built VideoDiT (the model code knows nothing of it).

For rank r of W (heads H, head_dim D, SwiGLU width F, local heads H/W):
- `attn.qkv`  [3·H·D, d] → column shard [3·(H/W)·D, d]: rows of q, k and v for heads r·H/W … (r+1)·H/W;
- `attn.o`    [d, H·D]   → row shard [d, (H/W)·D], followed by an all-reduce (sum over ranks);
- `mlp.gate_up` [2F, d]  → [2F/W, d]: rows r·F/W … of gate and the same rows of up;
- `mlp.down`  [d, F]     → [d, F/W], followed by an all-reduce.
Everything else (embeddings, modulation, norms, output head) is replicated. The KV cache of a rank holds
only its heads, so a rank's cache is 1/W of the whole. For the 57b preset at W = 4: 16 heads,
QKV N = 6144, O K = 2048, gate+up N = 13824, down K = 6912.

The reduce after a row-parallel projection is one of three modules with one interface: `Reduce` (the
identity: TP = 1), `AllReduce` (torch.distributed: NCCL on GPUs, gloo on CPU) and `SimulatedAllReduce` (the
single-GPU stand-in of the one-rank benchmark: the same-sized local reduction, so the bytes moved are counted,
reported as its own line). `fusable_group()` says whether a fused GEMM + all-reduce has a group to sum over
(worker/model/fused_tp.py).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn


class Reduce(nn.Module):
    """The all-reduce after a row-parallel projection at TP = 1: the identity."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def fusable_group(self) -> dist.ProcessGroup | None:
        return None

    def adds_residual(self) -> bool:
        """Whether this rank's partial product carries the residual when the GEMM adds it (EngineOptions.
        residual_in_gemm): exactly one rank of the group does, so the sum holds it once."""
        return True


class AllReduce(Reduce):
    def __init__(self, group: dist.ProcessGroup | None = None):
        super().__init__()
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x, op=dist.ReduceOp.SUM, group=self.group)
        return x

    def fusable_group(self) -> dist.ProcessGroup | None:
        """The group to sum over, or None when it has one rank (nothing to fuse)."""
        group = self.group if self.group is not None else dist.group.WORLD
        return group if dist.get_world_size(group) > 1 else None

    def adds_residual(self) -> bool:
        """Rank 0 of the group adds the residual to its partial product; the others add nothing."""
        return dist.get_rank(self.group if self.group is not None else dist.group.WORLD) == 0


class SimulatedAllReduce(Reduce):
    """One-GPU stand-in for a W-way all-reduce: reads W partial sums and writes one (same bytes as a
    reduce-scatter + all-gather's local work), returning x unchanged in value."""

    def __init__(self, world_size: int):
        super().__init__()
        self.world_size = world_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        parts = x.unsqueeze(0).expand(self.world_size, *x.shape)
        return parts.sum(0) / self.world_size


def _shard_rows(w: torch.Tensor, rank: int, world: int, groups: int) -> torch.Tensor:
    """Split the output rows into `groups` equal blocks (q/k/v or gate/up) and take this rank's slice of each."""
    blocks = w.chunk(groups, dim=0)
    parts = []
    for b in blocks:
        if b.shape[0] % world:
            raise ValueError(f"cannot shard {tuple(w.shape)} rows of {b.shape[0]} per block over {world} ranks")
        n = b.shape[0] // world
        parts.append(b[rank * n:(rank + 1) * n])
    return torch.cat(parts, dim=0)


def _shard_cols(w: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    if w.shape[1] % world:
        raise ValueError(f"cannot shard {tuple(w.shape)} columns over {world} ranks")
    n = w.shape[1] // world
    return w[:, rank * n:(rank + 1) * n]


def _replace(linear: nn.Linear, weight: torch.Tensor) -> None:
    linear.weight = nn.Parameter(weight.contiguous(), requires_grad=False)
    linear.in_features, linear.out_features = weight.shape[1], weight.shape[0]


def apply_tensor_parallel(model: nn.Module, rank: int, world_size: int, *, group: dist.ProcessGroup | None = None,
                          reduce: str = "dist") -> nn.Module:
    """Shard `model` (a VideoDiT, worker/model/model.py, which imports this module) in place for `rank` of
    `world_size`. reduce: "dist" (torch.distributed all-reduce),
    "simulated" (one-GPU stand-in, benchmark only) or "none" (leave partial sums; tests)."""
    cfg = model.cfg
    cfg.shard_heads(world_size)  # raises a ConfigError naming the field when it does not divide
    if not 0 <= rank < world_size:
        raise ValueError(f"rank = {rank}; expected 0 ≤ rank < world_size = {world_size}")
    if world_size == 1:
        return model
    with torch.no_grad():
        for block in model.blocks:
            _replace(block.attn.qkv, _shard_rows(block.attn.qkv.weight, rank, world_size, groups=3))
            _replace(block.attn.o, _shard_cols(block.attn.o.weight, rank, world_size))
            _replace(block.mlp.gate_up, _shard_rows(block.mlp.gate_up.weight, rank, world_size, groups=2))
            _replace(block.mlp.down, _shard_cols(block.mlp.down.weight, rank, world_size))
            for mod in (block.attn, block.mlp):
                if reduce == "dist":
                    mod.reduce = AllReduce(group)
                elif reduce == "simulated":
                    mod.reduce = SimulatedAllReduce(world_size)
                elif reduce != "none":
                    raise ValueError(f"reduce = {reduce!r}; expected 'dist', 'simulated' or 'none'")
    model.tp_rank, model.tp_world_size = rank, world_size
    return model


def local_shapes(cfg, world_size: int) -> dict[str, tuple[int, int]]:
    """The per-rank GEMM shapes (N, K) of one block: what the benchmark times and the FLOP count uses."""
    h = cfg.shard_heads(world_size)
    f = cfg.d_ff // world_size
    return {
        "qkv": (3 * h * cfg.head_dim, cfg.d_model),
        "o": (cfg.d_model, h * cfg.head_dim),
        "gate_up": (2 * f, cfg.d_model),
        "down": (cfg.d_model, f),
    }
