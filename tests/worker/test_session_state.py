"""The worker service's per-session state (`worker/serving/session_state.py`), alone: the playout estimate's slots
and stalls, the numerical-fault run, and the one place the final frames and stalls are chosen."""

from __future__ import annotations

import pytest
from vivant.apis.feature_flags import FlagValues
from vivant.sessions.models import Assignment
from vivant.worker.serving.runner import PlayoutAccount
from vivant.worker.serving.session_state import FaultRun, PlayoutEstimate, SessionState

CHUNK_S = 4 / 24  # 4 frames at 24 fps


def _play(done_at: list[float], buffer_chunks: int = 2, start: float = 100.0) -> list[PlayoutEstimate]:
    states = [PlayoutEstimate(CHUNK_S, buffer_chunks, start=start)]
    for t in done_at:
        states.append(states[-1].after_chunk(4, t))
    return states


def test_the_playout_clock_starts_one_chunk_before_the_first_chunk_is_done() -> None:
    """A first chunk done 30 s after the session began (graph capture) is no stall, and neither is any chunk after it
    that is on time; start moves to 130 − 1/6 s."""
    states = _play([130.0 + n * CHUNK_S for n in range(10)])
    last = states[-1]
    assert last.start == pytest.approx(130.0 - CHUNK_S)
    assert (last.chunks, last.frames, last.stalls) == (10, 40, 0)


def test_a_chunk_done_after_its_slot_is_a_stall() -> None:
    """Buffer 2: chunk n is due (n + 2) chunk periods after the start. First chunk at t = 1 → start = 1 − 1/6; chunk 1
    is due at start + 3/6 = 1 + 2/6 (done at 1 + 2/6 − 1 ms: on time); chunk 2 due at 1 + 3/6, done 1 ms late."""
    eps = 1e-3
    states = _play([1.0, 1.0 + 2 * CHUNK_S - eps, 1.0 + 3 * CHUNK_S + eps])
    assert [s.stalls for s in states] == [0, 0, 0, 1]
    assert [later.stalled(earlier) for earlier, later in zip(states, states[1:], strict=False)] == [False, False, True]


def test_chunks_slower_than_the_video_stall_once_the_buffer_is_spent() -> None:
    """Every chunk takes three chunk periods: chunk n is done (3n + 1) periods after the start and due n + 2 periods
    after it, so every chunk after the first is late."""
    states = _play([1.0 + n * 3 * CHUNK_S for n in range(8)])
    assert [s.stalls for s in states[1:]] == [0, 1, 2, 3, 4, 5, 6, 7]


def test_ahead_is_the_video_made_minus_the_time_played() -> None:
    est = _play([1.0, 1.0 + 0.05])[-1]  # 2 chunks made, 0.05 s + one chunk period of play since the start
    assert est.ahead_s(1.05) == pytest.approx(2 * CHUNK_S - (CHUNK_S + 0.05))


def test_the_fault_run_counts_faults_in_a_row_and_finite_chunks() -> None:
    run = FaultRun()
    for faulted in (False, True, True, False, True):
        run = run.after_chunk(faulted)
    assert run == FaultRun(in_a_row=1, finite=2, seen=True)
    run = run.after_chunk(True).after_chunk(True)
    assert run.faulted_s(CHUNK_S) == pytest.approx(0.5)
    assert run.over_limit(CHUNK_S, 0.5) and not run.over_limit(CHUNK_S, 0.51)
    assert not FaultRun(finite=3).over_limit(CHUNK_S, 0.0 + 1e-12), "no fault in a row: never over the limit"


def test_the_final_account_is_the_pacers_when_there_is_one() -> None:
    a = Assignment(session_id="ns/s1", namespace="ns", pool="pool-a", character="ada", room="room-1",
                   livekit_url="wss://lk.example", agent_identity="agent-1", token="tok", max_duration_s=60)
    state = SessionState.begin(a, 3, FlagValues(), chunk_s=CHUNK_S, buffer_chunks=2, now=10.0)
    for n in range(4):
        state.playout = state.playout.after_chunk(4, 20.0 + n)  # every chunk a second apart: stalls
    assert state.playout.stalls == 3, "chunks 1, 2, 3 a second apart miss their slots"
    assert state.final_account(None) == PlayoutAccount(frames_published=16, stalls=3)
    pacer = PlayoutAccount(frames_published=15, stalls=0)
    assert state.final_account(pacer) is pacer
