"""The ablation's engine choices (EngineOptions.gemm, fused_norm, cache_policy; worker/model/fast_parts.py,
worker/model/whole_window.py) on CPU at the tiny shapes: each, installed as a part, tracks the float parts of the
same weights within the FP8 parts' tolerance (test_engine_parts_cpu.py: 2 % relative RMS over 26 chunks with
position resets), runs the parts it names and not the ones it replaces, and a bad value names its field.
The compiled forms (GPU) are checked here for being traceable as one graph; their speed is GPU-only."""

from __future__ import annotations

import pytest
import torch
import vivant.worker.model.fast_parts as fast_parts
import vivant.worker.model.kv_cache as kv_cache
from engine_runs import chunk_audio, rel_rms, run_chunks
from vivant.worker.model.config import ModelConfig
from vivant.worker.model.engine import Engine
from vivant.worker.model.fast_parts import (
    Fp8Linear,
    Fp8ResidualNormMod,
    Fp8SwiGLU,
    GatedRowSum,
    GateFold,
    UnfusedFp8ResidualNormMod,
    UnfusedFp8SwiGLU,
    WholeWindowAttention,
    install_parts,
)
from vivant.worker.model.generator import ChunkGenerator
from vivant.worker.model.model import Linear, ResidualNormMod, SwiGLUAct, VideoDiT, init_random_, keep_gates
from vivant.worker.model.options import CachePolicy, EngineOptions, GemmAlgorithms, GemmPrecision
from vivant.worker.model.whole_window import requantize_window_eager, rotate_window_eager

FP8 = EngineOptions(fp8=True)
CHUNKS = 26  # crosses position resets at the tiny preset's t_limit


@pytest.fixture(scope="module")
def setup():
    cfg = ModelConfig.from_name("tiny")
    model = init_random_(VideoDiT(cfg), seed=4)
    ref, _ = run_chunks(ChunkGenerator(cfg, mode="baseline", model=model, seed=2, fp8=False), cfg, CHUNKS)
    return cfg, model, ref


VARIANTS = {
    "whole_window": FP8.replace(cache_policy="whole_window"),
    "bf16_gemm": FP8.replace(gemm="bf16"),
    "unfused_norm": FP8.replace(fused_norm=False),
    "bf16_gemm_unfused": FP8.replace(gemm="bf16", fused_norm=False),
    "whole_window_unfused": FP8.replace(cache_policy="whole_window", fused_norm=False),
    "bf16_o_gemm": FP8.replace(o_gemm="bf16"),
    "residual_after_gemm": FP8.replace(residual_in_gemm=False),
}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_each_choice_tracks_the_float_parts_across_resets(setup, name):
    cfg, model, ref = setup
    got, resets = run_chunks(ChunkGenerator(cfg, mode="optimized", engine=Engine.build(model, VARIANTS[name]), seed=2),
                       cfg, CHUNKS)
    errs = [rel_rms(g, w) for g, w in zip(got, ref, strict=True)]
    assert resets >= 2, f"the run crossed {resets} position resets; the test needs at least 2"
    assert max(errs) < 0.02, f"{name} vs the float parts: relative RMS up to {max(errs):.3e} (per chunk {errs})"
    assert max(errs) > 1e-4, f"{name}: no FP8 error at all although the ring is FP8"


def test_the_parts_each_choice_installs(setup):
    cfg, model, _ = setup
    projections = ("qkv", "o", "gate_up", "down")

    def parts(options):
        m = Engine.build(model, options).model
        b = m.blocks[0]
        lin = {type(getattr(b.attn if n in ("qkv", "o") else b.mlp, n)) for n in projections}
        return lin, type(b.res_norm), type(b.mlp.act), type(b.attn.core), m

    lin, norm, act, core, m = parts(VARIANTS["bf16_gemm"])
    assert lin == {Linear} and norm is ResidualNormMod and act is SwiGLUAct, (lin, norm, act)
    assert m.blocks[0].attn.qkv is model.blocks[0].attn.qkv, "bf16 GEMMs should run the float model's own weights"
    lin, norm, act, core, m = parts(VARIANTS["bf16_o_gemm"])
    b = m.blocks[0]
    assert type(b.attn.o) is Linear and b.attn.o is model.blocks[0].attn.o, "o_gemm = bf16: the float O weights"
    assert {type(b.attn.qkv), type(b.mlp.gate_up), type(b.mlp.down)} == {Fp8Linear}, "the other three stay FP8"
    assert norm is Fp8ResidualNormMod and act is Fp8SwiGLU and not b.attn.core.quantize, (norm, act)
    lin, norm, act, core, m = parts(VARIANTS["unfused_norm"])
    assert lin == {Fp8Linear} and norm is UnfusedFp8ResidualNormMod and act is UnfusedFp8SwiGLU, (lin, norm, act)
    lin, norm, act, core, m = parts(VARIANTS["whole_window"])
    assert lin == {Fp8Linear} and norm is Fp8ResidualNormMod and core is WholeWindowAttention, (lin, norm, core)
    assert len({id(b.res_norm) for b in m.blocks}) == 1, "one res_norm object should serve every block"
    assert all(type(b.attn.qkv) is Linear for b in model.blocks), "installing the parts changed the float model"


def test_whole_window_rederives_the_window_every_call_and_never_writes_the_ring(setup, monkeypatch):
    cfg, model, _ = setup
    ring_writes, requant = [], []
    real_ring = kv_cache.qkv_ring_write
    monkeypatch.setattr(kv_cache, "qkv_ring_write", lambda *a, **k: ring_writes.append(1) or real_ring(*a, **k))
    gen = ChunkGenerator(cfg, mode="optimized", engine=Engine.build(model, VARIANTS["whole_window"]), seed=2)
    for n in range(3):
        gen.generate_chunk(chunk_audio(cfg, n), cfg.audio_sample_rate)
        if n == 0:
            win = gen.cache.window
            real = win.requantize
            win.requantize = lambda *a, real=real: requant.append(a[0].shape) or real(*a)
    assert not ring_writes, f"the whole-window policy wrote the ring {len(ring_writes)} times"
    calls = cfg.n_layers * cfg.passes
    assert len(requant) == 2 * calls, f"{len(requant)} whole-window re-quantizations in 2 chunks; expected {2 * calls}"
    assert requant[0] == (cfg.cache_slots, cfg.n_heads, cfg.head_dim), f"not the whole window: {requant[0]}"
    assert gen.cache.k_image is None, "the whole-window policy should not keep the ring's read image"


def test_whole_window_positions_follow_resets_and_clear(setup):
    """After a reset the store's slot positions are the ring's: every resident slot moved back by the shift, so a
    key re-rotated per call lands where the ring's delta-rotated key is (the numerics test checks the values)."""
    cfg, model, _ = setup
    gen = ChunkGenerator(cfg, mode="optimized", engine=Engine.build(model, VARIANTS["whole_window"]), seed=2)
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
    """The per-call function on its own: un-rotated keys rotated at their positions and quantized per row give the
    values the ring's write-time rotation + quantization gives (kernels/qkv_ring.py's twin, same rule)."""
    from vivant.kernels.fp8 import dequantize_rows, quantize_rows_ref
    from vivant.kernels.rope import apply_rope_ref, rope_angles

    g = torch.Generator().manual_seed(0)
    s, h, d = 40, 2, 16
    k = torch.randn(s, h, d, generator=g)
    v = torch.randn(s, h, d, generator=g)
    pos = torch.randint(0, 30, (s, 3), generator=g)
    ang = rope_angles(pos, (8, 4, 4))
    k_img, v_img = requantize_window_eager(k, v, ang.cos(), ang.sin())
    want_k = dequantize_rows(*quantize_rows_ref(apply_rope_ref(k, pos, (8, 4, 4))))
    assert torch.equal(k_img, want_k), "rotated keys differ from the ring's rule"
    assert torch.equal(v_img, dequantize_rows(*quantize_rows_ref(v)))


def test_compiled_forms_trace_as_one_graph():
    """What a GPU compiles (fullgraph: a graph break fails here, not silently eager there): the whole-window
    function and the float norm/SwiGLU parts the bf16 row compiles, traced on CPU (aot_eager: no codegen)."""
    g = torch.Generator().manual_seed(1)
    k, v = torch.randn(12, 2, 8, generator=g), torch.randn(12, 2, 8, generator=g)
    cos, sin = torch.rand(12, 4, generator=g), torch.rand(12, 4, generator=g)
    fn = torch.compile(requantize_window_eager, fullgraph=True, dynamic=False, backend="aot_eager")
    for got, want in zip(fn(k, v, cos, sin), requantize_window_eager(k, v, cos, sin), strict=True):
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


@pytest.mark.parametrize("field, value, match", [
    ("gemm", "fp16", "EngineOptions.gemm = 'fp16'; expected one of fp8, bf16"),
    ("cache_policy", "paged", "EngineOptions.cache_policy = 'paged'; expected one of ring, whole_window"),
    ("fused_norm", "yes", "EngineOptions.fused_norm = 'yes'; expected True or False"),
    ("gemm_algorithms", "fastest", "EngineOptions.gemm_algorithms = 'fastest'; expected one of heuristic, tuned"),
])
def test_bad_values_name_their_field(field, value, match):
    with pytest.raises(ValueError, match=match):
        FP8.replace(**{field: value})


@pytest.mark.parametrize("change", [{"gemm": "bf16"}, {"fused_norm": False}, {"cache_policy": "whole_window"},
                                    {"gemm_algorithms": "tuned"}])
def test_choices_of_the_fast_parts_refused_with_the_float_parts(change):
    field = next(iter(change))
    with pytest.raises(ValueError, match=f"EngineOptions.{field} = .* needs fp8=True"):
        EngineOptions(**change)


def test_parsed_values_are_the_enums():
    o = FP8.replace(gemm="bf16", cache_policy="whole_window", gemm_algorithms="tuned")
    assert o.gemm is GemmPrecision.BF16 and o.cache_policy is CachePolicy.WHOLE_WINDOW
    assert o.gemm_algorithms is GemmAlgorithms.TUNED


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


def test_bf16_gemms_refuse_an_already_quantized_model(setup):
    cfg, model, _ = setup
    fp8_model = Engine.build(model, FP8).model
    with pytest.raises(ValueError, match="gemm = 'bf16' needs the model's float projections"):
        Engine.build(fp8_model, VARIANTS["bf16_gemm"])


def test_bf16_o_gemm_refuses_an_already_quantized_model_and_the_float_parts(setup):
    cfg, model, _ = setup
    fp8_model = Engine.build(model, FP8).model
    with pytest.raises(ValueError, match=r"o_gemm = 'bf16' needs the model's float projections \(o\)"):
        Engine.build(fp8_model, VARIANTS["bf16_o_gemm"])
    with pytest.raises(ValueError, match="o_gemm = 'bf16' needs fp8=True"):
        EngineOptions(o_gemm="bf16")
    with pytest.raises(ValueError, match="EngineOptions.o_gemm = 'fp16'; expected one of fp8, bf16"):
        FP8.replace(o_gemm="fp16")


def test_bf16_o_gemm_is_closer_to_the_float_parts_than_fp8(setup):
    """The O projection's activations unrounded: the difference from the float parts shrinks (same weights, seed,
    audio), the point of the choice."""
    cfg, model, ref = setup
    err = {}
    for name, options in (("fp8", FP8), ("bf16_o", VARIANTS["bf16_o_gemm"])):
        got, _ = run_chunks(ChunkGenerator(cfg, mode="optimized", engine=Engine.build(model, options), seed=2), cfg, 8)
        err[name] = sum(rel_rms(g, w) for g, w in zip(got, ref[:8], strict=True)) / 8
    assert err["bf16_o"] < err["fp8"], f"mean relative RMS vs the float parts: {err}"


def test_compiled_part_is_eager_on_cpu():
    part = SwiGLUAct()
    assert fast_parts.compiled_part(part, torch.device("cpu")) is part


@pytest.mark.parametrize("name, split_fn", [("whole_window", "split_kv_attention_fp8"), ("bf16_gemm", "split_kv_sdpa")])
def test_split_kv_under_each_choice(setup, monkeypatch, name, split_fn):
    """The GPU's attention form on a bf16 model: image attention with 7 KV parts (they divide the tiny ring's 91
    slots) once every slot is valid — FP8 output through the quantizing combine (whole window), bf16 output
    through the plain combine (bf16 GEMMs) — tracks the same choice with one call."""
    cfg, model, _ = setup
    bf = init_random_(VideoDiT(cfg), seed=4).to(torch.bfloat16)
    calls = []
    real = getattr(fast_parts, split_fn)
    monkeypatch.setattr(fast_parts, split_fn, lambda *a, **k: calls.append(1) or real(*a, **k))
    image = VARIANTS[name].replace(attention="image")

    def run(options):
        gen = ChunkGenerator(cfg, mode="optimized", engine=Engine.build(bf, options), seed=2, dtype=torch.bfloat16)
        return run_chunks(gen, cfg, 12)[0]

    one = run(image)
    assert not calls, "one KV part should not take the split path"
    split = run(image.replace(kv_splits=7))
    assert calls, f"{name}: the split-KV path never ran although every slot became valid"
    errs = [rel_rms(a, b) for a, b in zip(split, one, strict=True)]
    assert max(errs) < 1e-2, f"{name}: 7 KV parts vs one call, relative RMS up to {max(errs):.3e}"


def test_whole_window_beside_a_bf16_ring_rotates_without_quantizing(setup):
    """Against the served GPU ring (bf16 rows, its own image) the whole window keeps bf16 and only re-rotates per
    call (one choice undone, not the precision too): it tracks the bf16 ring across a reset, leaves the ring
    unwritten, and its image is the rotated keys and kept values, unquantized."""
    cfg, _, _ = setup
    bf = init_random_(VideoDiT(cfg), seed=4).to(torch.bfloat16)
    ring = FP8.replace(attention="image", ring="bf16")

    def run(options):
        gen = ChunkGenerator(cfg, mode="optimized", engine=Engine.build(bf, options), seed=2, dtype=torch.bfloat16)
        lat, resets = run_chunks(gen, cfg, cfg.t_limit + 2)
        return gen, lat, resets

    g_ww, got, resets = run(ring.replace(cache_policy="whole_window"))
    _, want, _ = run(ring)
    assert resets >= 1
    errs = [rel_rms(a, b) for a, b in zip(got, want, strict=True)]
    assert max(errs) < 1e-2, f"whole window vs the bf16 ring: relative RMS up to {max(errs):.3e} ({errs})"
    win = g_ww.cache.window
    assert win.quantize is False and win.requantize is rotate_window_eager
    assert not g_ww.cache.k.float().any(), "the whole-window policy wrote the ring"
    k_img, v_img = win.images(0)
    assert v_img.data_ptr() == win.v[0].data_ptr(), "with a bf16 ring the kept values are the image"
    assert torch.equal(k_img, rotate_window_eager(win.k[0], win.v[0], win.cos, win.sin)[0])


def test_rewind_is_refused_under_the_whole_window(setup):
    """A turn's rewind (KVCache.rewind) restores the ring from its undo log; the whole window (an ablation, not a
    served policy) keeps none, so a rewind is refused by name rather than leaving the window inconsistent."""
    cfg, model, _ = setup
    gen = ChunkGenerator(cfg, mode="optimized", engine=Engine.build(model, VARIANTS["whole_window"]), seed=2)
    run_chunks(gen, cfg, 3)
    with pytest.raises(ValueError, match="whole-window policy .* keeps no undo log"):
        gen.cache.rewind(gen.cache.next_chunk - 1)


def test_residual_in_gemm_folds_the_gates_and_matches_the_residual_kernel(setup):
    """EngineOptions.residual_in_gemm: every O and down Fp8Linear reads its row of GateFold's buffer, which each pass
    fills with its weights' scales × that pass's gates; the row-parallel step hands res_norm a GatedRowSum; and the
    engine's latents equal the engine that adds the residual after the GEMM (residual_in_gemm=False) up to where
    each rounds (the CPU twin rounds the unfolded GEMM's product to bf16 first)."""
    cfg, model, ref = setup
    fold, plain = Engine.build(model, FP8), Engine.build(model, VARIANTS["residual_after_gemm"])
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


def test_residual_in_gemm_is_refused_when_not_a_bool():
    with pytest.raises(ValueError, match="EngineOptions.residual_in_gemm = 'yes'; expected True or False"):
        FP8.replace(residual_in_gemm="yes")
