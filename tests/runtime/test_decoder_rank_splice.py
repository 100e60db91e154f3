"""The decoder rank's splice at REWIND (`worker/serving/decoder_rank.splice_for_rewind`): a chunk in its decoder stage
whose first frame is due within the keep horizon (rank 0's lead + the rank's own decode time) is kept whole and r moves
past it (the one-process loop's rule); a chunk due after it is dropped. A real `Playout` (`tiny` grid, a small VAE of
the same code so decode takes milliseconds on CPU) on a FakeClock: the decoder stage's thread runs, the test polls the
pacer; the test holds the stage's lock while it submits, so the chunks stay in the stage at the REWIND."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from vivant.worker.model.config import ModelConfig
from vivant.worker.serving.decoder_rank import splice_for_rewind
from vivant.worker.serving.layout import RankLayout
from vivant.worker.serving.ranks import RankSpec
from vivant.worker.serving.wire import LinkMessage, Op
from vivant.worker.stream.decoder_stage import LatentChunk
from vivant.worker.stream.pacer import FakeClock
from vivant.worker.stream.playout import Playout
from vivant.worker.stream.vae import VAEConfig, build_vae_decoder

CFG = ModelConfig.from_name("tiny")
FPC = CFG.frames_per_chunk
SMALL_VAE = VAEConfig(name="rank-test", latent_h=CFG.latent_h, latent_w=CFG.latent_w, widths=(16, 8, 8))


def latent_chunk(n: int, seed: int = 0) -> LatentChunk:
    g = torch.Generator().manual_seed(seed * 1000 + n)
    a, b = CFG.chunk_sample_range(n)
    return LatentChunk(n, torch.randn(CFG.latent_channels, CFG.latent_h, CFG.latent_w, generator=g),
                       np.zeros(b - a, np.float32), {"audio_taken": 0.0, "diffused": 0.0})


def delivered(playout: Playout, chunks: int, timeout_s: float = 60.0) -> None:
    end = time.monotonic() + timeout_s
    while playout.pacer.stats().chunks_received < chunks:
        assert time.monotonic() < end, f"{chunks} chunks were not delivered within {timeout_s} s"
        time.sleep(0.002)


@pytest.fixture
def held():
    """Chunks 0, 1 decoded and buffered, slots 0..3 published (clock at 3/24 s); chunks 2 (due at slot 8 = 0.333 s)
    and 3 (due at slot 12 = 0.5 s) submitted and held in the decoder stage (its lock held by the test)."""
    clock = FakeClock()
    vae = build_vae_decoder(SMALL_VAE, seed=0)
    with torch.no_grad():  # warmed as the decoder rank warms it before it says ready (first calls allocate)
        cache = vae.new_cache()
        for _ in range(2):
            vae.decode_chunk(torch.zeros(CFG.latent_channels, CFG.latent_h, CFG.latent_w), cache)
    playout = Playout(CFG, vae, [], clock=clock, decoder_queue_chunks=4)
    playout.decoder.start()
    for n in range(2):
        playout.submit(latent_chunk(n))
    delivered(playout, 2)
    frames = []
    for slot in range(4):
        clock.set(slot / CFG.fps)
        frames += playout.pacer.poll()
    playout.decoder.lock.acquire()
    held: list[bool] = []

    def release() -> None:
        if held.pop():
            playout.decoder.lock.release()

    held.append(True)
    for n in (2, 3):
        playout.submit(latent_chunk(n))
    try:
        yield playout, clock, frames, release
    finally:
        if held:
            release()
        playout.decoder.close()


def test_a_chunk_in_the_decoder_stage_due_within_the_horizon_is_kept_and_r_moves_past_it(held):
    playout, clock, frames, release = held
    decode_s = max(playout.decoder.decode_ms[-8:]) / 1e3
    assert decode_s < 0.2, f"the small warm VAE must decode in well under a chunk period on CPU, took {decode_s:.3f} s"
    # horizon = now (0.125 s) + lead + decode: past chunk 2's slot (0.333 s), before chunk 3's (0.5 s)
    rewind = LinkMessage(Op.REWIND, 1, 4, lead_s=0.25 - decode_s, oldest=0, interrupt=False)
    assert splice_for_rewind(playout, rewind) == (3, 0), "chunk 2 is kept whole; chunk 3 is made again"
    assert playout.rewinds[-1].dropped == [3] and playout.rewinds[-1].cause == "turn"
    release()
    delivered(playout, 3)  # chunk 2, kept in the stage, reaches the pacer
    playout.submit(latent_chunk(3, seed=1))  # rank 0 makes chunk 3 again
    delivered(playout, 4)
    playout.pacer.close_input()
    clock.set(100.0)
    frames += playout.pacer.poll()
    assert [f.content_index for f in frames] == list(range(4 * FPC)) and not any(f.repeated for f in frames), \
        "no held frame: chunk 2 kept its slot, the remade chunk 3 fills its own"


def test_an_interrupt_at_the_decoder_rank_cuts_the_stage_chunk_due_after_the_horizon(held):
    playout, clock, _, _ = held
    rewind = LinkMessage(Op.REWIND, 1, 4, lead_s=0.0, oldest=0, interrupt=True)
    r, k = splice_for_rewind(playout, rewind)
    assert r == 1, f"the horizon (now + decode < 0.33 s) ends inside chunk 1's slots: cut there, got ({r}, {k})"
    assert playout.rewinds[-1].cause == "interrupt" and 2 in playout.rewinds[-1].dropped
    assert playout.pacer.stats().discards[-1].at_s == clock.now(), "the interrupt's cut is on the pacer's record"


def test_rank_spec_vae_must_take_the_model_latents():
    spec = RankSpec(layout=RankLayout(tp=1), init_method="tcp://127.0.0.1:1")
    assert spec.vae_config() == VAEConfig.for_model(CFG), "no vae: the preset's"
    assert RankSpec(layout=RankLayout(tp=1), init_method="tcp://127.0.0.1:1", vae=SMALL_VAE).vae_config() == SMALL_VAE
    bad = {"latent_h": VAEConfig(name="b", latent_h=9, latent_w=CFG.latent_w, widths=(16, 8)),
           "latent_channels": VAEConfig(name="b", latent_h=8, latent_w=12, widths=(16, 8), latent_channels=8),
           "temporal_factor": VAEConfig(name="b", latent_h=8, latent_w=12, widths=(16, 8), temporal_up_levels=(0,))}
    for field, vae in bad.items():
        with pytest.raises(ValueError, match=rf"RankSpec\.vae\.{field} = \d+; expected \d+ \(the 'tiny' model's\)"):
            RankSpec(layout=RankLayout(tp=1), init_method="tcp://127.0.0.1:1", vae=vae).vae_config()


def test_rank_spec_min_lead_chunks_is_a_count_a_rewind_still_reaches():
    assert RankSpec(layout=RankLayout(tp=1), init_method="tcp://127.0.0.1:1").min_lead_chunks == 1
    assert RankSpec(layout=RankLayout(tp=1), init_method="tcp://127.0.0.1:1", min_lead_chunks=5).min_lead_chunks == 5
    for bad in (0, 6, 2.0, True, "3"):
        with pytest.raises(ValueError, match=r"RankSpec\.min_lead_chunks = .*; expected an integer in \[1, 5\]"):
            RankSpec(layout=RankLayout(tp=1), init_method="tcp://127.0.0.1:1", min_lead_chunks=bad)
