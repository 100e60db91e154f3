"""`vivant bench step --ablation` on CPU at the tiny shapes (bench/ablation.py): the harness's structure — every
row present and timed with finite numbers, each row the optimized engine with exactly one choice undone, numerics
against the baseline row — as a CI smoke test. The timings are the kernels' CPU twins: no performance claim."""

from __future__ import annotations

import argparse
import json
import math

import numpy as np
import pytest
from vivant.bench import step
from vivant.bench.ablation import ROWS, VARIANT_ROWS, variant_options
from vivant.worker.model.options import EngineOptions


@pytest.fixture(scope="module")
def doc(tmp_path_factory):
    out = tmp_path_factory.mktemp("ablation") / "ablation.json"
    parser = argparse.ArgumentParser()
    step.add_arguments(parser)
    args = parser.parse_args(["--preset", "tiny", "--device", "cpu", "--ablation", "--chunks", "2", "--warmup", "1",
                              "--out", str(out)])
    assert step.run(args) == 0
    return json.loads(out.read_text())


def test_every_row_is_present_and_finite(doc):
    rows = {r["row"]: r for r in doc["rows"]}
    assert list(rows) == list(ROWS), f"rows {list(rows)}"
    for name, r in rows.items():
        assert "error" not in r, f"{name}: {r.get('error')}"
        assert len(r["per_chunk_ms"]) == 2, f"{name}: {len(r['per_chunk_ms'])} timed chunks, expected 2"
        for key in ("ms", "p99_ms", "x_optimized"):
            assert math.isfinite(r[key]) and r[key] > 0, f"{name}.{key} = {r[key]}"
        n = r["numerics"]
        assert n["chunks"] == 3 and math.isfinite(n["max_rel_rms"]), f"{name}: numerics {n}"
    assert rows["baseline"]["numerics"]["max_rel_rms"] == 0.0, "the baseline is the reference"
    assert rows["optimized"]["x_optimized"] == 1.0
    for name in ROWS[1:]:
        err = rows[name]["numerics"]["max_rel_rms"]
        assert 1e-4 < err < 0.05, f"{name}: relative RMS {err:.3e} against the float reference"


def test_each_row_undoes_exactly_one_choice(doc):
    rows = {r["row"]: r for r in doc["rows"]}
    opt = rows["optimized"]["options"]
    assert rows["baseline"]["options"] is None
    for name in VARIANT_ROWS:  # the optimized options with the variant's parts swapped in
        assert rows[name]["options"] == {**opt, "variant": name}, f"{name}: {rows[name]['options']} vs {opt}"
    diff = {k for k, v in rows["residual_after_gemm"]["options"].items() if opt[k] != v}
    assert diff == {"residual_in_gemm"}, f"residual_after_gemm differs from optimized in {diff}"
    # no_cuda_graphs, no_split_kv, heuristic_gemm: the optimized options on a CPU


def test_variant_options_on_a_gpu_differ_by_one_field():
    served = EngineOptions.served("cuda").replace(kv_splits=4)
    fields = ("cuda_graphs", "kv_splits", "gemm_algorithms", "residual_in_gemm")
    for name, options in variant_options(served).items():
        if options is None or name == "optimized":
            continue
        diff = [f for f in fields if getattr(options, f) != getattr(served, f)]
        assert len(diff) == (0 if name in VARIANT_ROWS else 1), f"{name}: differs in {diff}"


def test_document_fields(doc):
    for key in ("machine", "date", "command", "reference", "chunks", "warmup"):
        assert key in doc, f"missing {key}"
    assert doc["machine"]["torch"] and "triton" in doc["machine"]
    assert doc["memory"] is None, "CPU runs have no device memory figures"
    assert doc["command"].startswith("vivant bench step --ablation --preset tiny --tp 1 --rank 0 --device cpu "
                                     "--chunks 2 --warmup 1"), doc["command"]


def test_memory_counts_on_cpu_tensors():
    """bench/memory.py's counting (device-agnostic): shared tensors and views count once, FP8 weights held as plain
    attributes count, the ring's parts are split."""
    import torch
    from vivant.bench.memory import cache_bytes, engine_weight_bytes, tensor_bytes
    from vivant.worker.model.config import ModelConfig
    from vivant.worker.model.engine import Engine
    from vivant.worker.model.generator import ChunkGenerator
    from vivant.worker.model.model import VideoDiT, init_random_

    t = torch.zeros(10, 4)
    assert tensor_bytes([t, t[2:], t.view(40), None]) == 160
    cfg = ModelConfig.from_name("tiny")
    model = init_random_(VideoDiT(cfg), seed=0)
    fp8 = Engine.build(model, EngineOptions(fp8=True)).model
    proj = sum(getattr(m, n).weight.numel() for b in model.blocks for m, n in
               ((b.attn, "qkv"), (b.attn, "o"), (b.mlp, "gate_up"), (b.mlp, "down")))
    want = engine_weight_bytes(model) - 4 * proj + proj + 4 * sum(
        getattr(m, n).weight.shape[0] for b in model.blocks for m, n in
        ((b.attn, "qkv"), (b.attn, "o"), (b.mlp, "gate_up"), (b.mlp, "down")))
    assert engine_weight_bytes(fp8) == want, "FP8 weights: 1 byte per value plus a float32 scale per output channel"
    gen = ChunkGenerator(cfg, mode="optimized", model=model, seed=0)  # the float parts: a float32 ring
    c = cache_bytes(gen.cache)
    s, h, d, layers = cfg.cache_slots, cfg.n_heads, cfg.head_dim, cfg.n_layers
    assert c == {"ring_bytes": 2 * layers * s * h * d * 4, "whole_window_bytes": 0, "undo_log_bytes": 0}, c
    gen.generate_chunk(np.zeros(cfg.chunk_sample_range(0)[1], dtype=np.float32), cfg.audio_sample_rate)
    gen.generate_chunk(np.zeros(cfg.chunk_sample_range(1)[1] - cfg.chunk_sample_range(1)[0], dtype=np.float32),
                       cfg.audio_sample_rate)
    entry = gen.cache.rewind_chunks * 2 * layers * cfg.tokens_per_chunk * h * d * 4  # K and V rows
    assert cache_bytes(gen.cache)["undo_log_bytes"] == entry, "the undo log's chunk entries, once allocated"
    served = ChunkGenerator(cfg, mode="optimized", seed=0, model=model, options=EngineOptions(fp8=True)).cache
    assert cache_bytes(served)["ring_bytes"] == 2 * layers * s * h * d * 2, "the served ring: bf16 K and V"
    from vivant.bench.ablation_parts import WholeWindowCache

    window = WholeWindowCache.adopt(served)
    window.enable_whole_window(torch.float32)
    c = cache_bytes(window)
    assert c["ring_bytes"] == 2 * layers * s * h * d * 2 + s * 3 * 8, "the ring and the slot positions"
    assert c["whole_window_bytes"] == 2 * layers * s * h * d * 4 + 2 * s * (d // 2) * 4, c


def test_the_doc_renderer_takes_the_harness_output(doc):
    from vivant.bench.ablation_md import LABELS, section

    text = section(doc, "ablation_tiny_cpu.json")
    for name in ROWS:
        assert LABELS[name] in text, f"row {name} missing from the rendered table"


class FakeAllocator:
    """Stands in for torch.cuda's allocator counters: this machine has no GPU, and the GPU run is the only other
    place `StepMemory.report` runs. Bytes move as the test says; the report's arithmetic and keys are checked."""

    def __init__(self):
        self.allocated, self.reserved, self.peak_alloc, self.peak_res = 0, 0, 0, 0

    def set(self, allocated, reserved):
        self.allocated, self.reserved = allocated, reserved
        self.peak_alloc, self.peak_res = max(self.peak_alloc, allocated), max(self.peak_res, reserved)

    def install(self, monkeypatch):
        import torch

        for name, fn in {"mem_get_info": lambda d=None: (100 - 3 - self.reserved, 100),
                         "memory_allocated": lambda d=None: self.allocated,
                         "memory_reserved": lambda d=None: self.reserved, "synchronize": lambda d=None: None,
                         "reset_peak_memory_stats": lambda d=None: self.set_peak(),
                         "max_memory_allocated": lambda d=None: self.peak_alloc,
                         "max_memory_reserved": lambda d=None: self.peak_res}.items():
            monkeypatch.setattr(torch.cuda, name, fn)

    def set_peak(self):
        self.peak_alloc, self.peak_res = self.allocated, self.reserved


def test_memory_report_arithmetic(monkeypatch):
    import torch
    from vivant.bench.memory import CARDS, StepMemory, cache_bytes, engine_weight_bytes
    from vivant.worker.model.config import ModelConfig
    from vivant.worker.model.generator import ChunkGenerator
    from vivant.worker.model.model import VideoDiT, init_random_

    fake = FakeAllocator()
    fake.install(monkeypatch)
    mem = StepMemory(torch.device("cuda"))
    assert mem.context_bytes == 3, "context = total − free − what torch reserved"
    fake.set(50, 60)
    mem.mark("before_fp8_weights")
    fake.set(65, 80)
    mem.mark("after_fp8_weights")
    mem.mark("before_cache")
    fake.set(70, 80)
    mem.mark("before_chunk0")
    mem.reset_peak()
    fake.set(90, 100)  # chunk 0's peak
    fake.set(72, 100)  # after it: 2 kept
    hook = mem.chunk_hook()
    hook(0, False)
    fake.set(75, 110)  # graphs captured
    hook(1, True)
    cfg = ModelConfig.from_name("tiny")
    model = init_random_(VideoDiT(cfg), seed=0)
    cache = ChunkGenerator(cfg, mode="optimized", model=model, seed=0).cache
    r = mem.report(model, cache)
    w, c = engine_weight_bytes(model), cache_bytes(cache)
    assert r["measured_deltas"] == {"fp8_weights": 15, "ring_cache": 5, "kept_by_chunk0": 2}, r["measured_deltas"]
    assert r["activations_peak_bytes"] == 20 and r["graphs_reserved_bytes"] == 10 and r["graphs_allocated_bytes"] == 3
    assert r["served_estimate_bytes"] == 3 + w + c["ring_bytes"] + c["undo_log_bytes"] + 20 + 10
    assert r["headroom_bytes"] == {k: v - r["served_estimate_bytes"] for k, v in CARDS.items()}
    assert r["process_peak_allocated_bytes"] == 90 and r["process_peak_reserved_bytes"] == 110


def test_a_failing_row_is_reported_and_a_compiled_row_retries_without_graphs(monkeypatch, tmp_path):
    """Faults: a row whose engine fails carries its error and the other rows still run; a row with compiled parts
    that fails under CUDA graphs (here: graphs asked for on a CPU, which the engine refuses) runs again without
    them and says so."""
    from vivant.bench import ablation

    real_options, real_row = ablation.variant_options, ablation.run_row

    def graphs_on_cpu(optimized):
        o = real_options(optimized)
        return o | {"whole_window": o["whole_window"].replace(cuda_graphs=True)}  # valid options, refused on a CPU

    def failing_row(name, opts, **kw):
        if name == "unfused_norm":
            raise RuntimeError("injected failure")
        return real_row(name, opts, **kw)

    monkeypatch.setattr(ablation, "variant_options", graphs_on_cpu)
    monkeypatch.setattr(ablation, "run_row", failing_row)
    out = tmp_path / "a.json"
    parser = argparse.ArgumentParser()
    step.add_arguments(parser)
    args = parser.parse_args(["--preset", "tiny", "--device", "cpu", "--ablation", "--chunks", "1", "--warmup", "0",
                              "--out", str(out), "--json"])
    assert step.run(args) == 0
    rows = {r["row"]: r for r in json.loads(out.read_text())["rows"]}
    assert list(rows) == list(ROWS)
    assert rows["unfused_norm"]["error"] == "RuntimeError: injected failure", rows["unfused_norm"]
    assert "ms" not in rows["unfused_norm"]
    ww = rows["whole_window"]
    assert ww["note"].startswith("run without CUDA graphs: under graphs it failed (ValueError: EngineOptions.cuda_graphs"), ww
    assert ww["options"]["cuda_graphs"] is False and math.isfinite(ww["ms"])
    for name in ("baseline", "optimized", "bf16_gemm", "no_cuda_graphs", "no_split_kv"):
        assert "error" not in rows[name] and math.isfinite(rows[name]["ms"]), rows[name]
