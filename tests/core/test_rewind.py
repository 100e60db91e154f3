"""Rewinding the chunk generator (worker/model/generator.py, kv_cache.py, ring_undo.py) on CPU, `tiny` preset.

A session that generated silence up to chunk k and then rewinds to r < k and generates speech from r must equal a
session that had silence up to r − 1 and the same speech from r: the noise is seeded per (seed, chunk), so with the
cache and the position frame restored exactly the latents are bit-identical (torch.equal: the same float32 ops on
the same inputs in the same order; no tolerance is needed and none is allowed). Checked for the float parts on their
float32 ring, the FP8 parts' CPU twins on the served bf16 ring (EngineOptions.served("cpu"), with the reference and
the image attention) and the baseline cache, across a position reset, to chunks 1 and 0, after `reset_session`, and
the refusals."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from vivant.worker.model.config import ModelConfig
from vivant.worker.model.engine import Engine
from vivant.worker.model.generator import ChunkGenerator
from vivant.worker.model.model import VideoDiT, init_random_
from vivant.worker.model.options import AttentionBackend, EngineOptions

CFG = ModelConfig.from_name("tiny")  # W = 3, t_limit = 12: a position reset before chunk 12


def _speech(n: int) -> np.ndarray:
    a, b = CFG.chunk_sample_range(n)
    return (0.4 * np.sin(np.arange(a, b) * 0.07 + 0.3 * n)).astype(np.float32)


def _silence(n: int) -> np.ndarray:
    a, b = CFG.chunk_sample_range(n)
    return np.zeros(b - a, np.float32)


@pytest.fixture(scope="module")
def model():
    return init_random_(VideoDiT(CFG), seed=5)


VARIANTS = {
    "float-ring": dict(options=EngineOptions(), mode="optimized", fp8=False),  # the float32 reference ring
    "fp8-served": dict(options=EngineOptions.served("cpu"), mode="optimized", fp8=True),  # the bf16 ring
    "fp8-image": dict(options=EngineOptions(fp8=True, attention=AttentionBackend.IMAGE), mode="optimized", fp8=True),
    "baseline": dict(options=EngineOptions(), mode="baseline", fp8=False),
}


def _gen(model, variant: str, **kw) -> ChunkGenerator:
    v = VARIANTS[variant]
    return ChunkGenerator(CFG, mode=v["mode"], fp8=v["fp8"], engine=Engine.build(model, v["options"]), seed=3, **kw)


def _run(gen: ChunkGenerator, chunks: range, audio) -> list[torch.Tensor]:
    out = []
    for n in chunks:
        assert gen.chunk == n
        out.append(gen.generate_chunk(audio(n), CFG.audio_sample_rate).latents)
    return out


def _assert_same_state(got: ChunkGenerator, want: ChunkGenerator) -> None:
    assert got.chunk == want.chunk
    assert (got.frame.offset, got.frame.resets) == (want.frame.offset, want.frame.resets)
    assert got.cache.position_shift == want.cache.position_shift
    assert got.cache.next_chunk == want.cache.next_chunk
    c, r = got.cache, want.cache
    if c.mode.value == "optimized":
        for name in ("k", "v"):
            a, b = getattr(c, name), getattr(r, name)
            assert torch.equal(a.float(), b.float()), f"cache.{name} differs after the rewind"
    else:
        lo = got.chunk - CFG.window_chunks + 1
        mine = {x.chunk: x for x in c._chunks if x.chunk >= lo}
        ref = {x.chunk: x for x in r._chunks if x.chunk >= lo}
        assert sorted(mine) == sorted(ref)
        for i in mine:
            assert all(torch.equal(a, b) for a, b in zip(mine[i].k + mine[i].v, ref[i].k + ref[i].v, strict=True))


def _check_rewind(model, variant: str, silent_until: int, to_chunk: int, speech_chunks: int = 2) -> None:
    """Session A: silence 0..silent_until−1, rewind to `to_chunk`, speech; session B: silence then speech at
    `to_chunk` from the start."""
    a, b = _gen(model, variant), _gen(model, variant)
    _run(a, range(silent_until), _silence)
    a.rewind(to_chunk)
    _run(b, range(to_chunk), _silence)
    _assert_same_state(a, b)
    end = max(silent_until, to_chunk) + speech_chunks
    got = _run(a, range(to_chunk, end), _speech)
    want = _run(b, range(to_chunk, end), _speech)
    for n, (x, y) in enumerate(zip(got, want, strict=True), start=to_chunk):
        assert torch.equal(x, y), f"{variant}: chunk {n} after the rewind differs by {float((x - y).abs().max()):.3e}"
    _assert_same_state(a, b)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_rewound_session_equals_a_session_that_had_the_speech_there(model, variant):
    _check_rewind(model, variant, silent_until=6, to_chunk=3)


@pytest.mark.parametrize("variant", ["float-ring", "fp8-image", "baseline"])
def test_rewind_across_a_position_reset_restores_the_rotated_keys(model, variant):
    # the frame resets before chunk 12 (t_limit 12); undoing chunks 11..13 undoes the reset's delta rotation
    gen = _gen(model, variant)
    _run(gen, range(14), _silence)
    assert gen.frame.resets == 1
    _check_rewind(model, variant, silent_until=14, to_chunk=11)


@pytest.mark.parametrize("to_chunk", [1, 0])
def test_rewind_to_the_first_chunks(model, to_chunk):
    _check_rewind(model, "fp8-image", silent_until=3, to_chunk=to_chunk)


def test_rewind_to_the_next_chunk_changes_nothing(model):
    a, b = _gen(model, "float-ring"), _gen(model, "float-ring")
    _run(a, range(4), _silence)
    _run(b, range(4), _silence)
    a.rewind(4)
    _assert_same_state(a, b)


def test_rewind_after_reset_session_uses_only_the_new_session(model):
    a, b = _gen(model, "fp8-served"), _gen(model, "fp8-served")
    _run(a, range(5), _speech)
    a.reset_session(3)
    _run(a, range(3), _silence)
    a.rewind(1)
    _run(b, range(1), _silence)
    _assert_same_state(a, b)
    assert torch.equal(_run(a, range(1, 3), _speech)[-1], _run(b, range(1, 3), _speech)[-1])
    with pytest.raises(ValueError, match="to_chunk"):
        a.reset_session(3)
        a.rewind(1)


def test_rewind_outside_the_log_is_refused_and_changes_nothing(model):
    gen, ref = _gen(model, "float-ring"), _gen(model, "float-ring")
    _run(gen, range(7), _silence)
    _run(ref, range(7), _silence)
    assert gen.rewind_chunks == 4
    with pytest.raises(ValueError, match=r"to_chunk = 2: expected an integer in \[3, 7\]"):
        gen.rewind(2)
    with pytest.raises(ValueError, match=r"to_chunk = 8"):
        gen.rewind(8)
    with pytest.raises(ValueError, match=r"to_chunk = -1"):
        gen.rewind(-1)
    _assert_same_state(gen, ref)


def test_rewind_off_and_bad_depths(model):
    gen = _gen(model, "float-ring", rewind_chunks=0)
    _run(gen, range(2), _silence)
    gen.rewind(2)
    with pytest.raises(ValueError, match="rewind_chunks = 0"):
        gen.rewind(1)
    with pytest.raises(ValueError, match="rewind_chunks = -1"):
        _gen(model, "float-ring", rewind_chunks=-1)
    with pytest.raises(ValueError, match=r"rewind_chunks = 9: expected < t_limit − window_chunks = 9"):
        _gen(model, "float-ring", rewind_chunks=9)


def test_a_second_position_reset_within_the_log_is_refused():
    from vivant.worker.model.kv_cache import KVCache
    from vivant.worker.model.positions import RingLayout

    layout = RingLayout(CFG.sink_tokens, CFG.tokens_per_chunk, CFG.window_chunks)
    cache = KVCache(layers=1, heads=1, head_dim=CFG.head_dim, layout=layout, rope_dims=CFG.rope_dims,
                    rope_theta=CFG.rope_theta, fp8=False, rewind_chunks=4)
    window = torch.arange(layout.sink, layout.slots)
    cache.shift_positions(9, window)
    with pytest.raises(RuntimeError, match="position reset at chunk 0 while the reset at chunk 0 is still within"):
        cache.shift_positions(9, window)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("silent_until, to_chunk", [(6, 3), (14, 11)], ids=["window", "across-a-reset"])
def test_rewind_on_the_served_gpu_engine(silent_until, to_chunk):
    """The engine a worker serves with on CUDA (FP8 GEMMs, the bf16 ring, CUDA graphs replayed from the warm-up):
    restoring the ring with copy_ into the captured addresses makes the rewound session bit-identical to one that
    had the speech at `to_chunk`, across a position reset too."""
    import copy

    from vivant.worker.model.generator import build_generator

    base = init_random_(VideoDiT(CFG), seed=5)
    a, b = (build_generator(CFG, device="cuda", seed=3, engine="fast", model=copy.deepcopy(base)) for _ in range(2))
    for g in (a, b):
        assert g.engine.options.cuda_graphs and g.cache.k.dtype == torch.bfloat16, g.engine.options
        g.warm_up()
        g.reset_session(3)
    _run(a, range(silent_until), _silence)
    a.rewind(to_chunk)
    _run(b, range(to_chunk), _silence)
    _assert_same_state(a, b)
    replays = a.engine.graph_replays
    got = _run(a, range(to_chunk, silent_until + 2), _speech)
    want = _run(b, range(to_chunk, silent_until + 2), _speech)
    assert a.engine.graph_replays > replays, "the rewound chunks did not replay the captured graphs"
    for n, (x, y) in enumerate(zip(got, want, strict=True), start=to_chunk):
        assert torch.equal(x, y), f"chunk {n} after the rewind differs by {float((x - y).abs().max()):.3e}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_copy_words_is_bit_exact_on_ring_slices(dtype):
    """The undo log's slot-slice copies (ring_undo.copy_words) move 8-byte words where they can; the bytes must be
    the same as an element copy's, NaN payloads included, and an unaligned slice must fall back, not corrupt."""
    from vivant.worker.model.ring_undo import copy_words

    gen = torch.Generator().manual_seed(3)
    ring = torch.randn(3, 40, 4, 16, generator=gen).to(dtype)
    ring.view(torch.uint8)[0, 5].fill_(0x7F)  # NaN bytes in every dtype's view
    dst = torch.zeros(3, 9, 4, 16, dtype=dtype)
    copy_words(dst, ring[:, 11:20])
    assert torch.equal(dst.view(torch.uint8), ring[:, 11:20].contiguous().view(torch.uint8))
    back = torch.zeros_like(ring)
    copy_words(back[:, 11:20], dst)
    assert torch.equal(back[:, 11:20].view(torch.uint8), ring[:, 11:20].contiguous().view(torch.uint8))
    assert not back[:, :11].view(torch.uint8).any() and not back[:, 20:].view(torch.uint8).any()
    odd = torch.zeros(3, 9, 4, 15, dtype=dtype)  # rows of 15 elements: no word view; the element copy runs
    copy_words(odd, ring[:, 11:20, :, 1:])
    assert torch.equal(odd.view(torch.uint8), ring[:, 11:20, :, 1:].contiguous().view(torch.uint8))


def test_undo_saves_follow_ring_tensors_that_were_replaced():
    """save_chunk keeps its (entry, slot range) → word views between chunks; when the ring's tensors are replaced
    (another dtype, another ring) the kept views must go, or a save would copy a tensor the cache no longer
    uses. A restore after the replacement must bring back the new tensors' bytes."""
    from vivant.worker.model.kv_cache import KVCache
    from vivant.worker.model.positions import RingLayout

    layout = RingLayout(CFG.sink_tokens, CFG.tokens_per_chunk, CFG.window_chunks)
    cache = KVCache(layers=2, heads=1, head_dim=CFG.head_dim, layout=layout, rope_dims=CFG.rope_dims,
                    rope_theta=CFG.rope_theta, fp8=False, rewind_chunks=2)
    undo = cache.undo
    a, b = layout.chunk_slot_range(1)
    cache.k.normal_()
    undo.save_chunk(cache, 1)
    assert torch.equal(undo._buf["k"][1], cache.k[:, a:b])
    old_k = cache.k
    cache.k = torch.randn_like(old_k)  # the ring's K replaced by another tensor
    undo.save_chunk(cache, 1)
    assert torch.equal(undo._buf["k"][1], cache.k[:, a:b]), "the save copied the replaced tensor"
    saved = cache.k[:, a:b].clone()
    cache.k[:, a:b] = 0.0
    undo.restore(cache, to_chunk=1, next_chunk=2)
    assert torch.equal(cache.k[:, a:b], saved)


def test_host_inputs_name_their_chunk_and_frame(model):
    """The next chunk's audio-independent inputs (built while the device runs a chunk) carry the chunk, the model's
    origin (the chunk a numerical fault restarted it at), position frame and seed they were made for, and there are
    none while a position reset is due first."""
    gen = ChunkGenerator(CFG, model=model, seed=4, rewind_chunks=2)
    for n in range(CFG.t_limit - 1):
        gen.generate_chunk(_silence(n), CFG.audio_sample_rate)
    nxt = gen.host_inputs(gen.chunk)
    assert nxt is not None and nxt.key == (gen.chunk, 0, gen.frame.offset, gen.frame.resets, 4)
    assert nxt.pos_t == gen.frame.t_of(gen.chunk) and torch.equal(nxt.noise, gen.noise(gen.chunk))
    gen.generate_chunk(_silence(gen.chunk), CFG.audio_sample_rate)
    assert gen.frame.needs_reset(gen.chunk) and gen.host_inputs(gen.chunk) is None
