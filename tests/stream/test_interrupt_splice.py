"""An interrupt is a splice (issue #21, docs/ARCHITECTURE.md "Turns: rewind and lead"): `clear_buffer` cuts the
stream at f* = the first frame due after now + the keep horizon, and chunk m is made again from silence from frame k,
so the face stops talking at f* and the next slot gets the remade frame, not a held one.

On a FakeClock: the pacer's cut (no repeated frame when the remake comes in time; a gap counted as a stall of cause
"interrupt" when it comes late; the frames never shown counted once), and the streaming loop's steps
(`StreamPipeline.make_next_chunk`, real `tiny` DiT and VAE, the decoder stage's thread, the pacer polled by the test):
no repeated frame at the interrupt, speech up to f* and silence after it, and the latents of every chunk equal a
session that got the speech only up to f*'s first sample in the first place (torch.equal)."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from vivant.worker.model.config import ModelConfig
from vivant.worker.model.generator import ChunkGenerator
from vivant.worker.stream.audio_in import AudioInput
from vivant.worker.stream.lead import LeadConfig
from vivant.worker.stream.pacer import DecodedChunk, FakeClock, Pacer, PacerConfig
from vivant.worker.stream.pipeline import StreamPipeline
from vivant.worker.stream.vae import VAEConfig, build_vae_decoder

CFG = ModelConfig.from_name("tiny")
SR = CFG.audio_sample_rate
FPS, FPC = 24, 4
PC = PacerConfig(fps=FPS, frames_per_chunk=FPC, buffer_chunks=3, start_chunks=2)


def decoded(n: int, mark: int = 0, speech: bool = True) -> DecodedChunk:
    """Chunk n: frame j's pixel value n·FPC + j + mark; audio non-zero (speech) or silence."""
    frames = np.stack([np.full((2, 2, 3), (n * FPC + j + mark) % 256, np.uint8) for j in range(FPC)])
    a, b = PC.chunk_sample_range(n)
    audio = np.full(b - a, 0.25, np.float32) if speech else np.zeros(b - a, np.float32)
    return DecodedChunk(n, frames, audio)


def started() -> tuple[Pacer, FakeClock]:
    """Chunks 0, 1, 2 (speech) pushed, t0 = 0, slot 0 published."""
    clock = FakeClock()
    pacer = Pacer(PC, clock)
    for n in range(3):
        pacer.push(decoded(n))
    assert len(pacer.poll()) == 1
    return pacer, clock


def shown(frames) -> list[tuple[int, int]]:
    return [(f.content_index, int(f.rgb[0, 0, 0])) for f in frames if not f.repeated]


# ---- pacer ------------------------------------------------------------------------------------------------------
def test_an_interrupt_splice_fills_the_next_slot_with_the_remade_frame():
    pacer, clock = started()
    clock.set(1.5 / FPS)
    assert pacer.splice_unshown(clock.now(), interrupt=True) == (0, 2)
    pacer.push(decoded(0, mark=100, speech=False))  # remade from silence from frame 2
    pacer.push(decoded(1, mark=100, speech=False))
    clock.set(7 / FPS)
    frames = pacer.poll()
    assert not any(f.repeated for f in frames), "the remake came in time: no held frame"
    assert shown(frames) == [(1, 1), (2, 102), (3, 103)] + [(4 + j, 104 + j) for j in range(4)]
    assert frames[0].audio.any() and not np.concatenate([f.audio for f in frames[1:]]).any(), \
        "speech up to f* (frame 2), silence from it"
    stats = pacer.stats()
    assert stats.stalls == [] and [d.chunks for d in stats.discards] == [[0, 1, 2]]
    # never shown: the old chunk 0's frames 2, 3, chunks 1 and 2, and the remade chunk 0's frames 0, 1
    assert stats.discarded_frames == 2 + 4 + 4 + 2


def test_a_late_remake_after_an_interrupt_is_a_stall_of_cause_interrupt_and_a_later_gap_is_late():
    pacer, clock = started()
    clock.set(1.5 / FPS)
    assert pacer.splice_unshown(clock.now(), interrupt=True) == (0, 2)
    clock.set(4 / FPS)
    frames = pacer.poll()  # slot 1: frame 1; slots 2..4: the remake is not there
    assert [f.repeated for f in frames] == [False, True, True, True]
    pacer.push(decoded(0, mark=100, speech=False))
    clock.set(6 / FPS)
    frames += pacer.poll()  # the remade frames 2, 3 in slots 5, 6
    clock.set(8 / FPS)
    frames += pacer.poll()  # chunk 1 is late too: a gap that is not the interrupt's
    pacer.push(decoded(1, speech=False))
    clock.set(12 / FPS)
    frames += pacer.poll()
    stats = pacer.stats()
    assert [(s.first_slot, s.frames, s.cause) for s in stats.stalls] == [(2, 3, "interrupt"), (7, 2, "late")]
    assert stats.repeated_frames == 5 and shown(frames)[:3] == [(1, 1), (2, 102), (3, 103)]


def test_a_turn_splice_is_not_counted_as_an_interrupt():
    pacer, clock = started()
    clock.set(1.5 / FPS)
    assert pacer.splice_unshown(clock.now()) == (0, 2)
    clock.set(3 / FPS)
    pacer.poll()
    stats = pacer.stats()
    assert stats.discards == [] and [s.cause for s in stats.stalls] == ["late"]


# ---- the loop's steps on a FakeClock ----------------------------------------------------------------------------
SPEECH_S = 2.0


def speech() -> np.ndarray:
    t = np.arange(int(SPEECH_S * SR)) / SR
    return (0.4 * np.sin(2 * np.pi * 170 * t) + 0.05).astype(np.float32)  # never 0


class RecordingGenerator(ChunkGenerator):
    """The real generator, keeping the latents of the last version made of each chunk."""

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.made: dict[int, torch.Tensor] = {}

    def generate_chunk(self, audio, sample_rate):
        n = self.chunk
        out = super().generate_chunk(audio, sample_rate)
        self.made[n] = out.latents.clone()
        return out


def delivered(pipe: StreamPipeline, n: int, timeout_s: float = 60.0) -> None:
    """Wait (real time) until the decoder stage's thread pushed chunk n into the pacer."""
    end = time.monotonic() + timeout_s
    while pipe.pacer.stats().chunks_received < n + 1:
        if time.monotonic() > end:
            pipe.decoder.close(0)  # re-raises the decoder's error, if that is why
            raise AssertionError(f"chunk {n} was not delivered within {timeout_s} s")
        time.sleep(0.002)


@pytest.fixture(scope="module")
def interrupted():
    """Speech from sample 0; the producer keeps 3 chunks ahead; at t = 30.5 frames (chunk 7 on screen) clear_buffer,
    then the next step splices; the clock moves only once the chunks due are delivered (the producer keeps up)."""
    clock = FakeClock()
    gen = RecordingGenerator(CFG, seed=0)
    # never "measured" in this short run: the keep horizon stays one chunk period (4 frames), whatever this CPU's speed
    lead = LeadConfig.for_model(CFG, initial_chunks=1, min_chunks=1, max_chunks=4, min_samples=48, window=48)
    vae = build_vae_decoder(VAEConfig(name="loop-test", latent_h=CFG.latent_h, latent_w=CFG.latent_w,
                                      widths=(16, 8, 8)), seed=0)
    pipe = StreamPipeline(gen, vae, [], pacer_config=PacerConfig.for_model(CFG), clock=clock, lead_config=lead)
    pipe.playout.decoder.start()
    pipe.audio_in.push(speech(), SR)
    pipe.audio_in.end_segment()
    frames = []
    cleared = False
    try:
        while pipe.next_index < 16:
            while pipe.pacer.depth() < 3 and pipe.next_index < 16:
                delivered(pipe, pipe.make_next_chunk())
            frames += pipe.pacer.poll()
            if not cleared and clock.now() >= 30 / FPS:
                clock.set(30.5 / FPS)
                pipe.clear_buffer()
                delivered(pipe, pipe.make_next_chunk())
                cleared = True
            clock.advance(1 / FPS)
    finally:
        pipe.decoder.close()
    pipe.pacer.close_input()
    clock.advance(100.0)
    frames += pipe.pacer.poll()
    return pipe, gen, frames


def test_an_interrupt_leaves_no_held_frame_and_cuts_the_speech_at_f_star(interrupted):
    pipe, _, frames = interrupted
    rewinds = pipe.playout.rewinds
    assert [(rw.to_chunk, rw.frame, rw.cause) for rw in rewinds] == [(8, 3, "interrupt")], \
        "f* = slot 35 (the first due after 30.5 + 4 frames): frame 3 of chunk 8"
    assert not any(f.repeated for f in frames), "the remade frames filled every slot"
    assert [f.content_index for f in frames] == list(range(16 * FPC)), "every content frame once, in order"
    speaking = [bool(f.audio.any()) for f in frames]
    assert speaking == [True] * 35 + [False] * (len(frames) - 35), "speech until f*, silence from it"
    stats = pipe.pacer.stats()
    assert stats.stalls == [] and [d.chunks for d in stats.discards] == [[8, 9]]
    assert stats.discarded_frames == 1 + 4 + 3, "chunk 8's frame 3, chunk 9, the remade chunk 8's frames 0..2"
    assert pipe.audio_in.cleared_samples > 0


def test_the_interrupted_stream_equals_a_session_that_got_silence_from_f_star(interrupted):
    """Session B: the same speech, but only up to frame 35's first sample, then silence, from the start. Every chunk
    the interrupted session finally made (chunks 0..7 once, chunk 8 and on remade) is bit-identical."""
    _, gen, _ = interrupted
    ref_gen, ref_in = ChunkGenerator(CFG, seed=0), AudioInput(CFG)
    ref_in.push(speech()[: PC.frame_sample(35)], SR)
    for n in range(16):
        want = ref_gen.generate_chunk(ref_in.next_chunk().samples, SR).latents
        got = gen.made[n]
        assert torch.equal(got, want), f"chunk {n}: differs by {float((got - want).abs().max()):.3e}"
