"""EngineOptions' served choices beyond the parts themselves (worker/model/options.py, fast_parts.py) on CPU at
the tiny shapes: the residual added in the O/down GEMMs' epilogue (residual_in_gemm) against the residual kernel,
the GEMM algorithms (tuned on CUDA only), and bad values named by field. The ablation's variants are tested in
test_ablation_parts_cpu.py."""

from __future__ import annotations

import pytest
import torch
import vivant.worker.model.fast_parts as fast_parts
from engine_runs import rel_rms, run_chunks
from vivant.worker.model.config import ModelConfig
from vivant.worker.model.engine import Engine
from vivant.worker.model.fast_parts import Fp8Linear, GatedRowSum, GateFold, install_parts
from vivant.worker.model.generator import ChunkGenerator
from vivant.worker.model.model import VideoDiT, init_random_, keep_gates
from vivant.worker.model.options import EngineOptions, GemmAlgorithms

FP8 = EngineOptions(fp8=True)
CHUNKS = 26  # crosses position resets at the tiny preset's t_limit


@pytest.fixture(scope="module")
def setup():
    cfg = ModelConfig.from_name("tiny")
    model = init_random_(VideoDiT(cfg), seed=4)
    ref, _ = run_chunks(ChunkGenerator(cfg, mode="baseline", model=model, seed=2, fp8=False), cfg, CHUNKS)
    return cfg, model, ref


@pytest.mark.parametrize("field, value, match", [
    ("attention", "sdpa", "EngineOptions.attention = 'sdpa'; expected one of image, torch"),
    ("gemm_algorithms", "fastest", "EngineOptions.gemm_algorithms = 'fastest'; expected one of heuristic, tuned"),
    ("residual_in_gemm", "yes", "EngineOptions.residual_in_gemm = 'yes'; expected True or False"),
    ("kv_splits", 0, "EngineOptions.kv_splits = 0; expected an int >= 1 or 'auto'"),
])
def test_bad_values_name_their_field(field, value, match):
    with pytest.raises(ValueError, match=match):
        FP8.replace(**{field: value})


@pytest.mark.parametrize("change", [{"gemm_algorithms": "tuned"}, {"attention": "image"}, {"cuda_graphs": True}])
def test_choices_of_the_fast_parts_refused_with_the_float_parts(change):
    field = next(iter(change))
    with pytest.raises(ValueError, match=f"EngineOptions.{field} = .* needs fp8=True"):
        EngineOptions(**change)


def test_only_deployment_choices_remain():
    """The ablation's variants are parts in bench/, not options: the fields a deployment sets, and nothing else."""
    fields = set(EngineOptions.__dataclass_fields__)
    assert fields == {"fp8", "attention", "kv_splits", "fast_accum", "cuda_graphs", "gemm_algorithms",
                      "residual_in_gemm"}, fields


def test_served_tunes_gemm_algorithms_on_cuda_only():
    """Tuning times cuBLASLt on the GPU it serves on; a CPU runs the float32 twin, which has no algorithms."""
    assert EngineOptions.served("cuda").gemm_algorithms is GemmAlgorithms.TUNED
    assert EngineOptions.served("cpu").gemm_algorithms is GemmAlgorithms.HEURISTIC


def test_tuned_options_on_a_cpu_model_install_the_heuristic_parts():
    """gemm_algorithms = tuned on a CPU model installs the same FP8 parts, with no plan (nothing to time)."""
    cfg = ModelConfig.from_name("tiny")
    model = init_random_(VideoDiT(cfg), seed=0)
    fast = install_parts(model, FP8.replace(gemm_algorithms="tuned"))
    lins = [getattr(getattr(b, o), r) for b in fast.blocks for o, r in (("attn", "qkv"), ("mlp", "down"))]
    assert lins and all(isinstance(lin, Fp8Linear) and lin.plan is None for lin in lins), [type(x) for x in lins]


def test_residual_in_gemm_folds_the_gates_and_matches_the_residual_kernel(setup):
    """EngineOptions.residual_in_gemm: every O and down Fp8Linear reads its row of GateFold's buffer, which each pass
    fills with its weights' scales × that pass's gates; the row-parallel step hands res_norm a GatedRowSum; and the
    engine's latents equal the engine that adds the residual after the GEMM (residual_in_gemm=False) up to where
    each rounds (the CPU twin rounds the unfolded GEMM's product to bf16 first)."""
    cfg, model, ref = setup
    fold, plain = Engine.build(model, FP8), Engine.build(model, FP8.replace(residual_in_gemm=False))
    m = fold.model
    assert isinstance(m.gate_fold, GateFold) and plain.model.gate_fold is keep_gates
    assert model.gate_fold is keep_gates, "installing the parts changed the float model"
    for i, b in enumerate(m.blocks):
        for j, lin in enumerate((b.attn.o, b.mlp.down)):
            assert lin.gated_scale is not None and lin.gated_scale.data_ptr() == m.gate_fold.scales[i, j].data_ptr()
        assert b.attn.qkv.gated_scale is None and b.mlp.gate_up.gated_scale is None
    assert all(b.attn.o.gated_scale is None and b.mlp.down.gated_scale is None for b in plain.model.blocks)
    b = m.blocks[1]
    assert isinstance(b.attn.row_parallel(fast_parts.Rows8(*fast_parts.quant_rows(torch.randn(5, b.attn.o.in_features))),
                                          b.attn.o, b.attn.reduce), GatedRowSum)
    mods, _ = m.modulation(0.37)
    m.gate_fold(mods)
    for i, blk in enumerate(m.blocks):
        torch.testing.assert_close(m.gate_fold.scales[i, 0], blk.attn.o.sw * mods[i, 2].float(), rtol=0, atol=0)
        torch.testing.assert_close(m.gate_fold.scales[i, 1], blk.mlp.down.sw * mods[i, 5].float(), rtol=0, atol=0)
    got, _ = run_chunks(ChunkGenerator(cfg, mode="optimized", engine=fold, seed=2), cfg, CHUNKS)
    want, _ = run_chunks(ChunkGenerator(cfg, mode="optimized", engine=plain, seed=2), cfg, CHUNKS)
    errs = [rel_rms(g, w) for g, w in zip(got, want, strict=True)]
    assert max(errs) < 5e-3, f"folded vs residual kernel: relative RMS up to {max(errs):.3e} ({errs})"
    assert max(rel_rms(g, r) for g, r in zip(got, ref, strict=True)) < 0.02
