"""Nothing lost when Redis fails: a real redis-server killed and restarted (persisted, and empty) mid-stream.

What runs: real `WorkerService`s (the worker's loop, heartbeat thread and registry calls; a small runner in
place of the model, which is tested elsewhere) and the operator's own decisions (`operator/reconcile.py`:
assign, progress, reap through `pool_scale`, the orphan-lease sweep) called in a loop the way kopf's
handlers and timers call them, with the operator's default heartbeat TTL (10 s) and reap grace (30 s).
Only kopf's glue is left out: these tests are about Redis, and the cluster tests cover the glue.

Figures (docs/reliability.md): an outage of 12 s (longer than the heartbeat TTL: fact 6 of issue 15),
outages of 5 s and 30 s, and a restart with no data; in each, sessions lost (a session marked Failed)
and double assignments (a session streamed by two workers, or a lease on two) must both be 0.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import polling
import pytest
from servers import RedisServer
from vivant.apis import resources
from vivant.apis.livekit_token import LiveKitCredentials
from vivant.operator import reconcile as rc
from vivant.operator.config import OperatorConfig
from vivant.sessions.flags import FlagStore
from vivant.sessions.models import Assignment, WorkerInfo
from vivant.sessions.registry import Registry, RegistryUnavailable
from vivant.worker.serving.runner import ChunkReport
from vivant.worker.serving.service import WorkerService

NS, POOL_NAME = "ns", "p"
POOL = resources.pool_key(NS, POOL_NAME)
DEFAULTS = OperatorConfig(redis_url="redis://unused", livekit=LiveKitCredentials("APIkey123", "x" * 32))
TTL, GRACE = DEFAULTS.heartbeat_ttl_s, DEFAULTS.reap_grace_s
POOL_SPEC = resources.WorkerPoolSpec.model_validate({
    "model": {"preset": "tiny", "checkpoint": "random://tiny"}, "image": "vivant:dev", "minIdle": 8, "maxWorkers": 8})  # no idle worker is drained
TIMEOUTS = rc.Timeouts(pending_s=300, connect_s=60)


def spec() -> resources.CharacterSessionSpec:
    return resources.CharacterSessionSpec.model_validate({
        "character": "ada-v1", "pool": POOL_NAME, "maxDurationSeconds": 3600,
        "livekit": {"url": "wss://lk.example.com", "room": "room", "agentIdentity": "agent-1"}})


class Runner:
    """Streams forever, one chunk per 50 ms (the model is tested elsewhere)."""

    frames_per_chunk, chunk_seconds = 4, 4 / 24

    def __init__(self) -> None:
        self.n = 0

    def idle(self) -> None:
        pass

    def begin(self, assignment: Assignment, flags: Any) -> None:
        self.n = 0

    def apply_flags(self, flags: Any) -> None:
        return None

    def step(self) -> ChunkReport:
        time.sleep(0.05)
        self.n += 1
        return ChunkReport(index=self.n - 1, compute_ms=50.0, frames=self.frames_per_chunk)

    def end(self, reason: str) -> None:
        pass


class Fleet:
    """Workers + the operator's decision loop on one Redis; records every phase and every double assignment."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.registry = Registry(url, heartbeat_ttl_s=TTL, reap_grace_s=GRACE)  # the operator's client
        self.workers: dict[str, WorkerService] = {}
        self.threads: list[threading.Thread] = []
        self.sessions: dict[str, dict[str, Any]] = {}  # name -> status
        self.refs: dict[str, rc.SessionRef] = {}
        self.failed: list[tuple[str, str]] = []  # (session, message) of every Failed decision
        self.doubles: list[str] = []
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.loop = threading.Thread(target=self._operator, daemon=True)
        self.loop.start()

    def add_worker(self) -> str:
        wid = f"{POOL_NAME}-{len(self.workers)}"
        reg = Registry(self.url, heartbeat_ttl_s=TTL)
        svc = WorkerService(reg, FlagStore(reg.redis), WorkerInfo(worker_id=wid, pool=POOL, warm=True), Runner(),
                            poll_s=0.2, stats_interval_s=0.2)
        t = threading.Thread(target=svc.run, daemon=True)
        t.start()
        self.workers[wid], self.threads = svc, [*self.threads, t]
        wait_for(f"worker {wid} idle", lambda: wid in self.registry.idle_workers(POOL))
        return wid

    def add_session(self, name: str) -> None:
        with self.lock:
            self.refs[name] = rc.SessionRef(namespace=NS, name=name, uid=f"uid-{name}", created=datetime.now(tz=UTC))
            self.sessions[name] = {}

    def phase(self, name: str) -> str | None:
        return self.sessions[name].get("phase")

    def streaming_on(self, name: str) -> list[str]:
        return [w for w, svc in self.workers.items() if svc._current == f"{NS}/{name}"]

    def _operator(self) -> None:
        tick = 0
        while not self.stop.wait(0.2):
            tick += 1
            try:
                with self.lock:
                    for name, status in self.sessions.items():
                        now = datetime.now(tz=UTC)
                        if status.get("phase") in (None, "Pending"):
                            out = rc.assign_session(self.refs[name], spec(), status, registry=self.registry,
                                                    credentials=DEFAULTS.livekit, apply_secret=lambda s: None,
                                                    timeouts=TIMEOUTS, now=now)
                        else:
                            out = rc.progress_session(self.refs[name], spec(), status, registry=self.registry,
                                                      timeouts=TIMEOUTS, now=now)
                        status.update(out.status)
                        if out.status.get("phase") == "Failed":
                            self.failed.append((name, out.status.get("message") or ""))
                    live = {f"{NS}/{n}" for n, st in self.sessions.items() if st.get("phase") not in ("Ended", "Failed")}
                rc.pool_scale(POOL_NAME, NS, POOL_SPEC, len(self.workers), registry=self.registry)
                rc.release_orphan_leases(POOL, self.registry, live)
            except RegistryUnavailable:
                pass  # kopf retries; so does this loop
            holders: dict[str, list[str]] = {}
            for wid, svc in self.workers.items():
                if svc._current:
                    holders.setdefault(svc._current, []).append(wid)
            self.doubles += [f"{s} on {ws}" for s, ws in holders.items() if len(ws) > 1]

    def close(self) -> None:
        self.stop.set()
        for svc in self.workers.values():
            svc.stop.set()
        for t in [self.loop, *self.threads]:
            t.join(timeout=10)


def wait_for(what: str, cond: Callable[[], object], timeout: float = 30.0) -> object:
    return polling.wait_for(what, cond, timeout, retry_on=(RegistryUnavailable,))


@pytest.fixture
def server(tmp_path: Path) -> Iterator[RedisServer]:
    """A redis-server of our own, persisted (an append-only file), so an outage can keep or lose its data."""
    s = RedisServer(data_dir=tmp_path / "redis")
    yield s
    s.stop()


@pytest.fixture
def fleet(server: RedisServer) -> Iterator[Fleet]:
    f = Fleet(server.url)
    yield f
    f.close()


def streaming(fleet: Fleet, names: list[str]) -> dict[str, str]:
    """Wait until every session streams; name -> its worker."""
    for n in names:
        try:
            wait_for(f"{n} Streaming", lambda n=n: fleet.phase(n) == "Streaming" and len(fleet.streaming_on(n)) == 1)
        except AssertionError as exc:
            state = {"status": fleet.sessions[n], "leases": fleet.registry.leases(POOL),
                     "idle": fleet.registry.idle_workers(POOL), "failed": fleet.failed,
                     "streaming": {w: svc._current for w, svc in fleet.workers.items()}}
            raise AssertionError(f"{exc}; {state}") from None
    return {n: fleet.sessions[n]["worker"] for n in names}


def outage(server: RedisServer, seconds: float, *, empty: bool = False) -> None:
    """Kill redis-server (SIGKILL, a crash), wait `seconds`, start it again with its data or without."""
    server.stop(kill=True)
    time.sleep(seconds)
    server.start(empty=empty)


def assert_nothing_lost(fleet: Fleet, placed: dict[str, str], watch_s: float) -> None:
    """For `watch_s` after Redis is back: every session streams on the worker it had, its lease is there."""
    end = time.monotonic() + watch_s
    while time.monotonic() < end:
        assert not fleet.failed, f"sessions lost: {fleet.failed}"
        time.sleep(0.2)
    for name, worker in placed.items():
        assert fleet.phase(name) == "Streaming", (name, fleet.sessions[name])
        assert fleet.streaming_on(name) == [worker], (name, fleet.streaming_on(name), worker)
        wait_for(f"{name}'s lease on {worker}", lambda n=name, w=worker: fleet.registry.worker_of(f"{NS}/{n}") == w, 15)
    assert not fleet.doubles, f"double assignments: {fleet.doubles[:5]}"


@pytest.mark.timeout(120)
def test_outage_longer_than_the_heartbeat_ttl_loses_no_session(server: RedisServer, fleet: Fleet) -> None:
    """Fact 6 of issue 15: an outage longer than the heartbeat TTL let the reaper fail healthy sessions
    (their heartbeat keys had expired) before the workers' next heartbeat."""
    for _ in range(2):
        fleet.add_worker()
    for n in ("a", "b"):
        fleet.add_session(n)
    placed = streaming(fleet, ["a", "b"])
    outage(server, TTL + 2)
    assert_nothing_lost(fleet, placed, watch_s=TTL + 2)


@pytest.mark.timeout(180)
def test_outages_of_5_and_30_seconds_lose_no_session(server: RedisServer, fleet: Fleet) -> None:
    for _ in range(2):
        fleet.add_worker()
    for n in ("a", "b"):
        fleet.add_session(n)
    placed = streaming(fleet, ["a", "b"])
    for seconds in (5.0, GRACE):
        outage(server, seconds)
        assert_nothing_lost(fleet, placed, watch_s=TTL)


@pytest.mark.timeout(120)
def test_empty_restart_is_rebuilt_from_workers_and_crs_without_double_assignment(server: RedisServer,
                                                                                 fleet: Fleet) -> None:
    """Fact 7 of issue 15, first half: after Redis restarted empty a streaming session was marked Failed
    (LeaseLost) while its worker went on streaming it. Here the leases come back from the workers (they
    re-register with what they stream) and from the sessions' status (the operator restores the lease it
    names), and a new session goes to the idle worker, never to a busy one."""
    for _ in range(2):
        fleet.add_worker()
    for n in ("a", "b"):
        fleet.add_session(n)
    placed = streaming(fleet, ["a", "b"])
    outage(server, 1.0, empty=True)
    assert_nothing_lost(fleet, placed, watch_s=TTL)
    idle = fleet.add_worker()
    fleet.add_session("c")
    assert streaming(fleet, ["c"]) == {"c": idle}
    assert_nothing_lost(fleet, placed, watch_s=1)


@pytest.mark.timeout(120)
def test_deleting_a_terminal_session_stops_its_worker_which_then_serves_the_next(server: RedisServer,
                                                                               fleet: Fleet) -> None:
    """Fact 7, second half: a session whose phase was already terminal (e.g. marked Failed while its worker
    streamed on) was deleted without an end request, so it kept streaming; the worker, freed in Redis, was
    handed the next session and dropped it."""
    worker = fleet.add_worker()
    fleet.add_session("a")
    streaming(fleet, ["a"])
    with fleet.lock:  # the state the old LeaseLost decision left: Failed, worker still streaming
        status = fleet.sessions.pop("a")
        status["phase"] = "Failed"
    step = rc.release_session(fleet.refs["a"], spec(), status, registry=fleet.registry, end_sent_at=None,
                              now=datetime.now(tz=UTC), grace_s=15)
    assert step.end_sent, step
    wait_for("the worker stops the deleted session", lambda: not fleet.streaming_on("a"), 10)
    fleet.add_session("d")
    assert streaming(fleet, ["d"]) == {"d": worker}
    assert not fleet.failed and not fleet.doubles, (fleet.failed, fleet.doubles)
