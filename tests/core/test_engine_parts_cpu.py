"""One model, two sets of parts (worker/model/model.py, worker/model/fast_parts.py), on CPU.

The FP8 parts run through their kernels' float32 twins, so the forward they share with the float parts is
checked without a GPU: both engines are built from the same `VideoDiT` weights (the FP8 one in a fork that shares
them), both run `VideoDiT.denoise` — a change to the model's definition reaches both —, they agree within FP8
tolerance across position resets, and the FP8 parts write the served bf16 ring through one kernel for every chunk,
chunk 0's sink included, and attend it as it is. Graph capture needs CUDA and is exercised by the GPU tests."""

from __future__ import annotations

import pytest
import torch
import vivant.worker.model.fast_parts as fast_parts
import vivant.worker.model.kv_cache as kv_cache
from engine_runs import chunk_audio, rel_rms, run_chunks
from vivant.worker.model.config import ModelConfig
from vivant.worker.model.engine import Engine
from vivant.worker.model.fast_parts import Fp8Linear, auto_kv_splits
from vivant.worker.model.generator import ChunkGenerator
from vivant.worker.model.kv_cache import KVCache
from vivant.worker.model.model import Linear, VideoDiT, init_random_
from vivant.worker.model.options import AttentionBackend, EngineOptions
from vivant.worker.model.positions import RingLayout

FP8 = EngineOptions(fp8=True)


def _latents(gen, cfg, chunks):
    return run_chunks(gen, cfg, chunks)[0]


@pytest.fixture(scope="module")
def setup():
    cfg = ModelConfig.from_name("tiny")
    model = init_random_(VideoDiT(cfg), seed=4)
    return cfg, model


def _gen(cfg, model, options=EngineOptions(), mode="optimized", **kw):
    return ChunkGenerator(cfg, mode=mode, engine=Engine.build(model, options), seed=2, **kw)


def test_fp8_parts_track_the_float_parts_of_the_same_weights_across_resets(setup):
    cfg, model = setup
    fast = Engine.build(model, FP8)
    got = _latents(ChunkGenerator(cfg, mode="optimized", engine=fast, seed=2), cfg, 26)
    want = _latents(ChunkGenerator(cfg, mode="baseline", model=model, seed=2, fp8=False), cfg, 26)
    errs = [rel_rms(g, w) for g, w in zip(got, want, strict=True)]
    assert max(errs) < 0.02, f"FP8 parts vs float parts: relative RMS up to {max(errs):.3e} (per chunk {errs})"
    assert max(errs) > 1e-4, "no FP8 error at all: the FP8 parts are not quantizing"
    assert type(fast.model) is VideoDiT and fast.model is not model, "the FP8 engine should run a fork of the VideoDiT"
    assert all(type(b.attn.qkv) is Linear for b in model.blocks), "installing the FP8 parts changed the float model"
    assert all(type(b.attn.qkv) is Fp8Linear for b in fast.model.blocks), "the fork has no FP8 projections"
    assert fast.model.blocks[0].attn.q_norm.weight is model.blocks[0].attn.q_norm.weight, "the fork copied weights"


def test_both_parts_run_the_models_one_forward(setup, monkeypatch):
    """Every pass of either engine goes through VideoDiT.denoise, and a change to the model's definition (here its
    head) changes both paths' output the same way: no second forward exists to forget."""
    cfg, model = setup
    calls = []
    real_denoise, real_head = VideoDiT.denoise, VideoDiT.head
    monkeypatch.setattr(VideoDiT, "denoise", lambda self, *a, **k: calls.append(self) or real_denoise(self, *a, **k))
    before = {name: _latents(_gen(cfg, model, opts), cfg, 2) for name, opts in (("float", EngineOptions()), ("fp8", FP8))}
    assert len(calls) == 2 * 2 * cfg.passes, f"{len(calls)} denoise calls for 2 engines × 2 chunks × {cfg.passes} passes"
    monkeypatch.setattr(VideoDiT, "head", lambda self, x, final: real_head(self, x, final) + 0.5)
    after = {name: _latents(_gen(cfg, model, opts), cfg, 2) for name, opts in (("float", EngineOptions()), ("fp8", FP8))}
    want = 0.5 * (0.0 - cfg.sigmas[0])  # Euler steps from sigma 1 to 0 with the velocity offset by +0.5
    for name in before:
        # chunk 0 alone: its passes attend only its own keys, which the head does not touch
        shift = (after[name][0] - before[name][0]).mean().item()
        assert abs(shift - want) < 1e-3, f"{name}: a +0.5 head offset moved chunk 0's latents by {shift:.4f}, not {want}"


def test_fp8_parts_write_the_ring_through_one_kernel_for_every_chunk(setup, monkeypatch):
    """Chunk 0 (which also fills the sink) and later chunks: the fused QKV → ring kernel, once per layer and pass,
    plus once more for the sink while chunk 0 runs; never the float parts' write."""
    cfg, model = setup
    fused, unfused = [], []
    real = kv_cache.qkv_ring_write
    monkeypatch.setattr(kv_cache, "qkv_ring_write", lambda *a, **k: fused.append(a[0].shape[0]) or real(*a, **k))
    monkeypatch.setattr(kv_cache.KVCache, "write_chunk", lambda *a, **k: unfused.append(1))
    gen = _gen(cfg, model, FP8)
    per_chunk = []
    for n in range(2):
        gen.generate_chunk(chunk_audio(cfg, n), cfg.audio_sample_rate)
        per_chunk.append(list(fused))
        fused.clear()
    calls = cfg.n_layers * cfg.passes
    assert sorted(set(per_chunk[0])) == sorted({cfg.tokens_per_chunk, cfg.sink_tokens}), per_chunk[0]
    assert per_chunk[0].count(cfg.sink_tokens) == calls and per_chunk[0].count(cfg.tokens_per_chunk) == calls, \
        f"chunk 0: {len(per_chunk[0])} fused writes; expected {calls} of the chunk and {calls} of the sink"
    assert per_chunk[1] == [cfg.tokens_per_chunk] * calls, f"chunk 1: fused writes {per_chunk[1]}"
    assert not unfused, f"the FP8 parts called the float parts' ring write {len(unfused)} times"


def test_sink_written_by_the_fused_kernel_matches_the_float_parts(setup):
    cfg, model = setup
    fast, ref = _gen(cfg, model, FP8), _gen(cfg, model)
    for g in (fast, ref):
        g.generate_chunk(chunk_audio(cfg, 0), cfg.audio_sample_rate)
    s = cfg.sink_tokens
    k = [g.cache.k[:, :s].float() for g in (fast, ref)]
    assert k[1].abs().sum() > 0, "the float parts left the sink empty"
    err = rel_rms(k[0], k[1])
    assert err < 0.05, f"sink keys of the FP8 parts vs the float parts: relative RMS {err:.3e}"


def test_engine_cache_modes_agree(setup):
    """Same FP8 parts, ring cache vs the baseline's per-call whole-cache work: only the cache path differs."""
    cfg, model = setup
    ring = _latents(_gen(cfg, model, FP8), cfg, 26)
    base = _latents(_gen(cfg, model, FP8, mode="baseline"), cfg, 26)
    errs = [rel_rms(g, w) for g, w in zip(ring, base, strict=True)]
    assert max(errs) < 0.02, f"ring vs baseline cache under the FP8 parts: up to {max(errs):.3e}"


def test_graphs_need_cuda(setup):
    _, model = setup
    with pytest.raises(ValueError, match="cuda_graphs = True needs the model on a CUDA device"):
        Engine.build(model, FP8.replace(cuda_graphs=True))


def test_served_ring_is_bf16_on_cpu_as_on_gpu(setup):
    """The CPU engine the tests run writes the ring format GPUs serve: EngineOptions.served('cpu') builds a bf16
    ring, the same as served('cuda'); the float parts keep a float32 ring (the reference)."""
    cfg, model = setup
    for options in (EngineOptions.served("cpu"), FP8.replace(attention=AttentionBackend.IMAGE)):
        gen = _gen(cfg, model, options)
        gen.generate_chunk(chunk_audio(cfg, 0), cfg.audio_sample_rate)
        assert gen.cache.k.dtype == gen.cache.v.dtype == torch.bfloat16, f"{options}: a {gen.cache.k.dtype} ring"
        assert gen.cache.k.float().abs().sum() > 0, "the ring was not written"
    assert _gen(cfg, model).cache.k.dtype == torch.float32, "the float parts' reference ring is float32"


def test_image_backend_equals_the_reference_attention_over_the_same_ring(setup):
    """Attention over the bf16 ring as it is (image: SDPA on the bf16 queries the FP8 GEMM writes, bf16 math) tracks
    the float32 reference attention (torch) over the same ring, chunk by chunk across position resets: the ring
    needs no read image of its own."""
    cfg, model = setup
    g_img = _gen(cfg, model, FP8.replace(attention=AttentionBackend.IMAGE))
    g_ref = _gen(cfg, model, FP8)
    resets = 0
    for n in range(26):
        a, b = (g.generate_chunk(chunk_audio(cfg, n), cfg.audio_sample_rate) for g in (g_img, g_ref))
        resets += a.reset
        err = rel_rms(a.latents, b.latents)
        assert err < 1e-2, f"chunk {n}: image backend vs the reference attention relative RMS {err:.3e}"
    assert resets >= 2, f"the run crossed {resets} position resets; the test needs at least 2"
    assert g_img.cache.k.dtype == torch.bfloat16 and g_img.cache.k.float().any(), "the image backend's ring"
    g_img.cache.clear()
    assert not g_img.cache.k.float().any() and not g_img.cache.v.float().any(), "clear() left values in the ring"


@pytest.mark.parametrize("splits, taken", [(7, True), (2, False)])
def test_split_kv_path_matches_the_single_call(setup, monkeypatch, splits, taken):
    """kv_splits: passes with every slot valid take the split-KV attention with the O quantization fused into the
    combine (7 parts divide the tiny ring's 91 slots); 2 parts do not divide it, so the single call runs. Either
    way the latents follow the unsplit engine's (different summation order, FP8 rounding)."""
    cfg, model = setup
    calls = []
    real = fast_parts.split_kv_attention_fp8
    monkeypatch.setattr(fast_parts, "split_kv_attention_fp8", lambda *a, **k: calls.append(a[0].shape) or real(*a, **k))
    image = FP8.replace(attention=AttentionBackend.IMAGE)
    got = _latents(_gen(cfg, model, image.replace(kv_splits=splits)), cfg, 12)
    want = _latents(_gen(cfg, model, image), cfg, 12)
    errs = [rel_rms(g, w) for g, w in zip(got, want, strict=True)]
    assert max(errs) < 1e-2, f"{splits} KV parts vs one call: relative RMS up to {max(errs):.3e} ({errs})"
    if taken:
        assert calls, "the split-KV path never ran although every slot became valid"
        assert calls[0] == (splits, cfg.n_heads, cfg.tokens_per_chunk, cfg.head_dim), \
            f"queries not given per part: {calls[0]}"
    else:
        assert not calls, f"{splits} parts do not divide {cfg.cache_slots} slots, yet the split path ran"


@pytest.mark.parametrize("tokens, heads, slots, sms, want", [
    (757, 16, 5788, 132, 4),  # 57b TP=4 on an H200: 192 CTAs per call → 4 parts (768 ≥ 4 waves)
    (757, 64, 5788, 132, 1),  # whole model: 768 CTAs already
    (757, 32, 5788, 132, 2),  # TP=2: 384 CTAs → 2 parts
    (757, 16, 5787, 132, 3),  # 3 parts divide 5,787 slots: 576 CTAs ≥ 528
    (757, 16, 5791, 132, 1),  # a prime slot count: nothing divides it
    (27, 4, 91, 0, 1),  # no SMs (CPU)
])
def test_auto_kv_splits(tokens, heads, slots, sms, want):
    got = auto_kv_splits(tokens, heads, slots, sms)
    assert got == want, f"auto_kv_splits({tokens}, {heads}, {slots}, {sms}) = {got}, expected {want}"


def test_fp8_parts_refuse_a_float_ring(setup):
    cfg, model = setup
    gen = _gen(cfg, model, FP8)
    gen.cache = _gen(cfg, model).cache  # the float parts' float32 ring
    with pytest.raises(ValueError, match="the FP8 parts write and read a bf16 ring, got a torch.float32 one"):
        gen.generate_chunk(chunk_audio(cfg, 0), cfg.audio_sample_rate)


def test_ring_dtype_is_checked():
    cfg = ModelConfig.from_name("tiny")
    with pytest.raises(ValueError, match="KVCache ring_dtype = torch.float8_e4m3fn; expected torch.bfloat16"):
        KVCache(layers=1, heads=1, head_dim=cfg.head_dim, layout=RingLayout(cfg.sink_tokens, cfg.tokens_per_chunk,
                cfg.window_chunks), rope_dims=cfg.rope_dims, rope_theta=cfg.rope_theta, ring_dtype=torch.float8_e4m3fn)
