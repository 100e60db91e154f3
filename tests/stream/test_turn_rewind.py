"""Rewind at a turn start in the streaming loop (vivant.worker.stream.pipeline), end to end on CPU: the real tiny
DiT → decoder stage → pacer on the wall clock → a collecting sink.

The lead is held at 4 chunks so that, when a turn starts, chunks generated from silence are waiting ahead of
playout and the rewind has something to drop. The loop splices at a frame (`Playout.splice`): which frame, (r, k),
depends on the wall clock (what has been published), so the tests read it from the report and check everything
against it: the speech starts at frame k of chunk r, every content frame is published once (the old chunk r's frames
< k, then the remade chunk r's frames ≥ k), and those equal a stream that got, for chunk r, the same silence before
frame k and the speech from frame k in the first place (same seeds, no rewind).
"""

from __future__ import annotations

import numpy as np
import pytest
from collecting_sink import CollectingSink
from vivant.worker.model.config import ModelConfig
from vivant.worker.model.generator import ChunkGenerator
from vivant.worker.stream.lead import LeadConfig
from vivant.worker.stream.pipeline import StreamPipeline
from vivant.worker.stream.playout import TURN_STAGES
from vivant.worker.stream.vae import VAEConfig, build_vae_decoder

CFG = ModelConfig.from_name("tiny")
SR = CFG.audio_sample_rate
LOOP_VAE = VAEConfig(name="loop-test", latent_h=CFG.latent_h, latent_w=CFG.latent_w, widths=(16, 8, 8))
FIXED_LEAD = LeadConfig.for_model(CFG, initial_chunks=4, min_chunks=4, max_chunks=4)
CHUNKS = 34


def speech(seconds: float, f0: float = 180.0) -> np.ndarray:
    t = np.arange(int(seconds * SR)) / SR
    return (0.5 * np.sin(2 * np.pi * f0 * t) + 0.05).astype(np.float32)


def pipeline(sink, **kw) -> StreamPipeline:
    return StreamPipeline(ChunkGenerator(CFG, seed=0), build_vae_decoder(LOOP_VAE, seed=0), [sink],
                          lead_config=FIXED_LEAD, **kw)


def generated(sink) -> dict[int, list]:
    """chunk index → its published (not repeated) frames, in order."""
    out: dict[int, list] = {}
    for f in sink.frames:
        if not f.repeated:
            out.setdefault(f.chunk_index, []).append(f)
    return out


@pytest.fixture(scope="module")
def rewound():
    """Turn 0 at step 8; turn 1 at step 16, interrupted at step 20; turn 2 at step 24 (after the interruption)."""
    sink = CollectingSink()
    pipe = pipeline(sink)

    def script(step, p):
        if step == 8:
            p.audio_in.push(speech(1.0), SR)
            p.audio_in.end_segment()
        elif step == 16:
            p.audio_in.push(speech(3.0, 140.0), SR)
            p.audio_in.end_segment()
        elif step == 20:
            p.clear_buffer()
        elif step == 24:
            p.audio_in.push(speech(0.5, 220.0), SR)
            p.audio_in.end_segment()

    report = pipe.run(CHUNKS, script)
    return pipe, sink, report


def turn_rewinds(report) -> list[dict]:
    return [r for r in report.rewinds if r["cause"] == "turn"]


def test_each_turn_rewinds_and_dropped_chunks_are_never_published(rewound):
    pipe, sink, report = rewound
    assert [r["cause"] for r in report.rewinds] == ["turn", "turn", "interrupt", "turn"], report.rewinds
    assert [t.rewound_to for t in pipe.turn_traces()] == [r["to_chunk"] for r in turn_rewinds(report)]
    for r in report.rewinds:
        assert r["to_chunk"] <= r["from_chunk"], r
    first = report.rewinds[0]
    assert first["to_chunk"] < first["from_chunk"], f"lead 4: chunks made from silence must be dropped: {first}"
    dropped = sum(r["from_chunk"] - r["to_chunk"] for r in report.rewinds)
    assert report.chunks == CHUNKS and report.chunks_generated == CHUNKS + dropped
    content = [f.content_index for f in sink.frames if not f.repeated]
    # the interrupt is a splice too: its chunks are made again, so every content frame is published once
    assert content == list(range(4 * CHUNKS)), "each frame published once, in order: a dropped version never shows"


def test_the_interrupt_cuts_the_speech_at_its_splice_frame(rewound):
    _, sink, report = rewound
    cut = next(r for r in report.rewinds if r["cause"] == "interrupt")
    f_star = 4 * cut["to_chunk"] + cut["to_frame"]
    turn2 = turn_rewinds(report)[2]
    after = [f for f in sink.frames
             if not f.repeated and f_star <= f.content_index < 4 * turn2["to_chunk"] + turn2["to_frame"]]
    assert after and not np.concatenate([f.audio for f in after]).any(), "silence from the interrupt's frame f*"
    before = next(f for f in sink.frames if not f.repeated and f.content_index == f_star - 1)
    assert before.audio.any(), "turn 1 spoke up to f* (3 s of speech, interrupted after 4 chunks)"
    assert set(report.discarded_chunks) <= set(cut["dropped"]) and report.discarded_frames > 0


def test_the_speech_starts_at_the_rewound_chunk_and_the_trace_has_every_stage_in_order(rewound):
    pipe, sink, report = rewound
    frames = generated(sink)
    traces = pipe.turn_traces()
    assert [t.turn for t in traces] == [0, 1, 2]
    for trace, rewind in zip(traces, turn_rewinds(report), strict=True):
        r, k = rewind["to_chunk"], rewind["to_frame"]
        assert trace.rewound_to == r and 0 <= k < 4
        if trace.turn != 1:  # after silence or an interrupt the speech starts at the cut
            assert trace.chunk_index == r and trace.first_frame == 4 * r + k
        else:  # a splice into turn 0's last frames gives their speech back: turn 1 follows it
            assert trace.first_frame >= 4 * r + k
    t0 = traces[0]
    assert not np.concatenate([f.audio for f in frames[t0.chunk_index - 1]]).any(), "turn 0: the chunk before r is silent"
    assert all(np.concatenate([f.audio for f in frames[n]]).any() for n in range(t0.chunk_index, t0.chunk_index + 6))
    for t in (traces[0], traces[2]):  # turn 1 was interrupted; its first chunk may have been discarded
        assert t.pushed_s <= t.rewound_s <= t.diffused_s <= t.decoded_s <= t.published_s, t
        stages = t.stage_ms()
        assert [stages[f"{s}_ms"] for s in TURN_STAGES] == sorted(stages[f"{s}_ms"] for s in TURN_STAGES)
        assert t.published_s == next(f.published_s for f in frames[t.chunk_index] if f.content_index == t.first_frame)
    text = report.format_text()
    assert "turn 2: first sample in → rewound to chunk" in text and "first frame published" in text
    assert report.turn_stages_ms["rewound"]["n"] == 3 and report.turn_stages_ms["published"]["n"] >= 2


def test_av_offset_after_rewinds_is_measured_and_within_one_frame(rewound):
    _, sink, report = rewound
    assert report.max_abs_av_offset_after_rewind_ms is not None
    assert report.max_abs_av_offset_after_rewind_ms < 1000 / 24
    r0 = 4 * report.rewinds[0]["to_chunk"] + report.rewinds[0]["to_frame"]
    after = [abs(f.av_offset_s) * 1e3 for f in sink.frames if not f.repeated and f.content_index >= r0]
    assert max(after) == pytest.approx(report.max_abs_av_offset_after_rewind_ms)
    assert report.lead_chunks == 4 and report.lead_changes == [(0, 4)]


def test_spliced_frames_equal_a_stream_that_got_the_speech_at_the_cut(rewound):
    """Turn 0 spliced at (r, k): the old chunk r's frames < k (made from silence) are those of a silent stream; its
    frames ≥ k, and every chunk after it up to turn 1, are those of a stream that got, for chunk r, silence before frame
    k's first sample and the speech from there, in the first place (no rewind)."""
    _, sink, report = rewound
    r, k = report.rewinds[0]["to_chunk"], report.rewinds[0]["to_frame"]
    start, _ = CFG.chunk_sample_range(r)
    lead_in = np.zeros((4 * r + k) * SR // CFG.fps - start, np.float32)  # chunk r's samples before frame k

    def script(step, p):
        if step == r:
            p.audio_in.push(np.concatenate([lead_in, speech(1.0)]), SR)
            p.audio_in.end_segment()

    end = turn_rewinds(report)[1]["to_chunk"]  # where A's turn 1 begins; up to there both got the same audio
    assert end > r + 3
    sink_b, sink_silent = CollectingSink(), CollectingSink()
    pipeline(sink_b, rewind_on_turn=False).run(end, script)
    pipeline(sink_silent, rewind_on_turn=False).run(r + 1)
    a, b, silent = generated(sink), generated(sink_b), generated(sink_silent)
    for n in range(end):
        want = [f for f in silent[n] if f.content_index < 4 * r + k] if n <= r else []
        want += [f for f in b[n] if f.content_index >= 4 * r + k]
        got = a[n]
        assert [f.content_index for f in got] == [f.content_index for f in want], f"chunk {n}"
        for fa, fb in zip(got, want, strict=True):
            assert np.array_equal(fa.rgb, fb.rgb), f"chunk {n} frame {fa.content_index}: pixels differ"
            assert np.array_equal(fa.audio, fb.audio), f"chunk {n} frame {fa.content_index}: audio differs"



def test_a_turn_queued_right_behind_speech_continues_it_without_a_rewind():
    sink = CollectingSink()
    pipe = pipeline(sink)
    first, second = speech(0.5), speech(0.5, 240.0)

    def script(step, p):
        if step == 6:
            p.audio_in.push(first, SR)
            p.audio_in.end_segment()
            p.audio_in.push(second, SR)  # the next turn, queued right behind the first
            p.audio_in.end_segment()

    report = pipe.run(18, script)
    traces = pipe.turn_traces()
    assert len(report.rewinds) == 1 and traces[0].rewound_to == report.rewinds[0]["to_chunk"]
    assert traces[1].rewound_to is None and traces[1].rewound_s is None
    starts = pipe.audio_in.turns()
    assert starts[1].stream_sample == starts[0].stream_sample + len(first), "turn 1 follows turn 0's speech at once"
    audio = np.concatenate([f.audio for f in sink.frames if not f.repeated])
    begin = int(np.flatnonzero(audio)[0])
    assert begin == starts[0].stream_sample
    assert np.array_equal(audio[begin:begin + 2 * len(first)], np.concatenate([first, second])), \
        "both turns are published whole, in order"
    assert not audio[begin + 2 * len(first):].any()
    assert "turn 1: first sample in (no rewind)" in report.format_text()
