"""The ablation's variant parts (bench/ablation_parts.py) on CPU at the tiny shapes: each, swapped into a built
engine, tracks the float parts of the same weights within the FP8 parts' tolerance (test_engine_parts_cpu.py: 2 %
relative RMS over 26 chunks with position resets), runs the parts it names and not the ones it replaces, and
leaves the float model as it was. The compiled forms (GPU) are checked here for being traceable as one graph;
their speed is GPU-only (`vivant bench step --ablation`)."""

from __future__ import annotations

import pytest
import torch
import vivant.bench.ablation_parts as ablation_parts
import vivant.worker.model.fast_parts as fast_parts
import vivant.worker.model.kv_cache as kv_cache
from engine_runs import chunk_audio, rel_rms, run_chunks
from vivant.bench.ablation_parts import (
    UnfusedFp8ResidualNormMod,
    UnfusedFp8SwiGLU,
    UnquantizedOutputAttention,
    WholeWindowAttention,
    WholeWindowCache,
    install_variant,
    rotate_window_eager,
)
from vivant.worker.model.config import ModelConfig
from vivant.worker.model.engine import Engine
from vivant.worker.model.fast_parts import Fp8Linear, Fp8ResidualNormMod, Fp8SwiGLU, install_parts
from vivant.worker.model.generator import ChunkGenerator
from vivant.worker.model.model import Linear, ResidualNormMod, SwiGLUAct, VideoDiT, init_random_, keep_gates
from vivant.worker.model.options import EngineOptions

FP8 = EngineOptions(fp8=True)
CHUNKS = 26  # crosses position resets at the tiny preset's t_limit
VARIANTS = ("whole_window", "bf16_gemm", "bf16_o_gemm", "unfused_norm")


@pytest.fixture(scope="module")
def setup():
    cfg = ModelConfig.from_name("tiny")
    model = init_random_(VideoDiT(cfg), seed=4)
    ref, _ = run_chunks(ChunkGenerator(cfg, mode="baseline", model=model, seed=2, fp8=False), cfg, CHUNKS)
    return cfg, model, ref


def generator(cfg, model, name: str, options: EngineOptions = FP8, **kw) -> ChunkGenerator:
    """A generator running variant `name` swapped into the engine `options` builds (the whole window's cache
    adopted, as bench/ablation.py does)."""
    parts = install_variant(name, model=model, fp8_model=install_parts(model, FP8), options=options)
    gen = ChunkGenerator(cfg, mode="optimized", engine=Engine(parts, options), seed=2, **kw)
    if name == "whole_window":
        WholeWindowCache.adopt(gen.cache)
    return gen


@pytest.mark.parametrize("name", VARIANTS)
def test_each_variant_tracks_the_float_parts_across_resets(setup, name):
    cfg, model, ref = setup
    got, resets = run_chunks(generator(cfg, model, name), cfg, CHUNKS)
    errs = [rel_rms(g, w) for g, w in zip(got, ref, strict=True)]
    assert resets >= 2, f"the run crossed {resets} position resets; the test needs at least 2"
    assert max(errs) < 0.02, f"{name} vs the float parts: relative RMS up to {max(errs):.3e} (per chunk {errs})"
    assert max(errs) > 1e-5, f"{name}: no rounding error at all although the ring is bf16 (its K/V rounding: ~7e-5)"


def test_the_parts_each_variant_installs(setup):
    cfg, model, _ = setup
    projections = ("qkv", "o", "gate_up", "down")

    def parts(name):
        m = install_variant(name, model=model, fp8_model=install_parts(model, FP8), options=FP8)
        b = m.blocks[0]
        lin = {type(getattr(b.attn if n in ("qkv", "o") else b.mlp, n)) for n in projections}
        return lin, type(b.res_norm), type(b.mlp.act), type(b.attn.core), m

    lin, norm, act, core, m = parts("bf16_gemm")
    assert lin == {Linear} and norm is ResidualNormMod and act is SwiGLUAct, (lin, norm, act)
    assert core is UnquantizedOutputAttention and m.gate_fold is keep_gates
    assert m.blocks[0].attn.qkv is model.blocks[0].attn.qkv, "bf16 GEMMs should run the float model's own weights"
    lin, norm, act, core, m = parts("bf16_o_gemm")
    b = m.blocks[0]
    assert type(b.attn.o) is Linear and b.attn.o is model.blocks[0].attn.o, "bf16_o_gemm: the float O weights"
    assert {type(b.attn.qkv), type(b.mlp.gate_up), type(b.mlp.down)} == {Fp8Linear}, "the other three stay FP8"
    assert norm is Fp8ResidualNormMod and act is Fp8SwiGLU and core is UnquantizedOutputAttention, (norm, act, core)
    lin, norm, act, core, m = parts("unfused_norm")
    assert lin == {Fp8Linear} and norm is UnfusedFp8ResidualNormMod and act is UnfusedFp8SwiGLU, (lin, norm, act)
    assert m.gate_fold is keep_gates, "the unfused parts add the residual after the GEMM"
    lin, norm, act, core, m = parts("whole_window")
    assert lin == {Fp8Linear} and norm is Fp8ResidualNormMod and core is WholeWindowAttention, (lin, norm, core)
    assert len({id(b.res_norm) for b in m.blocks}) == 1, "one res_norm object should serve every block"
    assert all(type(b.attn.qkv) is Linear for b in model.blocks), "installing the parts changed the float model"
    assert model.gate_fold is keep_gates and all(type(b.attn.core).__name__ == "CacheAttention" for b in model.blocks)
    with pytest.raises(ValueError, match="ablation variant = 'paged'; expected one of whole_window, bf16_gemm"):
        install_variant("paged", model=model, fp8_model=model, options=FP8)


def test_whole_window_rederives_the_window_every_call_and_never_writes_the_ring(setup, monkeypatch):
    cfg, model, _ = setup
    ring_writes, rotations = [], []
    real_ring = kv_cache.qkv_ring_write
    monkeypatch.setattr(kv_cache, "qkv_ring_write", lambda *a, **k: ring_writes.append(1) or real_ring(*a, **k))
    gen = generator(cfg, model, "whole_window")
    for n in range(3):
        gen.generate_chunk(chunk_audio(cfg, n), cfg.audio_sample_rate)
        if n == 0:
            win = gen.cache.window
            real = win.rotate
            win.rotate = lambda *a, real=real: rotations.append(a[0].shape) or real(*a)
    assert not ring_writes, f"the whole-window policy wrote the ring {len(ring_writes)} times"
    assert not gen.cache.k.float().any(), "the whole-window policy wrote the ring"
    calls = cfg.n_layers * cfg.passes
    assert len(rotations) == 2 * calls, f"{len(rotations)} whole-window rotations in 2 chunks; expected {2 * calls}"
    assert rotations[0] == (cfg.cache_slots, cfg.n_heads, cfg.head_dim), f"not the whole window: {rotations[0]}"


def test_whole_window_positions_follow_resets_and_clear(setup):
    """After a reset the store's slot positions are the ring's: every resident slot moved back by the shift, so a
    key re-rotated per call lands where the ring's delta-rotated key is (the tracking test checks the values)."""
    cfg, model, _ = setup
    gen = generator(cfg, model, "whole_window")
    _, resets = run_chunks(gen, cfg, cfg.t_limit + 2)
    assert resets >= 1
    c = gen.cache
    last = c.layout.chunk_slots(gen.chunk - 1)
    assert int(c.slot_pos[last, 0].max()) < cfg.t_limit, "the last chunk's positions were not shifted into the frame"
    ang = torch.as_tensor(c.window.cos)
    assert not torch.equal(ang, torch.ones_like(ang)), "the window's angles were never set"
    c.clear()
    assert not c.window.k.any() and not c.slot_pos.any(), "clear() left the whole window's keys or positions"


def test_whole_window_image_is_the_ring_of_the_same_keys():
    """The per-call function on its own: un-rotated keys rotated at their positions give the ring's write-time
    rotation (RoPE at the position, in float32, rounded once to the store's dtype); values pass as kept."""
    from vivant.kernels.rope import apply_rope_ref, rope_angles

    g = torch.Generator().manual_seed(0)
    s, h, d = 40, 2, 16
    k = torch.randn(s, h, d, generator=g).to(torch.bfloat16)
    v = torch.randn(s, h, d, generator=g).to(torch.bfloat16)
    pos = torch.randint(0, 30, (s, 3), generator=g)
    ang = rope_angles(pos, (8, 4, 4))
    k_img, v_img = rotate_window_eager(k, v, ang.cos(), ang.sin())
    want = apply_rope_ref(k.float(), pos, (8, 4, 4)).to(torch.bfloat16)
    differ = int((k_img != want).sum())
    assert differ <= 2e-3 * want.numel(), f"{differ} of {want.numel()} rotated keys differ from the ring's rule"
    assert v_img is v


def test_rewind_is_refused_under_the_whole_window(setup):
    """A turn's rewind restores the ring from its undo log; the whole window keeps none, so a rewind is refused by
    name rather than leaving the window inconsistent."""
    cfg, model, _ = setup
    gen = generator(cfg, model, "whole_window")
    run_chunks(gen, cfg, 3)
    with pytest.raises(ValueError, match="whole-window policy keeps no undo log"):
        gen.cache.rewind(gen.cache.next_chunk - 1)


def test_compiled_forms_trace_as_one_graph():
    """What a GPU compiles (fullgraph: a graph break fails here, not silently eager there): the whole-window
    function and the float norm/SwiGLU parts the bf16 row compiles, traced on CPU (aot_eager: no codegen)."""
    g = torch.Generator().manual_seed(1)
    k, v = torch.randn(12, 2, 8, generator=g), torch.randn(12, 2, 8, generator=g)
    cos, sin = torch.rand(12, 4, generator=g), torch.rand(12, 4, generator=g)
    fn = torch.compile(rotate_window_eager, fullgraph=True, dynamic=False, backend="aot_eager")
    for got, want in zip(fn(k, v, cos, sin), rotate_window_eager(k, v, cos, sin), strict=True):
        assert torch.equal(got, want)
    x, y = torch.randn(6, 16, generator=g), torch.randn(6, 16, generator=g)
    gate, shift, scale = (torch.randn(16, generator=g) for _ in range(3))
    part = ResidualNormMod(1e-6)
    comp = torch.compile(part, fullgraph=True, dynamic=False, backend="aot_eager")
    for args in ((x, y, gate, shift, scale), (x, None, None, shift, scale)):
        for got, want in zip(comp(*args), part(*args), strict=True):
            assert torch.allclose(got, want, atol=1e-6)
    gu = torch.randn(6, 32, generator=g)
    act = torch.compile(SwiGLUAct(), fullgraph=True, dynamic=False, backend="aot_eager")
    assert torch.allclose(act(gu), SwiGLUAct()(gu), atol=1e-6)


def test_compiled_part_is_eager_on_cpu():
    part = SwiGLUAct()
    assert ablation_parts.compiled_part(part, torch.device("cpu")) is part


def test_bf16_o_gemm_is_closer_to_the_float_parts_than_fp8(setup):
    """The O projection's activations unrounded: the difference from the float parts shrinks (same weights, seed,
    audio), the point of the variant."""
    cfg, model, ref = setup
    fp8, _ = run_chunks(ChunkGenerator(cfg, mode="optimized", engine=Engine.build(model, FP8), seed=2), cfg, 8)
    bf16_o, _ = run_chunks(generator(cfg, model, "bf16_o_gemm"), cfg, 8)
    err = {name: sum(rel_rms(g, w) for g, w in zip(got, ref[:8], strict=True)) / 8
           for name, got in (("fp8", fp8), ("bf16_o", bf16_o))}
    assert err["bf16_o"] < err["fp8"], f"mean relative RMS vs the float parts: {err}"


@pytest.mark.parametrize("name, owner, split_fn", [("whole_window", fast_parts, "split_kv_attention_fp8"),
                                                   ("bf16_gemm", ablation_parts, "split_kv_sdpa")])
def test_split_kv_under_each_variant(setup, monkeypatch, name, owner, split_fn):
    """The GPU's attention form on a bf16 model: image attention with 7 KV parts (they divide the tiny ring's 91
    slots) once every slot is valid — FP8 output through the quantizing combine (whole window), bf16 output
    through the plain combine (bf16 GEMMs) — tracks the same variant with one call."""
    cfg, _, _ = setup
    bf = init_random_(VideoDiT(cfg), seed=4).to(torch.bfloat16)
    calls = []
    real = getattr(owner, split_fn)
    monkeypatch.setattr(owner, split_fn, lambda *a, **k: calls.append(1) or real(*a, **k))
    image = FP8.replace(attention="image")

    def run(options):
        return run_chunks(generator(cfg, bf, name, options, dtype=torch.bfloat16), cfg, 12)[0]

    one = run(image)
    assert not calls, "one KV part should not take the split path"
    split = run(image.replace(kv_splits=7))
    assert calls, f"{name}: the split-KV path never ran although every slot became valid"
    errs = [rel_rms(a, b) for a, b in zip(split, one, strict=True)]
    assert max(errs) < 1e-2, f"{name}: 7 KV parts vs one call, relative RMS up to {max(errs):.3e}"


def test_whole_window_tracks_the_bf16_ring_on_a_bf16_model(setup):
    """Against the served ring (bf16 rows, read by image attention) the whole window keeps bf16 and only
    re-rotates per call (one choice undone, not the precision too): it tracks the ring across a reset."""
    cfg, _, _ = setup
    bf = init_random_(VideoDiT(cfg), seed=4).to(torch.bfloat16)
    image = FP8.replace(attention="image")
    got, resets = run_chunks(generator(cfg, bf, "whole_window", image, dtype=torch.bfloat16), cfg, cfg.t_limit + 2)
    gen = ChunkGenerator(cfg, mode="optimized", engine=Engine.build(bf, image), seed=2, dtype=torch.bfloat16)
    want, _ = run_chunks(gen, cfg, cfg.t_limit + 2)
    assert resets >= 1
    errs = [rel_rms(a, b) for a, b in zip(got, want, strict=True)]
    assert max(errs) < 1e-2, f"whole window vs the bf16 ring: relative RMS up to {max(errs):.3e} ({errs})"
