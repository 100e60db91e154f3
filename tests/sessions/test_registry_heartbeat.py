"""Heartbeat expiry against a real redis-server: dead workers are skipped, reaped, their sessions lost."""

from __future__ import annotations

import time

import pytest
from vivant.sessions.models import WorkerInfo
from vivant.sessions.registry import Registry

POOL = "gpu-b"
TTL = 1.0  # short, yet robust to a loaded 2-core machine pausing this process ~0.9 s


def warm(worker_id: str) -> WorkerInfo:
    return WorkerInfo(worker_id=worker_id, pool=POOL, warm=True)


@pytest.fixture
def registry(redis_url: str) -> Registry:
    reg = Registry(redis_url, heartbeat_ttl_s=TTL)
    yield reg
    reg.close()


def keep_alive(registry: Registry, workers: list[str], seconds: float) -> None:
    """Beat for `workers` only, every 0.1 s, for `seconds`."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for w in workers:
            assert registry.heartbeat(w, POOL, {"session": None}), f"{w} unknown to the registry"
        time.sleep(0.1)


def test_expired_heartbeat_is_skipped_by_claims_and_reaped_with_its_session(registry: Registry):
    for w in ("w1", "w2", "w3"):
        registry.register(warm(w))
    assert registry.claim_idle_worker(POOL, "ns/s1") == "w1"
    keep_alive(registry, ["w2"], seconds=TTL + 0.4)  # w1 (busy) and w3 (idle) go silent

    counts = registry.pool_counts(POOL)
    assert (counts.registered, counts.dead, counts.idle, counts.busy) == (1, 2, 1, 0), counts
    assert registry.claim_idle_worker(POOL, "ns/s2") == "w2", "claim should take the only live idle worker"
    assert registry.claim_idle_worker(POOL, "ns/s3") is None, "a dead idle worker (w3) was claimed"

    reaped = sorted(registry.reap_dead_workers(POOL))
    assert reaped == [("w1", "ns/s1"), ("w3", None)], f"reaped {reaped}"
    assert registry.worker_of("ns/s1") is None
    assert "heartbeat of worker w1 expired" in (registry.lost_reason("ns/s1") or "")
    assert registry.reap_dead_workers(POOL) == [], "reaping twice returned workers again"
    assert registry.worker_failures(POOL) == {"fault": 0, "lost": 2}, "each reaped worker counts once as lost"
    counts = registry.pool_counts(POOL)
    assert (counts.registered, counts.dead, counts.busy) == (1, 0, 1), counts


def test_reaped_worker_coming_back_cannot_keep_its_session(registry: Registry):
    registry.register(warm("w1"))
    registry.claim_idle_worker(POOL, "s1")
    time.sleep(TTL + 0.2)
    assert registry.reap_dead_workers(POOL) == [("w1", "s1")]
    assert registry.heartbeat("w1", POOL) is False, "a reaped worker's heartbeat should ask it to re-register"
    assert registry.register(warm("w1"), session_id="s1") is False, "a reaped session was resurrected"
    assert registry.worker_of("s1") is None
    assert registry.idle_workers(POOL) == ["w1"], "the returning worker should be idle, its session is gone"


def test_heartbeat_keeps_a_worker_alive_past_its_ttl(registry: Registry):
    registry.register(warm("w1"))
    keep_alive(registry, ["w1"], seconds=TTL * 2)
    assert registry.reap_dead_workers(POOL) == []
    assert registry.claim_idle_worker(POOL, "s1") == "w1"


def test_release_of_a_dead_worker_does_not_make_it_idle(registry: Registry):
    registry.register(warm("w1"))
    registry.claim_idle_worker(POOL, "s1")
    time.sleep(TTL + 0.2)
    assert registry.release(POOL, "w1", "s1") is True
    assert registry.idle_workers(POOL) == [], "a worker with an expired heartbeat went back to idle"
