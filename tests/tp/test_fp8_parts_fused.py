"""The FP8 parts' (worker/model/fast_parts.py) row-parallel step swapped between "FP8 GEMM, then all-reduce"
(`GemmThenAllReduce`) and the fused step (`FusedGemmAllReduce` over an `Fp8Linear`, worker/model/fused_tp.py), on
CPU with gloo, in spawned processes (one per rank) at world sizes 2 and 4. The engine runs eagerly
(`EngineOptions(fp8=True)`: torch attention, no graphs): its kernels run their torch reference twins on CPU.

Per world size one spawn checks, on every rank:
* one projection with per-row scales, 51 token rows (not a multiple of 2 or 4): the chunked-overlap step
  (1, 3 and more chunks than rows) and the symmetric-memory step (on CPU torch's reference of
  `symm_mem::fused_scaled_matmul_reduce_scatter`, so the row padding, scatter and gather are exercised;
  the CUDA op itself needs GPUs) against `AllReduce(fp8_linear(...))`;
* the tiny preset, TP-sharded, one FP8 engine over 6 chunks: unfused throughout, fused throughout, the
  symmetric-memory step throughout, and the flag flipped on at chunk 2 and off at chunk 4 through
  `ChunkGenerator.apply_flags`; the paths `apply_flags` returned; and that a swap drops the engine's
  captured graphs (a marker entry stands in for a CUDA graph, which cannot be captured on CPU) while
  re-applying the same path keeps them;
and the parent checks the ranks agree bit for bit and equal the TP = 1 engine within FP8 tolerance. The unfused
step adds the residual inside rank 0's GEMM (EngineOptions.residual_in_gemm, on by default: `GatedRowSum`, the
others add nothing and the sum holds it once) while the fused step adds it after the sum, so "fused equals unfused"
also checks that the residual is counted exactly once at every world size (twice or never would be O(1)).

Tolerances: the fused steps compute the same bf16 partial products and sum them over the same ranks, so
they differ from the unfused step only by the order in which bf16 values are added and rounded (gloo
picks its reduction schedule by buffer size, so a row block is summed in another order than the whole
matrix): a few bf16 ulps (2^-8 ≈ 3.9e-3). Measured at world 4: ≈ 3e-3 relative per projection and
≈ 3.3e-3 on the latents; the bound is 1e-2 for both (a wrong block, scale or padding row is O(1)). TP = W vs TP = 1 differs by the FP8
quantization itself (each rank's O/down weight shard and activation rows get their own scales), so that
comparison uses the FP8-vs-float bound of tests/core/test_fast_dit_cpu.py (2e-2).

That the worker reports the path `apply_flags` returned ("no_tp" at TP = 1), not the flag that asked for the
fused one, is checked on the real worker in tests/runtime/test_worker_runtime.py.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from gloo_ranks import run_ranks
from vivant.apis.feature_flags import FlagValues
from vivant.kernels.fp8 import quantize_rows_ref
from vivant.worker.model.config import ModelConfig
from vivant.worker.model.engine import Engine
from vivant.worker.model.fast_parts import Fp8Linear, Rows8
from vivant.worker.model.fused_tp import (
    FusedGemmAllReduce,
    GemmThenAllReduce,
    chunked_overlap_fp8_matmul_all_reduce,
    symm_mem_fp8_matmul_all_reduce,
)
from vivant.worker.model.generator import ChunkGenerator
from vivant.worker.model.model import VideoDiT, init_random_
from vivant.worker.model.options import EngineOptions, RowParallelPath
from vivant.worker.model.tp import AllReduce, apply_tensor_parallel

CHUNKS = 6
SWITCH = {0: False, 2: True, 4: False}  # chunk index → fusedGemmAllReduce from that chunk on
FUSED, UNFUSED, NO_TP = RowParallelPath.FUSED, RowParallelPath.UNFUSED, RowParallelPath.NO_TP
FP8 = EngineOptions(fp8=True)
PROJ_TOL, LATENT_TOL, TP1_TOL = 1e-2, 1e-2, 2e-2


def audio(cfg, n):
    a, b = cfg.chunk_sample_range(n)
    return (0.2 * np.sin(np.arange(a, b) * 0.05 + n)).astype(np.float32)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def run_session(cfg, engine, schedule: dict[int, bool]) -> tuple[torch.Tensor, list[str]]:
    """6 chunks; before chunk n, `apply_flags` when the schedule names n. Returns latents [6, C, h, w] and
    the path in effect for each chunk (as `apply_flags` returned it, or the engine's current one)."""
    gen = ChunkGenerator(cfg, mode="optimized", seed=5, engine=engine)
    out, paths = [], []
    for n in range(CHUNKS):
        if n in schedule:
            paths.append(gen.apply_flags(FlagValues(fusedGemmAllReduce=schedule[n])).value)
        else:
            paths.append(engine.row_parallel_path.value)
        out.append(gen.generate_chunk(audio(cfg, n), cfg.audio_sample_rate).latents)
    return torch.stack(out), paths


def _projection_errors(rank: int, world: int) -> dict[str, float]:
    """x [51 tokens, K_local] → fp8 rows with per-row scales; w [N = 64, K_local] with per-channel scales;
    different data on every rank (each holds other heads / other columns of d_ff)."""
    g = torch.Generator().manual_seed(100 + rank)
    k = 64 // world
    a8, sa = quantize_rows_ref(torch.randn(51, k, generator=g))
    w8, sw = quantize_rows_ref(torch.randn(64, k, generator=g))
    lin, rows = Fp8Linear(w8, sw), Rows8(a8, sa)
    unfused = GemmThenAllReduce()(rows, lin, AllReduce())
    errs = {}
    for chunks in (1, 3, 64):
        errs[f"overlap{chunks}"] = rel(chunked_overlap_fp8_matmul_all_reduce(a8, sa, w8, sw, None, chunks), unfused)
    errs["auto_step"] = rel(FusedGemmAllReduce("auto")(rows, lin, AllReduce()), unfused)
    errs["symm_mem_reference"] = rel(symm_mem_fp8_matmul_all_reduce(a8, sa, w8, sw, None), unfused)
    errs["symm_mem_step"] = rel(FusedGemmAllReduce("symm_mem")(rows, lin, AllReduce()), unfused)
    shapes = {tuple(chunked_overlap_fp8_matmul_all_reduce(a8, sa, w8, sw, None, 3).shape),
              tuple(symm_mem_fp8_matmul_all_reduce(a8, sa, w8, sw, None).shape)}
    assert shapes == {(51, 64)}, f"fused outputs have shapes {shapes}; expected (51, 64)"
    return errs


def _rank_body(rank: int, world: int, out_dir: str) -> None:
    result = _projection_errors(rank, world)
    cfg = ModelConfig.from_name("tiny")
    engine = Engine.build(apply_tensor_parallel(init_random_(VideoDiT(cfg), seed=11), rank, world), FP8)
    result["lat_unfused"], result["paths_unfused"] = run_session(cfg, engine, {0: False})
    result["lat_fused"], result["paths_fused"] = run_session(cfg, engine, {0: True})
    result["lat_switched"], result["paths_switched"] = run_session(cfg, engine, SWITCH)
    result["path_symm"] = engine.set_row_parallel_path(fused=True, method="symm_mem").value
    result["lat_symm"], _ = run_session(cfg, engine, {})

    # graph bookkeeping: a swap drops what was captured, re-applying the same path keeps it
    marker = object()
    engine._graphs["captured"] = marker
    kept = engine.set_row_parallel_path(fused=True, method="symm_mem") == FUSED and "captured" in engine._graphs
    dropped = engine.set_row_parallel_path(fused=False) == UNFUSED and not engine._graphs
    result.update(graphs_kept_on_same_path=kept, graphs_dropped_on_swap=dropped)
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))



@pytest.fixture(scope="module")
def tp1_engine_latents():
    cfg = ModelConfig.from_name("tiny")
    engine = Engine.build(init_random_(VideoDiT(cfg), seed=11), FP8)
    lat, paths = run_session(cfg, engine, {0: True})  # the flag on at TP = 1: nothing to fuse
    assert paths == [NO_TP] * CHUNKS, f"TP = 1 engine paths: {paths}; expected no_tp throughout"
    assert engine.model.row_parallel_step == GemmThenAllReduce(), "TP = 1 engine left the unfused step"
    return lat


@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"world{w}")
def world_results(request, tmp_path_factory):
    world = request.param
    out = tmp_path_factory.mktemp(f"fast_fused_world{world}")
    return world, run_ranks(_rank_body, world, out)


def test_fused_fp8_projection_equals_gemm_then_all_reduce(world_results):
    world, results = world_results
    for rank, res in enumerate(results):
        for label in ("overlap1", "overlap3", "overlap64", "auto_step", "symm_mem_reference", "symm_mem_step"):
            assert res[label] < PROJ_TOL, f"world {world} rank {rank} {label}: relative error {res[label]:.3e} vs unfused"


def test_fused_engine_equals_unfused_engine(world_results):
    world, results = world_results
    for rank, res in enumerate(results):
        assert res["paths_unfused"] == [UNFUSED] * CHUNKS, f"world {world} rank {rank}: {res['paths_unfused']}"
        assert res["paths_fused"] == [FUSED] * CHUNKS, f"world {world} rank {rank}: {res['paths_fused']}"
        assert res["path_symm"] == FUSED
        for label in ("lat_fused", "lat_symm"):
            err = rel(res[label], res["lat_unfused"])
            assert err < LATENT_TOL, f"world {world} rank {rank}: {label} vs unfused latents relative error {err:.3e}"


def test_flag_switched_at_chunk_boundaries_through_apply_flags(world_results):
    world, results = world_results
    expected = [UNFUSED, UNFUSED, FUSED, FUSED, UNFUSED, UNFUSED]
    for rank, res in enumerate(results):
        assert res["paths_switched"] == expected, f"world {world} rank {rank}: paths {res['paths_switched']}"
        assert torch.equal(res["lat_switched"][:2], res["lat_unfused"][:2]), \
            f"world {world} rank {rank}: chunks before the switch differ from the unfused run"
        for n, path in enumerate(expected):
            same = res["lat_fused"][n] if path == FUSED else res["lat_unfused"][n]
            err = rel(res["lat_switched"][n], same)
            assert err < LATENT_TOL, f"world {world} rank {rank} chunk {n} ({path}): switched vs uniform run {err:.3e}"


def test_a_swap_drops_captured_graphs_and_a_repeat_keeps_them(world_results):
    world, results = world_results
    for rank, res in enumerate(results):
        assert res["graphs_kept_on_same_path"], f"world {world} rank {rank}: same path re-applied dropped the graphs"
        assert res["graphs_dropped_on_swap"], f"world {world} rank {rank}: fused → unfused kept stale graphs"


def test_ranks_agree_and_equal_the_tp1_engine(world_results, tp1_engine_latents):
    world, results = world_results
    for rank, res in enumerate(results[1:], start=1):
        for label in ("lat_unfused", "lat_fused", "lat_switched", "lat_symm"):
            assert torch.equal(res[label], results[0][label]), f"world {world}: rank {rank} {label} differs from rank 0"
    for label in ("lat_unfused", "lat_fused", "lat_switched", "lat_symm"):
        err = rel(results[0][label], tp1_engine_latents)
        assert err < TP1_TOL, f"world {world} {label}: relative error {err:.3e} vs the TP = 1 engine"


def test_fp8_step_refuses_bad_settings_and_multicast(monkeypatch):
    with pytest.raises(ValueError, match=r"fused method = 'nvls'; expected one of \['auto', 'symm_mem'"):
        FusedGemmAllReduce("nvls")
    with pytest.raises(ValueError, match="FusedGemmAllReduce.chunks = 0; expected a positive integer"):
        FusedGemmAllReduce(chunks=0)
    with pytest.raises(NotImplementedError, match="in_switch.*not allowed"):
        FusedGemmAllReduce("in_switch")
    monkeypatch.delenv("TORCH_SYMM_MEM_DISABLE_MULTICAST", raising=False)
    a8, sa = quantize_rows_ref(torch.randn(4, 8))
    with pytest.raises(RuntimeError, match="TORCH_SYMM_MEM_DISABLE_MULTICAST = None; expected '1'"):
        symm_mem_fp8_matmul_all_reduce(a8, sa, a8, sa, None)


def test_engine_swap_refuses_a_bad_method_and_keeps_its_step():
    cfg = ModelConfig.from_name("tiny")
    engine = Engine.build(init_random_(VideoDiT(cfg), seed=11), FP8)
    with pytest.raises(ValueError, match="fused method = 'multicast'"):
        engine.set_row_parallel_path(fused=True, method="multicast")
    assert engine.model.row_parallel_step == GemmThenAllReduce() and engine.row_parallel_path == NO_TP
