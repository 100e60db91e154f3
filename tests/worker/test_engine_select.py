"""`vivant worker --engine` (worker/model/engine.py): which engine the serving generator runs, on CPU.

"auto" picks the float VideoDiT off CUDA; "fast" builds FastDiT (its kernels' float32 twins, no graphs on
CPU) and tracks the float model of the same seed; bad combinations are refused by name; the CLI flag and
its environment default parse. The CUDA side (bf16, image attention, graphs, fast accumulation) is what
`build_generator` configures; it runs in the GPU benchmarks."""

from __future__ import annotations

import argparse

import numpy as np
import pytest
from vivant.worker.model.config import ModelConfig
from vivant.worker.model.engine import ENGINES, build_generator
from vivant.worker.model.fast_dit import FastDiT
from vivant.worker.model.model import VideoDiT
from vivant.worker.serving.cli import add_arguments
from vivant.worker.serving.runners import GeneratorRunner

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


def test_auto_on_cpu_runs_the_float_model(caplog):
    with caplog.at_level("INFO", logger="vivant.worker.model.engine"):
        gen = build_generator(CFG, device="cpu", seed=3)
    assert isinstance(gen.model, VideoDiT), f"auto on CPU: expected a VideoDiT, got {type(gen.model).__name__}"
    assert "engine auto -> model" in caplog.text, f"auto did not log its choice: {caplog.text!r}"


def test_fast_on_cpu_is_fastdit_without_graphs():
    gen = build_generator(CFG, device="cpu", seed=3, engine="fast")
    fast = gen.model
    assert isinstance(fast, FastDiT), f"engine fast: expected a FastDiT, got {type(fast).__name__}"
    assert (fast.use_graphs, fast.attn_backend, fast.fast_accum) == (False, "torch", False), \
        f"on CPU: use_graphs/attn_backend/fast_accum = {(fast.use_graphs, fast.attn_backend, fast.fast_accum)}"
    assert gen.mode == "optimized" and gen.fp8, f"fast engine generator: mode {gen.mode!r}, fp8 {gen.fp8}"


def test_fast_engine_tracks_the_model_engine_with_the_same_seed():
    fast = GeneratorRunner("tiny", device="cpu", seed=5, engine="fast").generator
    ref = GeneratorRunner("tiny", device="cpu", seed=5, engine="model").generator
    assert isinstance(fast.model, FastDiT) and isinstance(ref.model, VideoDiT), \
        f"runner engines: {type(fast.model).__name__}, {type(ref.model).__name__}"
    got, want = _latents(fast), _latents(ref)
    for n, (g, w) in enumerate(zip(got, want, strict=True)):
        assert bool(g.isfinite().all()), f"chunk {n}: the fast engine's latents have NaN/Inf"
        err = float((g - w).norm() / w.norm())
        assert err < 2e-2, f"chunk {n}: fast vs model engine, same seed, relative RMS {err:.3e} (limit 2e-2)"
        assert err > 1e-4, f"chunk {n}: fast engine equals the float model ({err:.1e}): it is not running FP8"


def test_fast_engine_has_no_tensor_parallel_step_to_fuse():
    gen = build_generator(CFG, device="cpu", engine="fast")
    path = gen.apply_flags({"fusedGemmAllReduce": True})
    assert path == "no_tp", f"one device, fusedGemmAllReduce on: expected 'no_tp', got {path!r}"


# ------------------------------------------------------------------------------ bad input


def test_unknown_engine_is_refused_by_name():
    with pytest.raises(ValueError, match="engine") as exc:
        build_generator(CFG, engine="turbo")
    assert all(e in str(exc.value) for e in ENGINES), f"the error should list {ENGINES}: {exc.value}"


def test_fast_engine_refuses_the_baseline_mode():
    with pytest.raises(ValueError, match="mode"):
        build_generator(CFG, mode="baseline", engine="fast")


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
    with pytest.raises(SystemExit):
        _parse(["--engine", "turbo"])
