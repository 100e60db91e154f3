"""`vivant worker --engine` (worker/model/engine.py): which engine the serving generator runs, on CPU.

"auto" picks the float parts off CUDA; "fast" installs the FP8 parts (their kernels' float32 twins, no graphs on
CPU) into the same VideoDiT and tracks the float parts of the same seed; bad combinations are refused by name;
the CLI flag and its environment default parse. The CUDA side (bf16, image attention, graphs, fast
accumulation) is `EngineOptions.served("cuda")`; it runs in the GPU benchmarks."""

from __future__ import annotations

import argparse

import numpy as np
import pytest
import torch
from vivant.apis.feature_flags import FlagValues
from vivant.worker.model.config import ModelConfig
from vivant.worker.model.fast_parts import Fp8Linear
from vivant.worker.model.generator import build_generator
from vivant.worker.model.model import Linear, VideoDiT
from vivant.worker.model.options import AttentionBackend, EngineName, EngineOptions, RowParallelPath
from vivant.worker.serving.cli import add_arguments, rank_spec

CFG = ModelConfig.from_name("tiny")
CHUNKS = 4


def _latents(gen, chunks=CHUNKS):
    out = []
    for n in range(chunks):
        a, b = CFG.chunk_sample_range(n)
        audio = (0.3 * np.sin(np.arange(a, b) * 0.05 + n)).astype(np.float32)
        out.append(gen.generate_chunk(audio, CFG.audio_sample_rate).latents)
    return out


# ------------------------------------------------------------------------------ engine selection


def test_auto_on_cpu_runs_the_float_parts(caplog):
    with caplog.at_level("INFO", logger="vivant.worker.model.generator"):
        gen = build_generator(CFG, device="cpu", seed=3)
    assert gen.engine.options == EngineOptions.reference(), f"auto on CPU: {gen.engine.options}"
    assert type(gen.engine.model.blocks[0].attn.qkv) is Linear, "auto on CPU installed other projections"
    assert "engine auto -> EngineOptions(fp8=False" in caplog.text, f"auto did not log its choice: {caplog.text!r}"


def test_fast_on_cpu_is_the_fp8_parts_without_graphs():
    gen = build_generator(CFG, device="cpu", seed=3, engine="fast")
    opts = gen.engine.options
    assert (opts.fp8, opts.cuda_graphs, opts.attention, opts.fast_accum) == (True, False, AttentionBackend.TORCH, False), \
        f"engine fast on CPU: {opts}"
    assert type(gen.engine.model) is VideoDiT, f"the fast engine runs {type(gen.engine.model).__name__}, not VideoDiT"
    assert all(type(getattr(b.attn, n)) is Fp8Linear for b in gen.engine.model.blocks for n in ("qkv", "o")), \
        "the fast engine's attention projections are not FP8"
    assert gen.mode == "optimized", f"fast engine generator: mode {gen.mode!r}"
    assert gen.cache.k.dtype == torch.bfloat16, f"the CPU fast engine must write the served bf16 ring, not {gen.cache.k.dtype}"


def test_served_options_on_cuda_are_the_measured_configuration():
    opts = EngineOptions.served("cuda")
    assert (opts.fp8, opts.attention, opts.kv_splits, opts.fast_accum, opts.cuda_graphs, opts.gemm_algorithms) == \
        (True, AttentionBackend.IMAGE, "auto", True, True, "tuned"), f"served on CUDA: {opts}"


def test_fast_engine_tracks_the_model_engine_with_the_same_seed():
    fast = build_generator(CFG, device="cpu", seed=5, engine="fast")
    ref = build_generator(CFG, device="cpu", seed=5, engine="model")
    assert fast.engine.options.fp8 and not ref.engine.options.fp8, \
        f"runner engines: {fast.engine.options}, {ref.engine.options}"
    got, want = _latents(fast), _latents(ref)
    for n, (g, w) in enumerate(zip(got, want, strict=True)):
        assert bool(g.isfinite().all()), f"chunk {n}: the fast engine's latents have NaN/Inf"
        err = float((g - w).norm() / w.norm())
        assert err < 2e-2, f"chunk {n}: fast vs model engine, same seed, relative RMS {err:.3e} (limit 2e-2)"
        assert err > 1e-4, f"chunk {n}: fast engine equals the float model ({err:.1e}): it is not running FP8"


def test_fast_engine_has_no_tensor_parallel_step_to_fuse():
    gen = build_generator(CFG, device="cpu", engine="fast")
    path = gen.apply_flags(FlagValues(fusedGemmAllReduce=True))
    assert path is RowParallelPath.NO_TP, f"one device, fusedGemmAllReduce on: expected 'no_tp', got {path!r}"


# ------------------------------------------------------------------------------ bad input


def test_unknown_engine_is_refused_by_name():
    with pytest.raises(ValueError, match="engine") as exc:
        build_generator(CFG, engine="turbo")
    assert all(e.value in str(exc.value) for e in EngineName), f"the error should list {list(EngineName)}: {exc.value}"


def test_fast_engine_refuses_the_baseline_mode():
    with pytest.raises(ValueError, match="mode"):
        build_generator(CFG, mode="baseline", engine="fast")


def test_unknown_cache_mode_is_refused_by_name():
    with pytest.raises(ValueError, match="mode = 'ring'; expected one of optimized, baseline"):
        build_generator(CFG, mode="ring")


@pytest.mark.parametrize("kwargs, field", [
    ({"attention": "triton", "fp8": True}, "EngineOptions.attention = 'triton'; expected one of image, torch"),
    ({"attention": "image"}, "EngineOptions.attention = 'image' needs fp8=True"),
    ({"cuda_graphs": True}, "EngineOptions.cuda_graphs = True needs fp8=True"),
    ({"kv_splits": 0, "fp8": True}, "EngineOptions.kv_splits = 0; expected an int >= 1 or 'auto'"),
    ({"kv_splits": "four", "fp8": True}, "EngineOptions.kv_splits = 'four'"),
    ({"kv_splits": True, "fp8": True}, "EngineOptions.kv_splits = True"),
    ({"fp8": "yes"}, "EngineOptions.fp8 = 'yes'; expected True or False"),
])
def test_bad_engine_options_are_named(kwargs, field):
    with pytest.raises(ValueError, match=field.replace("(", r"\(").replace(")", r"\)")):
        EngineOptions(**kwargs)


def test_engine_options_are_frozen():
    opts = EngineOptions.reference()
    with pytest.raises(AttributeError):
        opts.fp8 = True  # type: ignore[misc]


# ------------------------------------------------------------------------------ CLI


def _parse(argv):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv)


def test_cli_engine_flag_and_environment_default(monkeypatch):
    monkeypatch.delenv("VIVANT_ENGINE", raising=False)
    assert _parse([]).engine == "auto", "no flag, no env: expected the auto engine"
    assert _parse(["--engine", "fast"]).engine == "fast", "--engine fast was not parsed"
    monkeypatch.setenv("VIVANT_ENGINE", "model")
    assert _parse([]).engine == "model", "VIVANT_ENGINE=model was not the default"
    assert _parse(["--engine", "fast"]).engine == "fast", "--engine should override VIVANT_ENGINE"
    assert rank_spec(_parse(["--engine", "fast"])).engine is EngineName.FAST
    monkeypatch.setenv("VIVANT_ENGINE", "turbo")
    with pytest.raises(ValueError, match=r"engine: expected one of auto, fast, model \(--engine or VIVANT_ENGINE\)"):
        rank_spec(_parse([]))
