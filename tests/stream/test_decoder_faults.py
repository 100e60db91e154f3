"""A chunk whose latents are not finite (the generator's numerical fault, flagged by it) on the decoder stage, on CPU
with the `tiny` VAE: it is not decoded (its causal state would turn every later frame black: a NaN chunk decoded into the cache made
the next chunks constant), its frames hold the last frame delivered, and the decoder restarts with the generator, so
the chunks after it equal a fresh decoder's, frame for frame."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from vivant.worker.model.config import ModelConfig
from vivant.worker.stream.decoder_stage import DecoderStage, LatentChunk
from vivant.worker.stream.pacer import DecodedChunk
from vivant.worker.stream.vae import VAEConfig, build_vae_decoder

CFG = ModelConfig.from_name("tiny")


@pytest.fixture(scope="module")
def vae():
    return build_vae_decoder(VAEConfig.for_model(CFG), seed=1)


def latent(n: int, bad: bool = False) -> torch.Tensor:
    x = torch.randn(CFG.latent_channels, CFG.latent_h, CFG.latent_w, generator=torch.Generator().manual_seed(n))
    if bad:
        x[0, 0, :3] = torch.tensor([float("nan"), float("inf"), -float("inf")])
    return x


def decode(vae, latents: list[torch.Tensor], rewind: tuple[int, list[torch.Tensor]] | None = None) -> tuple[
        list[DecodedChunk], DecoderStage]:
    """Chunks 0, 1, ... of `latents` through a DecoderStage; `rewind` = (r, new chunks from r) after they are out."""
    got: list[DecodedChunk] = []
    stage = DecoderStage(vae, got.append, queue_chunks=8).start()
    a, b = CFG.chunk_sample_range(0)

    def submit(n: int, x: torch.Tensor) -> None:
        # the producer's flag, as the generator sets it from its own check (ChunkOutput.finite)
        stage.submit(LatentChunk(n, x, np.zeros(b - a, np.float32), {"audio_taken": time.monotonic()},
                                 finite=bool(torch.isfinite(x).all())))

    for n, x in enumerate(latents):
        submit(n, x)
    if rewind is not None:
        deadline = time.monotonic() + 30
        while len(got) < len(latents) and time.monotonic() < deadline:
            time.sleep(0.01)
        r, again = rewind
        stage.rewind(r)
        for i, x in enumerate(again):
            submit(r + i, x)
    stage.close()
    return got, stage


def test_a_non_finite_chunk_holds_the_last_frame_and_the_decoder_restarts(vae) -> None:
    xs = [latent(0), latent(1), latent(2, bad=True), latent(3), latent(4)]
    got, stage = decode(vae, xs)
    assert [c.index for c in got] == [0, 1, 2, 3, 4] and stage.nonfinite_chunks == [2], stage.nonfinite_chunks
    held = got[2].frames
    assert held.shape == got[1].frames.shape and held.dtype == np.uint8, held.shape
    assert all(np.array_equal(f, got[1].frames[-1]) for f in held), "the faulted chunk's frames are not the last one held"
    fresh, _ = decode(vae, [latent(3), latent(4)])
    for a, b in zip(got[3:], fresh, strict=True):
        assert np.array_equal(a.frames, b.frames), f"chunk {a.index} after the fault differs from a fresh decoder's"
        assert a.frames.std() > 1.0, f"chunk {a.index} is flat (std {a.frames.std():.2f}): the fault reached it"


def test_a_non_finite_first_chunk_is_black(vae) -> None:
    got, stage = decode(vae, [latent(0, bad=True), latent(1)])
    assert stage.nonfinite_chunks == [0] and not got[0].frames.any(), "the first chunk held nothing: black"
    fresh, _ = decode(vae, [latent(1)])
    assert np.array_equal(got[1].frames, fresh[0].frames)


def test_a_rewind_to_the_chunk_after_a_fault_restores_the_fresh_state(vae) -> None:
    got, _ = decode(vae, [latent(0), latent(1, bad=True), latent(2), latent(3)], rewind=(2, [latent(7), latent(8)]))
    assert [c.index for c in got] == [0, 1, 2, 3, 2, 3], [c.index for c in got]
    fresh, _ = decode(vae, [latent(7), latent(8)])
    for a, b in zip(got[4:], fresh, strict=True):
        assert np.array_equal(a.frames, b.frames), f"rewound chunk {a.index} differs from a fresh decoder's"
