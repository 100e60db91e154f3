"""The rewind at a frame (issue #21, docs/ARCHITECTURE.md "Rewind at a turn start"): `Pacer.splice_unshown` on a
FakeClock (k = 0, k > 0 in the chunk on screen and in a chunk not begun, a remade chunk cut again, the chunks in the
decoder stage judged whole), `AudioInput.rewind(m, keep_samples=…)` (the samples chunk m took for frames < k are kept),
the generator's latents after a splice against a session that had that audio in the first place (torch.equal, CPU,
`tiny`), and `Playout.splice` through the real decoder stage (frames equal to fresh decodes, np.array_equal)."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from collecting_sink import CollectingSink
from vivant.worker.model.config import ModelConfig
from vivant.worker.model.generator import ChunkGenerator
from vivant.worker.model.model import VideoDiT, init_random_
from vivant.worker.stream.audio_in import AudioInput
from vivant.worker.stream.decoder_stage import LatentChunk
from vivant.worker.stream.pacer import DecodedChunk, FakeClock, Pacer, PacerConfig, PacerFull
from vivant.worker.stream.playout import Playout
from vivant.worker.stream.vae import VAEConfig, build_vae_decoder

CFG = ModelConfig.from_name("tiny")
SR = CFG.audio_sample_rate
FPS, FPC = 24, 4
PC = PacerConfig(fps=FPS, frames_per_chunk=FPC, buffer_chunks=3, start_chunks=2)


def decoded(n: int, mark: int = 0) -> DecodedChunk:
    """Chunk n's frames (pixel value n·FPC + j + mark) and audio (sample s of the stream → s / 1e5 + mark)."""
    frames = np.stack([np.full((2, 2, 3), (n * FPC + j + mark) % 256, np.uint8) for j in range(FPC)])
    a, b = PC.chunk_sample_range(n)
    return DecodedChunk(n, frames, (np.arange(a, b) / 1e5 + mark).astype(np.float32))


def started(chunks: int = 3) -> tuple[Pacer, FakeClock]:
    """Chunks 0 … chunks − 1 pushed, t0 = 0 and slot 0 (chunk 0's frame 0) published."""
    clock = FakeClock()
    pacer = Pacer(PC, clock)
    for n in range(chunks):
        pacer.push(decoded(n))
    assert len(pacer.poll()) == 1
    return pacer, clock


def shown(frames) -> list[tuple[int, int]]:
    """(content frame, pixel value) of each generated frame."""
    return [(f.content_index, int(f.rgb[0, 0, 0])) for f in frames if not f.repeated]


def expected_audio(frames, marks: dict[int, int]) -> np.ndarray:
    """The audio each frame must carry: its own slot of the chunk version that was shown (content frame → mark)."""
    return np.concatenate([(np.arange(PC.frame_sample(f.content_index), PC.frame_sample(f.content_index + 1)) / 1e5
                            + marks.get(f.content_index, 0)).astype(np.float32) for f in frames])


# ---- pacer ------------------------------------------------------------------------------------------------------
def test_a_splice_at_a_chunk_boundary_is_the_chunk_rewind():
    pacer, clock = started()
    twin, twin_clock = started()
    clock.set(3.5 / FPS)
    twin_clock.set(3.5 / FPS)
    assert pacer.splice_unshown(clock.now()) == (1, 0), "slots 1..3 are due by now; frame 4 (chunk 1's first) is not"
    assert twin.drop_unstarted(twin_clock.now()) == 1
    assert pacer.buffered_indices() == twin.buffered_indices() == [0]
    pacer.push(decoded(1, mark=100))
    clock.set(7 / FPS)
    frames = pacer.poll()
    assert shown(frames) == [(1, 1), (2, 2), (3, 3)] + [(4 + j, 104 + j) for j in range(4)]


def test_a_splice_cuts_the_chunk_on_screen_at_k_and_shows_the_remade_chunk_from_k():
    """The half-shown chunk is no longer played to its end: frames 0, 1 of chunk 0 (published or due by now) stay,
    frames 2, 3 come from the remade chunk 0, with their own audio slots."""
    pacer, clock = started()
    clock.set(1.5 / FPS)
    assert pacer.splice_unshown(clock.now()) == (0, 2)
    assert pacer.buffered_indices() == [0], "chunk 0 stays, cut at frame 2; chunks 1, 2 are dropped"
    with pytest.raises(ValueError, match="expected 0"):
        pacer.push(decoded(1, mark=100))
    assert pacer.wait_until_started(1, 0), "chunk 0 is on screen: the lead still counts it started"
    pacer.push(decoded(0, mark=100))
    pacer.push(decoded(1, mark=100))
    clock.set(8 / FPS)
    frames = pacer.poll()
    assert shown(frames) == [(1, 1), (2, 102), (3, 103)] + [(4 + j, 104 + j) for j in range(4)]
    assert frames[-1].repeated, "slot 8: nothing more was pushed"
    generated = [f for f in frames if not f.repeated]
    marks = {f: 100 for f in range(2, 8)}
    assert np.array_equal(np.concatenate([f.audio for f in generated]), expected_audio(generated, marks))
    assert pacer.stats().max_abs_av_offset_s < 1 / SR, "audio slots stay on the frame grid across the splice"
    assert pacer.stats().stalls[0].first_slot == 8


def test_a_splice_in_a_chunk_not_begun_keeps_its_frames_due_within_the_horizon():
    pacer, clock = started()
    twin, twin_clock = started()
    clock.set(1 / FPS)
    twin_clock.set(1 / FPS)
    # slots 1..5 are due by 5.5/24 s: chunk 0's frames 1..3 and chunk 1's frames 0, 1; frame 6 (chunk 1, k = 2) is not
    assert pacer.splice_unshown(clock.now() + 4.5 / FPS) == (1, 2)
    assert twin.drop_unstarted(twin_clock.now() + 4.5 / FPS) == 2, "the chunk rule keeps chunk 1 whole"
    assert pacer.buffered_indices() == [0, 1]
    assert not pacer.wait_until_started(2, 0), "chunk 1 has not started"
    pacer.push(decoded(1, mark=100))
    clock.set(4 / FPS)
    frames = pacer.poll()  # chunk 0 played out: room for chunk 2
    pacer.push(decoded(2, mark=100))
    clock.set(11 / FPS)
    frames += pacer.poll()
    assert shown(frames) == [(f, f) for f in range(1, 6)] + [(6, 106), (7, 107)] + [(8 + j, 108 + j) for j in range(4)]
    assert pacer.stats().stalls == []


def test_a_remade_chunk_can_be_cut_again():
    """A second turn splices into the remade chunk 0 (which plays from frame 2): frames 2 come from the first remake,
    frame 3 from the second; the entry starting at k is judged from k."""
    pacer, clock = started()
    clock.set(1.5 / FPS)
    assert pacer.splice_unshown(clock.now()) == (0, 2)
    pacer.push(decoded(0, mark=100))
    clock.set(2.5 / FPS)
    assert pacer.splice_unshown(clock.now()) == (0, 3)
    assert pacer.buffered_indices() == [0, 0], "the old chunk 0 (frame 1 left) and the first remake (frame 2)"
    pacer.push(decoded(0, mark=200))
    clock.set(3 / FPS)
    frames = pacer.poll()  # the old chunk 0 and the first remake played out: room for chunk 1
    pacer.push(decoded(1, mark=200))
    clock.set(7 / FPS)
    frames += pacer.poll()
    assert shown(frames) == [(1, 1), (2, 102), (3, 203)] + [(4 + j, 204 + j) for j in range(4)]


def test_a_splice_before_the_remake_is_pushed_cuts_at_the_first_frame_not_pushed():
    """Two splices with nothing pushed between: the second finds every buffered frame due within its horizon, so its
    cut is the first frame not pushed — frame 3 of chunk 0, whose remake has not come — not chunk 0's frame 0."""
    pacer, clock = started()
    clock.set(2.5 / FPS)
    assert pacer.splice_unshown(clock.now()) == (0, 3)
    clock.set(3.5 / FPS)
    assert pacer.splice_unshown(clock.now()) == (0, 3)
    pacer.push(decoded(0, mark=100))
    pacer.push(decoded(1, mark=100))
    clock.set(7 / FPS)
    assert shown(pacer.poll()) == [(1, 1), (2, 2), (3, 103)] + [(4 + j, 104 + j) for j in range(4)]


def test_a_refused_push_of_the_remade_chunk_keeps_its_k():
    """A cut inside the last buffered chunk leaves the buffer full (chunks 0, 1 and chunk 2's frames < 2): the remade
    chunk 2 is refused (PacerFull) and pushed again once chunk 0 has played; it still plays from frame 2."""
    pacer, clock = started()
    assert pacer.splice_unshown(9.5 / FPS) == (2, 2)
    with pytest.raises(PacerFull):
        pacer.push(decoded(2, mark=100))
    clock.set(4 / FPS)
    frames = pacer.poll()
    pacer.push(decoded(2, mark=100))
    clock.set(11 / FPS)
    frames += pacer.poll()
    assert shown(frames) == [(f, f) for f in range(1, 10)] + [(10, 110), (11, 111)]
    assert pacer.stats().discarded_frames == 2 + 2, "the old chunk 2's frames 2, 3 and the remake's frames 0, 1"


def test_a_splice_judges_the_chunks_in_the_decoder_whole():
    """Chunk 1 on screen (slot 4 published), chunk 2 upstream (due at slot 8 = 0.333 s)."""
    def lead_one() -> tuple[Pacer, FakeClock]:
        pacer, clock = started(chunks=2)
        clock.set(4 / FPS)
        assert len(pacer.poll()) == 4
        return pacer, clock

    pacer, _ = lead_one()
    assert pacer.splice_unshown(0.42, pending_until=3) == (3, 0), "chunk 2's first frame is due by then: kept whole"
    assert pacer.buffered_indices() == [1]
    pacer, _ = lead_one()
    assert pacer.splice_unshown(0.26, pending_until=3) == (1, 3), "slot 7 (0.292 s) is after 0.26 s: chunk 1 is cut"
    assert pacer.buffered_indices() == [1]
    with pytest.raises(ValueError, match="expected 1"):
        pacer.push(decoded(2))
    pacer, _ = lead_one()
    with pytest.raises(ValueError, match="pending_until = 1"):
        pacer.splice_unshown(0.42, pending_until=1)
    assert pacer.buffered_indices() == [1], "nothing dropped by the bad call"


def test_a_splice_before_playout_started_drops_everything():
    pacer = Pacer(PC, FakeClock())
    pacer.push(decoded(0))
    assert pacer.splice_unshown(100.0) == (0, 0) and pacer.buffered_indices() == []
    pacer.push(decoded(0, mark=7))


# ---- audio input ------------------------------------------------------------------------------------------------
def keep_samples(m: int, k: int) -> int:
    return PC.frame_sample(m * FPC + k) - PC.chunk_sample_range(m)[0]


def speech(n: int, offset: float = 0.0) -> np.ndarray:
    return (0.5 * np.sin(np.arange(n) * 0.05 + offset) + 0.01).astype(np.float32)  # never 0


def test_audio_splice_keeps_the_samples_of_frames_before_k_and_places_the_speech_at_frame_k():
    ai, ref = AudioInput(CFG), AudioInput(CFG)
    old = [ai.next_chunk() for _ in range(5)]  # silence ahead of playback
    x = speech(3 * 2667)
    ai.push(x, SR)
    keep = keep_samples(2, 3)
    ai.rewind(2, keep_samples=keep)
    assert ai.next_index == 2 and ai.pending_samples() == len(x)
    for _ in range(2):
        ref.next_chunk()
    ref.push(np.concatenate([np.zeros(keep, np.float32), x]), SR)  # the same samples for chunk 2, in the first place
    got = [ai.next_chunk() for _ in range(4)]
    want = [ref.next_chunk() for _ in range(4)]
    assert np.array_equal(got[0].samples[:keep], old[2].samples[:keep])
    for a, b in zip(got, want, strict=True):
        assert a.index == b.index and np.array_equal(a.samples, b.samples)
    turn = ai.turns()[0]
    assert (turn.chunk_index, turn.stream_sample) == (2, PC.frame_sample(2 * FPC + 3)), "the turn starts at frame k"


def test_audio_splice_keeps_the_speech_before_k_and_gives_back_the_rest():
    """Chunk 2 took speech A for its first 1000 samples; the splice at frame 1 (666 samples) keeps A's first 666 and
    gives A's other 334 back, ahead of the new turn B."""
    ai = AudioInput(CFG)
    a_len = 2 * 2667 + 1000
    a = speech(a_len)
    ai.push(a, SR)
    ai.end_segment()
    old = [ai.next_chunk() for _ in range(4)]
    start2 = CFG.chunk_sample_range(2)[0]
    assert old[2].speech_samples == a_len - start2
    b = speech(2000, 1.0)
    ai.push(b, SR)
    keep = keep_samples(2, 1)
    ai.rewind(2, keep_samples=keep)
    assert ai.pending_samples() == len(b) + (a_len - start2 - keep)
    again = ai.next_chunk()
    stop2 = CFG.chunk_sample_range(2)[1]
    want = np.concatenate([a[start2:], b])[: stop2 - start2]
    assert np.array_equal(again.samples, want)
    assert again.speech_samples == stop2 - start2
    assert [t.turn for t in again.turns] == [1] and ai.turns()[1].stream_sample == a_len, "B starts after A's rest"
    assert ai.turns()[0].chunk_index == 0, "turn A's first sample was not taken again"


def test_audio_splice_prefix_is_undone_by_a_rewind_before_it_is_taken():
    ai = AudioInput(CFG)
    a = speech(3 * 2667)
    ai.push(a, SR)
    [ai.next_chunk() for _ in range(3)]
    before = ai.pending_samples()
    ai.rewind(1, keep_samples=keep_samples(1, 2))
    ai.rewind(0)
    assert before == 1 and ai.pending_samples() == len(a), "every sample taken is queued again, the prefix included"
    assert np.array_equal(np.concatenate([ai.next_chunk().samples for _ in range(4)])[: len(a)], a)


def test_audio_splice_refuses_bad_kept_samples_and_loses_nothing():
    ai = AudioInput(CFG)
    ai.push(speech(5000), SR)
    [ai.next_chunk() for _ in range(3)]
    pending = ai.pending_samples()
    length = CFG.chunk_sample_range(1)[1] - CFG.chunk_sample_range(1)[0]
    for bad in (-1, length, 2.5, True):
        with pytest.raises(ValueError, match="keep_samples"):
            ai.rewind(1, keep_samples=bad)
    with pytest.raises(ValueError, match="keep_samples = 10.*unless chunk 3 was taken"):
        ai.rewind(3, keep_samples=10)
    assert ai.next_index == 3 and ai.pending_samples() == pending, "nothing changed"


# ---- generator: the #21 equality at a frame ---------------------------------------------------------------------
@pytest.mark.parametrize("m, k", [(3, 0), (3, 2), (2, 3)])
def test_a_spliced_session_equals_one_that_had_the_audio_at_the_cut(m, k):
    """Session A: silence for chunks 0..5, a turn, rewind to (m, k); session B: silence for chunks < m, then chunk m's
    first samples as A took them (silence) and the speech from frame k on. The latents of m and every later chunk are
    bit-identical (the noise is seeded per (seed, chunk); the ring and positions restored exactly)."""
    model = init_random_(VideoDiT(CFG), seed=5)
    gen_a = ChunkGenerator(CFG, fp8=False, model=model, seed=3)
    gen_b = ChunkGenerator(CFG, fp8=False, model=model, seed=3)
    ai, ref = AudioInput(CFG), AudioInput(CFG)
    x = speech(4 * 2667, 0.7)
    for _ in range(6):
        gen_a.generate_chunk(ai.next_chunk().samples, SR)
    ai.push(x, SR)
    gen_a.rewind(m)
    ai.rewind(m, keep_samples=keep_samples(m, k))
    for _ in range(m):
        gen_b.generate_chunk(ref.next_chunk().samples, SR)
    ref.push(np.concatenate([np.zeros(keep_samples(m, k), np.float32), x]), SR)
    for n in range(m, 8):
        a, b = ai.next_chunk(), ref.next_chunk()
        assert a.index == b.index == n and np.array_equal(a.samples, b.samples)
        got, want = gen_a.generate_chunk(a.samples, SR).latents, gen_b.generate_chunk(b.samples, SR).latents
        assert torch.equal(got, want), f"chunk {n} after the splice differs by {float((got - want).abs().max()):.3e}"


# ---- playout: the decoder stage at a splice ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def vae():
    return build_vae_decoder(VAEConfig.for_model(CFG), seed=1)


def latent_chunk(n: int, seed: int) -> LatentChunk:
    g = torch.Generator().manual_seed(seed * 1000 + n)
    a, b = CFG.chunk_sample_range(n)
    now = time.monotonic()
    return LatentChunk(n, torch.randn(CFG.latent_channels, CFG.latent_h, CFG.latent_w, generator=g),
                       np.zeros(b - a, np.float32), {"audio_taken": now, "diffused": now})


def test_playout_splice_shows_the_old_frames_before_k_then_the_remade_chunk(vae):
    sink = CollectingSink()
    playout = Playout(CFG, vae, [sink], decoder_queue_chunks=8, max_lead_chunks=6).start()
    for n in range(6):
        playout.submit(latent_chunk(n, seed=0))
    assert playout.pacer.wait_until_started(1, 30)  # chunk 0 is on screen
    m, k = playout.splice(0.0)
    assert 0 <= m <= 6 and 0 <= k < FPC
    for n in range(m, 8):
        playout.submit(latent_chunk(n, seed=1))
    playout.finish()
    rec = playout.rewinds[-1]
    assert (rec.to_chunk, rec.frame) == (m, k) and all(i >= m for i in rec.dropped)
    cut = m * FPC + k
    got = [f for f in sink.frames if not f.repeated]
    assert [f.content_index for f in got] == list(range(8 * FPC)), "every content frame once, in order"

    def fresh(seed_from: int) -> list:
        ref = CollectingSink()
        p = Playout(CFG, vae, [ref], decoder_queue_chunks=8, max_lead_chunks=8).start()
        for n in range(8):
            p.submit(latent_chunk(n, seed=0 if n < seed_from else 1))
        p.finish()
        return [f for f in ref.frames if not f.repeated]

    old, new = fresh(8), fresh(m)
    for f in got:
        want = (old if f.content_index < cut else new)[f.content_index]
        assert np.array_equal(f.rgb, want.rgb), f"frame {f.content_index} (cut at {cut}) differs"


def test_a_splice_leaves_the_producer_time_for_the_chunk_after_the_remade_one():
    """`next_chunk_s`: with a chunk costing more than a frame period to make, a cut at the last frame of a chunk would
    leave one frame period for the whole next chunk (a late stall). Frame k of chunk m qualifies only if chunk m + 1,
    due (F − k) frames after it, is due later than the horizon + next_chunk_s; with 0 the cut is the plain one."""
    pacer, clock = started()
    twin, twin_clock = started()
    # slot 0 published at t = 0; horizon 2.5 frames → frame 3 (chunk 0's last) is the first due after it
    assert pacer.splice_unshown(2.5 / FPS) == (0, 3)
    # the chunk after the remade one must be due later than 2.5 + 2.2 = 4.7 frames: a cut at frame 3 (then chunk 1
    # is due at 4) does not qualify; a cut at chunk 1's frame 0 (due at 4 > 2.5, chunk 2 then due at 8) does
    assert twin.splice_unshown(2.5 / FPS, next_chunk_s=2.2 / FPS) == (1, 0)
    twin.push(decoded(1, mark=100))
    twin_clock.set(8 / FPS)
    assert shown(twin.poll()) == [(1, 1), (2, 2), (3, 3)] + [(4 + j, 104 + j) for j in range(4)], \
        "frames 1–3 of chunk 0 play, then the remade chunk 1 whole"
    with pytest.raises(ValueError, match="next_chunk_s = -0.1; expected finite seconds ≥ 0"):
        twin.splice_unshown(0.0, next_chunk_s=-0.1)
