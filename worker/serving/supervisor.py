"""Rank 0's watch over the ranks it spawned: start them, know when they are ready, and end everything the moment
one of them dies or raises — never a hang (docs/multi_gpu.md).

The watchdog thread waits on the children's process sentinels and the status queue together, so a death is
seen within `poll_s` (0.2 s). A rank's own report (`("error", rank, text)`, sent before it exits) becomes the
reason; otherwise the exit status does ("rank 2 (decoder, cpu) pid 4242 died: killed by signal 9 (SIGKILL)").
On the first failure the supervisor kills every other child (so rank 0's pending collectives fail at once
instead of waiting for their timeout) and calls `on_failure(reason)`: the worker service ends the session
with that reason, releases the lease and stops (the worker exits non-zero, so its pod restarts and the ranks
are formed again). If rank 0's main thread has not finished that within `grace_s` (a collective that does not
notice its dead peer), `on_stuck(reason)` runs on the watchdog thread (the service ends the session from there)
and the process exits with EXIT_FAULT.

Session-level errors a rank reports without dying (`("session_error", rank, session, text)`, e.g. the decoder
rank's sink failed) are queued for rank 0's runner, which ends that session and keeps serving; so are the
decoder rank's LiveKit room events (`("room", rank, session, event)`, vivant.worker.serving.livekit_avatar).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import queue
import signal
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import wait

from vivant.worker.serving.rank_main import child_main
from vivant.worker.serving.ranks import RankSpec
from vivant.worker.serving.runner import EXIT_FAULT, WorkerFault

log = logging.getLogger(__name__)


def describe_exit(code: int | None) -> str:
    if code is None:
        return "is running"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = "unknown signal"
        return f"killed by signal {-code} ({name})"
    return f"exited with status {code}"


class RankFailure(WorkerFault):
    """A rank died or raised: the session ends with this reason and the worker stops."""


class Supervisor:
    def __init__(self, spec: RankSpec, *, poll_s: float = 0.2, grace_s: float = 5.0) -> None:
        self.spec, self.layout = spec, spec.layout
        self.poll_s, self.grace_s = poll_s, grace_s
        ctx = mp.get_context("spawn")
        self.status = ctx.Queue()
        self.procs = {r: ctx.Process(target=child_main, args=(r, spec, self.status), name=f"vivant-rank{r}",
                                     daemon=True) for r in range(1, self.layout.world_size)}
        self.ready: dict[int, int] = {}  # rank → pid
        self.session_errors: queue.Queue = queue.Queue()  # (rank, session, text)
        self.room_events: queue.Queue = queue.Queue()  # (session, event): the decoder rank's LiveKit room
        self.failure: str | None = None
        self.failed = threading.Event()
        self.released = threading.Event()  # set by the worker once the failed session is ended and released
        self.on_failure: Callable[[str], None] | None = None
        self.on_stuck: Callable[[str], None] | None = None
        self._lock = threading.Lock()
        self._stopping = False
        self._thread: threading.Thread | None = None

    # ---- lifecycle --------------------------------------------------------------------------------------
    def start(self) -> None:
        for r, p in self.procs.items():
            p.start()
            log.info("%s started: pid %d", self.layout.describe(r), p.pid)
        self._thread = threading.Thread(target=self._watch, name="vivant-rank-watchdog", daemon=True)
        self._thread.start()

    def wait_ready(self, timeout_s: float) -> None:
        """Until every spawned rank reported ready; RankFailure when one failed first or the time ran out."""
        deadline = time.monotonic() + timeout_s
        while len(self.ready) < len(self.procs):
            if self.failed.wait(0.1):
                raise RankFailure(self.failure)
            if time.monotonic() > deadline:
                missing = sorted(set(self.procs) - set(self.ready))
                self.fail(f"ranks {missing} not ready within {timeout_s:.0f}s")
                raise RankFailure(self.failure)

    def pids(self) -> dict[int, int]:
        return {r: p.pid for r, p in self.procs.items()}

    def stop(self, timeout_s: float = 10.0) -> None:
        """After SHUTDOWN was sent: wait for the ranks to exit, kill what is left."""
        self._stopping = True
        deadline = time.monotonic() + timeout_s
        for p in self.procs.values():
            p.join(max(0.0, deadline - time.monotonic()))
        self._kill_all()

    # ---- failures ---------------------------------------------------------------------------------------
    def fail(self, reason: str) -> None:
        """Record the first failure, kill every child, tell the worker, and watch that it lets go in time."""
        with self._lock:
            if self.failure is not None:
                return
            self.failure = reason
        log.error("rank failure: %s", reason)
        self.failed.set()
        self._kill_all()
        if self.on_failure is not None:
            self.on_failure(reason)
        threading.Thread(target=self._escalate, args=(reason,), name="vivant-rank-escalate", daemon=True).start()

    def failure_within(self, seconds: float) -> str | None:
        """The failure, waiting up to `seconds` for the watchdog to find it (after a collective raised)."""
        self.failed.wait(seconds)
        return self.failure

    def _escalate(self, reason: str) -> None:
        if self.released.wait(self.grace_s):
            return
        log.error("rank 0 did not end the session within %.0fs of the failure; ending it from the watchdog",
                  self.grace_s)
        try:
            if self.on_stuck is not None:
                self.on_stuck(reason)
        finally:
            os._exit(EXIT_FAULT)

    def _kill_all(self) -> None:
        for p in self.procs.values():
            if p.is_alive():
                p.kill()
        for p in self.procs.values():
            p.join(5)

    # ---- the watchdog -----------------------------------------------------------------------------------
    def _drain(self) -> None:
        while True:
            try:
                msg = self.status.get_nowait()
            except queue.Empty:
                return
            kind, rank = msg[0], msg[1]
            if kind == "ready":
                self.ready[rank] = msg[2]
                log.info("%s ready", self.layout.describe(rank))
            elif kind == "error":
                self.fail(f"{self.layout.describe(rank)} raised {msg[2]}")
            elif kind == "session_error":
                self.session_errors.put((rank, msg[2], msg[3]))
            elif kind == "room":
                self.room_events.put((msg[2], msg[3]))
            else:
                log.warning("unknown status from rank %s: %r", rank, msg)

    def _watch(self) -> None:
        sentinels = {p.sentinel: r for r, p in self.procs.items()}
        reader = self.status._reader  # noqa: SLF001 (the queue's pipe: woken by a message as by a death)
        while not self._stopping and self.failure is None:
            wait([*sentinels, reader], timeout=self.poll_s)
            self._drain()
            if self._stopping or self.failure is not None:
                return
            for r, p in self.procs.items():
                if not p.is_alive():
                    time.sleep(0.05)  # a rank that raised has put its report on the queue before exiting
                    self._drain()
                    self.fail(f"{self.layout.describe(r)} pid {p.pid} died: {describe_exit(p.exitcode)}")
                    return
