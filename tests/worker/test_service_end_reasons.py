"""The worker service ends a session when its runner (or the operator) says so, reports why, and releases itself;
what a runner raises decides how (tests/runtime/ run the same through the real ranks).

Runs for real: redis-server (conftest), `WorkerService` in a thread, the operator-side `Registry`, small runners
that end, fail or fault the session the way the worker's runtime does (`SessionEnded` from `step` or an
`end_reason`, `SessionInputError`, `SessionFailed`, `WorkerFault`), and the stream pipeline stopped early.
The LiveKit room's own end reasons (agent left, END_CALL, disconnected) are covered in
tests/livekit/test_livekit_avatar.py; a `--runner livekit` worker that cannot reach its room in tests/runtime/.
Budget: under 60 s for this file on 2 cores.
"""

from __future__ import annotations

import argparse
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import polling
import pytest
from vivant.apis.feature_flags import FlagValues
from vivant.sessions.flags import FlagStore
from vivant.sessions.models import Assignment, SessionStats, WorkerInfo
from vivant.sessions.registry import Registry
from vivant.worker.model.config import ModelConfig
from vivant.worker.serving.cli import add_arguments
from vivant.worker.serving.cli import run as run_worker_cli
from vivant.worker.serving.runner import (
    EXIT_FAULT,
    ChunkReport,
    SessionEnded,
    SessionFailed,
    SessionInputError,
    WorkerFault,
)
from vivant.worker.serving.service import WorkerService
from vivant.worker.stream.pipeline import StreamPipeline

CFG = ModelConfig.from_name("tiny")  # 192x128, 24 fps, 4 frames per chunk, 16 kHz
POOL, WID, AGENT = "gpu-lk", "worker-lk-0", "agent-1"
pytestmark = pytest.mark.timeout(60)


# ------------------------------------------------------------------------------------------ harness


def wait_for(what: str, cond: Callable[[], Any], timeout: float = 15.0) -> Any:
    return polling.wait_for(what, cond, timeout, every=0.02)


def assignment(session_id: str = "ns/s1", **over: Any) -> Assignment:
    body: dict[str, Any] = dict(session_id=session_id, namespace="ns", pool=POOL, character="ada", room="room-1",
                                livekit_url="wss://lk.example", agent_identity=AGENT, token="secret-tok",
                                max_duration_s=60)
    body.update(over)
    return Assignment(**body)


class Worker:
    """A WorkerService in a thread plus an operator-side registry client to drive it."""

    def __init__(self, url: str, runner: Any) -> None:
        self.registry = Registry(url, heartbeat_ttl_s=3.0)
        self.runner = runner
        self.service = WorkerService(Registry(url, heartbeat_ttl_s=3.0), FlagStore(url),
                                     WorkerInfo(worker_id=WID, pool=POOL), runner, poll_s=0.1, stats_interval_s=0.05)
        self.thread = threading.Thread(target=self.service.run, daemon=True)
        self.thread.start()
        wait_for("worker idle", lambda: self.registry.idle_workers(POOL) == [WID])

    def assign(self, a: Assignment) -> None:
        assert self.registry.claim_idle_worker(POOL, a.session_id) == WID, "worker was not idle"
        self.registry.send_assignment(WID, a)

    def streaming(self, session_id: str, chunks: int = 3) -> SessionStats:
        return wait_for(f"{session_id} streaming {chunks} chunks",
                        lambda: (s := self.registry.session_stats(session_id)) and s.phase == "Streaming"
                        and s.chunks >= chunks and s)

    def ended(self, session_id: str) -> SessionStats:
        return wait_for(f"{session_id} to end", lambda: (s := self.registry.session_stats(session_id))
                        and s.phase in ("Ended", "Failed") and s)

    def assert_released(self, session_id: str) -> None:
        wait_for("worker idle again", lambda: self.registry.idle_workers(POOL) == [WID])
        assert self.registry.worker_of(session_id) is None, "the session's lease is still held"
        assert self.registry.session_of(POOL, WID) is None, "the worker still holds a session"
        assert self.registry.redis.llen(self.registry.processing_key(WID)) == 0, "inbox message left unacked"

    def stop(self) -> None:
        self.service.stop.set()
        self.thread.join(timeout=15)
        assert not self.thread.is_alive(), "worker did not stop"


@pytest.fixture
def worker(redis_url: str) -> Iterator[Callable[[Any], Worker]]:
    made: list[Worker] = []

    def start(runner: Any) -> Worker:
        made.append(Worker(redis_url, runner))
        return made[-1]

    yield start
    for w in made:
        if w.thread.is_alive():
            w.stop()


def assert_ended(stats: SessionStats, reason: str) -> None:
    assert (stats.phase, stats.end_reason) == ("Ended", reason), \
        f"expected phase Ended with end_reason {reason!r}, got {stats.phase} / {stats.end_reason!r}"


# ------------------------------------------------------------------------------------------ the protocol


class EndsItselfRunner:
    """Raises `outcome` from `step` in chunk `at` of its first session (as the runtime does when the room ends
    mid-wait, the audio is bad, the decoder rank's sink failed, or a rank died); later sessions run normally.
    With `room_reason`, its `end_reason` says the room ended the session from chunk `at` on instead."""

    frames_per_chunk, chunk_seconds = 4, 4 / 24

    def __init__(self, at: int = 3, outcome: Exception | None = None, room_reason: str | None = None) -> None:
        self.at, self.n, self.ended, self.sessions, self.idles = at, 0, [], 0, 0
        self.outcome = outcome if outcome is not None else SessionEnded("EndCall")
        self.room_reason = room_reason

    @property
    def end_reason(self) -> str | None:
        return self.room_reason if self.room_reason and self.n >= self.at and self.sessions == 1 else None

    def idle(self) -> None:
        self.idles += 1

    def begin(self, assignment: Assignment, flags: FlagValues) -> None:
        self.n = 0
        self.sessions += 1

    def apply_flags(self, flags: FlagValues) -> None:
        pass

    def step(self) -> ChunkReport:
        if self.n == self.at and self.sessions == 1 and self.room_reason is None:
            raise self.outcome
        self.n += 1
        time.sleep(0.01)
        return ChunkReport(index=self.n - 1, compute_ms=10.0, frames=4)

    def end(self, reason: str) -> None:
        self.ended.append(reason)


def test_step_raising_session_ended_ends_the_session(worker):
    runner = EndsItselfRunner(at=3)
    w = worker(runner)
    w.assign(assignment())
    final = w.ended("ns/s1")
    assert_ended(final, "EndCall")
    assert final.chunks == 3, f"the 3 chunks made before the end should be counted, got {final.chunks}"
    w.assert_released("ns/s1")
    assert runner.ended == ["EndCall"]


def test_the_rooms_end_reason_ends_the_session_at_a_chunk_boundary(worker):
    runner = EndsItselfRunner(at=4, room_reason="AgentLeft")
    w = worker(runner)
    w.assign(assignment())
    final = w.ended("ns/s1")
    assert_ended(final, "AgentLeft")
    assert final.chunks == 4 and runner.ended == ["AgentLeft"], (final, runner.ended)
    w.assert_released("ns/s1")


@pytest.mark.parametrize("outcome, reason", [
    (SessionInputError("audio for chunk 3: 2 of 2666 samples are not finite (NaN/Inf)"),
     "bad input: audio for chunk 3: 2 of 2666 samples are not finite (NaN/Inf)"),
    (SessionFailed("rank 2 (decoder, cpu): OSError: disk full"), "rank 2 (decoder, cpu): OSError: disk full"),
    (RuntimeError("boom"), "worker error: RuntimeError('boom')"),
])
def test_a_failed_session_reports_why_and_the_worker_serves_the_next(worker, outcome, reason):
    runner = EndsItselfRunner(at=3, outcome=outcome)
    w = worker(runner)
    w.assign(assignment("ns/a"))
    final = w.ended("ns/a")
    assert (final.phase, final.end_reason, final.chunks) == ("Failed", reason, 3), final
    w.assert_released("ns/a")
    w.assign(assignment("ns/b"))
    w.streaming("ns/b", 3)
    w.registry.send_end(WID, "ns/b", "Deleted")
    assert_ended(w.ended("ns/b"), "Deleted")
    assert runner.idles > 0, "the service never ticked the runner between sessions"


def test_a_worker_fault_ends_the_session_releases_the_lease_and_stops_the_worker(worker):
    runner = EndsItselfRunner(at=2, outcome=WorkerFault("rank 1 (dit, cpu) pid 77 died: killed by signal 9 (SIGKILL)"))
    w = worker(runner)
    w.assign(assignment())
    final = w.ended("ns/s1")
    assert (final.phase, final.end_reason) == ("Failed", "rank 1 (dit, cpu) pid 77 died: killed by signal 9 (SIGKILL)")
    w.thread.join(10)
    assert not w.thread.is_alive(), "the service kept serving after a worker fault"
    assert w.service.exit_code == EXIT_FAULT, w.service.exit_code
    assert w.registry.worker_of("ns/s1") is None and w.registry.workers(POOL) == {}, "lease or registration leaked"


def test_fail_from_another_thread_ends_the_running_session_with_its_reason(worker):
    """What the rank supervisor does when a rank dies mid-chunk: `fail` from its watchdog thread."""
    runner = EndsItselfRunner(at=10_000)
    w = worker(runner)
    w.assign(assignment())
    w.streaming("ns/s1", 3)
    w.service.fail("rank 2 (decoder, cpu) pid 9 died: exited with status 1")
    final = w.ended("ns/s1")
    assert (final.phase, final.end_reason) == ("Failed", "rank 2 (decoder, cpu) pid 9 died: exited with status 1")
    w.thread.join(10)
    assert not w.thread.is_alive() and w.service.exit_code == EXIT_FAULT
    assert w.registry.workers(POOL) == {}, "the failed worker is still registered"


def test_abort_releases_a_session_whose_chunk_loop_cannot_come_back(worker):
    """The watchdog's last resort (a collective that never returns): the session is released from its thread."""
    gate, stuck = threading.Event(), threading.Event()

    class Stuck(EndsItselfRunner):
        def step(self) -> ChunkReport:
            if self.n == 2:
                stuck.set()
                gate.wait(30)  # "blocked on a dead rank"
            return super().step()

    w = worker(Stuck(at=10_000))
    try:
        w.assign(assignment())
        assert stuck.wait(15), "the session never reached chunk 2"
        w.service.abort("rank 1 (dit, cpu) pid 5 died: killed by signal 9 (SIGKILL)")
        final = w.registry.session_stats("ns/s1")
        assert (final.phase, final.end_reason) == ("Failed", "rank 1 (dit, cpu) pid 5 died: killed by signal 9 (SIGKILL)")
        assert w.registry.worker_of("ns/s1") is None and w.registry.workers(POOL) == {}
    finally:
        gate.set()
    w.thread.join(timeout=15)
    assert not w.thread.is_alive(), "the aborted worker's loop did not end"
    assert w.registry.worker_failures(POOL) == {"fault": 1, "lost": 0}, \
        "aborted, then deregistered again as the loop ended: one failure"


def test_session_ended_needs_a_reason():
    with pytest.raises(ValueError, match="reason must be a non-empty string"):
        SessionEnded("")


# ------------------------------------------------------------------------------------------ pipeline runner


def test_pipeline_stops_early_and_reports_the_chunks_made():
    from vivant.worker.model.generator import ChunkGenerator
    from vivant.worker.stream.sinks import NullSink
    from vivant.worker.stream.vae import VAEConfig, build_vae_decoder

    stop = threading.Event()
    sink = NullSink()
    pipe = StreamPipeline(ChunkGenerator(CFG), build_vae_decoder(VAEConfig.for_model(CFG)), [sink])
    report = pipe.run(1000, lambda n, _p: stop.set() if n == 3 else None, stop=stop)
    assert report.chunks == 3, f"stop set before chunk 3: expected 3 chunks made, got {report.chunks}"
    assert report.generated_frames_published == 12 and sink.closed, report.format_text()


def test_pipeline_stopped_before_its_first_chunk_reports_none():
    from vivant.worker.model.generator import ChunkGenerator
    from vivant.worker.stream.sinks import NullSink
    from vivant.worker.stream.vae import VAEConfig, build_vae_decoder

    stop = threading.Event()
    stop.set()
    sink = NullSink()
    report = StreamPipeline(ChunkGenerator(CFG), build_vae_decoder(VAEConfig.for_model(CFG)), [sink]).run(10, stop=stop)
    assert (report.chunks, report.frames_published, sink.frames) == (0, 0, 0), report.format_text()
    assert sink.closed, "the sinks must be closed even when no chunk was made"


# ------------------------------------------------------------------------------------------ CLI


def cli_args(**over: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    ns = parser.parse_args(["--pool", POOL])
    for k, v in over.items():
        setattr(ns, k, v)
    return ns


def test_cli_rejects_an_unknown_runner_from_the_environment(monkeypatch, capsys):
    monkeypatch.setenv("VIVANT_RUNNER", "webrtc")
    assert run_worker_cli(cli_args()) == 2
    out = capsys.readouterr().out
    assert "runner: expected one of generator, pipeline, livekit (--runner or VIVANT_RUNNER), got 'webrtc'" in out, out


def test_cli_rejects_a_relative_vae_weights_path(capsys):
    assert run_worker_cli(cli_args(runner="pipeline", vae_weights="vae.safetensors")) == 2
    assert "vae-weights: expected an absolute path" in capsys.readouterr().out
