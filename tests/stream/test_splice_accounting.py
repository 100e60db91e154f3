"""What the playout reports after a splice (what `vivant bench turn` prints): a chunk remade at a splice inside it
(k > 0) is timed from its first shown frame k, with its own stage times (buffer = published − decoded, end to end =
published − audio taken), and `discarded_frames` counts only the frames decoded and never shown.

A real `Playout` (decoder stage and playout threads, the `tiny` grid with a small VAE) on a `GatedClock`: the playout
thread publishes exactly the slots the test lets fall due."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch
from collecting_sink import CollectingSink
from vivant.worker.model.config import ModelConfig
from vivant.worker.stream.decoder_stage import LatentChunk
from vivant.worker.stream.pacer import FakeClock
from vivant.worker.stream.playout import Playout
from vivant.worker.stream.vae import VAEConfig, build_vae_decoder

CFG = ModelConfig.from_name("tiny")
FPS, FPC = CFG.fps, CFG.frames_per_chunk
SMALL_VAE = VAEConfig(name="accounting-test", latent_h=CFG.latent_h, latent_w=CFG.latent_w, widths=(16, 8, 8))


class GatedClock(FakeClock):
    """A FakeClock whose `sleep_until(t)` waits (real time, in 50 ms steps) until the test has set the clock to t.
    Why not FakeClock: its sleep_until jumps to t, so the playout thread would run the clock ahead of the test."""

    def __init__(self) -> None:
        super().__init__()
        self._cond = threading.Condition()

    def set(self, t: float) -> None:
        with self._cond:
            super().set(t)
            self._cond.notify_all()

    def sleep_until(self, t: float) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self.t >= t, timeout=0.05)


def latent_chunk(n: int, taken_s: float, seed: int = 0) -> LatentChunk:
    g = torch.Generator().manual_seed(seed * 1000 + n)
    a, b = CFG.chunk_sample_range(n)
    return LatentChunk(n, torch.randn(CFG.latent_channels, CFG.latent_h, CFG.latent_w, generator=g),
                       np.zeros(b - a, np.float32), {"audio_taken": taken_s, "diffused": taken_s})


def until(cond, what: str, timeout_s: float = 60.0) -> None:
    end = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < end, f"{what}: not within {timeout_s} s"
        time.sleep(0.002)


@pytest.fixture
def spliced():
    """Chunks 0..2 taken and decoded at t = 0; slots 0, 1 published (slot 1 at t = 1.5 frames); then a splice (f* =
    frame 2 of chunk 0); chunks 0 (remade), 1, 2 taken again and decoded at t = 1.5 frames; each later slot published
    at its due time."""
    clock = GatedClock()
    sink = CollectingSink()
    playout = Playout(CFG, build_vae_decoder(SMALL_VAE, seed=0), [sink], clock=clock, decoder_queue_chunks=8).start()
    try:
        for n in range(3):
            playout.submit(latent_chunk(n, 0.0))
        until(lambda: playout.pacer.stats().chunks_received == 3, "chunks 0..2 decoded")
        clock.set(1.5 / FPS)
        until(lambda: len(sink.frames) == 2, "slots 0, 1 published")
        assert playout.splice(0.0) == (0, 2)
        for n in range(3):
            playout.submit(latent_chunk(n, clock.now(), seed=1))
        until(lambda: playout.pacer.stats().chunks_received == 3, "chunks 0..2 made again")
        for slot in range(2, 3 * FPC):  # each slot published at its due time; none after the last content frame
            clock.set(slot / FPS)
            until(lambda slot=slot: len(sink.frames) == slot + 1, f"slot {slot} published")
    finally:
        playout.finish()
    return playout, sink


def test_a_chunk_remade_at_a_splice_is_timed_from_its_first_shown_frame(spliced):
    playout, sink = spliced
    assert [f.content_index for f in sink.frames] == list(range(3 * FPC)) and not any(f.repeated for f in sink.frames)
    cut = 1.5 / FPS
    # the old chunk 0 at its frame 0 (decoded at 0, shown at 0); the remade chunk 0 at its frame 2 (slot 2); chunks 1, 2
    want_buffer = [0.0, (2 / FPS - cut) * 1e3, (4 / FPS - cut) * 1e3, (8 / FPS - cut) * 1e3]
    assert playout.buffer_ms == pytest.approx(want_buffer, abs=1e-6)
    assert playout.e2e_ms == pytest.approx(want_buffer, abs=1e-6), "audio taken = decoded on this clock"
    first = [f for f in sink.frames if f.first_of_chunk]
    assert [f.content_index for f in first] == [0, 2, 4, 8]


def test_discarded_frames_counts_only_frames_decoded_and_never_shown(spliced):
    playout, sink = spliced
    report = playout.report(3, playout.production_seconds(), [])
    # never shown: the old chunk 0's frames 2, 3, the old chunks 1 and 2, the remade chunk 0's frames 0, 1
    assert report.discarded_frames == 2 + 4 + 4 + 2
    assert report.generated_frames_published == len(sink.frames) == 3 * FPC
    assert report.discarded_chunks == [], "a turn's splice is not an interrupt's discard"
    assert "12 decoded frames never shown" in report.format_text()
