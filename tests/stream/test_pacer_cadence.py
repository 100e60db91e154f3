"""The pacer on a fake clock (no sleeping): exact 1/24 s cadence, stalls counted, nothing dropped.

Frames are tiny (2x2) and filled with their generated frame index, so a repeat is recognisable.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from vivant.worker.stream.pacer import DecodedChunk, FakeClock, Pacer, PacerConfig, PacerFull

FPS, FPC = 24, 4


def make_chunk(cfg: PacerConfig, n: int) -> DecodedChunk:
    frames = np.stack([np.full((2, 2, 3), (n * FPC + j) % 256, np.uint8) for j in range(FPC)])
    start, stop = cfg.chunk_sample_range(n)
    audio = (np.arange(start, stop) % 1000 + 1).astype(np.float32) / 1000  # never 0: silence is recognisable
    return DecodedChunk(n, frames, audio)


def drive(pacer: Pacer, clock: FakeClock, arrivals: list[float]):
    """Chunk n becomes ready at arrivals[n] (in order); the playout polls at every due time.

    A chunk that meets a full buffer is pushed again at the next poll (the producer waits)."""
    frames, full_events = [], 0
    n = 0
    while True:
        next_arrival = arrivals[n] if n < len(arrivals) else math.inf
        due = pacer.next_due()
        t = min(next_arrival, math.inf if due is None else due)
        if t == math.inf:
            break
        clock.set(max(t, clock.now()))
        if n < len(arrivals) and arrivals[n] <= clock.now():
            try:
                pacer.push(make_chunk(pacer.config, n))
                n += 1
                if n == len(arrivals):
                    pacer.close_input()
            except PacerFull:
                full_events += 1
                arrivals[n] = pacer.next_due()  # retry when the next frame has left
        frames += pacer.poll(clock.now())
        if pacer.drained:
            break
    return frames, full_events


def test_late_generator_stalls_counted_cadence_exact_nothing_dropped():
    cfg = PacerConfig(fps=FPS, frames_per_chunk=FPC, buffer_chunks=3, start_chunks=2)
    clock = FakeClock()
    pacer = Pacer(cfg, clock)
    chunks = 12
    arrivals = [k / 6 + 0.01 for k in range(chunks)]  # one chunk ahead of playout
    t0 = arrivals[1]  # start-up: the second chunk fills the start buffer
    arrivals[4] = t0 + 16 / FPS + 0.100  # 100 ms late: slots 16, 17, 18 fall due without it
    arrivals[5] = arrivals[4] + 0.05
    arrivals[8] = t0 + 35 / FPS + 0.200  # 200 ms late (after a 3-slot shift): slots 35..39 missing
    arrivals[9] = arrivals[8] + 0.02
    frames, _ = drive(pacer, clock, arrivals)
    stats = pacer.stats()

    assert stats.t0 == pytest.approx(t0, abs=1e-12)
    # Cadence: slot k is due, released and stamped at exactly t0 + k/24 (fake clock: no jitter).
    assert [f.slot for f in frames] == list(range(len(frames))), "slots must be consecutive"
    for f in frames:
        assert f.due_s == pytest.approx(t0 + f.slot / FPS, abs=1e-9), f"slot {f.slot} due at {f.due_s}"
        assert f.published_s == f.due_s, f"slot {f.slot} released at {f.published_s}, due {f.due_s}"
        assert f.pts_s == f.slot / FPS
    # Stalls: exactly the two late chunks, with the lengths worked out above.
    assert [(s.first_slot, s.frames) for s in stats.stalls] == [(16, 3), (35, 5)], stats.stalls
    assert stats.repeated_frames == 8 and sum(f.repeated for f in frames) == 8
    # Nothing dropped: every generated frame exactly once, in order; repeats show the previous frame.
    generated = [f.content_index for f in frames if not f.repeated]
    assert generated == list(range(chunks * FPC)), "generated frames missing, duplicated or out of order"
    assert stats.frames_published == chunks * FPC + 8 == len(frames)
    for prev, f in zip(frames, frames[1:], strict=False):
        if f.repeated:
            assert f.content_index == prev.content_index and int(f.rgb[0, 0, 0]) == prev.content_index % 256
            assert not f.audio.any(), f"stall slot {f.slot} must carry silence"
        else:
            assert int(f.rgb[0, 0, 0]) == f.content_index % 256
    # Audio follows the slot grid exactly: no drift however many stalls.
    assert sum(len(f.audio) for f in frames) == cfg.frame_sample(len(frames))
    offsets = [abs(f.av_offset_s) for f in frames if not f.repeated]
    assert max(offsets) <= 1.5 / cfg.audio_sample_rate, f"A/V offset up to {max(offsets) * 1e3:.3f} ms"


def test_startup_fills_buffer_before_first_frame():
    cfg = PacerConfig(buffer_chunks=3, start_chunks=2)
    clock = FakeClock()
    pacer = Pacer(cfg, clock)
    pacer.push(make_chunk(cfg, 0))
    clock.advance(5.0)
    assert pacer.poll() == [] and pacer.next_due() is None, "no frame may leave before start_chunks are buffered"
    pacer.push(make_chunk(cfg, 1))
    first = pacer.poll()
    assert [f.slot for f in first] == [0] and first[0].published_s == 5.0
    assert pacer.stats().stall_count == 0


def test_full_buffer_refuses_without_losing_and_end_is_not_a_stall():
    cfg = PacerConfig(buffer_chunks=3, start_chunks=2)
    clock = FakeClock()
    pacer = Pacer(cfg, clock)
    for n in range(3):
        pacer.push(make_chunk(cfg, n))
    with pytest.raises(PacerFull, match="3 chunks"):
        pacer.push(make_chunk(cfg, 3))
    assert pacer.depth() == 3
    frames = pacer.poll(0.0)
    clock.set(3 / FPS)
    frames += pacer.poll()  # slots 0..3: chunk 0 fully played, a place is free
    assert pacer.space() == 1
    pacer.push(make_chunk(cfg, 3))  # the refused chunk goes in now, nothing was lost
    pacer.close_input()
    clock.set(100.0)
    frames += pacer.poll()
    assert [f.content_index for f in frames] == list(range(16))
    assert pacer.drained and pacer.stats().stall_count == 0, "running dry after close_input is the end, not a stall"


def test_bad_chunks_are_rejected_with_the_reason():
    cfg = PacerConfig()
    pacer = Pacer(cfg, FakeClock())
    with pytest.raises(ValueError, match="chunk index: expected 0 .*got 1"):
        pacer.push(make_chunk(cfg, 1))
    bad = make_chunk(cfg, 0)
    bad.frames = bad.frames[:3]
    with pytest.raises(ValueError, match=r"expected shape \[4, H, W, 3\], got \[3, 2, 2, 3\]"):
        pacer.push(bad)
    bad = make_chunk(cfg, 0)
    bad.audio = bad.audio[:-1]
    with pytest.raises(ValueError, match="expected 2666 samples .* got shape \\[2665\\]"):
        pacer.push(bad)
    assert pacer.depth() == 0
    pacer.push(make_chunk(cfg, 0))  # a good chunk 0 is still accepted
    with pytest.raises(ValueError, match="start_chunks = 4; expected ≤ buffer_chunks = 3"):
        PacerConfig(buffer_chunks=3, start_chunks=4)


def test_interrupt_discards_unplayed_speech_records_it_and_the_gap():
    cfg = PacerConfig(buffer_chunks=3, start_chunks=2)
    clock = FakeClock()
    pacer = Pacer(cfg, clock)
    for n in range(3):
        pacer.push(make_chunk(cfg, n))  # all carry (non-zero) audio: speech
    frames = pacer.poll(0.0)  # chunk 0 is on screen
    dropped = pacer.discard_speech_before(4)  # the interrupt: chunks 0..3 were taken before the cut
    assert dropped == [1, 2], "the chunk on screen finishes, the unplayed speech chunks go"
    silent = make_chunk(cfg, 3)
    silent.audio[:] = 0
    pacer.push(silent)  # an idle chunk taken before the cut is kept
    clock.set(4 / FPS)
    frames += pacer.poll()  # chunk 0 finishes, then chunk 3 (idle) plays
    late = make_chunk(cfg, 4)
    late.audio[:] = 0
    clock.set(10 / FPS)
    frames += pacer.poll()  # slots 8..10: nothing ready → the interruption's gap
    pacer.push(late)
    pacer.close_input()
    clock.set(100.0)
    frames += pacer.poll()
    stats = pacer.stats()
    assert [f.content_index for f in frames if not f.repeated] == [0, 1, 2, 3, 12, 13, 14, 15, 16, 17, 18, 19]
    assert [d.chunks for d in stats.discards] == [[1, 2]] and stats.discarded_frames == 8
    assert [(s.first_slot, s.frames) for s in stats.stalls] == [(8, 3)]
    assert stats.stalls[0].cause == "late", "an idle chunk played after the cut, so this gap is a late generator"
    pacer2 = Pacer(cfg, FakeClock())
    pacer2.push(make_chunk(cfg, 0))
    pacer2.push(make_chunk(cfg, 1))
    pacer2.poll(0.0)
    pacer2.discard_speech_before(3)
    pacer2.push(make_chunk(cfg, 2))  # arrives after the interrupt, carries speech from before it: dropped
    assert pacer2.stats().discards[0].chunks == [1, 2] and pacer2.depth() == 1
    pacer2.poll(4 / FPS)
    assert pacer2.stats().stalls[0].cause == "interrupt"
