"""The streaming loop end to end on CPU: real tiny DiT → decoder stage thread → pacer (wall clock) → sinks.

The decoder here is a small config of the same causal VAE code (8x12 latents → 32x48, 4 frames per
chunk) so the loop runs near real time on 2 shared cores; the loop does not depend on the resolution.
Stalls depend on this machine's load, so they are checked for consistency, not for a count.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from collecting_sink import CollectingSink
from prometheus_client import CollectorRegistry
from vivant.worker.model.config import ModelConfig
from vivant.worker.model.generator import ChunkGenerator
from vivant.worker.serving.metrics import WorkerMetrics
from vivant.worker.stream.decoder_stage import DecoderStage, LatentChunk
from vivant.worker.stream.pipeline import StreamPipeline
from vivant.worker.stream.vae import LatentShapeError, VAEConfig, VAEDecoder, build_vae_decoder

CFG = ModelConfig.from_name("tiny")
SR = CFG.audio_sample_rate
CHUNKS = 18
LOOP_VAE = VAEConfig(name="loop-test", latent_h=CFG.latent_h, latent_w=CFG.latent_w, widths=(16, 8, 8))


def speech(seconds: float) -> np.ndarray:
    t = np.arange(int(seconds * SR)) / SR
    return (0.5 * np.sin(2 * np.pi * 180 * t) + 0.05).astype(np.float32)


@pytest.fixture(scope="module")
def streamed():
    gen = ChunkGenerator(CFG, seed=0)
    vae = build_vae_decoder(LOOP_VAE)
    sink = CollectingSink()
    metrics = WorkerMetrics(pool="ns/test-pool", registry=CollectorRegistry())
    pipe = StreamPipeline(gen, vae, [sink], metrics=metrics, session="s1", rewind_on_turn=False)  # rewinds: test_turn_rewind

    clear_at: list[float] = []

    def script(n, p):
        if n == 2:
            p.audio_in.push(speech(1.0), SR)  # turn 0: 6 chunks of speech (2..7)
            p.audio_in.end_segment()
        elif n == 9:
            p.audio_in.push(speech(3.0), SR)  # turn 1, interrupted at chunk 14
        elif n == 14:
            clear_at.append(p.clock.now())
            p.clear_buffer()

    report = pipe.run(CHUNKS, script)
    return pipe, sink, report, metrics, clear_at[0]


def chunk_audio(sink, n: int) -> np.ndarray:
    return np.concatenate([f.audio for f in sink.frames if not f.repeated and f.chunk_index == n] or [np.zeros(0)])


def test_every_chunk_is_published_once_in_order_or_reported_discarded(streamed):
    pipe, sink, report, _, _ = streamed
    discarded = set(report.discarded_chunks)
    assert discarded <= {11, 12, 13}, f"only turn 1's chunks not yet on screen may be discarded: {discarded}"
    expected = [f for n in range(CHUNKS) if n not in discarded for f in range(4 * n, 4 * n + 4)]
    generated = [f.content_index for f in sink.frames if not f.repeated]
    assert generated == expected, "generated frames missing, duplicated or out of order"
    assert [f.slot for f in sink.frames] == list(range(len(sink.frames)))
    assert report.frames_published == len(sink.frames) == report.generated_frames_published + report.repeated_frames
    assert report.repeated_frames == sum(report.stall_frames) and report.stalls == len(report.stall_frames)
    assert sink.closed
    for stage in ("diffuse", "decode"):
        assert report.stages_ms[stage]["n"] == CHUNKS, f"{stage}: {report.stages_ms[stage]}"


def test_idle_chunks_speech_and_interrupt_reach_the_published_audio(streamed):
    _, sink, report, _, t_clear = streamed
    for n in (0, 1, 8):
        assert not chunk_audio(sink, n).any(), f"chunk {n} is idle and must be silent"
    for n in range(2, 8):
        assert chunk_audio(sink, n).any(), f"chunk {n} must carry turn 0's speech"
    for n in range(9, 14):
        assert (n in report.discarded_chunks) != chunk_audio(sink, n).any(), \
            f"chunk {n} of turn 1 must be either published with speech or reported discarded"
    for n in range(14, CHUNKS):
        assert not chunk_audio(sink, n).any(), f"chunk {n} was taken after clear_buffer: speech must be cut"
    late_speech = {f.chunk_index for f in sink.frames if f.published_s > t_clear and f.audio.any()}
    assert len(late_speech) <= 1, f"speech of chunks {sorted(late_speech)} played after the interrupt (max one)"
    assert report.cleared_samples > 0


def test_av_offset_measured_within_one_frame(streamed):
    _, sink, report, _, _ = streamed
    assert report.max_abs_av_offset_ms < 1000 / 24, f"A/V offset {report.max_abs_av_offset_ms} ms"
    offsets = [abs(f.av_offset_s) for f in sink.frames if not f.repeated]
    assert max(offsets) * 1e3 == pytest.approx(report.max_abs_av_offset_ms)


def test_turn_latency_trace_orders_its_timestamps(streamed):
    pipe, sink, report, metrics, _ = streamed
    traces = pipe.turn_traces()
    assert [(t.turn, t.chunk_index, t.first_frame) for t in traces] == [(0, 2, 8), (1, 9, 36)]
    for t in traces:
        assert t.pushed_s <= t.diffused_s <= t.decoded_s <= t.published_s, t
        first = next(f for f in sink.frames if f.content_index == t.first_frame and not f.repeated)
        assert t.published_s == first.published_s
    assert [t["turn"] for t in report.turns] == [0, 1] and "turn 1: first sample in" in report.format_text()
    reg = metrics.registry
    assert reg.get_sample_value("vivant_worker_turn_latency_seconds_count", {"pool": "ns/test-pool"}) == 2
    assert reg.get_sample_value("vivant_worker_decoder_seconds_count", {"pool": "ns/test-pool"}) == CHUNKS
    frames = reg.get_sample_value("vivant_worker_session_frames_total", {"pool": "ns/test-pool", "session": "s1"})
    assert frames == report.generated_frames_published


class FailingDecoder(VAEDecoder):
    def decode_chunk(self, latents, cache):
        if cache.chunks >= 2:
            raise RuntimeError("decoder GPU fell over")
        return super().decode_chunk(latents, cache)


def test_decoder_failure_surfaces_instead_of_hanging():
    vae = FailingDecoder(LOOP_VAE).eval()
    pipe = StreamPipeline(ChunkGenerator(CFG, seed=0), vae, [CollectingSink()])
    with pytest.raises(RuntimeError, match="decoder stage failed: RuntimeError\\('decoder GPU fell over'\\)"):
        pipe.run(8)


def test_decoder_stage_rejects_wrong_latent_shape_naming_both():
    stage = DecoderStage(build_vae_decoder(LOOP_VAE), lambda chunk: None)
    with pytest.raises(LatentShapeError, match=r"expected shape \[16, 8, 12\].*got \[16, 44, 68\]"):
        stage.submit(LatentChunk(0, torch.zeros(16, 44, 68), np.zeros(2666, np.float32)))


class BrokenSink(CollectingSink):
    def write(self, frame) -> None:
        if frame.slot == 10:
            raise OSError("network sink went away")
        super().write(frame)


def test_sink_failure_stops_the_loop_and_still_closes_every_sink():
    good, broken = CollectingSink(), BrokenSink()
    pipe = StreamPipeline(ChunkGenerator(CFG, seed=0), build_vae_decoder(LOOP_VAE), [good, broken])
    with pytest.raises(RuntimeError, match="playout failed: OSError\\('network sink went away'\\)"):
        pipe.run(30)
    assert good.closed and broken.closed, "sinks must be closed (files finalised) after a failure"
    assert len(broken.frames) == 10
