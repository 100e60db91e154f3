"""The row-parallel GEMM fused with the tensor-parallel all-reduce (O and down), behind a flag.

Why: in the unfused step every block waits twice for an all-reduce of a [tokens, d_model] partial sum
after its row-parallel GEMM (`attn.o`, `mlp.down`); at TP = 4 on the 57b preset that is 757 × 8192
values per reduce, 120 per pass. Fusing lets the reduction of finished output tiles run while the GEMM
still computes the rest, so most of the communication hides behind the math.

`FusedRowParallel` has the signature of the pair it replaces: `fused(x) == reduce(linear(x))`, with
x [..., K_local] (K_local = K / tp: this rank's heads × head_dim, or d_ff / tp) and the result
[..., N] (N = d_model), summed over the TP group. Methods (`FusedMethod`):

* `symm_mem` (CUDA + NCCL): torch's symmetric-memory op `symm_mem::fused_matmul_reduce_scatter`
  computes the GEMM in per-peer column blocks and pushes each finished block to its owner over
  peer-to-peer symmetric memory while the next block is computed, leaving each rank its reduced
  N / tp columns; an all-gather over the TP group then rebuilds [tokens, N]. Scattering on the
  column dim (N = d_model divides by tp) avoids padding the 757 token rows (757 is prime). Multicast
  (NVLS, in-switch) must stay off: this path refuses to run unless TORCH_SYMM_MEM_DISABLE_MULTICAST=1.
* `chunked_overlap` (any backend, gloo included): the token rows are split into `chunks` blocks; the
  GEMM of block i runs while block i−1's asynchronous all-reduce is in flight, then all are awaited.
  Same math as the unfused pair, up to float summation order.
* `in_switch`: the design slot for NVLink-multicast (in-switch) reduction on clusters that allow it
  (e.g. `symm_mem::multimem_all_reduce_`). Not allowed on the machines this project runs on, so it
  raises NotImplementedError with the reason.
* `auto`: `symm_mem` for CUDA tensors on an NCCL group, else `chunked_overlap`.

`set_row_parallel_path(model, fused=...)` swaps every block's O/down between the unfused pair and the
fused module. It only touches blocks whose `reduce` is a real `AllReduce` (TP > 1), keeps the original
modules so the swap is reversible, and is meant to run between chunks (`ChunkGenerator.apply_flags`),
on every TP rank at the same chunk boundary (the ranks must issue the same collectives).
"""

from __future__ import annotations

import enum
import os

import torch
import torch.distributed as dist
import torch.nn as nn

from .model import Reduce, VideoDiT
from .tp import AllReduce

MULTICAST_ENV = "TORCH_SYMM_MEM_DISABLE_MULTICAST"
IN_SWITCH_MESSAGE = (
    "fused method 'in_switch' (NVLink multicast / NVLS reduction) is a design slot only: in-switch reduction is "
    "not allowed on the machines vivant runs on (TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NCCL_NVLS_ENABLE=0); "
    "use 'symm_mem' (peer-to-peer) or 'chunked_overlap'")


class FusedMethod(enum.StrEnum):
    AUTO = "auto"
    SYMM_MEM = "symm_mem"
    CHUNKED_OVERLAP = "chunked_overlap"
    IN_SWITCH = "in_switch"


def parse_method(value: str | FusedMethod) -> FusedMethod:
    try:
        return FusedMethod(value)
    except ValueError:
        raise ValueError(f"fused method = {value!r}; expected one of {[m.value for m in FusedMethod]}") from None


class FusedRowParallel(nn.Module):
    """`reduce(linear(x))` as one step: a row-parallel GEMM whose output is summed over `group`.

    Holds the linear it replaces (weight [N, K_local], shared, not copied) and the unfused reduce module,
    so `set_row_parallel_path` can restore both. Inference only (no autograd), like `AllReduce`."""

    def __init__(self, linear: nn.Linear, unfused_reduce: AllReduce, *, method: str | FusedMethod = FusedMethod.AUTO,
                 chunks: int = 4) -> None:
        super().__init__()
        if chunks < 1:
            raise ValueError(f"FusedRowParallel.chunks = {chunks}; expected a positive integer")
        self.method = parse_method(method)
        if self.method is FusedMethod.IN_SWITCH:
            raise NotImplementedError(IN_SWITCH_MESSAGE)
        self.linear = linear
        self.unfused_reduce = unfused_reduce
        self.group = unfused_reduce.group
        self.chunks = chunks

    def resolved_method(self, x: torch.Tensor) -> FusedMethod:
        if self.method is not FusedMethod.AUTO:
            return self.method
        backend = dist.get_backend(self.group)
        return FusedMethod.SYMM_MEM if x.is_cuda and backend == "nccl" else FusedMethod.CHUNKED_OVERLAP

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead, k = x.shape[:-1], x.shape[-1]
        if k != self.linear.in_features:
            raise ValueError(f"FusedRowParallel input: expected last dim {self.linear.in_features} (K per rank), got {k}")
        x2 = x.reshape(-1, k)
        method = self.resolved_method(x)
        if method is FusedMethod.SYMM_MEM:
            y = symm_mem_matmul_all_reduce(x2, self.linear.weight, self.group)
        else:
            y = chunked_overlap_matmul_all_reduce(x2, self.linear.weight, self.group, self.chunks)
        if self.linear.bias is not None:  # added once, after the sum (each rank's partial has no bias)
            y = y + self.linear.bias
        return y.reshape(*lead, y.shape[-1])


def chunked_overlap_matmul_all_reduce(x: torch.Tensor, weight: torch.Tensor, group: dist.ProcessGroup | None,
                                      chunks: int) -> torch.Tensor:
    """sum over ranks of x @ weight.T, x [M, K_local], weight [N, K_local] → [M, N].

    Row block i's GEMM is computed while the all-reduces of the earlier blocks are in flight."""
    m = x.shape[0]
    out = torch.empty(m, weight.shape[0], dtype=torch.result_type(x, weight), device=x.device)
    bounds = torch.linspace(0, m, min(chunks, max(m, 1)) + 1).round().long().tolist()
    works = []
    wt = weight.t()
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):
        if b == a:
            continue
        block = out[a:b]  # a row slice of a row-major matrix: contiguous
        torch.mm(x[a:b], wt, out=block)
        works.append(dist.all_reduce(block, op=dist.ReduceOp.SUM, group=group, async_op=True))
    for work in works:
        work.wait()
    return out


def symm_mem_matmul_all_reduce(x: torch.Tensor, weight: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """CUDA + NCCL: symmetric-memory fused GEMM + reduce-scatter on the column dim, then an all-gather.

    x [M, K_local], weight [N, K_local] → [M, N]. Peer-to-peer only: refuses to run with multicast enabled.
    On CPU tensors (tests) torch's reference of the same op runs instead, so the column scatter and the
    gather back are checked on gloo; the CUDA kernel itself runs only on GPUs."""
    if os.environ.get(MULTICAST_ENV) != "1":
        raise RuntimeError(f"{MULTICAST_ENV} = {os.environ.get(MULTICAST_ENV)!r}; expected '1' (in-switch/multicast "
                           "reduction must stay off; the launcher in worker/tp_layout.py sets it before init)")
    group = group if group is not None else dist.group.WORLD
    world = dist.get_world_size(group)
    n = weight.shape[0]
    if n % world:
        raise ValueError(f"output features N = {n} do not divide by the TP world size {world}")
    import torch.distributed._symmetric_memory as symm_mem  # registers the op's CUDA implementation (Python)

    if x.is_cuda:
        op = torch.ops.symm_mem.fused_matmul_reduce_scatter
    else:  # torch's own reference of the op (GEMM, then a plain reduce-scatter): same math, no symmetric memory
        op = symm_mem._fused_matmul_reduce_scatter_fallback
    shard = op(x, weight.t(), "sum", 1, group.group_name)  # [M, N/W], columns rank·N/W …
    return gather_column_shards(shard.contiguous(), group)


def gather_column_shards(shard: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """All-gather each rank's [M, N/W] column block into [M, N] (rank r's block at columns r·N/W …)."""
    world = dist.get_world_size(group)
    m, nw = shard.shape
    stacked = torch.empty(world * m, nw, dtype=shard.dtype, device=shard.device)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in newer torch
    gather(stacked, shard, group=group)
    return stacked.view(world, m, nw).permute(1, 0, 2).reshape(m, world * nw)


def _row_parallel_pairs(model: VideoDiT):
    for block in model.blocks:
        yield block.attn, "o"
        yield block.mlp, "down"


def set_row_parallel_path(model: VideoDiT, *, fused: bool, method: str | FusedMethod = FusedMethod.AUTO,
                          chunks: int = 4) -> str:
    """Install (fused=True) or remove the fused O/down + all-reduce in every block of a TP-sharded model.

    Returns the path now in effect: "fused_gemm_all_reduce", "gemm_then_all_reduce", or "no_tp" when the
    model has no all-reduce to fuse (TP = 1, or a `reduce` other than `AllReduce`)."""
    method = parse_method(method)
    if fused and method is FusedMethod.IN_SWITCH:
        raise NotImplementedError(IN_SWITCH_MESSAGE)
    touched = 0
    for mod, name in _row_parallel_pairs(model):
        current = getattr(mod, name)
        if fused:
            if isinstance(current, FusedRowParallel):
                current.method, current.chunks = method, chunks
                touched += 1
            elif isinstance(mod.reduce, AllReduce):
                setattr(mod, name, FusedRowParallel(current, mod.reduce, method=method, chunks=chunks))
                mod.reduce = Reduce()
                touched += 1
        elif isinstance(current, FusedRowParallel):
            setattr(mod, name, current.linear)
            mod.reduce = current.unfused_reduce
            touched += 1
        elif isinstance(mod.reduce, AllReduce):
            touched += 1
    if not touched:
        return "no_tp"
    return "fused_gemm_all_reduce" if fused else "gemm_then_all_reduce"


def row_parallel_path(model: VideoDiT) -> str:
    """The path the model runs now (same names as `set_row_parallel_path` returns)."""
    kinds = set()
    for mod, name in _row_parallel_pairs(model):
        if isinstance(getattr(mod, name), FusedRowParallel):
            kinds.add("fused_gemm_all_reduce")
        elif isinstance(mod.reduce, AllReduce):
            kinds.add("gemm_then_all_reduce")
    if len(kinds) > 1:
        raise RuntimeError(f"model runs a mix of row-parallel paths: {sorted(kinds)}")
    return kinds.pop() if kinds else "no_tp"
