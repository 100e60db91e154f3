"""Registry leases against a real redis-server: atomic claims under concurrency, release, drain, reap.

Concurrent claimers are threads in this process plus separate OS processes (lease_claimer.py), all
against the same real Redis; a worker held by two sessions at once would show as overlapping
[claimed, releasing] intervals of one worker.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path

import pytest
from lease_claimer import claim_cycles
from vivant.sessions.models import WorkerInfo
from vivant.sessions.registry import Registry, RegistryUnavailable, SessionConflict

POOL = "gpu-a"


def warm(worker_id: str, pool: str = POOL) -> WorkerInfo:
    return WorkerInfo(worker_id=worker_id, pool=pool, node="node-1", model_preset="tiny", warm=True)


@pytest.fixture
def registry(redis_url: str) -> Registry:
    reg = Registry(redis_url, heartbeat_ttl_s=120)
    yield reg
    reg.close()


def overlaps(intervals: list[list]) -> list[str]:
    by_worker: dict[str, list[list]] = defaultdict(list)
    for iv in intervals:
        by_worker[iv[0]].append(iv)
    found = []
    for worker, ivs in by_worker.items():
        ivs.sort(key=lambda iv: iv[2])
        for a, b in zip(ivs, ivs[1:], strict=False):
            if b[2] < a[3]:
                found.append(f"{worker}: {a[1]} [{a[2]:.6f}, {a[3]:.6f}] overlaps {b[1]} [{b[2]:.6f}, {b[3]:.6f}]")
    return found


class TestConcurrentClaims:
    def test_1000_cycles_threads_and_processes_no_double_assignment_no_leak(self, registry: Registry, redis_url: str):
        workers = [f"w{i}" for i in range(4)]
        for w in workers:
            assert registry.register(warm(w))
        helper = Path(__file__).with_name("lease_claimer.py")
        # 2 processes x 2 threads x 125 cycles + 4 threads here x 125 cycles = 1,000 cycles
        procs = [
            subprocess.Popen([sys.executable, str(helper), redis_url, POOL, f"proc{p}", "250", "2"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for p in range(2)
        ]
        results: list[tuple[list, list]] = []
        lock = threading.Lock()
        held_now: dict[str, str] = {}
        doubles: list[str] = []

        def claimer(k: int) -> None:
            # in-process exact check on top of the interval check: a worker claimed while a thread here holds it
            intervals, errors = [], []
            i = 0
            while len(intervals) < 125:
                session = f"thread{k}-{i}"
                i += 1
                w = registry.claim_idle_worker(POOL, session)
                if w is None:
                    time.sleep(0.0005)
                    continue
                with lock:
                    if w in held_now:
                        doubles.append(f"{w} claimed for {session} while held for {held_now[w]}")
                    held_now[w] = session
                t1 = time.monotonic()
                if registry.session_of(POOL, w) != session:
                    errors.append(f"{w} should hold {session}")
                t2 = time.monotonic()
                intervals.append([w, session, t1, t2])
                with lock:
                    del held_now[w]
                if not registry.release(POOL, w, session):
                    errors.append(f"release {w}/{session} refused")
            with lock:
                results.append((intervals, errors))

        threads = [threading.Thread(target=claimer, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for p in procs:
            out, err = p.communicate(timeout=120)
            assert p.returncode == 0, f"claimer process failed: {err}"
            body = json.loads(out)
            results.append((body["intervals"], body["errors"]))

        intervals = [iv for r in results for iv in r[0]]
        errors = [e for r in results for e in r[1]]
        assert len(intervals) == 1000, f"expected 1000 completed cycles, got {len(intervals)}"
        assert len({iv[1] for iv in intervals}) == 1000, "a session id was completed twice"
        assert doubles == [], f"double assignments seen in-process: {doubles[:10]}"
        double = overlaps(intervals)
        assert double == [], f"{len(double)} double assignment(s): {double[:10]}"
        assert errors == [], f"{len(errors)} anomalies: {errors[:10]}"
        counts = registry.pool_counts(POOL)
        leaked = {w: registry.session_of(POOL, w) for w in workers if registry.session_of(POOL, w)}
        assert leaked == {}, f"workers still leased after all releases: {leaked}"
        assert (counts.idle, counts.busy, counts.registered) == (4, 0, 4), f"pool not back to 4 idle: {counts}"
        assert registry.idle_workers(POOL) == workers
        assert registry.redis.hlen("vivant:session_worker") == 0, "session->worker entries leaked"


class TestClaimRelease:
    def test_claim_is_idempotent_and_a_worker_never_holds_two_sessions(self, registry: Registry):
        registry.register(warm("w0"))
        registry.register(warm("w1"))
        a = registry.claim_idle_worker(POOL, "ns/s1")
        assert registry.claim_idle_worker(POOL, "ns/s1") == a, "second claim for one session gave another worker"
        b = registry.claim_idle_worker(POOL, "ns/s2")
        assert {a, b} == {"w0", "w1"}
        assert registry.claim_idle_worker(POOL, "ns/s3") is None, "claimed a third session with 2 workers"
        assert registry.pool_counts(POOL).busy == 2

    def test_release_only_by_the_holder(self, registry: Registry):
        registry.register(warm("w0"))
        w = registry.claim_idle_worker(POOL, "s1")
        assert registry.release(POOL, w, "other-session") is False
        assert registry.session_of(POOL, w) == "s1", "a release for another session freed the lease"
        assert registry.release(POOL, w, "s1") is True
        assert registry.worker_of("s1") is None
        assert registry.idle_workers(POOL) == ["w0"]

    def test_loading_workers_are_not_claimable_until_warm(self, registry: Registry):
        registry.register(WorkerInfo(worker_id="w0", pool=POOL, warm=False))
        assert registry.claim_idle_worker(POOL, "s1") is None
        c = registry.pool_counts(POOL)
        assert (c.registered, c.loading, c.idle) == (1, 1, 0), c
        assert registry.set_warm("w0", POOL)
        assert registry.claim_idle_worker(POOL, "s1") == "w0"

    def test_session_held_in_another_pool_is_a_conflict(self, registry: Registry):
        registry.register(warm("a0", pool="pool-a"))
        registry.register(warm("b0", pool="pool-b"))
        assert registry.claim_idle_worker("pool-a", "s1") == "a0"
        with pytest.raises(SessionConflict, match="a0 of pool pool-a"):
            registry.claim_idle_worker("pool-b", "s1")
        assert registry.idle_workers("pool-b") == ["b0"], "the conflicting claim took a worker"

    def test_draining_workers_take_no_new_session_and_do_not_return_to_idle(self, registry: Registry):
        for w in ("w0", "w1"):
            registry.register(warm(w))
        busy = registry.claim_idle_worker(POOL, "s1")
        assert registry.set_draining(POOL, ["w0", "w1"]) == 2
        assert registry.claim_idle_worker(POOL, "s2") is None, "a draining worker was claimed"
        assert registry.release(POOL, busy, "s1")
        c = registry.pool_counts(POOL)
        assert (c.idle, c.busy, c.draining) == (0, 0, 2), c

    def test_reregistration_after_redis_lost_everything_restores_the_lease(self, registry: Registry):
        registry.register(warm("w0"))
        assert registry.claim_idle_worker(POOL, "s1") == "w0"
        registry.redis.flushall()  # Redis restarted without persistence
        assert registry.heartbeat("w0", POOL) is False, "heartbeat of an unknown worker should ask to re-register"
        assert registry.register(warm("w0"), session_id="s1") is True
        assert registry.worker_of("s1") == "w0"
        assert registry.claim_idle_worker(POOL, "s2") is None, "the busy worker was handed a second session"
        c = registry.pool_counts(POOL)
        assert (c.busy, c.idle) == (1, 0), c

    def test_restarted_worker_keeps_an_existing_lease_until_it_looks_at_its_inbox(self, registry: Registry):
        registry.register(warm("w0"))
        registry.claim_idle_worker(POOL, "s1")
        registry.register(warm("w0"))  # pod restarted, registers without a session
        assert registry.session_of(POOL, "w0") == "s1"
        assert registry.abandon(POOL, "w0", "s1", reason="worker w0 restarted")
        assert registry.lost_reason("s1") == "worker w0 restarted"
        assert registry.idle_workers(POOL) == ["w0"]

    def test_deregister_returns_the_held_session(self, registry: Registry):
        registry.register(warm("w0"))
        registry.claim_idle_worker(POOL, "s1")
        assert registry.deregister("w0", POOL, reason="shutting down") == "s1"
        assert registry.lost_reason("s1") == "shutting down"
        assert registry.pool_counts(POOL).registered == 0
        assert registry.workers(POOL) == {}

    def test_a_worker_stopping_on_a_fault_counts_once_and_a_clean_stop_not_at_all(self, registry: Registry):
        assert registry.worker_failures(POOL) == {"fault": 0, "lost": 0}, "a pool with no history"
        for w in ("w0", "w1"):
            registry.register(warm(w))
        registry.claim_idle_worker(POOL, "s1")
        assert registry.deregister("w0", POOL, reason="rank 1 died", failed=True) == "s1"
        assert registry.deregister("w0", POOL, reason="rank 1 died", failed=True) is None  # again, at exit
        assert registry.deregister("w1", POOL, reason="worker shut down") is None
        assert registry.worker_failures(POOL) == {"fault": 1, "lost": 0}
        assert registry.worker_failures("other-pool") == {"fault": 0, "lost": 0}

    def test_workers_lists_what_they_registered(self, registry: Registry):
        registry.register(warm("w0"))
        info = registry.workers(POOL)["w0"]
        assert (info.pool, info.node, info.model_preset, info.warm) == (POOL, "node-1", "tiny", True)


class TestOutage:
    def test_calls_raise_registry_unavailable_and_work_again_after_restart(self):
        from servers import RedisServer

        server = RedisServer()
        try:
            reg = Registry(server.url, heartbeat_ttl_s=5)
            reg.register(warm("w0"))
            server.stop()
            with pytest.raises(RegistryUnavailable, match="claim_idle_worker"):
                reg.claim_idle_worker(POOL, "s1")
            with pytest.raises(RegistryUnavailable):
                reg.heartbeat("w0", POOL)
            server.start()
            assert reg.heartbeat("w0", POOL) is False  # came back empty
            assert reg.register(warm("w0"))
            assert reg.claim_idle_worker(POOL, "s1") == "w0"
        finally:
            server.stop()

    def test_bad_ttl_is_rejected(self, redis_url: str):
        with pytest.raises(ValueError, match="heartbeat_ttl_s"):
            Registry(redis_url, heartbeat_ttl_s=0)


def test_claim_cycles_helper_runs_in_process(registry: Registry):
    """The process helper's loop, run once here so a broken helper fails with a readable trace."""
    registry.register(warm("w0"))
    intervals, errors = claim_cycles(registry, POOL, "inproc", 5)
    assert len(intervals) == 5 and errors == [], errors


def test_reregistering_with_a_session_never_overwrites_another_lease(registry: Registry):
    registry.register(warm("w0"))
    assert registry.claim_idle_worker(POOL, "s2") == "w0"
    assert registry.register(warm("w0"), session_id="s1") is False
    assert registry.session_of(POOL, "w0") == "s2", "re-registration replaced the worker's current lease"
