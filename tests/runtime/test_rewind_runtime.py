"""Rewind at a turn start in the served runtime (worker/serving/), on CPU: gloo ranks on loopback, `tiny` preset.

Rank 0 (`RankRuntime`, in this process) spawns its DiT ranks and its decoder rank. A session streams silence, then
the agent's speech arrives (pushed into the session's audio input, as the room feed pushes it): rank 0 asks the
decoder rank where to restart (the pipeline runner's playout splices: frames from frame k of chunk r are dropped),
every DiT rank rewinds at the same chunk boundary r, rank 0's audio input keeps chunk r's samples of frames < k, and
from r on the latents equal those of a session that had, for chunk r, those samples (silence) then the speech from
frame k's first sample, from the start — the reference runs the generator runner, which has no playout and so never
rewinds (its speech lands exactly where it is pushed). The decoder rank's kept latents (`<out>/<session>/latents/`) are compared bit for bit (the
same ops on the same inputs at the same TP: np.array_equal)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from vivant.apis.feature_flags import FlagValues
from vivant.ports import free_port
from vivant.worker.model.config import ModelConfig
from vivant.worker.serving.layout import RankLayout
from vivant.worker.serving.ranks import RankSpec, RunnerKind
from vivant.worker.serving.runtime import RankRuntime
from vivant.worker.stream.vae import VAEConfig
from worker_proc import assignment

CFG = ModelConfig.from_name("tiny")
SR = CFG.audio_sample_rate
SILENT, SPEAKING = 10, 4  # chunks of silence before the speech arrives (rank 0's warm-up chunks, slower, then
# out of the 8 diffuse times its rewind lead is taken from); chunks taken after it
SESSION = "ns/rewind"
# the decoder rank's VAE: the tiny grid with small widths, so decode (a few ms) keeps up on CPU and the chunks made
# ahead sit in the pacer, not in the decoder stage (whose chunks due within the keep horizon are kept whole)
# the pipeline runner's lead never below 5 chunks (the most a rewind reaches): rank 0 gets that far ahead of playout
# over the silent chunks whatever this CPU's timings, so at the turn (or the interrupt) there are frames to cut after
# the keep horizon and the next chunk's time
MIN_LEAD = 5
FAST_VAE = VAEConfig(name="tiny-fast", latent_h=CFG.latent_h, latent_w=CFG.latent_w, widths=(16, 8, 8))


def speech() -> np.ndarray:
    t = np.arange(int(0.9 * SR)) / SR
    return (0.5 * np.sin(2 * np.pi * 220 * t) + 0.01).astype(np.float32)


def run_session(tp: int, runner: RunnerKind, out: Path, script: Callable[[RankRuntime], None]) -> list[tuple[int, int, int]]:
    """One session on a fresh runtime (`tp` DiT ranks + the decoder rank, `runner`): `script(rt)` feeds and steps
    it; returns rank 0's rewinds (next, r, k)."""
    spec = RankSpec(layout=RankLayout(tp=tp), init_method=f"tcp://127.0.0.1:{free_port()}", runner=runner,
                    out_dir=str(out), timeout_s=60.0, vae=FAST_VAE, min_lead_chunks=MIN_LEAD)
    rt = RankRuntime(spec).start(ready_timeout_s=300)
    try:
        rt.begin(assignment(SESSION), FlagValues())
        script(rt)
        rewinds = list(rt.rewinds)
        rt.end("test done")
    finally:
        rt.shutdown()
    return rewinds


def serve(tp: int, runner: RunnerKind, out: Path, silent: int, lead_in: int = 0) -> list[tuple[int, int, int]]:
    """`silent` chunks, the speech pushed (after `lead_in` samples of silence), SPEAKING chunks."""
    def script(rt: RankRuntime) -> None:
        for _ in range(silent):
            rt.step()
        rt.audio_in.push(np.concatenate([np.zeros(lead_in, np.float32), speech()]), SR)
        for _ in range(SPEAKING):
            rt.step()
    return run_session(tp, runner, out, script)


def trace(out: Path, rank: int) -> list[dict]:
    lines = (out / SESSION.replace("/", "_") / f"rank{rank}.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def latents(out: Path, chunk: int) -> np.ndarray:
    return np.load(out / SESSION.replace("/", "_") / "latents" / f"chunk_{chunk:05d}.npy")


@pytest.mark.parametrize("tp", [1, 2])
def test_a_turn_start_rewinds_every_rank_and_equals_the_speech_at_that_chunk(tp, tmp_path):
    a = tmp_path / "rewound"
    rewound = serve(tp, RunnerKind.PIPELINE, a, SILENT)
    if rewound and rewound[0][1] == SILENT:  # nothing to cut: this CPU kept rank 0 from getting ahead (once more)
        a = tmp_path / "rewound-again"
        rewound = serve(tp, RunnerKind.PIPELINE, a, SILENT)
    assert len(rewound) == 1 and rewound[0][0] == SILENT, rewound
    _, r, k = rewound[0]
    assert 1 <= r < SILENT and 0 <= k < CFG.frames_per_chunk, \
        f"the playout kept every chunk made from silence in two sessions (r = {r}, k = {k}): nothing was rewound"
    lead_in = (r * CFG.frames_per_chunk + k) * SR // CFG.fps - CFG.chunk_sample_range(r)[0]
    ref = serve(tp, RunnerKind.GENERATOR, tmp_path / "reference", r, lead_in)
    assert ref == [(r, r, 0)], f"the generator runner has no playout: its rewind is the next chunk, got {ref}"

    b = tmp_path / "reference"
    for n in range(r + SPEAKING):
        assert np.array_equal(latents(a, n), latents(b, n)), \
            f"TP = {tp}: chunk {n} of the rewound session differs from the session that had the speech at {r}"

    taken = [[(e["chunk"], e["speech_samples"]) for e in trace(d, 0) if e["event"] == "chunk"] for d in (a, b)]
    ref_taken = [(c, s - lead_in if c == r else s) for c, s in taken[1][r:]]  # the reference pushed its lead-in
    assert taken[0][SILENT:] == ref_taken, "rank 0's audio input must give chunk r … the speech a fresh one gives"
    for rank in range(tp):  # every DiT rank rewound at the same boundary and ran the same chunks
        t = trace(a, rank)
        assert [e["chunk"] for e in t if e["event"] == "rewind"] == [r], (rank, t)
        assert [e["chunk"] for e in t if e["event"] == "chunk"] == list(range(SILENT)) + list(range(r, r + SPEAKING))
    dec = trace(a, tp)
    assert [(e["chunk"], e["frame"], e["next_chunk"]) for e in dec if e["event"] == "rewind"] == [(r, k, SILENT)]
    assert all(e["next_chunk_ms"] > 0 for e in dec if e["event"] == "rewind"), \
        "rank 0's next-chunk time (its recent max diffuse) crossed the link with the REWIND"
    assert dec[-1]["event"] == "end" and dec[-1]["error"] == "", dec[-1]
    playout = json.loads((a / SESSION.replace("/", "_") / "playout.json").read_text())
    assert playout["generated_frames_published"] == (r + SPEAKING) * CFG.frames_per_chunk, \
        "the playout shows every frame before the cut once and then the speech from it, nothing dropped twice"
    assert [(rw["to_chunk"], rw["to_frame"]) for rw in playout["rewinds"]] == [(r, k)]


def long_speech() -> np.ndarray:
    t = np.arange(int(3.0 * SR)) / SR
    return (0.4 * np.sin(2 * np.pi * 150 * t) + 0.02).astype(np.float32)  # never 0


def serve_interrupted(tp: int, runner: RunnerKind, out: Path, steps: int, spoken: int | None,
                      cut_sample: int | None = None) -> list[tuple[int, int, int]]:
    """3 s of speech queued before chunk 0 (only its first `cut_sample` samples when given); with `spoken`, after that
    many chunks an interrupt — `AudioInput.clear_buffer`, as the room feed applies lk.clear_buffer — then the rest of
    `steps` chunks."""
    def script(rt: RankRuntime) -> None:
        rt.audio_in.push(long_speech()[:cut_sample], SR)
        rt.audio_in.end_segment()
        for step in range(steps):
            if step == spoken:
                rt.audio_in.clear_buffer()
            rt.step()
    return run_session(tp, runner, out, script)


@pytest.mark.parametrize("tp", [1, 2])
def test_an_interrupt_splices_every_rank_and_equals_a_session_that_got_silence_from_the_cut(tp, tmp_path):
    """The speech is cut at the decoder rank's splice frame f* = frame k of chunk r: every chunk the session finally
    made equals a session that had the speech only up to f*'s first sample, from the start (np.array_equal)."""
    spoken = SILENT
    a, b = tmp_path / "interrupted", tmp_path / "reference"
    rewound = serve_interrupted(tp, RunnerKind.PIPELINE, a, spoken + SPEAKING, spoken)
    if rewound and rewound[0][1] == spoken:  # nothing to cut: this CPU kept rank 0 from getting ahead (once more)
        a = tmp_path / "interrupted-again"
        rewound = serve_interrupted(tp, RunnerKind.PIPELINE, a, spoken + SPEAKING, spoken)
    assert len(rewound) == 1 and rewound[0][0] == spoken, rewound
    _, r, k = rewound[0]
    assert 1 <= r < spoken and 0 <= k < CFG.frames_per_chunk, \
        f"the playout kept every chunk made before the interrupt in two sessions (r = {r}, k = {k}): nothing was cut"
    cut = (r * CFG.frames_per_chunk + k) * SR // CFG.fps  # f*'s first sample (the speech began at sample 0)
    assert serve_interrupted(tp, RunnerKind.GENERATOR, b, r + SPEAKING, None, cut) == []
    for n in range(r + SPEAKING):
        assert np.array_equal(latents(a, n), latents(b, n)), \
            f"TP = {tp}: chunk {n} of the interrupted session differs from the one that got silence from frame {k} of {r}"
    for rank in range(tp):
        t = trace(a, rank)
        assert [e["chunk"] for e in t if e["event"] == "rewind"] == [r], (rank, t)
    dec = [e for e in trace(a, tp) if e["event"] == "rewind"]
    assert [(e["chunk"], e["frame"], e["cause"]) for e in dec] == [(r, k, "interrupt")]
    assert [e["cause"] for e in trace(a, 0) if e["event"] == "rewind"] == ["interrupt"]
    playout = json.loads((a / SESSION.replace("/", "_") / "playout.json").read_text())
    assert [(rw["to_chunk"], rw["to_frame"], rw["cause"]) for rw in playout["rewinds"]] == [(r, k, "interrupt")]
    assert playout["generated_frames_published"] == (r + SPEAKING) * CFG.frames_per_chunk, \
        "every content frame shown once: the frames from the cut are the remade ones"
