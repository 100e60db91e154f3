"""The row-parallel GEMM fused with the tensor-parallel all-reduce (O and down), behind a flag.

Why: in the unfused step every block waits twice for an all-reduce of a [tokens, d_model] partial sum
after its row-parallel GEMM (`attn.o`, `mlp.down`); at TP = 4 on the 57b preset that is 757 × 8192
values per reduce, 120 per pass. Fusing lets the reduction of finished output tiles run while the GEMM
still computes the rest, so most of the communication hides behind the math.

The model's O and down projections run through one swappable row-parallel step, `step(a, linear, reduce)
-> [tokens, d_model]` summed over the TP group (worker/model/model.py):

* `GemmThenAllReduce`: `reduce(linear(a))` — the unfused pair;
* `FusedGemmAllReduce(method, chunks)`: `linear.matmul_all_reduce(a, group, method, chunks)`, the GEMM fused
  with the sum, in the linear's own weight format: the float `Linear` (x [M, K_local] @ W[N, K_local]ᵀ) or the
  FP8 `Fp8Linear` (rows quantized with one scale each, weights with one scale per output channel), each with
  the methods below. Where the reduce has no group to sum over (TP = 1, the one-GPU stand-in), it runs the
  unfused pair.

Methods (`FusedMethod`):

* `symm_mem` (CUDA + NCCL): torch's symmetric-memory ops. Float: `symm_mem::fused_matmul_reduce_scatter`
  computes the GEMM in per-peer column blocks and pushes each finished block to its owner over peer-to-peer
  symmetric memory while the next is computed, leaving each rank its reduced N / tp columns; an all-gather
  rebuilds [tokens, N] (scattering columns avoids padding the 757 token rows; 757 is prime). FP8:
  `symm_mem::fused_scaled_matmul_reduce_scatter` (rowwise scales) scatters token rows, so M is padded to a
  multiple of tp with zero rows of scale 1 and the gather is on rows. Multicast (NVLS, in-switch) must stay
  off: these refuse to run unless TORCH_SYMM_MEM_DISABLE_MULTICAST=1.
* `chunked_overlap` (any backend, gloo included): the token rows in `chunks` blocks; block i's GEMM runs while
  the earlier blocks' asynchronous all-reduces are in flight, then all are awaited. Same math as the unfused
  pair, up to summation order.
* `in_switch`: the design slot for NVLink-multicast (in-switch) reduction on clusters that allow it
  (e.g. `symm_mem::multimem_all_reduce_`). Not allowed on the machines this project runs on: it raises
  NotImplementedError with the reason.
* `auto`: `symm_mem` for CUDA tensors on an NCCL group, else `chunked_overlap`.

`VideoDiT.set_row_parallel_path(fused=...)` installs one step in every block, between chunks only, on every
TP rank at the same chunk boundary (the ranks must issue the same collectives).
"""

from __future__ import annotations

import enum
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
from vivant.kernels.fp8_gemm import fp8_linear

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


def resolve_method(method: FusedMethod, x: torch.Tensor, group: dist.ProcessGroup | None) -> FusedMethod:
    """`auto` → `symm_mem` for CUDA tensors on an NCCL group, else `chunked_overlap`; others unchanged."""
    if method is not FusedMethod.AUTO:
        return method
    return FusedMethod.SYMM_MEM if x.is_cuda and dist.get_backend(group) == "nccl" else FusedMethod.CHUNKED_OVERLAP


def row_blocks(m: int, chunks: int) -> list[tuple[int, int]]:
    """[a, b) bounds of `chunks` near-equal row blocks of m rows (fewer when m < chunks), none empty."""
    bounds = torch.linspace(0, m, min(chunks, max(m, 1)) + 1).round().long().tolist()
    return [(a, b) for a, b in zip(bounds[:-1], bounds[1:], strict=True) if b > a]


def overlap_row_blocks_all_reduce(out: torch.Tensor, gemm_into: Callable[[int, int, torch.Tensor], object],
                                  group: dist.ProcessGroup | None, chunks: int) -> torch.Tensor:
    """Fill out [M, N] block by block with `gemm_into(a, b, out[a:b])` (rows a … b−1 of this rank's partial
    product) and start each block's asynchronous sum over `group` as soon as it is written, so block i's
    GEMM runs while block i−1 is on the wire; returns `out` once every reduction has landed."""
    works = []
    for a, b in row_blocks(out.shape[0], chunks):
        block = out[a:b]  # a row slice of a row-major matrix: contiguous
        gemm_into(a, b, block)
        works.append(dist.all_reduce(block, op=dist.ReduceOp.SUM, group=group, async_op=True))
    for work in works:
        work.wait()
    return out


def chunked_overlap_matmul_all_reduce(x: torch.Tensor, weight: torch.Tensor, group: dist.ProcessGroup | None,
                                      chunks: int) -> torch.Tensor:
    """sum over ranks of x @ weight.T, x [M, K_local], weight [N, K_local] → [M, N].

    Row block i's GEMM is computed while the all-reduces of the earlier blocks are in flight."""
    out = torch.empty(x.shape[0], weight.shape[0], dtype=torch.result_type(x, weight), device=x.device)
    wt = weight.t()
    return overlap_row_blocks_all_reduce(out, lambda a, b, block: torch.mm(x[a:b], wt, out=block), group, chunks)


def require_multicast_off() -> None:
    """The symmetric-memory paths are peer-to-peer only: refuse unless multicast (NVLS) is disabled."""
    if os.environ.get(MULTICAST_ENV) != "1":
        raise RuntimeError(f"{MULTICAST_ENV} = {os.environ.get(MULTICAST_ENV)!r}; expected '1' (in-switch/multicast "
                           "reduction must stay off; the worker's launcher sets it in every rank before init)")


def _symm_mem_module(group: dist.ProcessGroup, on_cuda: bool):
    """torch's symmetric-memory module (importing it registers the ops' CUDA implementations), with the
    group's symmetric-memory rendezvous set up once when the op will really run on GPUs."""
    import torch.distributed._symmetric_memory as symm_mem

    if on_cuda and not symm_mem.is_symm_mem_enabled_for_group(group.group_name):
        symm_mem.enable_symm_mem_for_group(group.group_name)
    return symm_mem


def symm_mem_matmul_all_reduce(x: torch.Tensor, weight: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """CUDA + NCCL: symmetric-memory fused GEMM + reduce-scatter on the column dim, then an all-gather.

    x [M, K_local], weight [N, K_local] → [M, N]. Peer-to-peer only: refuses to run with multicast enabled.
    On CPU tensors (tests) torch's reference of the same op runs instead, so the column scatter and the
    gather back are checked on gloo; the CUDA kernel itself runs only on GPUs."""
    require_multicast_off()
    group = group if group is not None else dist.group.WORLD
    world = dist.get_world_size(group)
    n = weight.shape[0]
    if n % world:
        raise ValueError(f"output features N = {n} do not divide by the TP world size {world}")
    symm_mem = _symm_mem_module(group, x.is_cuda)
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


def chunked_overlap_fp8_matmul_all_reduce(a8: torch.Tensor, sa: torch.Tensor, w8: torch.Tensor, sw: torch.Tensor,
                                          group: dist.ProcessGroup | None, chunks: int, *,
                                          fast_accum: bool = False) -> torch.Tensor:
    """sum over ranks of fp8_linear(a8, sa, w8, sw), bf16 [M, N], row block i (its rows of a8 with their
    scales) computed while the earlier blocks' all-reduces are in flight."""
    out = torch.empty(a8.shape[0], w8.shape[0], dtype=torch.bfloat16, device=a8.device)

    def gemm_into(a: int, b: int, block: torch.Tensor) -> None:
        scales = sa[a:b]
        if scales.is_cuda and scales.data_ptr() % 16:  # cuBLASLt's rowwise scales must be 16-byte aligned
            scales = scales.clone()
        block.copy_(fp8_linear(a8[a:b], scales, w8, sw, out_dtype=block.dtype, fast_accum=fast_accum))

    return overlap_row_blocks_all_reduce(out, gemm_into, group, chunks)


def symm_mem_fp8_matmul_all_reduce(a8: torch.Tensor, sa: torch.Tensor, w8: torch.Tensor, sw: torch.Tensor,
                                   group: dist.ProcessGroup | None) -> torch.Tensor:
    """CUDA + NCCL: torch's `symm_mem::fused_scaled_matmul_reduce_scatter` (rowwise scales), then a row
    all-gather. a8 fp8 [M, K_local], sa f32 [M], w8 fp8 [N, K_local], sw f32 [N] → bf16 [M, N].

    The op scatters token rows (scatter dim 0 of A), so M is padded to a multiple of the world size with
    zero rows of scale 1 (757 → 760 at tp = 4) and the padding is cut after the gather. Peer-to-peer only
    (refuses with multicast enabled). On CPU tensors torch's reference of the op (`_scaled_mm`, then a
    plain reduce-scatter) runs instead, so the padding, scatter and gather are checked on gloo."""
    require_multicast_off()
    group = group if group is not None else dist.group.WORLD
    world = dist.get_world_size(group)
    m, k = a8.shape
    pad = -m % world
    if pad:
        a8 = torch.cat([a8, a8.new_zeros(pad, k)])
        sa = torch.cat([sa.float(), sa.new_ones(pad, dtype=torch.float32)])
    symm_mem = _symm_mem_module(group, a8.is_cuda)
    op = (torch.ops.symm_mem.fused_scaled_matmul_reduce_scatter if a8.is_cuda
          else symm_mem._fused_scaled_matmul_reduce_scatter_fallback)
    n = w8.shape[0]
    shard = op(a8, w8.t(), sa.float().view(-1, 1), sw.float().view(1, -1), "sum", 0, 0, group.group_name,
               [m + pad, n], out_dtype=torch.bfloat16)  # [(M + pad) / W, N]: this rank's reduced rows
    full = torch.empty(m + pad, n, dtype=shard.dtype, device=shard.device)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in newer torch
    gather(full, shard.contiguous(), group=group)
    return full[:m]


# ---- the row-parallel steps: step(a, linear, reduce) -> [tokens, d_model] summed over the TP group ---------


class RowParallelLinear(Protocol):
    """What a row-parallel step needs of the projection: its product, and that product summed over a group."""

    def __call__(self, a: Any) -> torch.Tensor: ...

    def matmul_all_reduce(self, a: Any, group: dist.ProcessGroup, method: FusedMethod, chunks: int) -> torch.Tensor: ...

    def row_parallel_sum(self, a: Any, reduce: GroupReduce) -> Any: ...


class GroupReduce(Protocol):
    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...

    def fusable_group(self) -> dist.ProcessGroup | None: ...

    def adds_residual(self) -> bool: ...


class SummedProduct:
    """What a projection's unfused row-parallel step is unless it says otherwise: its product, summed by the
    reduce (mixed into every projection but the FP8 one that adds the residual in its GEMM, fast_parts.Fp8Linear)."""

    def row_parallel_sum(self, a: Any, reduce: GroupReduce) -> torch.Tensor:
        return reduce(self(a))


@dataclass(frozen=True)
class GemmThenAllReduce:
    """The unfused step: the GEMM, then the block's reduce (an all-reduce at TP > 1) — the linear's
    `row_parallel_sum`, which the FP8 parts may hand on not yet computed, for res_norm to run with the residual
    added in the GEMM (worker/model/fast_parts.py, `GatedRowSum`)."""

    def __call__(self, a: Any, linear: RowParallelLinear, reduce: GroupReduce) -> Any:
        return linear.row_parallel_sum(a, reduce)


@dataclass(frozen=True)
class FusedGemmAllReduce:
    """The GEMM fused with the TP sum (module docstring); the unfused pair where there is no group to sum over."""

    method: FusedMethod = FusedMethod.AUTO
    chunks: int = 4

    def __post_init__(self) -> None:
        object.__setattr__(self, "method", parse_method(self.method))
        if self.method is FusedMethod.IN_SWITCH:
            raise NotImplementedError(IN_SWITCH_MESSAGE)
        if isinstance(self.chunks, bool) or not isinstance(self.chunks, int) or self.chunks < 1:
            raise ValueError(f"FusedGemmAllReduce.chunks = {self.chunks!r}; expected a positive integer")

    def __call__(self, a: Any, linear: RowParallelLinear, reduce: GroupReduce) -> Any:
        group = reduce.fusable_group()
        if group is None:
            return linear.row_parallel_sum(a, reduce)
        return linear.matmul_all_reduce(a, group, self.method, self.chunks)


RowParallelStep = GemmThenAllReduce | FusedGemmAllReduce


def float_matmul_all_reduce(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                            group: dist.ProcessGroup, method: FusedMethod, chunks: int) -> torch.Tensor:
    """sum over the group of x @ weight.T (+ bias once, after the sum): x [..., K_local], weight [N, K_local]."""
    lead, k = x.shape[:-1], x.shape[-1]
    if k != weight.shape[1]:
        raise ValueError(f"fused row-parallel input: expected last dim {weight.shape[1]} (K per rank), got {k}")
    x2 = x.reshape(-1, k)
    if resolve_method(method, x2, group) is FusedMethod.SYMM_MEM:
        y = symm_mem_matmul_all_reduce(x2, weight, group)
    else:
        y = chunked_overlap_matmul_all_reduce(x2, weight, group, chunks)
    if bias is not None:  # each rank's partial has no bias
        y = y + bias
    return y.reshape(*lead, y.shape[-1])


def fp8_matmul_all_reduce(a8: torch.Tensor, sa: torch.Tensor, w8: torch.Tensor, sw: torch.Tensor,
                          group: dist.ProcessGroup, method: FusedMethod, chunks: int, *,
                          fast_accum: bool = False) -> torch.Tensor:
    """sum over the group of fp8_linear(a8, sa, w8, sw) → bf16 [M, N]. fast_accum reaches the cuBLASLt GEMMs of
    the chunked path; torch's symmetric-memory op takes no such option and accumulates as it does."""
    if resolve_method(method, a8, group) is FusedMethod.SYMM_MEM:
        return symm_mem_fp8_matmul_all_reduce(a8, sa, w8, sw, group)
    return chunked_overlap_fp8_matmul_all_reduce(a8, sa, w8, sw, group, chunks, fast_accum=fast_accum)
