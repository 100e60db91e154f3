"""The GPU engine (worker/model/fast_dit.py: FP8 weights and activations, fused kernels, ring attention) run on CPU
through its kernels' reference twins, against the float VideoDiT of the same weights — so its block structure
(fused residual + norm + quantization across block boundaries, modulation tables) is checked without a GPU.
Graph capture needs CUDA and is exercised by bench/gpu_smoke.py and the GPU benchmark."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from vivant.worker.model.config import ModelConfig
from vivant.worker.model.fast_dit import FastDiT, auto_kv_splits
from vivant.worker.model.generator import ChunkGenerator
from vivant.worker.model.model import VideoDiT, init_random_


def _audio(cfg, n):
    a, b = cfg.chunk_sample_range(n)
    return (0.3 * np.sin(np.arange(a, b) * 0.05 + n)).astype(np.float32)


def _run(gen, cfg, chunks):
    return [gen.generate_chunk(_audio(cfg, n), cfg.audio_sample_rate).latents for n in range(chunks)]


@pytest.fixture(scope="module")
def setup():
    cfg = ModelConfig.from_name("tiny")
    model = init_random_(VideoDiT(cfg), seed=4)
    return cfg, model


def test_fp8_engine_tracks_the_float_model_across_resets(setup):
    cfg, model = setup
    fast = FastDiT(model, attn_backend="torch", use_graphs=False)
    got = _run(ChunkGenerator(cfg, mode="optimized", model=fast, seed=2), cfg, 26)
    want = _run(ChunkGenerator(cfg, mode="baseline", model=model, seed=2, fp8=False), cfg, 26)
    errs = [float((g - w).norm() / w.norm()) for g, w in zip(got, want, strict=True)]
    assert max(errs) < 0.02, f"FP8 engine vs float model: relative RMS up to {max(errs):.3e} (per chunk {errs})"
    assert max(errs) > 1e-4, "no FP8 error at all: the engine is not quantizing"


def test_engine_cache_modes_agree(setup):
    """Same engine, ring cache vs the baseline's per-call whole-cache work: only the cache path differs."""
    cfg, model = setup
    fast = FastDiT(model, attn_backend="torch", use_graphs=False)
    ring = _run(ChunkGenerator(cfg, mode="optimized", model=fast, seed=2), cfg, 26)
    base = _run(ChunkGenerator(cfg, mode="baseline", model=FastDiT(model, attn_backend="torch", use_graphs=False),
                               seed=2), cfg, 26)
    errs = [float((g - w).norm() / w.norm()) for g, w in zip(ring, base, strict=True)]
    assert max(errs) < 0.02, f"ring vs baseline cache in the FP8 engine: up to {max(errs):.3e}"


def test_graphs_need_cuda(setup):
    _, model = setup
    with pytest.raises(RuntimeError, match="CUDA graphs need the model on a CUDA device"):
        FastDiT(model, use_graphs=True)


def test_image_backend_follows_the_ring_through_writes_resets_and_clear(setup):
    """Attention over the read image (refreshed at write, delta rotation and clear) gives exactly what attention
    over a whole-ring dequantization per call ("sdpa") gives, chunk by chunk across position resets; after the run the image equals a fresh
    dequantization of the whole ring, and a clear zeroes it with the ring."""
    cfg, model = setup
    g_img = ChunkGenerator(cfg, mode="optimized", model=FastDiT(model, attn_backend="image", use_graphs=False), seed=2)
    g_ring = ChunkGenerator(cfg, mode="optimized", model=FastDiT(model, attn_backend="sdpa", use_graphs=False), seed=2)
    resets = 0
    for n in range(26):
        a, b = (g.generate_chunk(_audio(cfg, n), cfg.audio_sample_rate) for g in (g_img, g_ring))
        resets += a.reset
        err = float((a.latents - b.latents).norm() / b.latents.norm())
        assert err == 0, f"chunk {n}: image backend vs whole-ring dequantization (sdpa) relative RMS {err:.3e}"
    assert resets >= 2, f"the run crossed {resets} position resets; the test needs at least 2"
    c = g_img.cache
    want_k = (c.k.float() * c.k_scale[..., None]).to(c.k_image.dtype)
    want_v = (c.v.float() * c.v_scale[..., None]).to(c.v_image.dtype)
    assert torch.equal(c.k_image, want_k), "the key image drifted from the ring"
    assert torch.equal(c.v_image, want_v), "the value image drifted from the ring"
    c.clear()
    assert not c.k_image.any() and not c.v_image.any(), "clear() left values in the read image"


def test_read_image_refused_for_a_baseline_cache(setup):
    cfg, _ = setup
    gen = ChunkGenerator(cfg, mode="baseline", model=VideoDiT(cfg), seed=0)
    with pytest.raises(ValueError, match="read image mirrors the ring"):
        gen.cache.enable_read_image(torch.float32)


def test_read_image_follows_ring_writes_by_the_float_model():
    """A cache whose image an engine enabled stays current when the float model writes the ring (a warm worker
    could serve one session with either): after chunks with a reset, the image equals the dequantized ring."""
    cfg = ModelConfig.from_name("tiny")
    gen = ChunkGenerator(cfg, mode="optimized", model=init_random_(VideoDiT(cfg), seed=4), seed=2)
    gen.cache.enable_read_image(torch.bfloat16)
    resets = sum(gen.generate_chunk(_audio(cfg, n), cfg.audio_sample_rate).reset for n in range(14))
    c = gen.cache
    assert resets >= 1, "the run needs a position reset"
    assert torch.equal(c.k_image, (c.k.float() * c.k_scale[..., None]).to(torch.bfloat16)), "key image is stale"
    assert torch.equal(c.v_image, (c.v.float() * c.v_scale[..., None]).to(torch.bfloat16)), "value image is stale"


@pytest.mark.parametrize("splits, taken", [(7, True), (2, False)])
def test_split_kv_path_matches_the_single_call(setup, monkeypatch, splits, taken):
    """attn_kv_splits: graph-path passes with every slot valid take the split-KV attention with the O quantization
    fused into the combine (7 parts divide the tiny ring's 91 slots); 2 parts do not divide it, so the single call
    runs. Either way the latents follow the unsplit engine's (different summation order, FP8 rounding)."""
    import vivant.worker.model.fast_dit as fd

    cfg, model = setup
    calls = []
    real = fd.split_kv_attention_fp8
    monkeypatch.setattr(fd, "split_kv_attention_fp8", lambda *a, **k: calls.append(a[0].shape) or real(*a, **k))
    split = FastDiT(model, attn_backend="image", use_graphs=False)
    split.attn_kv_splits = splits
    one = FastDiT(model, attn_backend="image", use_graphs=False)
    got = _run(ChunkGenerator(cfg, mode="optimized", model=split, seed=2), cfg, 12)
    want = _run(ChunkGenerator(cfg, mode="optimized", model=one, seed=2), cfg, 12)
    errs = [float((g - w).norm() / w.norm()) for g, w in zip(got, want, strict=True)]
    assert max(errs) < 1e-2, f"{splits} KV parts vs one call: relative RMS up to {max(errs):.3e} ({errs})"
    if taken:
        assert calls, "the split-KV path never ran although every slot became valid"
        assert calls[0] == (splits, cfg.n_heads, cfg.tokens_per_chunk, cfg.head_dim), \
            f"queries not given per part: {calls[0]}"
    else:
        assert not calls, f"{splits} parts do not divide {cfg.cache_slots} slots, yet the split path ran"


def test_unknown_pdl_site_is_named(setup):
    _, model = setup
    fast = FastDiT(model, attn_backend="image", use_graphs=False)
    fast.pdl = frozenset({"qkv", "softmax"})
    with pytest.raises(ValueError, match="pdl sites must be among .* got unknown \\['softmax'\\]"):
        _run(ChunkGenerator(ModelConfig.from_name("tiny"), mode="optimized", model=fast, seed=2),
             ModelConfig.from_name("tiny"), 1)



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


@pytest.mark.parametrize("bad", [0, -1, "four", True])
def test_bad_attn_kv_splits_named(setup, bad):
    cfg, model = setup
    fast = FastDiT(model, attn_backend="image", use_graphs=False)
    fast.attn_kv_splits = bad
    with pytest.raises(ValueError, match="attn_kv_splits must be an int >= 1 or 'auto'"):
        _run(ChunkGenerator(cfg, mode="optimized", model=fast, seed=2), cfg, 1)
