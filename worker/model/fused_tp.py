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

The FP8 engine (worker/model/fast_dit.py) runs the same projections as `fp8_linear(a8, sa, w8, sw)` with one
scale per token row (sa [M]) and per output channel (sw [N]); its swappable step has one signature,
`step(a8, sa, w8, sw, reduce) -> bf16 [M, N]`: `unfused_fp8_row_parallel` (GEMM, then `reduce`) or a
`FusedFP8RowParallel` (same methods as above: `symm_mem` runs torch's
`symm_mem::fused_scaled_matmul_reduce_scatter`, which scatters token rows, so M is padded to a multiple
of tp with zero rows and the all-gather is on rows; `chunked_overlap` slices rows and their scales).

`set_row_parallel_path(model, fused=...)` swaps every block's O/down between the unfused pair and the
fused module. It only touches blocks whose `reduce` is a real `AllReduce` (TP > 1), keeps the original
modules so the swap is reversible, and is meant to run between chunks (`ChunkGenerator.apply_flags`),
on every TP rank at the same chunk boundary (the ranks must issue the same collectives).
"""

from __future__ import annotations

import enum
import os
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from vivant.kernels.fp8_gemm import fp8_linear
from vivant.worker.model.model import Reduce, VideoDiT
from vivant.worker.model.tp import AllReduce

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
        return resolve_method(self.method, x, self.group)

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
                           "reduction must stay off; the launcher in worker/serving/tp_layout.py sets it before init)")


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


# ---- the FP8 engine's row-parallel step: step(a8, sa, w8, sw, reduce) -> bf16 [M, N] ----------------------


def unfused_fp8_row_parallel(a8: torch.Tensor, sa: torch.Tensor, w8: torch.Tensor, sw: torch.Tensor,
                             reduce: nn.Module, *, fast_accum: bool = False) -> torch.Tensor:
    """The FP8 GEMM, then the block's reduce (an all-reduce at TP > 1): a8 fp8 [M, K_local], sa f32 [M],
    w8 fp8 [N, K_local], sw f32 [N] → bf16 [M, N]. fast_accum: cuBLASLt FP8 fast accumulation (fp8_linear)."""
    return reduce(fp8_linear(a8, sa, w8, sw, fast_accum=fast_accum))


def tp_group_of(reduce: nn.Module) -> dist.ProcessGroup | None | bool:
    """The process group a block's reduce sums over, or False when there is nothing to fuse (an identity
    `Reduce`, the one-GPU `SimulatedAllReduce`, or an `AllReduce` over a group of one)."""
    if not isinstance(reduce, AllReduce):
        return False
    return reduce.group if dist.get_world_size(reduce.group) > 1 else False


class FusedFP8RowParallel:
    """The FP8 row-parallel GEMM fused with the TP sum, as a drop-in for `unfused_fp8_row_parallel`.

    Blocks whose reduce is not a real multi-rank `AllReduce` run the unfused pair (nothing to fuse).
    Stateless apart from its settings, so one instance serves every block."""

    def __init__(self, method: str | FusedMethod = FusedMethod.AUTO, chunks: int = 4) -> None:
        if chunks < 1:
            raise ValueError(f"FusedFP8RowParallel.chunks = {chunks}; expected a positive integer")
        self.method = parse_method(method)
        if self.method is FusedMethod.IN_SWITCH:
            raise NotImplementedError(IN_SWITCH_MESSAGE)
        self.chunks = chunks

    def __repr__(self) -> str:
        return f"FusedFP8RowParallel(method={self.method.value!r}, chunks={self.chunks})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, FusedFP8RowParallel) and (self.method, self.chunks) == (other.method, other.chunks)

    def __hash__(self) -> int:
        return hash((self.method, self.chunks))

    def __call__(self, a8: torch.Tensor, sa: torch.Tensor, w8: torch.Tensor, sw: torch.Tensor,
                 reduce: nn.Module, *, fast_accum: bool = False) -> torch.Tensor:
        """fast_accum reaches the cuBLASLt GEMMs of the unfused and chunked paths; torch's symmetric-memory op
        takes no such option and accumulates as it does."""
        group = tp_group_of(reduce)
        if group is False:
            return unfused_fp8_row_parallel(a8, sa, w8, sw, reduce, fast_accum=fast_accum)
        if resolve_method(self.method, a8, group) is FusedMethod.SYMM_MEM:
            return symm_mem_fp8_matmul_all_reduce(a8, sa, w8, sw, group)
        return chunked_overlap_fp8_matmul_all_reduce(a8, sa, w8, sw, group, self.chunks, fast_accum=fast_accum)


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
