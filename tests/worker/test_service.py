"""`vivant worker` (WorkerService) against a real redis-server: session lifecycle, flags applied at chunk
boundaries, a Redis outage mid-session, malformed inbox messages, crash recovery. The tests use
`RecordingRunner`, a small runner that records what it was asked to do; the real runtime (the model on its
ranks) serves sessions through this same service in tests/runtime/."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator

import polling
import pytest
from vivant.apis.feature_flags import FlagValues
from vivant.sessions.flags import FlagStore
from vivant.sessions.models import Assignment, WorkerInfo
from vivant.sessions.registry import Registry
from vivant.worker.serving.runner import EXIT_FAULT, ChunkReport, PlayoutAccount
from vivant.worker.serving.service import MAX_FAULTED_SECONDS, MAX_FAULTED_SESSIONS, WorkerService

POOL = "gpu-w"
WID = "worker-0"


class RecordingRunner:
    """Records, per chunk, the flags in force when the chunk started and when it ended, and any
    `apply_flags` call that arrives while a chunk is running (must never happen)."""

    frames_per_chunk = 4
    chunk_seconds = 4 / 24

    def __init__(self, step_s: float = 0.005) -> None:
        self.step_s = step_s
        self.flags = FlagValues()
        self.in_step = False
        self.chunks: list[tuple[int, bool, bool]] = []  # (index, fused at start, fused at end)
        self.mid_chunk_changes: list[int] = []
        self.sessions: list[str] = []
        self.ended: list[str] = []
        self.entered = threading.Event()  # set when a chunk starts (for tests that act mid-chunk)
        self.gate: threading.Event | None = None  # if set, a chunk waits on it before finishing
        self._n = 0

    def begin(self, assignment: Assignment, flags: FlagValues) -> None:
        self.sessions.append(assignment.session_id)
        self.flags, self._n = flags, 0

    def idle(self) -> None:
        pass

    def apply_flags(self, flags: FlagValues) -> None:
        if self.in_step:
            self.mid_chunk_changes.append(self._n)
        self.flags = flags

    def step(self) -> ChunkReport:
        self.in_step = True
        start = self.flags.fusedGemmAllReduce
        self.entered.set()
        if self.gate is not None:
            assert self.gate.wait(10), "test never opened the gate"
        time.sleep(self.step_s)
        end = self.flags.fusedGemmAllReduce
        self.chunks.append((self._n, start, end))
        self.in_step = False
        self._n += 1
        return ChunkReport(index=self._n - 1, compute_ms=self.step_s * 1e3, frames=self.frames_per_chunk)

    def end(self, reason: str) -> None:
        self.ended.append(reason)


def wait_for(what: str, cond: Callable[[], object], timeout: float = 10.0) -> object:
    return polling.wait_for(what, cond, timeout, every=0.02, retry_on=(Exception,))  # e.g. Redis down while polling


def assignment(session_id: str = "ns/s1", **over) -> Assignment:
    body = dict(session_id=session_id, namespace="ns", pool=POOL, character="ada", room="room-1",
                livekit_url="wss://lk.example", agent_identity="agent-1", token="tok", max_duration_s=60)
    body.update(over)
    return Assignment(**body)


class Harness:
    """A WorkerService running in a thread, plus an operator-side registry to drive it."""

    def __init__(self, url: str, runner, ttl: float = 3.0, **kw) -> None:  # noqa: ANN001
        self.worker_registry = Registry(url, heartbeat_ttl_s=ttl)
        self.registry = Registry(url, heartbeat_ttl_s=ttl)  # the operator's own client
        self.flags = FlagStore(url)
        self.runner = runner
        self.service = WorkerService(self.worker_registry, FlagStore(url), WorkerInfo(worker_id=WID, pool=POOL),
                                     runner, poll_s=0.1, stats_interval_s=0.05, **kw)
        self.thread = threading.Thread(target=self.service.run, daemon=True)

    def start(self) -> Harness:
        self.thread.start()
        wait_for("worker idle", lambda: self.registry.idle_workers(POOL) == [WID])
        return self

    def assign(self, a: Assignment) -> None:
        assert self.registry.claim_idle_worker(POOL, a.session_id) == WID
        self.registry.send_assignment(WID, a)

    def stop(self) -> None:
        self.service.stop.set()
        self.thread.join(timeout=15)
        assert not self.thread.is_alive(), "worker did not stop"


@pytest.fixture
def make(redis_url: str) -> Iterator[Callable[..., Harness]]:
    made: list[Harness] = []

    def factory(runner=None, url: str = redis_url, **kw) -> Harness:  # noqa: ANN001
        h = Harness(url, runner or RecordingRunner(), **kw)
        made.append(h)
        return h

    yield factory
    for h in made:
        if h.thread.is_alive():
            h.stop()


class TestLifecycle:
    def test_assigned_session_streams_reports_and_releases_on_end_request(self, make):
        h = make().start()
        h.assign(assignment())
        wait_for("Streaming stats", lambda: (s := h.registry.session_stats("ns/s1")) and s.phase == "Streaming")
        wait_for("10 chunks", lambda: len(h.runner.chunks) >= 10)
        assert h.registry.redis.llen(h.registry.processing_key(WID)) == 0, "assignment not acked once started"
        h.registry.send_end(WID, "ns/s1", "session deleted")
        final = wait_for("Ended stats", lambda: (s := h.registry.session_stats("ns/s1")) and s.phase == "Ended" and s)
        assert final.end_reason == "session deleted" and final.chunks >= 10, final
        assert final.fps > 0 and final.chunk_p99_ms >= 5.0 and final.streamed_s == pytest.approx(final.chunks / 6)
        wait_for("worker idle again", lambda: h.registry.idle_workers(POOL) == [WID])
        assert h.registry.worker_of("ns/s1") is None
        assert h.runner.ended == ["session deleted"]

    def test_max_duration_ends_the_session(self, make):
        h = make().start()
        h.assign(assignment(max_duration_s=0.3))
        final = wait_for("Ended", lambda: (s := h.registry.session_stats("ns/s1")) and s.phase == "Ended" and s)
        assert final.end_reason == "max duration reached", final

    def test_shutdown_deregisters(self, make):
        h = make().start()
        h.stop()
        assert h.registry.workers(POOL) == {}, "a stopped worker is still registered"
        assert h.registry.worker_failures(POOL) == {"fault": 0, "lost": 0}, "a clean stop is no failure"

    def test_shutdown_mid_session_fails_it_with_the_reason_and_releases(self, make):
        h = make().start()
        h.assign(assignment())
        wait_for("Streaming", lambda: (s := h.registry.session_stats("ns/s1")) and s.phase == "Streaming")
        h.stop()
        final = h.registry.session_stats("ns/s1")
        assert (final.phase, final.end_reason) == ("Failed", "worker shutting down"), final
        assert h.registry.worker_of("ns/s1") is None and h.registry.lost_reason("ns/s1") is None

    def test_stale_assignment_without_lease_is_dropped(self, make):
        h = make().start()
        h.registry.send_assignment(WID, assignment("ns/not-leased"))
        wait_for("inbox drained", lambda: h.registry.redis.llen(h.registry.inbox_key(WID)) == 0)
        time.sleep(0.2)
        assert h.runner.sessions == [], "ran a session whose lease it does not hold"
        assert h.registry.idle_workers(POOL) == [WID]


class TestMetrics:
    def test_session_series_kernel_path_and_slo_result(self, make):
        from prometheus_client import CollectorRegistry
        from vivant.worker.serving.metrics import WorkerMetrics

        prom = CollectorRegistry()
        h = make(metrics=WorkerMetrics(pool=POOL, registry=prom)).start()
        labels = {"pool": POOL, "session": "ns/s1"}
        h.assign(assignment())
        wait_for("frames counted", lambda: (prom.get_sample_value("vivant_worker_session_frames_total", labels) or 0) >= 20)
        path = {"pool": POOL, "path": "gemm_then_all_reduce", "flag_version": "0"}
        assert prom.get_sample_value("vivant_worker_kernel_path_info", path) == 1.0
        h.flags.set(POOL, {"fusedGemmAllReduce": True}, actor="test")
        fused = {"pool": POOL, "path": "fused_gemm_all_reduce", "flag_version": "1"}
        wait_for("kernel path follows the flag", lambda: prom.get_sample_value("vivant_worker_kernel_path_info", fused))
        assert (prom.get_sample_value("vivant_worker_chunk_step_seconds_count", {"pool": POOL, "stage": "diffuse"})
                or 0) >= 5, "fewer chunk timings than the 20 frames (5 chunks) counted"
        h.registry.send_end(WID, "ns/s1", "done")
        wait_for("idle", lambda: h.registry.idle_workers(POOL) == [WID])
        result = {"pool": POOL, "result": "short"}  # streamed < 1 s: not counted against the SLO
        wait_for("finished counted", lambda: prom.get_sample_value("vivant_worker_sessions_finished_total", result) == 1)
        assert prom.get_sample_value("vivant_worker_session_frames_total", labels) is None, "session series kept"


class TestLeaseLoss:
    def test_worker_stops_a_session_that_was_reaped_and_becomes_idle(self, make):
        h = make(ttl=0.6).start()
        h.assign(assignment())
        wait_for("Streaming", lambda: (s := h.registry.session_stats("ns/s1")) and s.phase == "Streaming")
        assert h.registry.deregister(WID, POOL, reason="heartbeat of worker worker-0 expired") == "ns/s1"
        final = wait_for("Failed", lambda: (s := h.registry.session_stats("ns/s1")) and s.phase == "Failed" and s)
        assert "lease lost: heartbeat of worker worker-0 expired" == final.end_reason, final
        wait_for("idle again", lambda: h.registry.idle_workers(POOL) == [WID])
        assert h.registry.worker_of("ns/s1") is None, "the reaped session was resurrected"

    def test_repeated_assignment_of_the_streaming_session_is_acknowledged(self, make):
        """The operator re-sends the assignment of the session this worker streams (its create handler ran
        twice): the worker acknowledges it and streams on; it is not a lost lease."""
        h = make().start()
        h.assign(assignment())
        wait_for("Streaming", lambda: (s := h.registry.session_stats("ns/s1")) and s.phase == "Streaming")
        assert h.registry.claim_idle_worker(POOL, "ns/s1") == WID  # the operator's retry: same lease
        h.registry.send_assignment(WID, assignment())
        wait_for("repeat consumed", lambda: h.registry.redis.llen(h.registry.inbox_key(WID)) == 0)
        chunks = len(h.runner.chunks)
        wait_for("chunks after the repeat", lambda: len(h.runner.chunks) >= chunks + 10)
        stats = h.registry.session_stats("ns/s1")
        assert stats.phase == "Streaming" and stats.end_reason is None, stats
        assert h.registry.redis.llen(h.registry.processing_key(WID)) == 0, "the repeat was not acknowledged"
        assert h.runner.sessions == ["ns/s1"] and h.runner.ended == [], (h.runner.sessions, h.runner.ended)
        assert h.registry.worker_of("ns/s1") == WID
        h.registry.send_end(WID, "ns/s1", "done")
        final = wait_for("Ended", lambda: (s := h.registry.session_stats("ns/s1")) and s.phase == "Ended" and s)
        assert final.end_reason == "done", final


class TestFlagsAtChunkBoundary:
    def test_change_made_mid_chunk_applies_from_the_next_chunk(self, make):
        runner = RecordingRunner()
        h = make(runner).start()
        h.assign(assignment())
        wait_for("5 chunks", lambda: len(runner.chunks) >= 5)
        runner.gate = threading.Event()
        runner.entered.clear()
        assert runner.entered.wait(5)
        held = len(runner.chunks)  # index of the chunk now blocked inside step()
        changed = h.flags.set(POOL, {"fusedGemmAllReduce": True}, actor="test", reason="mid-chunk flip")
        time.sleep(0.05)
        runner.gate.set()
        runner.gate = None
        wait_for("chunks after the change", lambda: len(runner.chunks) >= held + 3)
        h.registry.send_end(WID, "ns/s1", "done")
        wait_for("idle", lambda: h.registry.idle_workers(POOL) == [WID])

        assert runner.mid_chunk_changes == [], f"flags applied inside chunks {runner.mid_chunk_changes}"
        torn = [c for c in runner.chunks if c[1] != c[2]]
        assert torn == [], f"chunks whose flags changed while running: {torn}"
        assert runner.chunks[held] == (held, False, False), f"the chunk running during the set: {runner.chunks[held]}"
        assert runner.chunks[held + 1] == (held + 1, True, True), f"next chunk: {runner.chunks[held + 1]}"
        log = [r for r in h.service.chunk_log if r.session_id == "ns/s1"]
        assert [r.flag_version for r in log[: held + 1]] == [0] * (held + 1)
        assert {r.flag_version for r in log[held + 1:]} == {changed.version}
        final = h.registry.session_stats("ns/s1")
        assert final.flag_version == changed.version and final.flags.fusedGemmAllReduce is True, final

    def test_session_override_wins_over_pool_flag(self, make):
        runner = RecordingRunner()
        h = make(runner).start()
        h.flags.set(POOL, {"fusedGemmAllReduce": True}, actor="test")
        h.assign(assignment(flag_overrides={"fusedGemmAllReduce": False}))
        wait_for("3 chunks", lambda: len(runner.chunks) >= 3)
        assert all(not c[1] for c in runner.chunks), "the per-session override was ignored"


class TestRedisOutage:
    def test_worker_keeps_generating_reregisters_and_the_session_survives(self, make):
        from servers import RedisServer

        server = RedisServer()
        try:
            runner = RecordingRunner(step_s=0.01)
            h = make(runner, url=server.url, ttl=1.0).start()
            h.assign(assignment())
            wait_for("Streaming", lambda: (s := h.registry.session_stats("ns/s1")) and s.phase == "Streaming")
            server.stop()
            before = len(runner.chunks)
            time.sleep(1.2)  # longer than the heartbeat TTL: its key would have expired anyway
            during = len(runner.chunks) - before
            assert during >= 20, f"only {during} chunks generated during a 1.2 s outage (10 ms chunks)"
            print(f"chunks during 1.2 s outage: {during}")
            server.start()  # comes back EMPTY (no persistence): the worker must re-register with its session
            wait_for("lease restored", lambda: h.registry.worker_of("ns/s1") == WID, timeout=10)
            counts = h.registry.pool_counts(POOL)
            assert (counts.registered, counts.busy, counts.idle) == (1, 1, 0), counts
            assert h.service.reregistrations >= 1
            assert h.registry.claim_idle_worker(POOL, "ns/s2") is None, "a streaming worker was claimed again"
            wait_for("stats after outage", lambda: h.registry.session_stats("ns/s1"))
            h.registry.send_end(WID, "ns/s1", "session deleted")
            final = wait_for("Ended", lambda: (s := h.registry.session_stats("ns/s1")) and s.phase == "Ended" and s)
            assert final.chunks >= before + during, final
            wait_for("idle after end", lambda: h.registry.idle_workers(POOL) == [WID])
            assert runner.sessions == ["ns/s1"], f"session restarted or duplicated: {runner.sessions}"
        finally:
            server.stop()


class TestInboxRobustness:
    def test_malformed_messages_are_dead_lettered_and_the_worker_keeps_going(self, make, caplog):
        h = make().start()
        with caplog.at_level(logging.ERROR):
            h.registry.redis.rpush(h.registry.inbox_key(WID), b"{oops")
            h.registry.redis.rpush(h.registry.inbox_key(WID), '{"kind": "assign", "session_id": "ns/s1"}')
            h.assign(assignment())
            wait_for("session runs", lambda: len(h.runner.chunks) >= 3)
        dead = h.registry.dead_letters()
        assert len(dead) == 2, f"expected 2 dead letters, got {dead}"
        assert "livekit_url: Field required" in dead[0]["error"], dead[0]
        assert "Invalid JSON" in dead[1]["error"], dead[1]
        assert any("room: Field required" in r.getMessage() for r in caplog.records), "error not logged"

    def test_assignment_popped_by_a_crashed_incarnation_is_run_after_restart(self, make, redis_url):
        reg = Registry(redis_url, heartbeat_ttl_s=3)
        reg.register(WorkerInfo(worker_id=WID, pool=POOL, warm=True))
        assert reg.claim_idle_worker(POOL, "ns/s1") == WID
        reg.send_assignment(WID, assignment())
        assert reg.next_message(WID, 1) is not None  # popped, then the process "died" before acking
        h = make()
        h.thread.start()
        wait_for("recovered session runs", lambda: len(h.runner.chunks) >= 3)
        assert h.runner.sessions == ["ns/s1"]

    def test_lease_of_a_session_that_died_with_the_previous_incarnation_is_given_up(self, make, redis_url):
        reg = Registry(redis_url, heartbeat_ttl_s=3)
        reg.register(WorkerInfo(worker_id=WID, pool=POOL, warm=True))
        reg.claim_idle_worker(POOL, "ns/s1")  # assignment was acked and streaming when the pod died
        h = make().start()
        assert h.registry.lost_reason("ns/s1") == f"worker {WID} restarted"
        assert h.registry.worker_of("ns/s1") is None


class FailingRunner(RecordingRunner):
    """Raises in chunk `fail_at` of the first session; later sessions run normally."""

    def __init__(self, fail_at: int, in_begin: bool = False) -> None:
        super().__init__()
        self.fail_at, self.in_begin, self.failed = fail_at, in_begin, False

    def begin(self, assignment: Assignment, flags: FlagValues) -> None:
        super().begin(assignment, flags)
        if self.in_begin and not self.failed:
            self.failed = True
            raise RuntimeError("cannot open the sink")

    def step(self) -> ChunkReport:
        if not self.failed and self._n == self.fail_at:
            self.failed = True
            raise RuntimeError("CUDA error: an illegal memory access")
        return super().step()


class FaultyRunner(RecordingRunner):
    """Chunk 2 comes out with NaNs."""

    def step(self) -> ChunkReport:
        r = super().step()
        return ChunkReport(r.index, r.compute_ms, r.frames, numerical_fault=r.index == 2)


class TestFailures:
    @pytest.mark.parametrize("in_begin", [False, True], ids=["in-chunk", "at-start"])
    def test_runner_error_fails_the_session_not_the_worker(self, make, in_begin: bool):
        h = make(FailingRunner(fail_at=3, in_begin=in_begin)).start()
        h.assign(assignment("ns/s1"))
        final = wait_for("Failed", lambda: (s := h.registry.session_stats("ns/s1")) and s.phase == "Failed" and s)
        expected = "cannot open the sink" if in_begin else "illegal memory access"
        assert expected in (final.end_reason or ""), final
        assert final.chunks == (0 if in_begin else 3), final
        wait_for("idle after failure", lambda: h.registry.idle_workers(POOL) == [WID])
        h.assign(assignment("ns/s2"))  # the worker still serves
        wait_for("next session streams", lambda: (s := h.registry.session_stats("ns/s2")) and s.chunks >= 2)

    def test_numerical_fault_is_reported_while_streaming(self, make):
        from prometheus_client import CollectorRegistry
        from vivant.worker.serving.metrics import WorkerMetrics

        prom = CollectorRegistry()
        faults = "vivant_worker_numerical_faults_total"
        h = make(FaultyRunner(), metrics=WorkerMetrics(pool=POOL, registry=prom))
        assert prom.get_sample_value(faults, {"pool": POOL}) == 0.0, "no 0 before the first fault"
        h.start()
        h.assign(assignment())
        stats = wait_for("fault reported", lambda: (s := h.registry.session_stats("ns/s1")) and s.numerical_fault and s)
        assert stats.phase == "Streaming", stats
        wait_for("chunks after the fault", lambda: (s := h.registry.session_stats("ns/s1")) and s.chunks >= 5)
        assert prom.get_sample_value(faults, {"pool": POOL}) == 1.0, "one faulted chunk (chunk 2), counted once"


class FaultsFromRunner(RecordingRunner):
    """Every chunk from `start` on comes out with NaNs, until `cured` is set (e.g. the flag rollback took effect)."""

    def __init__(self, start: int = 0) -> None:
        super().__init__()
        self.start, self.cured = start, threading.Event()

    def step(self) -> ChunkReport:
        r = super().step()
        return ChunkReport(r.index, r.compute_ms, r.frames,
                           numerical_fault=r.index >= self.start and not self.cured.is_set())


class TestPersistentFaults:
    def test_faults_in_every_chunk_for_the_limit_fail_the_session_and_the_worker_serves_on(self, make):
        limit_chunks = round(MAX_FAULTED_SECONDS / RecordingRunner.chunk_seconds)  # 30
        h = make(FaultsFromRunner(start=3)).start()
        h.assign(assignment("ns/s1"))
        final = wait_for("Failed", lambda: (s := h.registry.session_stats("ns/s1")) and s.phase == "Failed" and s)
        assert final.chunks == 3 + limit_chunks and final.numerical_fault, final
        assert final.end_reason.startswith(f"numerical fault: {limit_chunks} chunks in a row with NaN/Inf latents"), final
        assert h.runner.ended == [final.end_reason], h.runner.ended
        wait_for("idle after", lambda: h.registry.idle_workers(POOL) == [WID])
        h.runner.start = 10**9  # the next session's chunks are clean: the worker was not marked broken
        h.assign(assignment("ns/s2"))
        wait_for("next session streams", lambda: (s := h.registry.session_stats("ns/s2")) and s.chunks >= 2)

    def test_faults_that_stop_before_the_limit_cost_nothing_more(self, make):
        runner = FaultsFromRunner(start=0)
        h = make(runner, max_faulted_s=2.0).start()
        h.assign(assignment())
        wait_for("faults", lambda: len(runner.chunks) >= 6)  # 1 s of faulted video, under the 2 s limit
        runner.cured.set()
        wait_for("streams on", lambda: len(runner.chunks) >= 40)  # far past 2 s of video in all
        stats = h.registry.session_stats("ns/s1")
        assert stats.phase == "Streaming" and stats.numerical_fault, stats

    def test_sessions_ended_by_faults_in_a_row_stop_the_worker(self, make):
        """A model that faults whatever it is given fails every session: after max_faulted_sessions of them the worker
        stops as after a rank failure (exit code EXIT_FAULT, deregistered) so Kubernetes restarts its container."""
        assert MAX_FAULTED_SESSIONS == 3
        h = make(FaultsFromRunner(start=0), max_faulted_s=0.5, max_faulted_sessions=2).start()
        for n in (1, 2):
            h.assign(assignment(f"ns/s{n}"))
            final = wait_for("Failed", lambda n=n: (s := h.registry.session_stats(f"ns/s{n}")) and s.phase == "Failed"
                             and s)
            assert final.end_reason.startswith("numerical fault: 3 chunks in a row"), final
            if n == 1:
                wait_for("idle after the first", lambda: h.registry.idle_workers(POOL) == [WID])
                assert h.service.exit_code == 0 and not h.service.stop.is_set(), "one faulted session stopped the worker"
        h.thread.join(timeout=10)
        assert not h.thread.is_alive(), "the worker did not stop after two faulted sessions in a row"
        assert h.service.exit_code == EXIT_FAULT
        assert h.registry.workers(POOL) == {}, "a worker that stopped is still registered"
        assert h.registry.worker_failures(POOL) == {"fault": 1, "lost": 0}, "the pool counts the worker's failure"

    def test_a_session_with_finite_chunks_breaks_the_row(self, make):
        runner = FaultsFromRunner(start=0)
        h = make(runner, max_faulted_s=0.5, max_faulted_sessions=2).start()
        h.assign(assignment("ns/s1"))
        wait_for("s1 Failed", lambda: (s := h.registry.session_stats("ns/s1")) and s.phase == "Failed")
        wait_for("idle", lambda: h.registry.idle_workers(POOL) == [WID])
        runner.cured.set()  # s2 runs clean and ends by its duration
        h.assign(assignment("ns/s2", max_duration_s=0.4))
        wait_for("s2 Ended", lambda: (s := h.registry.session_stats("ns/s2")) and s.phase == "Ended")
        wait_for("idle", lambda: h.registry.idle_workers(POOL) == [WID])
        runner.cured.clear()
        h.assign(assignment("ns/s3"))
        wait_for("s3 Failed", lambda: (s := h.registry.session_stats("ns/s3")) and s.phase == "Failed")
        wait_for("idle after s3", lambda: h.registry.idle_workers(POOL) == [WID])
        assert h.service.exit_code == 0 and h.thread.is_alive(), "s2's finite chunks should have broken the row"

    @pytest.mark.parametrize("bad", [0, -1, 1.5, True, "3"])
    def test_the_session_limit_must_be_a_positive_integer(self, make, bad):
        with pytest.raises(ValueError, match="max_faulted_sessions: expected an integer >= 1"):
            make(max_faulted_sessions=bad)

    @pytest.mark.parametrize("bad", [0, -1.0, float("nan"), "5"])
    def test_the_limit_must_be_positive_seconds(self, make, bad):
        with pytest.raises(ValueError, match="max_faulted_s: expected seconds > 0"):
            make(max_faulted_s=bad)


class PacedRunner(RecordingRunner):
    """A 4-frame chunk lasts 50 ms of video (80 fps nominal) so pacing shows quickly."""

    chunk_seconds = 0.05


class TestPacing:
    def test_realtime_mode_does_not_run_ahead_of_the_video_clock(self, make):
        h = make(PacedRunner(step_s=0.002), realtime=True).start()
        h.assign(assignment(max_duration_s=0.6))
        final = wait_for("Ended", lambda: (s := h.registry.session_stats("ns/s1")) and s.phase == "Ended" and s)
        assert final.fps <= 80 * 1.1, f"paced session ran at {final.fps:.1f} fps, faster than 80 fps of video"
        assert final.stalls == 0, final

    def test_chunks_slower_than_the_video_count_as_stalls(self, make):
        h = make(PacedRunner(step_s=0.1), realtime=True, buffer_chunks=2).start()
        h.assign(assignment(max_duration_s=0.8))
        final = wait_for("Ended", lambda: (s := h.registry.session_stats("ns/s1")) and s.phase == "Ended" and s)
        assert final.chunks >= 4 and final.stalls >= final.chunks - 2, final


    def test_a_slow_first_chunk_delays_playout_and_stalls_nothing_after(self, make):
        """The first chunk takes 10 chunk periods (a CUDA graph capture does); playback starts when it exists,
        so the chunks after it, each on time, are no stalls (seen on an H200: 351 of 351 counted before)."""

        class SlowStart(PacedRunner):
            def step(self) -> ChunkReport:
                self.step_s = 0.5 if self._n == 0 else 0.002
                return super().step()

        h = make(SlowStart(), realtime=True).start()
        h.assign(assignment(max_duration_s=1.5))
        final = wait_for("Ended", lambda: (s := h.registry.session_stats("ns/s1")) and s.phase == "Ended" and s)
        assert final.chunks >= 10 and final.stalls == 0, final
        assert 80 * 0.7 <= final.fps <= 80 * 1.1, f"{final.fps:.1f} fps on the playout clock, 80 fps of video"

    def test_the_pacers_account_replaces_the_estimate(self, make):
        """A runner with a pacer elsewhere (the decoder rank) returns its count from `end`: those stalls and
        frames are the session's, whatever the chunk loop estimated."""

        class Counted(PacedRunner):
            def end(self, reason: str) -> PlayoutAccount:
                super().end(reason)
                return PlayoutAccount(frames_published=4 * (self._n - 1), stalls=3)

        h = make(Counted(step_s=0.002), realtime=True).start()
        h.assign(assignment(max_duration_s=0.5))
        final = wait_for("Ended", lambda: (s := h.registry.session_stats("ns/s1")) and s.phase == "Ended" and s)
        assert final.stalls == 3, f"the pacer counted 3 stalls, the session reports {final.stalls}"
        assert final.chunks >= 5 and final.fps < 80, final


def test_vivant_worker_command_end_to_end(redis_url: str, tmp_path):
    """The real `vivant worker` process (tiny model, 1 + 1 ranks, latents kept under --out): registers with its
    pod's node and preset, streams, serves metrics, keeps the token out of its log, stops on SIGTERM."""
    import os
    import signal
    import subprocess
    import sys

    env = {**os.environ, "POD_NAME": "worker-cli-0", "NODE_NAME": "node-a"}
    from vivant.ports import free_port

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "vivant", "worker", "--pool", POOL, "--redis", redis_url,
                             "--preset", "tiny", "--out", str(tmp_path), "--heartbeat-ttl", "3",
                             "--metrics-port", str(port), "--metrics-addr", "127.0.0.1"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    reg = Registry(redis_url, heartbeat_ttl_s=3)
    try:
        wait_for("worker warm and idle", lambda: reg.idle_workers(POOL) == ["worker-cli-0"], timeout=90)
        info = reg.workers(POOL)["worker-cli-0"]
        assert (info.node, info.model_preset, info.warm) == ("node-a", "tiny", True), info
        assert reg.claim_idle_worker(POOL, "ns/cli") == "worker-cli-0"
        reg.send_assignment("worker-cli-0", assignment("ns/cli", token="LK-SECRET-TOKEN-7f3a"))
        wait_for("3 chunks", lambda: (s := reg.session_stats("ns/cli")) and s.chunks >= 3, timeout=60)
        import urllib.request

        scrape = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        assert f'vivant_worker_build_info{{pool="{POOL}"' in scrape, scrape[:2000]
        assert 'vivant_worker_session_frames_total{pool="gpu-w",session="ns/cli"}' in scrape, scrape[:2000]
        reg.send_end("worker-cli-0", "ns/cli", "done")
        wait_for("released", lambda: reg.idle_workers(POOL) == ["worker-cli-0"])
        written = sorted(p.name for p in (tmp_path / "ns_cli" / "latents").iterdir())
        assert len(written) >= 3 and written[0] == "chunk_00000.npy", written
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out
    assert "streaming session ns/cli" in out, out  # the log is there ...
    assert "LK-SECRET-TOKEN-7f3a" not in out, "the LiveKit token appeared in the worker's log"  # ... the token not
    assert reg.workers(POOL) == {}, "worker did not deregister on SIGTERM"


def test_vivant_worker_refuses_a_remote_checkpoint(capsys):
    from vivant.cli import main

    assert main(["worker", "--pool", POOL, "--checkpoint", "s3://bucket/57b.safetensors"]) == 2
    assert "checkpoint: expected an absolute path" in capsys.readouterr().out


def test_vivant_worker_requires_a_pool(capsys):
    from vivant.cli import main

    assert main(["worker", "--redis", "redis://127.0.0.1:1/0"]) == 2
    assert "--pool is required" in capsys.readouterr().out
