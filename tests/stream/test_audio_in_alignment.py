"""Audio in: chunk alignment, idle chunks, clear_buffer cutting within one chunk, rates, turns."""

from __future__ import annotations

import numpy as np
import pytest
from vivant.worker.model.config import ModelConfig
from vivant.worker.stream.audio_in import AudioBufferFull, AudioInConfig, AudioInput, SampleRateError
from vivant.worker.stream.pacer import FakeClock

CFG = ModelConfig.from_name("tiny")
SR = CFG.audio_sample_rate


def speech(seconds: float, rate: int = SR, freq: float = 220.0) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    return (0.5 * np.sin(2 * np.pi * freq * t) + 0.01).astype(np.float32)  # never exactly 0


def test_chunks_follow_the_grid_and_carry_speech_across_segment_boundaries():
    ai = AudioInput(CFG)
    x = speech(1.3)
    for part in np.array_split(x, 7):  # odd segment sizes
        ai.push(part, SR)
    got = [ai.next_chunk() for _ in range(10)]
    for c in got:
        start, stop = CFG.chunk_sample_range(c.index)
        assert len(c.samples) == stop - start, f"chunk {c.index}: {len(c.samples)} samples, grid says {stop - start}"
    joined = np.concatenate([c.samples for c in got])
    np.testing.assert_array_equal(joined[: len(x)], x, err_msg="speech must come out in order, sample for sample")
    assert not joined[len(x):].any(), "after the speech the chunks are silent (idle)"
    assert sum(c.speech_samples for c in got) == len(x)


def test_idle_chunks_are_silent_and_still_produced():
    ai = AudioInput(CFG)
    chunks = [ai.next_chunk() for _ in range(5)]
    assert [c.index for c in chunks] == [0, 1, 2, 3, 4]
    assert all(not c.samples.any() and c.speech_samples == 0 for c in chunks)


def test_clear_buffer_cuts_speech_within_one_chunk():
    ai = AudioInput(CFG)
    ai.push(speech(2.0), SR)
    first = ai.next_chunk()
    assert first.speech_samples == len(first.samples)
    pending = ai.pending_samples()
    dropped = ai.clear_buffer()  # interrupt while chunk 0 is being generated
    assert dropped == pending > 0
    after = [ai.next_chunk() for _ in range(3)]
    assert all(c.speech_samples == 0 and not c.samples.any() for c in after), \
        "no speech may reach any chunk taken after clear_buffer"
    # A new turn after the interrupt starts at the next chunk's first sample.
    ai.push(speech(0.1), SR)
    c = ai.next_chunk()
    assert c.samples[0] != 0 and [t.turn for t in c.turns] == [1]
    assert ai.cleared_samples == dropped


def test_turn_starts_are_traced_to_chunk_and_sample():
    clock = FakeClock(10.0)
    ai = AudioInput(CFG, clock=clock)
    ai.next_chunk()  # chunk 0 idle
    ai.push(speech(0.05), SR)  # 800 samples: turn 0
    ai.end_segment()
    clock.advance(0.5)
    ai.push(speech(0.05), SR)  # turn 1, queued right behind turn 0
    c = ai.next_chunk()
    start, _ = CFG.chunk_sample_range(1)
    assert [(t.turn, t.chunk_index, t.stream_sample, t.pushed_s) for t in c.turns] == [
        (0, 1, start, 10.0), (1, 1, start + 800, 10.5)]


def test_wrong_sample_rate_is_rejected_naming_the_expected_rate():
    ai = AudioInput(CFG, AudioInConfig(resample=False))
    with pytest.raises(SampleRateError, match="expected 16000 Hz, got 44100 Hz"):
        ai.push(speech(0.1, 44100), 44100)
    assert ai.pending_samples() == 0
    with pytest.raises(SampleRateError, match="expected 16000 Hz .* got 100 Hz"):
        AudioInput(CFG).push(speech(0.1, 100), 100)


def test_other_rates_are_resampled_keeping_duration_and_pitch():
    ai = AudioInput(CFG)
    ai.push(speech(1.0, 48_000, freq=440.0), 48_000)
    ai.end_segment()  # flushes the resampler's tail
    n = ai.pending_samples()
    assert abs(n - SR) <= 32, f"1 s at 48 kHz became {n} samples, expected about {SR}"
    x = np.concatenate([ai.next_chunk().samples for _ in range(6)])[:n]
    spectrum = np.abs(np.fft.rfft(x - x.mean()))
    peak_hz = np.argmax(spectrum) * SR / len(x)
    assert abs(peak_hz - 440) < 3, f"a 440 Hz tone came out at {peak_hz:.1f} Hz"


def test_pcm_formats_and_bounds():
    ai = AudioInput(CFG, AudioInConfig(max_pending_s=1.0))
    ai.push(np.array([16384, -32768], np.int16), SR)
    np.testing.assert_allclose(ai.next_chunk().samples[:2], [0.5, -1.0])
    with pytest.raises(ValueError, match=r"expected mono samples, shape \[n\] or \[n, 1\], got shape \[10, 2\]"):
        ai.push(np.zeros((10, 2), np.float32), SR)
    with pytest.raises(ValueError, match="expected dtype float32 or int16, got int32"):
        ai.push(np.zeros(10, np.int32), SR)
    ai.push(speech(0.9), SR)
    with pytest.raises(AudioBufferFull, match="max_pending_s = 1.0"):
        ai.push(speech(0.2), SR)
    assert ai.pending_samples() == int(0.9 * SR), "a refused segment leaves the queue as it was"
