"""Rewind at a turn start in the served runtime (worker/serving/), on CPU: gloo ranks on loopback, `tiny` preset.

Rank 0 (`RankRuntime`, in this process) spawns its DiT ranks and its decoder rank. A session streams silence, then
the agent's speech arrives (pushed into the session's audio input, as the room feed pushes it): rank 0 asks the
decoder rank where to restart (the pipeline runner's playout drops what was not shown), every DiT rank rewinds at the
same chunk boundary r, and from r on the latents equal those of a session that had the speech at chunk r from the
start — the reference runs the generator runner, which has no playout and so never rewinds (its speech lands exactly
where it is pushed). The decoder rank's kept latents (`<out>/<session>/latents/`) are compared bit for bit (the
same ops on the same inputs at the same TP: np.array_equal)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from servers import free_port
from vivant.apis.feature_flags import FlagValues
from vivant.worker.model.config import ModelConfig
from vivant.worker.serving.layout import RankLayout
from vivant.worker.serving.ranks import RankSpec, RunnerKind
from vivant.worker.serving.runtime import RankRuntime
from worker_proc import assignment

CFG = ModelConfig.from_name("tiny")
SR = CFG.audio_sample_rate
SILENT, SPEAKING = 6, 4  # chunks of silence before the speech arrives; chunks taken after it
SESSION = "ns/rewind"


def speech() -> np.ndarray:
    t = np.arange(int(0.9 * SR)) / SR
    return (0.5 * np.sin(2 * np.pi * 220 * t) + 0.01).astype(np.float32)


def serve(tp: int, runner: RunnerKind, out: Path, silent: int) -> list[tuple[int, int]]:
    """One session: `silent` chunks, the speech pushed, SPEAKING chunks; returns rank 0's rewinds (next, r)."""
    spec = RankSpec(layout=RankLayout(tp=tp), init_method=f"tcp://127.0.0.1:{free_port()}", runner=runner,
                    out_dir=str(out), timeout_s=60.0)
    rt = RankRuntime(spec).start(ready_timeout_s=300)
    try:
        rt.begin(assignment(SESSION), FlagValues())
        for _ in range(silent):
            rt.step()
        rt.audio_in.push(speech(), SR)
        for _ in range(SPEAKING):
            rt.step()
        rewinds = list(rt.rewinds)
        rt.end("test done")
    finally:
        rt.shutdown()
    return rewinds


def trace(out: Path, rank: int) -> list[dict]:
    lines = (out / SESSION.replace("/", "_") / f"rank{rank}.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def latents(out: Path, chunk: int) -> np.ndarray:
    return np.load(out / SESSION.replace("/", "_") / "latents" / f"chunk_{chunk:05d}.npy")


@pytest.mark.parametrize("tp", [1, 2])
def test_a_turn_start_rewinds_every_rank_and_equals_the_speech_at_that_chunk(tp, tmp_path):
    rewound = serve(tp, RunnerKind.PIPELINE, tmp_path / "rewound", SILENT)
    assert len(rewound) == 1 and rewound[0][0] == SILENT, rewound
    r = rewound[0][1]
    assert 1 <= r < SILENT, f"the playout kept every chunk made from silence (r = {r}): nothing was rewound"
    ref = serve(tp, RunnerKind.GENERATOR, tmp_path / "reference", r)
    assert ref == [(r, r)], f"the generator runner has no playout: its rewind is the next chunk, got {ref}"

    a, b = tmp_path / "rewound", tmp_path / "reference"
    for n in range(r + SPEAKING):
        assert np.array_equal(latents(a, n), latents(b, n)), \
            f"TP = {tp}: chunk {n} of the rewound session differs from the session that had the speech at {r}"

    taken = [[(e["chunk"], e["speech_samples"]) for e in trace(d, 0) if e["event"] == "chunk"] for d in (a, b)]
    assert taken[0][SILENT:] == taken[1][r:], "rank 0's audio input must give chunk r … the speech a fresh one gives"
    for rank in range(tp):  # every DiT rank rewound at the same boundary and ran the same chunks
        t = trace(a, rank)
        assert [e["chunk"] for e in t if e["event"] == "rewind"] == [r], (rank, t)
        assert [e["chunk"] for e in t if e["event"] == "chunk"] == list(range(SILENT)) + list(range(r, r + SPEAKING))
    dec = trace(a, tp)
    assert [(e["chunk"], e["next_chunk"]) for e in dec if e["event"] == "rewind"] == [(r, SILENT)]
    assert dec[-1]["event"] == "end" and dec[-1]["error"] == "", dec[-1]
    playout = json.loads((a / SESSION.replace("/", "_") / "playout.json").read_text())
    assert playout["generated_frames_published"] == (r + SPEAKING) * CFG.frames_per_chunk, \
        "the playout shows every chunk up to r − 1 once and then the speech from r, nothing dropped twice"
