"""`ChunkGenerator.warm_up`: a worker captures its CUDA graphs before it says warm, so the first session's chunks
replay graphs instead of capturing them and the first position reset compiles nothing (either, inside a session,
took 1–5 s on an H200 and cost a stall),
and the warm-up leaves nothing behind: a warmed generator's session equals a cold one's."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from vivant.worker.model.config import ModelConfig
from vivant.worker.model.generator import build_generator
from vivant.worker.model.options import EngineName

CFG = ModelConfig.from_name("tiny")


def _session(gen, chunks: int) -> torch.Tensor:
    gen.reset_session(3)
    rng = np.random.default_rng(0)
    out = []
    for n in range(chunks):
        a, b = CFG.chunk_sample_range(n)
        out.append(gen.generate_chunk(rng.standard_normal(b - a).astype(np.float32) * 0.1,
                                      CFG.audio_sample_rate).latents)
    return torch.stack(out)


def test_without_graphs_there_is_nothing_to_warm():
    gen = build_generator(CFG, device="cpu", engine=EngineName.MODEL)
    assert gen.warm_up() == 0 and gen.chunk == 0, "the float parts capture no graphs: the warm-up runs no chunk"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_warmed_generator_captures_no_graph_in_its_first_session_and_matches_a_cold_one():
    warm = build_generator(CFG, device="cuda", engine=EngineName.FAST, seed=1)
    ran = warm.warm_up()
    graphs = dict(warm.engine._graphs)
    assert ran >= 1 and len(graphs) == 2, f"warm-up ran {ran} chunks and captured {len(graphs)} graphs, expected 2"
    assert warm.chunk == 0, "the warm-up's chunks were not forgotten"
    chunks = ran + 4  # past the first position reset and the full ring
    replays = warm.engine.graph_replays
    got = _session(warm, chunks)
    assert warm.engine._graphs.keys() == graphs.keys(), "the first session captured a graph after the warm-up"
    assert warm.engine.graph_replays - replays == (chunks - 1) * CFG.passes, "a pass after chunk 0 was not replayed"
    cold = build_generator(CFG, device="cuda", engine=EngineName.FAST, seed=1)
    want = _session(cold, chunks)
    err = float((got.float() - want.float()).norm() / want.float().norm())
    assert err < 1e-3, f"a warmed generator's session differs from a cold one's: relative RMS {err:.2e}"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_numerical_fault_restarts_the_served_engine_on_the_warmed_graphs():
    """The fast engine on CUDA graphs: a chunk made non-finite restarts the model's state at the next chunk (the
    session's count goes on), replaying the graphs the warm-up captured, and that chunk equals a fresh session's
    chunk 0 given the same audio."""
    gen = build_generator(CFG, device="cuda", engine=EngineName.FAST, seed=1)
    gen.warm_up()
    graphs = dict(gen.engine._graphs)
    featurize = gen.featurize
    gen.featurize = lambda audio, rate: featurize(audio, rate) * (float("inf") if gen.chunk == 2 else 1.0)
    gen.reset_session(3)
    rng = np.random.default_rng(0)
    audio = []
    for n in range(5):
        a, b = CFG.chunk_sample_range(n)
        audio.append(rng.standard_normal(b - a).astype(np.float32) * 0.1)
    outs = [gen.generate_chunk(x, CFG.audio_sample_rate) for x in audio]
    finite = [bool(torch.isfinite(o.latents).all()) for o in outs]
    assert finite == [True, True, False, True, True] and [o.index for o in outs] == list(range(5)), finite
    assert gen.chunk == 5 and gen.origin == 3 and gen.engine._graphs.keys() == graphs.keys()
    fresh = build_generator(CFG, device="cuda", engine=EngineName.FAST, seed=1)
    fresh.reset_session(3)
    want = fresh.generate_chunk(audio[3], CFG.audio_sample_rate).latents
    err = float((outs[3].latents.float() - want.float()).norm() / want.float().norm())
    assert err < 1e-3, f"the chunk after the fault differs from a fresh session's chunk 0: relative RMS {err:.2e}"
