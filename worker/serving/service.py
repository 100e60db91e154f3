"""The worker's session service (rank 0 of `vivant worker`): register, load, wait for sessions, stream them.

Why a long-lived warm process: loading weights and capturing graphs takes minutes, a session must
start streaming within seconds. So the worker loads once (forms its ranks: vivant.worker.serving.runtime),
registers in the Redis registry as warm, and then serves sessions one at a time from its inbox
(`vivant.sessions.registry`).

Per session the loop is, chunk by chunk (one chunk = `frames_per_chunk` frames, 1/6 s at 24 fps):
  1. stop? (EndRequest in the inbox for this session, the runner's own `end_reason` (e.g. the agent left
     the LiveKit room), max duration reached, lease lost, a worker fault, shutdown)
  2. flags changed? (one GET of the pool's flag version) -> apply them to the runner, BETWEEN chunks
  3. run one chunk; record which flag version it ran under
  4. every `stats_interval_s`: report SessionStats (phase, fps, stalls, chunk p99 ms, streamed s)
A chunk with NaN/Inf latents (a numerical fault) is reported at once and counted; the runner has already restarted
the model's state, so the session goes on. Faults in every chunk for `max_faulted_s` of video mean this worker's
model cannot recover (a bad checkpoint, a broken kernel path): the session ends Failed, "numerical fault: …",
instead of showing a held frame for ever. When that ends `max_faulted_sessions` sessions in a row (a session that
ends otherwise with finite chunks breaks the row), the fault is the worker's, not a session's: it stops as after a
rank failure (`fail`, exit code EXIT_FAULT) so Kubernetes restarts its container, instead of failing every session
the pool gives it.
Between sessions the runner is ticked (`idle`) once per inbox poll. A heartbeat thread keeps the lease alive.
When Redis is unreachable the session keeps streaming (every registry call is allowed to fail); when Redis
comes back the heartbeat finds the worker unknown and re-registers it together with the session it is
streaming, so nothing assigned is lost.

The model sits behind `SessionRunner` (vivant.worker.serving.runner). How a session ends, by what the runner
does: an `end_reason` (checked at every chunk boundary) or `SessionEnded` from `step` → `Ended` with that
reason; `SessionInputError` → `Failed`, "bad input: …"; `SessionFailed` → `Failed` with its message; any
other exception → `Failed`, "worker error: …"; `WorkerFault` (a rank died) → `Failed` with its reason, and
the service stops (`exit_code` 3). Each time the runner's `end` runs and the lease is released. `fail(reason)`
does the same from another thread (the rank supervisor's watchdog), and `abort(reason)` releases the session
from that thread when the chunk loop cannot come back. The kernel-path metric (`vivant_worker_kernel_path_info`)
reports the row-parallel path the runner says is in effect (what `apply_flags` returned, e.g. "no_tp" at
TP = 1), not the flag that asked for it; only a runner that cannot tell (returns None) is reported by the
requested flag. Tests pass small runners of their own.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
from vivant.apis.feature_flags import FlagValues
from vivant.sessions.flags import FlagStore, FlagWatcher
from vivant.sessions.models import Assignment, EndRequest, FlagSet, SessionStats, WorkerInfo
from vivant.sessions.registry import Registry, RegistryUnavailable
from vivant.worker.model.options import RowParallelPath
from vivant.worker.serving.metrics import WorkerMetrics
from vivant.worker.serving.runner import (
    EXIT_FAULT,
    MAX_DURATION_REASON,
    ChunkReport,
    PlayoutAccount,
    SessionEnded,
    SessionFailed,
    SessionInputError,
    SessionRunner,
    WorkerFault,
)
from vivant.worker.serving.session_state import SessionOutcome, SessionState

log = logging.getLogger(__name__)

# Seconds of video made of consecutive faulted chunks after which a session ends Failed (30 chunks at 24 fps): long
# enough for the operator's rollback of the fused path to reach the worker (its next chunk boundary), short enough
# that a viewer is not left on a frozen frame.
MAX_FAULTED_SECONDS = 5.0
# Sessions in a row ended by that rule (one that ends otherwise with finite chunks breaks the row) after which the
# worker stops: one such session can be its input or a flag the operator rolls back; three mean the model fails on
# this worker whatever it is given.
MAX_FAULTED_SESSIONS = 3
T = TypeVar("T")


def failure_reason(exc: Exception) -> str:
    """SessionStats.end_reason for a session that failed with `exc`."""
    if isinstance(exc, SessionInputError):
        return f"bad input: {exc}"
    if isinstance(exc, WorkerFault | SessionFailed):
        return str(exc)
    return f"worker error: {exc!r}"


# ------------------------------------------------------------------------------------------------
# the service
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ChunkRecord:
    """Which pool flag version (and effective flags) one chunk of one session ran under."""

    session_id: str
    index: int
    flag_version: int
    flags: FlagValues


class WorkerService:
    """Serve sessions from the inbox until `stop` is set. Thread-safe against its heartbeat thread."""

    def __init__(self, registry: Registry, flags: FlagStore, info: WorkerInfo,
                 runner: SessionRunner | Callable[[], SessionRunner], *,
                 poll_s: float = 1.0, stats_interval_s: float = 1.0, realtime: bool = False,
                 buffer_chunks: int = 2, metrics: WorkerMetrics | None = None,
                 max_faulted_s: float = MAX_FAULTED_SECONDS,
                 max_faulted_sessions: int = MAX_FAULTED_SESSIONS) -> None:
        if not isinstance(max_faulted_s, int | float) or not max_faulted_s > 0:
            raise ValueError(f"max_faulted_s: expected seconds > 0, got {max_faulted_s!r}")
        if isinstance(max_faulted_sessions, bool) or not isinstance(max_faulted_sessions, int) \
                or max_faulted_sessions < 1:
            raise ValueError(f"max_faulted_sessions: expected an integer >= 1, got {max_faulted_sessions!r}")
        self.registry = registry
        self.flag_store = flags
        self.watcher = FlagWatcher(flags, info.pool)
        self.info = info
        # A ready runner, or a loader called by `run()` after registering (a worker loading weights for
        # minutes is registered, heartbeating and counted as `loading`, not dead).
        self._load = None if hasattr(runner, "step") else runner
        self.runner: SessionRunner = runner if self._load is None else None  # type: ignore[assignment]
        self.poll_s = poll_s
        self.stats_interval_s = stats_interval_s
        self.realtime = realtime
        self.buffer_chunks = buffer_chunks
        self.metrics = metrics
        self.max_faulted_s = float(max_faulted_s)
        self.max_faulted_sessions = max_faulted_sessions
        self._faulted_sessions = 0  # sessions in a row ended by the numerical-fault rule
        self.stop = threading.Event()
        self.chunk_log: deque[ChunkRecord] = deque(maxlen=100_000)
        self.sessions_done: list[SessionStats] = []
        self.reregistrations = 0
        self._lease_lock = threading.Lock()  # current session + register/finish must not interleave
        self._current: str | None = None
        self._lease_lost: str | None = None
        self._chunks_in_session = 0
        self._hb_thread: threading.Thread | None = None
        # While Redis is unreachable, the chunk loop skips its registry calls (each failed attempt costs a
        # connect + retry) and tries again every `redis_retry_s`, so an outage does not slow generation.
        self.redis_retry_s = 0.5
        self._redis_down_until = 0.0
        self._fatal: str | None = None  # the worker can no longer serve (a rank failed): why
        self.exit_code = 0  # EXIT_FAULT after a fatal failure

    @property
    def worker_id(self) -> str:
        return self.info.worker_id

    @property
    def pool(self) -> str:
        return self.info.pool

    # -- lifecycle -------------------------------------------------------------------------------
    def fail(self, reason: str) -> None:
        """The worker can no longer serve (e.g. one of its ranks died): end the current session with `reason` at
        its next boundary (or as soon as its step returns), release the lease, deregister, and stop."""
        if self._fatal is None:
            self._fatal = reason
            self.exit_code = EXIT_FAULT
            log.error("worker %s: %s; ending the session and stopping", self.worker_id, reason)
        self.stop.set()

    def abort(self, reason: str) -> None:
        """`fail`, from another thread, when the chunk loop cannot come back (blocked on a dead rank): report the
        current session Failed with `reason`, release its lease and deregister, here and now."""
        self.fail(reason)
        with self._lease_lock:
            session = self._current
        if session is not None:
            final = SessionStats(session_id=session, worker_id=self.worker_id, phase="Failed", end_reason=reason,
                                 chunks=self._chunks_in_session)
            try:
                with self._lease_lock:
                    self.registry.report_session(session, final)
                    self.registry.finish(self.pool, self.worker_id, session, reason)
                    self._current = None
            except RegistryUnavailable:
                log.error("worker %s: could not release session %s (redis unavailable)", self.worker_id, session)
        self._deregister(reason)

    def _deregister(self, reason: str) -> None:
        """Leave the registry; a worker stopping on a fault (`fail`) is counted in the pool's worker failures
        (once: the registry counts a worker only while it is still registered)."""
        try:
            self.registry.deregister(self.worker_id, self.pool, reason=reason, failed=self._fatal is not None)
        except RegistryUnavailable:
            log.warning("worker %s: could not deregister (redis unavailable); the reaper will", self.worker_id)

    def run(self) -> None:
        """Register (loading), start heartbeats, load the model, become warm, recover unacknowledged
        work, serve until stopped, deregister."""
        self.info = self.info.model_copy(update={"warm": False})
        self._retry("register", lambda: self.registry.register(self.info))
        self._hb_thread = threading.Thread(target=self._heartbeat_loop, name=f"heartbeat-{self.worker_id}",
                                           daemon=True)
        self._hb_thread.start()
        try:
            if self._load is not None:
                self.runner = self._load()
            with self._lease_lock:
                self.info = self.info.model_copy(update={"warm": True})
            self._retry("recover", self._recover)
            self._retry("set_warm", lambda: self.registry.set_warm(self.worker_id, self.pool))
            self.serve()
        finally:
            self.stop.set()
            self._hb_thread.join(timeout=5)
            self._deregister(self._fatal or "worker shut down")

    def _recover(self) -> None:
        n = self.registry.recover_unacked(self.worker_id)
        if n:
            log.warning("worker %s: requeued %d unacknowledged inbox message(s)", self.worker_id, n)
        held = self.registry.session_of(self.pool, self.worker_id)
        pending = {m.session_id for m in self.registry.pending(self.worker_id) if isinstance(m, Assignment)}
        if held and held not in pending:
            # We hold a lease for a session we are not running: a previous incarnation died mid-stream.
            self.registry.abandon(self.pool, self.worker_id, held, reason=f"worker {self.worker_id} restarted")
            log.error("worker %s: gave up session %s held by a previous incarnation", self.worker_id, held)

    def _retry(self, what: str, fn, backoff_s: float = 0.2, cap_s: float = 5.0):  # noqa: ANN001
        """Call `fn` until Redis answers; at least once, and no more retries once the worker is stopping."""
        while True:
            try:
                return fn()
            except RegistryUnavailable as exc:
                if self.stop.is_set():
                    log.warning("worker %s: %s failed (%s) while stopping; giving up", self.worker_id, what, exc)
                    return None
                log.warning("worker %s: %s failed (%s); retrying in %.1fs", self.worker_id, what, exc, backoff_s)
                self.stop.wait(backoff_s)
                backoff_s = min(cap_s, backoff_s * 2)

    def _heartbeat_loop(self) -> None:
        interval = self.registry.heartbeat_ttl_s / 3
        down = False
        while not self.stop.wait(interval):
            try:
                with self._lease_lock:
                    stats = {"session": self._current, "chunks": self._chunks_in_session}
                    if not self.registry.heartbeat(self.worker_id, self.pool, stats):
                        # the registry forgot us: Redis restarted empty, or we were reaped
                        kept = self.registry.register(self.info, session_id=self._current)
                        self.reregistrations += 1
                        log.warning("worker %s: re-registered (session %s %s)", self.worker_id, self._current,
                                    "kept" if kept else "LOST")
                        if self._current and not kept:
                            self._lease_lost = self.registry.lost_reason(self._current) or "held by another worker"
                if down:
                    log.warning("worker %s: redis is back", self.worker_id)
                down = False
            except RegistryUnavailable as exc:
                if not down:
                    log.error("worker %s: heartbeat failed, redis unavailable (%s); still streaming",
                              self.worker_id, exc)
                down = True

    # -- inbox -----------------------------------------------------------------------------------
    def serve(self) -> None:
        backoff = 0.2
        while not self.stop.is_set():
            try:
                self.runner.idle()
            except WorkerFault as exc:
                self.fail(str(exc))
                return
            try:
                msg = self.registry.next_message(self.worker_id, self.poll_s)
                backoff = 0.2
            except RegistryUnavailable:
                self.stop.wait(backoff)
                backoff = min(5.0, backoff * 2)
                continue
            if msg is None:
                continue
            if isinstance(msg, EndRequest):
                log.info("worker %s: end request for session %s, which is not running; ignored",
                         self.worker_id, msg.session_id)
                self._ack(msg)
                continue
            self._handle_assignment(msg)

    def _ack(self, msg: Assignment | EndRequest) -> None:
        try:
            self.registry.ack(self.worker_id, msg)
        except RegistryUnavailable:
            log.warning("worker %s: could not ack %s for %s (redis unavailable)", self.worker_id, msg.kind,
                        msg.session_id)

    def _handle_assignment(self, a: Assignment) -> None:
        if a.pool != self.pool:
            log.error("worker %s (pool %s): refused assignment of session %s for pool %s",
                      self.worker_id, self.pool, a.session_id, a.pool)
            self._ack(a)
            return
        try:
            holder = self.registry.session_of(self.pool, self.worker_id)
        except RegistryUnavailable:
            # Cannot check the lease now: put the assignment back and try again shortly.
            self._retry("recover", lambda: self.registry.recover_unacked(self.worker_id))
            return
        if holder != a.session_id:
            log.warning("worker %s: assignment for session %s is stale (lease is %s); dropped",
                        self.worker_id, a.session_id, holder)
            self._ack(a)
            return
        self.run_session(a)

    # -- one session -----------------------------------------------------------------------------
    def run_session(self, a: Assignment) -> SessionStats:
        """Stream session `a` to its end (module docstring): begin, then chunk by chunk `_next_chunk` until a stop,
        then end; returns the final SessionStats (also reported and kept in `sessions_done`)."""
        with self._lease_lock:
            self._current, self._lease_lost, self._chunks_in_session = a.session_id, None, 0
        try:
            flagset = self.watcher.current()
        except RegistryUnavailable:
            flagset = FlagSet(pool=self.pool, version=0)
        version, flags = flagset.version, flagset.with_overrides(a.flag_overrides)
        failed = self._begin(a, version, flags)
        if failed is not None:
            return failed
        now = time.monotonic()
        state = SessionState.begin(a, version, flags, chunk_s=self.runner.chunk_seconds,
                                   buffer_chunks=self.buffer_chunks, now=now)
        outcome = None
        while outcome is None:
            outcome = self._next_chunk(state)
        return self._end(state, outcome)

    def _begin(self, a: Assignment, version: int, flags: FlagValues) -> SessionStats | None:
        """Report the session Connecting and start it on the runner; the final stats when it could not start (the
        session fails alone; a WorkerFault also stops the worker), else None."""
        stats = SessionStats(session_id=a.session_id, worker_id=self.worker_id, phase="Connecting",
                             flag_version=version, flags=flags)
        self._report(stats)
        try:
            self.runner.begin(a, flags)
        except Exception as exc:  # noqa: BLE001 (a session that cannot start fails alone, not the worker)
            log.exception("worker %s: session %s could not start", self.worker_id, a.session_id)
            self._ack(a)
            if isinstance(exc, WorkerFault):
                self.fail(str(exc))
            # validated (model_copy(update=) is not): the phase is the enum, as every other report's
            failed = SessionStats.model_validate(stats.model_dump() | {"phase": "Failed", "end_reason": failure_reason(exc)})
            self._finish(a, failed, failed.end_reason or "")
            return failed
        self._ack(a)  # the session has started: the assignment is no longer at risk
        self._kernel_path(getattr(self.runner, "kernel_path", None), flags, version)
        log.info("worker %s: streaming session %s (flags v%d %s)", self.worker_id, a.session_id, version,
                 flags.model_dump())
        return None

    def _next_chunk(self, state: SessionState) -> SessionOutcome | None:
        """One chunk boundary and one chunk: stop? flags changed? step, account, faults, report. Returns the
        session's (phase, end reason) when it ends here, else None."""
        stop = self._stop(state)
        if stop is not None:
            return stop
        self._follow_flags(state)
        try:
            report = self.runner.step()
        except Exception as exc:  # noqa: BLE001
            return self._step_failed(state, exc)
        self._account(state, report)
        limit = self._fault_limit(state, report)
        if limit is not None:
            return limit
        now = time.monotonic()
        if now - state.last_report >= self.stats_interval_s or (state.faults.seen and report.numerical_fault):
            stats = self._stats(state, "Streaming", state.playout.account(), None)
            self._in_loop(lambda st=stats: self.registry.report_session(state.assignment.session_id, st), None)
            if self.metrics is not None:
                self.metrics.session_fps(state.assignment.session_id, stats.fps)
            state.last_report = now
        return None

    def _stop(self, state: SessionState) -> SessionOutcome | None:
        """At a chunk boundary: (phase, reason) when the session stops here (`_stop_reason`), else None. A lost
        lease (the operator has already marked it Failed and reclaimed the slot), a worker fault (a rank died) or
        shutting down (pod deleted, node drained) cut it short: Failed; any other stop ends it: Ended."""
        reason = self._stop_reason(state.assignment, time.monotonic() - state.started)
        if not reason:
            return None
        return SessionOutcome("Failed" if self._lease_lost or self._fatal or self.stop.is_set() else "Ended", reason)

    def _follow_flags(self, state: SessionState) -> None:
        """Apply the pool's flags to the runner when their version moved (between chunks; Redis down: keep them)."""
        changed = self._in_loop(lambda v=state.flag_version: self.watcher.changed_since(v), None)
        if changed is None:
            return
        a = state.assignment
        flags = changed.with_overrides(a.flag_overrides)
        log.info("worker %s: session %s flags v%d -> v%d %s at chunk boundary %d", self.worker_id, a.session_id,
                 state.flag_version, changed.version, flags.model_dump(), state.chunks)
        path = self.runner.apply_flags(flags)
        self._kernel_path(path, flags, changed.version)
        state.flag_version, state.flags = changed.version, flags

    def _step_failed(self, state: SessionState, exc: Exception) -> SessionOutcome:
        """(phase, reason) for a step that raised: `SessionEnded` ends the session; anything else fails it (a
        WorkerFault also stops the worker)."""
        a = state.assignment
        if isinstance(exc, SessionEnded):
            log.info("worker %s: session %s ended by its runner in chunk %d: %s", self.worker_id, a.session_id,
                     state.chunks, exc.reason)
            return SessionOutcome("Ended", exc.reason)
        log.error("worker %s: session %s failed in chunk %d", self.worker_id, a.session_id, state.chunks,
                  exc_info=exc)
        if isinstance(exc, WorkerFault):
            self.fail(str(exc))
        return SessionOutcome("Failed", failure_reason(exc))

    def _account(self, state: SessionState, report: ChunkReport) -> None:
        """Record a chunk done: the chunk log, its compute time, the playout estimate, the metrics; a real-time
        service then waits until the video made so far has played out."""
        a = state.assignment
        self.chunk_log.append(ChunkRecord(a.session_id, report.index, state.flag_version, state.flags))
        state.compute_ms.append(report.compute_ms)
        if self.metrics is not None:
            self.metrics.observe_chunk("diffuse", report.compute_ms / 1e3)
            self.metrics.observe_chunk("total", report.compute_ms / 1e3)  # no decode/publish stage here yet
            self.metrics.frames_published(a.session_id, report.frames)
            self.metrics.streamed_seconds(a.session_id, time.monotonic() - state.started)
        self._chunks_in_session = state.chunks
        done = time.monotonic()
        before, state.playout = state.playout, state.playout.after_chunk(report.frames, done)
        if state.playout.stalled(before) and self.metrics is not None:
            self.metrics.stall(a.session_id)
        if self.realtime:
            self.stop.wait(max(0.0, state.playout.ahead_s(done)))

    def _fault_limit(self, state: SessionState, report: ChunkReport) -> SessionOutcome | None:
        """Count the chunk's numerical fault; ("Failed", reason) once the faulted chunks in a row reach
        `max_faulted_s` of video, else None."""
        a = state.assignment
        first = not state.faults.seen
        state.faults = state.faults.after_chunk(report.numerical_fault)
        if not report.numerical_fault:
            return None
        if self.metrics is not None:
            self.metrics.numerical_fault()
        if first:
            log.error("worker %s: numerical fault (NaN/Inf) in session %s chunk %d", self.worker_id, a.session_id,
                      report.index)
        chunk_s = self.runner.chunk_seconds
        if not state.faults.over_limit(chunk_s, self.max_faulted_s):
            return None
        n = state.faults.in_a_row
        reason = (f"numerical fault: {n} chunks in a row with NaN/Inf latents ({state.faults.faulted_s(chunk_s):.1f} s "
                  "of video); the model does not recover on this worker")
        log.error("worker %s: session %s: %s", self.worker_id, a.session_id, reason)
        return SessionOutcome("Failed", reason)

    def _end(self, state: SessionState, outcome: SessionOutcome) -> SessionStats:
        """End the session on the runner, report its final stats (the pacer's frames and stalls when the runner
        has its count), release the lease, and count it toward the faulted-sessions rule."""
        a, (phase, reason) = state.assignment, outcome
        try:
            account = self.runner.end(reason)
        except Exception:  # noqa: BLE001
            log.exception("worker %s: runner.end failed for session %s", self.worker_id, a.session_id)
            account = None
        final = self._stats(state, phase, state.final_account(account), reason)
        self._finish(a, final, reason)
        self.sessions_done.append(final)
        if self.metrics is not None:
            self.metrics.session_ended(a.session_id)
        log.info("worker %s: session %s ended (%s): %d chunks, %.1f fps", self.worker_id, a.session_id, reason,
                 final.chunks, final.fps)
        # a session the fault rule ended is the only one that ends with the limit reached (reaching it ends one)
        fault_limit = state.faults.over_limit(self.runner.chunk_seconds, self.max_faulted_s)
        self._count_faulted_session(fault_limit, state.faults.finite)
        return final

    def _count_faulted_session(self, fault_limit: bool, finite: int) -> None:
        """After a session: one more in a row ended by the numerical-fault rule, or a finite chunk broke the run;
        at `max_faulted_sessions` the worker stops (`fail`)."""
        if fault_limit:
            self._faulted_sessions += 1
        elif finite:
            self._faulted_sessions = 0
        if self._faulted_sessions >= self.max_faulted_sessions:
            self.fail(f"numerical faults ended {self._faulted_sessions} sessions in a row: the model does not recover "
                      "on this worker; stopping so Kubernetes restarts it")

    def _in_loop(self, fn: Callable[[], T], default: T) -> T:
        """A registry call from the chunk loop: `default` while Redis is known to be down."""
        now = time.monotonic()
        if now < self._redis_down_until:
            return default
        try:
            return fn()
        except RegistryUnavailable:
            self._redis_down_until = now + self.redis_retry_s
            return default

    def _kernel_path(self, path: object, flags: FlagValues, version: int) -> None:
        """Report the path the runner said is in effect; the requested one only when it could not tell."""
        if not isinstance(path, str) or not path:
            path = (RowParallelPath.FUSED if flags.fusedGemmAllReduce else RowParallelPath.UNFUSED).value
        if self.metrics is not None:
            self.metrics.kernel_info(path, version)

    def _stop_reason(self, a: Assignment, elapsed: float) -> str:
        if self._fatal:
            return self._fatal
        if self.stop.is_set():
            return "worker shutting down"
        if self._lease_lost:
            return f"lease lost: {self._lease_lost}"
        ended = getattr(self.runner, "end_reason", None)  # the runner's side ended it (agent left, END_CALL)
        if ended:
            return str(ended)
        if elapsed >= a.max_duration_s:
            return MAX_DURATION_REASON
        msg = self._in_loop(lambda: self.registry.next_message(self.worker_id, 0), None)
        if msg is None:
            return ""
        if isinstance(msg, EndRequest) and msg.session_id == a.session_id:
            self._ack(msg)
            return msg.reason
        if isinstance(msg, Assignment) and msg.session_id == a.session_id:
            # The operator handed out this same session again (a retried assignment): the lease is this
            # worker's, and the session goes on. Acknowledged, not taken for a lost lease.
            self._ack(msg)
            log.warning("worker %s: repeated assignment of session %s, which it is streaming; acknowledged",
                        self.worker_id, a.session_id)
            return ""
        if isinstance(msg, Assignment):
            holder = self._in_loop(lambda: self.registry.session_of(self.pool, self.worker_id), a.session_id)
            if holder == msg.session_id:
                # The registry gave this worker to another session: our lease is gone (released by a delete
                # or an orphan sweep). Stop this one and serve the new one next instead of dropping it.
                self._in_loop(lambda: self.registry.recover_unacked(self.worker_id), 0)
                self._lease_lost = f"the worker was assigned session {msg.session_id}"
                return f"lease lost: {self._lease_lost}"
        self._ack(msg)
        log.error("worker %s: busy with session %s; dropped %s for session %s", self.worker_id, a.session_id,
                  msg.kind, msg.session_id)
        return ""

    def _stats(self, state: SessionState, phase: str, account: PlayoutAccount, reason: str | None) -> SessionStats:
        """The session's stats now: fps = frames over the seconds since the playout clock's start."""
        elapsed = max(1e-9, time.monotonic() - state.playout.start)
        p99 = float(np.percentile(state.compute_ms, 99)) if state.compute_ms else 0.0
        return SessionStats(session_id=state.assignment.session_id, worker_id=self.worker_id,
                            phase=phase,  # type: ignore[arg-type]
                            fps=account.frames_published / elapsed, stalls=account.stalls, chunk_p99_ms=p99,
                            chunks=state.chunks, streamed_s=state.chunks * self.runner.chunk_seconds,
                            end_reason=reason, numerical_fault=state.faults.seen, flag_version=state.flag_version,
                            flags=state.flags)

    def _report(self, stats: SessionStats) -> None:
        try:
            self.registry.report_session(stats.session_id, stats)
        except RegistryUnavailable:
            log.debug("worker %s: stats for %s not reported (redis unavailable)", self.worker_id, stats.session_id)

    def _finish(self, a: Assignment, final: SessionStats, reason: str) -> None:
        """Final stats + lease release; waits for Redis if it is down (until the worker stops)."""

        def attempt() -> bool:
            with self._lease_lock:
                self.registry.report_session(a.session_id, final)
                self.registry.finish(self.pool, self.worker_id, a.session_id, reason)
                self._current = None
            return True

        if self._retry("finish", attempt) is None:
            with self._lease_lock:
                self._current = None
            log.error("worker %s: stopped before session %s's end could be recorded", self.worker_id, a.session_id)
