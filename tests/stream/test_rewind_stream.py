"""Rewinding the back half of the stream at a turn start: AudioInput.rewind, DecoderStage.rewind,
Pacer.drop_unstarted (the half-shown rule, on a FakeClock) and Playout.rewind, on CPU with the `tiny` VAE.

The decoder stage's rewound decode must equal a decode that never saw the dropped chunks, frame for frame (the same
float32 ops on the same inputs: np.array_equal, no tolerance)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch
from collecting_sink import CollectingSink
from vivant.worker.model.config import ModelConfig
from vivant.worker.stream.audio_in import AudioInput
from vivant.worker.stream.decoder_stage import DecoderStage, LatentChunk
from vivant.worker.stream.pacer import DecodedChunk, FakeClock, Pacer, PacerConfig
from vivant.worker.stream.playout import Playout
from vivant.worker.stream.vae import VAEConfig, build_vae_decoder

CFG = ModelConfig.from_name("tiny")
SR = CFG.audio_sample_rate


def speech(n_samples: int, offset: float = 0.0) -> np.ndarray:
    return (0.5 * np.sin(np.arange(n_samples) * 0.05 + offset) + 0.01).astype(np.float32)  # never 0


# ---- audio input ------------------------------------------------------------------------------------------------
def test_audio_rewind_makes_the_speech_land_where_a_fresh_input_puts_it():
    ai, ref = AudioInput(CFG), AudioInput(CFG)
    taken = [ai.next_chunk() for _ in range(5)]  # silence ahead of playback
    assert all(c.speech_samples == 0 for c in taken)
    x = speech(2 * 2667 + 500)
    ai.push(x, SR)
    ai.rewind(2)
    assert ai.pending_samples() == len(x), "the dropped chunks held no speech: nothing more is queued"
    assert ai.next_index == 2
    for _ in range(2):
        ref.next_chunk()
    ref.push(x, SR)
    for _ in range(4):
        a, b = ai.next_chunk(), ref.next_chunk()
        assert a.index == b.index and np.array_equal(a.samples, b.samples) and a.speech_samples == b.speech_samples
    turn = ai.turns()[0]
    assert (turn.chunk_index, turn.stream_sample) == (2, CFG.chunk_sample_range(2)[0])


def test_audio_rewind_returns_the_speech_the_dropped_chunks_took_and_places_the_turn_again():
    ai = AudioInput(CFG)
    x = speech(3 * 2667)
    ai.push(x, SR)
    first = [ai.next_chunk() for _ in range(4)]
    assert first[0].turns and ai.turns()[0].chunk_index == 0
    before = ai.pending_samples()
    ai.rewind(1)
    assert ai.pending_samples() - before == sum(c.speech_samples for c in first[1:]), "their speech is queued again"
    again = [ai.next_chunk() for _ in range(3)]
    for a, b in zip(first[1:], again, strict=True):
        assert a.index == b.index and np.array_equal(a.samples, b.samples)
    ai.rewind(0)
    assert ai.turns()[0].chunk_index is None, "the turn's first sample is pending again"
    c0 = ai.next_chunk()
    assert np.array_equal(c0.samples, first[0].samples) and [t.turn for t in c0.turns] == [0]
    assert ai.turns()[0].chunk_index == 0


def test_audio_rewind_after_an_interrupt_keeps_the_interrupted_speech_discarded():
    ai = AudioInput(CFG)
    ai.push(speech(10 * 2667), SR)
    [ai.next_chunk() for _ in range(3)]
    cleared = ai.clear_buffer()
    ai.rewind(1)
    size = lambda n: CFG.chunk_sample_range(n)[1] - CFG.chunk_sample_range(n)[0]  # noqa: E731
    assert ai.cleared_samples == cleared + size(1) + size(2), "the dropped chunks' speech counts as cleared"
    assert ai.pending_samples() == 0
    c = ai.next_chunk()
    assert c.index == 1 and not c.samples.any(), "speech taken before the interrupt must not come back"
    assert ai.last_cut_chunk == 1


def test_audio_rewind_refuses_the_future_and_what_it_no_longer_holds():
    ai = AudioInput(CFG, history_chunks=2)
    [ai.next_chunk() for _ in range(5)]
    with pytest.raises(ValueError, match=r"to_chunk = 6: expected an integer in \[3, 5\]"):
        ai.rewind(6)
    with pytest.raises(ValueError, match=r"to_chunk = 2: expected an integer in \[3, 5\]"):
        ai.rewind(2)
    assert ai.next_index == 5
    with pytest.raises(ValueError, match="history_chunks"):
        AudioInput(CFG, history_chunks=-1)


# ---- decoder stage ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def vae():
    return build_vae_decoder(VAEConfig.for_model(CFG), seed=1)


def latent(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1000 + n)
    return torch.randn(CFG.latent_channels, CFG.latent_h, CFG.latent_w, generator=g)


def chunk(n: int, seed: int) -> LatentChunk:
    a, b = CFG.chunk_sample_range(n)
    now = time.monotonic()
    return LatentChunk(n, latent(n, seed), np.zeros(b - a, np.float32), {"audio_taken": now, "diffused": now})


class Collect:
    def __init__(self, gate_at: int | None = None) -> None:
        self.got: list[DecodedChunk] = []
        self.gate_at, self.gate, self.reached = gate_at, threading.Event(), threading.Event()

    def __call__(self, c: DecodedChunk) -> None:
        if c.index == self.gate_at:
            self.reached.set()
            self.gate.wait(10)
        self.got.append(c)

    def wait_for(self, count: int) -> None:
        deadline = time.monotonic() + 30
        while len(self.got) < count and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(self.got) >= count, f"decoder stage delivered {len(self.got)} chunks, expected {count}"


def test_decoder_rewind_drops_queued_and_decoding_chunks_and_restores_the_causal_state(vae):
    out = Collect(gate_at=1)
    stage = DecoderStage(vae, out, queue_chunks=8).start()
    for n in range(5):  # silence-made chunks 0..4; the delivery of chunk 1 waits at the gate
        stage.submit(chunk(n, seed=0))
    assert out.reached.wait(30)
    rewinder = threading.Thread(target=stage.rewind, args=(2,))
    rewinder.start()  # waits for the delivery in progress (the stage's lock)
    out.gate.set()
    rewinder.join(30)
    assert stage.rewind_dropped == [2, 3, 4], "the thread was delivering chunk 1: chunks 2..4 were queued"
    for n in (2, 3):
        stage.submit(chunk(n, seed=1))  # the speech-made chunks from the rewind point
    stage.close()
    assert [c.index for c in out.got] == [0, 1, 2, 3], "a dropped chunk reached on_decoded"

    ref = Collect()
    ref_stage = DecoderStage(vae, ref, queue_chunks=8).start()
    for n, seed in ((0, 0), (1, 0), (2, 1), (3, 1)):
        ref_stage.submit(chunk(n, seed))
    ref_stage.close()
    for a, b in zip(out.got, ref.got, strict=True):
        assert np.array_equal(a.frames, b.frames), f"chunk {a.index}: rewound decode differs from the fresh one"


def test_a_chunk_the_thread_has_taken_is_on_the_rewinds_record_at_once(vae):
    """The decoder thread's get and its record of the chunk it took are one step under the queue's mutex: a rewind
    that comes while the thread is held just after the get (as a thread switch can hold it) still lists the chunk
    (before: it was off `rewind_dropped`, and the decoder rank told rank 0 it had dropped fewer chunks than it
    had). The thread's get is wrapped to stop right after it returns."""
    stage = DecoderStage(vae, Collect(), queue_chunks=2)
    got, go = threading.Event(), threading.Event()
    get = stage._queue.get

    def get_then_pause():
        item = get()
        got.set()
        assert go.wait(30)
        return item

    stage._queue.get = get_then_pause
    stage.start()
    try:
        stage.submit(chunk(0, seed=0))
        assert got.wait(30), "the decoder thread took the chunk"
        stage.rewind(0)
        assert stage.rewind_dropped == [0], "the chunk just taken is dropped and on the record"
    finally:
        go.set()
        stage.close()
    assert stage.decode_ms == [], "the dropped chunk was not decoded"


def test_decoder_rewind_to_zero_and_beyond_what_it_keeps(vae):
    out = Collect()
    stage = DecoderStage(vae, out, queue_chunks=8, rewind_chunks=1).start()
    for n in range(3):
        stage.submit(chunk(n, seed=0))
    out.wait_for(3)
    with pytest.raises(ValueError, match=r"to_chunk = 1: the causal state after chunk 0 is no longer kept"):
        stage.rewind(1)
    stage.rewind(0)
    stage.submit(chunk(0, seed=2))
    stage.close()
    fresh = Collect()
    ref = DecoderStage(vae, fresh).start()
    ref.submit(chunk(0, seed=2))
    ref.close()
    assert np.array_equal(out.got[-1].frames, fresh.got[0].frames)


# ---- pacer ------------------------------------------------------------------------------------------------------
FPS, FPC = 24, 4


def decoded(cfg: PacerConfig, n: int, mark: int = 0) -> DecodedChunk:
    frames = np.stack([np.full((2, 2, 3), (n * FPC + j + mark) % 256, np.uint8) for j in range(FPC)])
    a, b = cfg.chunk_sample_range(n)
    return DecodedChunk(n, frames, np.full(b - a, 0.1 + mark / 1000, np.float32))


def started_pacer() -> tuple[Pacer, FakeClock, PacerConfig]:
    cfg = PacerConfig(fps=FPS, frames_per_chunk=FPC, buffer_chunks=3, start_chunks=2)
    clock = FakeClock()
    pacer = Pacer(cfg, clock)
    for n in range(3):
        pacer.push(decoded(cfg, n))
    assert len(pacer.poll()) == 1  # t0 = 0: chunk 0's first frame is published (chunk 0 is half shown)
    return pacer, clock, cfg


def test_drop_unstarted_keeps_the_half_shown_chunk_and_drops_the_rest():
    pacer, clock, cfg = started_pacer()
    clock.set(1.5 / FPS)
    assert pacer.drop_unstarted(clock.now()) == 1  # chunk 0 keeps playing; chunks 1, 2 were due later
    assert pacer.buffered_indices() == [0]
    with pytest.raises(ValueError, match="expected 1"):
        pacer.push(decoded(cfg, 3))
    pacer.push(decoded(cfg, 1, mark=100))
    clock.set(8 / FPS)
    frames = pacer.poll()
    # slots 1..8: chunk 0's last three frames, chunk 1 (made again) right after, then a repeat (nothing more came)
    assert [(f.chunk_index, f.repeated) for f in frames] == [(0, False)] * 3 + [(1, False)] * 4 + [(1, True)]
    shown = [f for f in frames if not f.repeated]
    assert [int(f.rgb[0, 0, 0]) for f in shown] == [1, 2, 3] + [(4 + j + 100) % 256 for j in range(4)]
    assert pacer.stats().max_abs_av_offset_s < 1 / FPS


def test_drop_unstarted_keeps_what_is_due_within_the_lead():
    pacer, clock, _ = started_pacer()
    clock.set(1 / FPS)
    assert pacer.drop_unstarted(clock.now() + 5 / FPS) == 2  # chunk 1 is due at 4/24 ≤ 6/24: kept
    assert pacer.buffered_indices() == [0, 1]
    assert pacer.drop_unstarted(clock.now() + 1.0) == 2  # nothing more to drop: r is the next chunk to push
    assert pacer.buffered_indices() == [0, 1]
    pacer, clock, _ = started_pacer()
    assert pacer.drop_unstarted(clock.now() + 1.0) == 3  # everything due within the lead: nothing dropped
    assert pacer.buffered_indices() == [0, 1, 2]


def test_drop_unstarted_before_playout_started_drops_everything():
    cfg = PacerConfig(fps=FPS, frames_per_chunk=FPC, buffer_chunks=3, start_chunks=2)
    pacer = Pacer(cfg, FakeClock())
    pacer.push(decoded(cfg, 0))
    assert pacer.drop_unstarted(100.0) == 0 and pacer.buffered_indices() == []
    pacer.push(decoded(cfg, 0, mark=7))


# The lead-1 steady state at the 57b step time (diffuse 110 ms + decode ~7 ms per 166.7 ms chunk): chunk 1 plays
# from 4/24 s; chunk 2 was taken then and is submitted at 4/24 + 0.110 s, still in the decoder when a turn's rewind
# comes 5 ms later (the loop's lead wait polls every 5 ms). Chunk 2 is due at 8/24 s, within the keep-horizon
# (p99 diffuse + decode + margin = 0.138 s); made again it would be ready only at rewind + 0.117 s.
STEP_S, DECODE_S, HORIZON_S = 0.110, 0.007, 0.138


def lead_one_pacer() -> tuple[Pacer, FakeClock, PacerConfig, float]:
    """Chunks 0, 1 pushed, playout at slot 4 (chunk 1 started), the clock at the rewind: chunk 2 is upstream."""
    cfg = PacerConfig(fps=FPS, frames_per_chunk=FPC, buffer_chunks=3, start_chunks=2)
    clock = FakeClock()
    pacer = Pacer(cfg, clock)
    for n in range(2):
        pacer.push(decoded(cfg, n))
    assert len(pacer.poll()) == 1  # t0 = 0
    clock.set(4 / FPS)
    assert len(pacer.poll()) == 4  # slots 1..4: the rest of chunk 0, then chunk 1's first frame
    rewind_at = 4 / FPS + STEP_S + 0.005
    clock.set(rewind_at)
    return pacer, clock, cfg, rewind_at


def test_a_chunk_remade_at_a_rewind_when_due_sooner_than_its_remake_is_late():
    """The cause of the late stalls at lead 1: judged by the buffer alone, the chunk still in the decoder is
    dropped (r = 2) and made again, and its slot passes before it arrives."""
    pacer, clock, cfg, rewind_at = lead_one_pacer()
    assert pacer.drop_unstarted(rewind_at + HORIZON_S) == 2
    clock.set(rewind_at + STEP_S + DECODE_S)  # chunk 2 made again
    frames = pacer.poll()
    pacer.push(decoded(cfg, 2, mark=50))
    frames += pacer.poll()
    assert [s.cause for s in pacer.stats().stalls] == ["late"]
    assert sum(f.repeated for f in frames) == 2, "slots 8 and 9 (due 0.333 s, 0.375 s) pass before 0.394 s"


def test_a_rewind_keeps_the_chunk_in_the_decoder_that_is_due_within_the_horizon():
    pacer, clock, cfg, rewind_at = lead_one_pacer()
    assert pacer.drop_unstarted(rewind_at + HORIZON_S, pending_until=3) == 3, "chunk 2 (due 8/24 s) is kept"
    assert pacer.buffered_indices() == [1]
    clock.set(rewind_at + 0.002)  # its decode ends
    pacer.push(decoded(cfg, 2))
    clock.set(rewind_at + STEP_S + DECODE_S)  # chunk 3, the turn's first, made from the rewind (due 12/24 s)
    frames = pacer.poll()
    pacer.push(decoded(cfg, 3, mark=50))
    clock.set(13 / FPS)
    frames += pacer.poll()
    assert pacer.stats().stalls == [] and not any(f.repeated for f in frames)
    assert [f.content_index for f in frames] == list(range(5, 14)), "slots 5..13: chunks 1, 2, 3 without a gap"


def test_a_rewind_drops_the_chunks_in_the_decoder_that_are_due_after_the_horizon():
    pacer, _, _, rewind_at = lead_one_pacer()
    # chunk 2 due at 0.333 s, chunk 3 (also upstream) at 0.5 s; the horizon 0.40 s keeps 2 and drops 3
    assert pacer.drop_unstarted(0.40, pending_until=4) == 3
    pacer, _, _, rewind_at = lead_one_pacer()
    assert pacer.drop_unstarted(rewind_at + 0.01, pending_until=3) == 2, "due after a short horizon: made again"
    pacer, clock, _ = started_pacer()
    clock.set(1 / FPS)
    assert pacer.drop_unstarted(clock.now() + 5 / FPS, pending_until=5) == 2, \
        "a buffered chunk dropped: everything upstream of it goes too"
    pacer = Pacer(PacerConfig(fps=FPS, frames_per_chunk=FPC, buffer_chunks=3, start_chunks=2), FakeClock())
    assert pacer.drop_unstarted(100.0, pending_until=2) == 0, "before playout starts nothing has a due time"


def test_drop_unstarted_rejects_a_pending_bound_behind_the_pushed_chunks():
    pacer, _, _, rewind_at = lead_one_pacer()
    with pytest.raises(ValueError, match="pending_until = 1"):
        pacer.drop_unstarted(rewind_at, pending_until=1)
    assert pacer.buffered_indices() == [1], "nothing dropped by the bad call"


# ---- playout ----------------------------------------------------------------------------------------------------
def test_playout_rewind_replays_from_the_first_unshown_chunk(vae):
    sink = CollectingSink()
    playout = Playout(CFG, vae, [sink], decoder_queue_chunks=8, max_lead_chunks=6).start()
    for n in range(6):
        playout.submit(chunk(n, seed=0))
    assert playout.pacer.wait_until_started(1, 30)  # chunk 0 is on screen
    r = playout.rewind(min_lead_s=0.0)
    assert 1 <= r <= 6
    for n in range(r, 8):
        playout.submit(chunk(n, seed=1))
    playout.finish()
    rec = playout.rewinds[-1]
    assert rec.to_chunk == r and all(i >= r for i in rec.dropped)
    shown = [f for f in sink.frames if not f.repeated]
    assert [f.content_index for f in shown] == list(range(8 * FPC)), "every content frame once, in order"

    ref = CollectingSink()
    ref_playout = Playout(CFG, vae, [ref], decoder_queue_chunks=8, max_lead_chunks=8).start()
    for n in range(8):
        ref_playout.submit(chunk(n, seed=0 if n < r else 1))
    ref_playout.finish()
    ref_shown = [f for f in ref.frames if not f.repeated]
    for a, b in zip(shown, ref_shown, strict=True):
        assert np.array_equal(a.rgb, b.rgb), f"frame {a.content_index} differs from the session without the drop"
    with pytest.raises(ValueError, match="min_lead_s"):
        playout.rewind(-1.0)


class SteppedClock:
    """A clock the test moves (`set`); `sleep_until` blocks the playout thread until the test has moved it that far.
    Why not FakeClock: FakeClock's `sleep_until` jumps the time forward, so the playout thread would run the timeline
    on its own; here the test must hold time still while a chunk sits in the decoder."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self.t = 0.0

    def now(self) -> float:
        with self._cond:
            return self.t

    def set(self, t: float) -> None:
        with self._cond:
            self.t = max(self.t, t)
            self._cond.notify_all()

    def sleep_until(self, t: float) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self.t >= t, timeout=5.0)


def test_playout_rewind_keeps_the_chunk_being_decoded_when_it_is_due_within_the_horizon(vae, monkeypatch):
    """The lead-1 race of `lead_one_pacer` through the real decoder stage: chunk 2 is being decoded when the rewind
    comes; it is due within the horizon, so the rewind keeps it (r = 3) and the stream plays on without a stall."""
    clock = SteppedClock()
    decoding, release = threading.Event(), threading.Event()
    calls = []
    plain = vae.decode_chunk

    def gated(latents, cache):  # the third decode (chunk 2) waits for the test
        calls.append(1)
        if len(calls) == 3:
            decoding.set()
            assert release.wait(30)
        return plain(latents, cache)

    monkeypatch.setattr(vae, "decode_chunk", gated)
    sink = CollectingSink()
    playout = Playout(CFG, vae, [sink], clock=clock, max_lead_chunks=1).start()
    try:
        for n in range(2):
            playout.submit(chunk(n, seed=0))
        deadline = time.monotonic() + 30
        while playout.pacer.t0 is None:  # the playout thread's first poll sets t0 = 0 (the clock holds still)
            assert time.monotonic() < deadline, "playout never started"
            time.sleep(0.005)
        assert playout.pacer.t0 == 0.0
        clock.set(4 / FPS)
        assert playout.pacer.wait_until_started(2, 30), "chunk 1 on screen"
        playout.submit(chunk(2, seed=0))
        assert decoding.wait(30), "chunk 2 is in the decoder"
        rewind_at = 4 / FPS + STEP_S + 0.005
        clock.set(rewind_at)
        r = playout.rewind(HORIZON_S, keep_pending_due=True)
        assert r == 3 and playout.rewinds[-1].dropped == [], "chunk 2 (due 8/24 s) is kept, nothing is made again"
    finally:
        release.set()
    playout.submit(chunk(3, seed=1))
    deadline = time.monotonic() + 30
    while 3 not in playout.pacer.buffered_indices():
        assert time.monotonic() < deadline, "chunk 3 never reached the pacer"
        time.sleep(0.005)
    clock.set((4 * FPC - 1) / FPS)  # the last frame's slot; the clock stops there, so no slot falls due after it
    while len(sink.frames) < 4 * FPC:
        assert time.monotonic() < deadline, f"{len(sink.frames)} frames published; expected {4 * FPC}"
        time.sleep(0.005)
    playout.finish()
    assert playout.pacer.stats().stalls == []
    assert [f.content_index for f in sink.frames] == list(range(4 * FPC)), "every frame once, in order, no repeat"


def test_a_turn_starts_next_only_after_silence_or_an_interrupt():
    ai = AudioInput(CFG)
    ai.next_chunk()
    assert not ai.turn_starts_next(), "nothing queued"
    ai.push(speech(3000), SR)
    assert ai.turn_starts_next(), "speech after silence: the next chunk starts the turn"
    ai.next_chunk()
    ai.end_segment()
    ai.push(speech(3000, 1.0), SR)  # a new turn queued right behind the speech still being taken
    ai.next_chunk()
    assert not ai.turn_starts_next(), "a turn that follows speech continues it: nothing made from silence"
    ai.clear_buffer()
    ai.push(speech(3000, 2.0), SR)
    assert ai.turn_starts_next(), "after an interrupt the new turn may rewind over the interrupted speech"
