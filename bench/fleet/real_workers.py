"""The fleet benchmark's workers as real `WorkerService`s with a null engine (`sim_workers --real-workers`).

Every worker pod gets the worker's own serving loop (`vivant.worker.serving.service.WorkerService`: its
registration, heartbeat thread, inbox rules, chunk loop, pacing and lease release), with `NullRunner` where
the model would be: it joins "the room" in `connect_s` and makes each chunk at once, and the service's
real-time pacing spaces the chunks at 24 fps. So whatever the operator sends, a real worker answers it: an
assignment repeated to the worker streaming it, one that reaches a busy worker, a lease that moved.

What it costs, and so when to use it: two threads and one blocked Redis connection per worker, and per
streaming worker a few registry calls per chunk (6 chunks/s), all in one Python process; a few hundred
workers fit beside the control plane on a small machine, a thousand do not (the asyncio simulation in
`sim_workers.py` follows the same inbox rules at a fraction of the cost).

Counts for the status file come from what the services did (their finished sessions) and from their log
lines (a repeated assignment acknowledged, an assignment dropped while busy, a stale one dropped).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from typing import Any

from vivant.apis.feature_flags import FlagValues
from vivant.bench.fleet import redis_count
from vivant.sessions.flags import FlagStore
from vivant.sessions.models import Assignment, SessionStats, WorkerInfo
from vivant.sessions.registry import Registry
from vivant.worker.serving.runner import ChunkReport
from vivant.worker.serving.service import WorkerService

SERVICE_LOGGER = "vivant.worker.serving.service"
# the service's log lines that count something for the status file: (text in the line, counter)
LOG_COUNTS = (("repeated assignment of session", "repeated_assignments"),
              ("; dropped assign for session", "assignments_while_busy"),
              ("is stale (lease is", "stale_assignments"))


class NullRunner:
    """A SessionRunner with no model: `begin` takes `connect_s` (joining the room), `step` returns a chunk of
    4 frames at once. Tells the fleet when a session starts and ends on this worker (double-assignment check)."""

    frames_per_chunk = 4
    chunk_seconds = 4 / 24

    def __init__(self, fleet: RealFleet, worker_id: str, connect_s: float) -> None:
        self.fleet, self.worker_id, self.connect_s = fleet, worker_id, connect_s
        self.session: str | None = None
        self._n = 0

    def begin(self, assignment: Assignment, flags: FlagValues) -> None:
        time.sleep(self.connect_s)
        self.session, self._n = assignment.session_id, 0
        self.fleet.started(assignment.session_id, self.worker_id)

    def idle(self) -> None:
        pass

    def apply_flags(self, flags: FlagValues) -> None:
        return None

    def step(self) -> ChunkReport:
        self._n += 1
        return ChunkReport(index=self._n - 1, compute_ms=0.0, frames=self.frames_per_chunk)

    def end(self, reason: str) -> None:
        if self.session is not None:
            self.fleet.ended(self.session, self.worker_id)
        self.session = None


class _StreamingClock(Registry):
    """The registry client of one worker; notes when each session is first reported Streaming."""

    fleet: RealFleet

    def report_session(self, session_id: str, stats: SessionStats) -> None:
        super().report_session(session_id, stats)
        if stats.phase == "Streaming":
            self.fleet.streaming_at.setdefault(session_id, time.time())


class _LogCounter(logging.Handler):
    def __init__(self, counters: Counter[str], lock: threading.Lock) -> None:
        super().__init__(level=logging.WARNING)
        self.counters, self.counters_lock = counters, lock  # not `lock`: logging.Handler's own

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        for needle, name in LOG_COUNTS:
            if needle in text:
                with self.counters_lock:
                    self.counters[name] += 1


class RealFleet:
    """One real WorkerService per worker pod, each in its own thread (pods come from `pod_event`)."""

    def __init__(self, redis_url: str, timing: Any, heartbeat_ttl_s: float) -> None:
        self.redis_url, self.timing, self.heartbeat_ttl_s = redis_url, timing, heartbeat_ttl_s
        self.services: dict[str, WorkerService] = {}
        self.threads: dict[str, threading.Thread] = {}
        self.active: dict[str, str] = {}  # session id -> worker streaming it
        self.counters: Counter[str] = Counter()
        self.streaming_at: dict[str, float] = {}
        self.double: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._log = _LogCounter(self.counters, self._lock)
        logging.getLogger(SERVICE_LOGGER).addHandler(self._log)  # the lines counted are warnings and errors

    def pod_event(self, kind: str, pod: dict[str, Any]) -> None:
        meta, spec, status = pod["metadata"], pod.get("spec") or {}, pod.get("status") or {}
        name = meta["name"]
        if kind == "DELETED" or meta.get("deletionTimestamp"):
            service = self.services.pop(name, None)
            if service is not None:
                service.stop.set()
            return
        if name in self.services or status.get("phase") != "Running" or not spec.get("nodeName"):
            return
        env = {e["name"]: e.get("value") for c in spec.get("containers", []) for e in c.get("env", [])}
        pool = env.get("VIVANT_POOL")
        if not pool:
            return
        registry = _StreamingClock(self.redis_url, heartbeat_ttl_s=self.heartbeat_ttl_s)
        registry.fleet = self
        t = self.timing

        def load() -> NullRunner:
            time.sleep(t.warmup_s)  # model load + graph capture
            return NullRunner(self, name, t.connect_s)

        service = WorkerService(registry, FlagStore(registry.redis),
                                WorkerInfo(worker_id=name, pool=pool, node=spec["nodeName"], model_preset="57b"),
                                load, poll_s=1.0, stats_interval_s=t.stats_interval_s, realtime=True)
        self.services[name] = service
        self.threads[name] = thread = threading.Thread(target=service.run, name=f"worker-{name}", daemon=True)
        thread.start()

    def wake(self, worker_id: str) -> None:
        """Real workers wait on their inbox themselves (BLMOVE): nothing to wake."""

    def started(self, session: str, worker: str) -> None:
        with self._lock:
            other = self.active.get(session)
            if other is not None and other != worker:
                self.counters["double_assignments"] += 1
                self.double.append({"session": session, "workers": [other, worker], "at": time.time(),
                                    "kind": "session-on-two-workers"})
            self.active[session] = worker
            self.counters["assignments"] += 1

    def ended(self, session: str, worker: str) -> None:
        with self._lock:
            if self.active.get(session) == worker:
                del self.active[session]

    def stop_all(self, timeout_s: float = 10.0) -> None:
        for service in self.services.values():
            service.stop.set()
        deadline = time.monotonic() + timeout_s
        for thread in self.threads.values():
            thread.join(timeout=max(0.0, deadline - time.monotonic()))

    def snapshot(self, final: bool = False) -> dict[str, Any]:
        states: Counter[str] = Counter()
        done: Counter[str] = Counter()
        lost = 0
        for service in list(self.services.values()):
            states["starting" if not service.info.warm else "busy" if service.runner.session else "idle"] += 1
            for s in list(service.sessions_done):
                done[f"sessions_{s.phase.value.lower()}"] += 1
                lost += bool(s.end_reason and s.end_reason.startswith("lease lost"))
        with self._lock:
            counters = {**self.counters, **done, "lease_lost": lost}
            out: dict[str, Any] = {
                "at": time.time(), "workers": len(self.services), "states": dict(states),
                "active_sessions": len(self.active), "counters": counters, "registry_calls": {},
                "redis_commands": redis_count.counts(), "double_assignments": list(self.double),
                "mode": "real WorkerService, null engine",
            }
            if final:
                out["streaming_at"] = dict(self.streaming_at)
        return out
