"""The fleet benchmark's simulated workers speak the registry's real protocol (against a real Redis).

The operator side of each exchange is the real `Registry` (claim, send assignment/end, release); the
simulated worker must register, become idle, take the assignment, report Streaming, ack, end on an end
request and give its lease back exactly as `vivant worker` does, treat an assignment that reaches it while
it is busy as the real chunk loop does, and count what the operator must never send (an assignment to a busy
worker, the streaming session's assignment again).
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest
from vivant.bench.fleet.run import FleetBenchConfig
from vivant.bench.fleet.sim_workers import Fleet, SimTiming, _listen_inboxes
from vivant.sessions.models import Assignment
from vivant.sessions.registry import Registry

POOL = "fleet/pool-0"


def pod(name: str, phase: str = "Running", deleting: bool = False) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": "fleet"}
    if deleting:
        meta["deletionTimestamp"] = "2026-12-01T00:00:00Z"
    return {"metadata": meta, "status": {"phase": phase},
            "spec": {"nodeName": "h200-0", "containers": [{"name": "worker", "env": [
                {"name": "VIVANT_POOL", "value": POOL}, {"name": "VIVANT_WORKER_ID", "valueFrom": {}}]}]}}


def assignment(session: str) -> Assignment:
    return Assignment(session_id=session, namespace="fleet", pool=POOL, character="ada", room=f"room-{session[-2:]}",
                      livekit_url="ws://127.0.0.1:7880", agent_identity="agent", token="t" * 20, max_duration_s=600)


async def until(check, what: str, timeout: float = 10.0) -> Any:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        await asyncio.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}; last: {got!r}")


@pytest.fixture
async def fleet(redis_url: str):
    registry = Registry(redis_url, heartbeat_ttl_s=3.0)
    fl = Fleet(registry, SimTiming(warmup_s=0.05, connect_s=0.05, end_s=0.01, stats_interval_s=0.1, poll_s=5.0))
    fl.loop = asyncio.get_running_loop()
    stop = threading.Event()
    th = threading.Thread(target=_listen_inboxes, args=(registry, fl.loop, fl, stop), daemon=True)
    th.start()
    yield fl
    stop.set()
    for w in list(fl.workers.values()):
        await w.shutdown()
    th.join(timeout=3)
    fl.pool.shutdown(wait=True)


async def test_worker_takes_streams_and_ends_a_session_over_the_registry(fleet: Fleet, redis_url: str) -> None:
    op = Registry(redis_url, heartbeat_ttl_s=3.0)
    fleet.pod_event("ADDED", pod("pool-0-0", phase="Pending"))
    assert fleet.workers == {}  # not Running yet: no worker
    fleet.pod_event("ADDED", pod("pool-0-0"))
    await until(lambda: op.idle_workers(POOL) == ["pool-0-0"], "the worker to become idle")
    assert op.workers(POOL)["pool-0-0"].node == "h200-0"

    assert op.claim_idle_worker(POOL, "fleet/s-01") == "pool-0-0"
    op.send_assignment("pool-0-0", assignment("fleet/s-01"))
    stats = await until(lambda: (s := op.session_stats("fleet/s-01")) and s.phase == "Streaming" and s.fps > 20 and s,
                        "Streaming at about 24 fps reported")
    assert stats.worker_id == "pool-0-0" and stats.fps <= 24.0 and stats.chunks >= 1
    assert op.redis.llen(op.processing_key("pool-0-0")) == 0  # acknowledged once streaming
    assert fleet.active == {"fleet/s-01": "pool-0-0"}

    op.send_end("pool-0-0", "fleet/s-01", "Deleted")
    final = await until(lambda: (s := op.session_stats("fleet/s-01")) and s.phase == "Ended" and s, "Ended reported")
    assert final.end_reason == "Deleted"
    await until(lambda: op.idle_workers(POOL) == ["pool-0-0"], "the lease given back")
    await until(lambda: fleet.active == {}, "the session off the worker")  # cleared just after the release
    assert op.worker_of("fleet/s-01") is None
    assert fleet.counters["double_assignments"] == 0 and fleet.counters["assignments_while_busy"] == 0

    fleet.pod_event("MODIFIED", pod("pool-0-0", deleting=True))
    await until(lambda: "pool-0-0" not in op.workers(POOL), "deregistration when the pod goes")


async def test_an_assignment_reaching_a_busy_worker_follows_the_real_workers_rules(fleet: Fleet,
                                                                                  redis_url: str) -> None:
    """As worker/serving/service.py's chunk loop: an assignment whose lease is not this worker's is dropped and
    counted; one whose lease the registry moved to this worker ends the current session Failed ("lease lost")
    and is served next."""
    op = Registry(redis_url, heartbeat_ttl_s=3.0)
    fleet.pod_event("ADDED", pod("pool-0-0"))
    await until(lambda: op.idle_workers(POOL) == ["pool-0-0"], "the worker to become idle")
    op.claim_idle_worker(POOL, "fleet/s-01")
    op.send_assignment("pool-0-0", assignment("fleet/s-01"))
    await until(lambda: (s := op.session_stats("fleet/s-01")) and s.phase == "Streaming", "Streaming reported")
    op.send_assignment("pool-0-0", assignment("fleet/s-03"))  # not leased to this worker
    await until(lambda: fleet.counters["assignments_while_busy"] == 1, "the drop counted")
    assert fleet.double[-1]["kind"] == "assigned-while-busy" and fleet.double[-1]["assigned"] == "fleet/s-03"
    assert op.session_stats("fleet/s-03") is None  # never started
    # the lease freed while the worker still streams, then handed to another session
    assert op.release(POOL, "pool-0-0", "fleet/s-01")
    assert op.claim_idle_worker(POOL, "fleet/s-02") == "pool-0-0"
    op.send_assignment("pool-0-0", assignment("fleet/s-02"))
    final = await until(lambda: (s := op.session_stats("fleet/s-01")) and s.phase == "Failed" and s, "s-01 Failed")
    assert final.end_reason == "lease lost: the worker was assigned session fleet/s-02", final
    await until(lambda: (s := op.session_stats("fleet/s-02")) and s.phase == "Streaming", "s-02 served next")
    assert fleet.counters["lease_lost"] == 1 and fleet.counters["assignments_while_busy"] == 1


async def test_a_repeated_assignment_of_the_streaming_session_is_acked_and_counted(fleet: Fleet,
                                                                                  redis_url: str) -> None:
    """As the real chunk loop: the session streams on; the repeat is counted (the operator must not send it)."""
    op = Registry(redis_url, heartbeat_ttl_s=3.0)
    fleet.pod_event("ADDED", pod("pool-0-0"))
    await until(lambda: op.idle_workers(POOL) == ["pool-0-0"], "the worker to become idle")
    op.claim_idle_worker(POOL, "fleet/s-01")
    op.send_assignment("pool-0-0", assignment("fleet/s-01"))
    await until(lambda: (s := op.session_stats("fleet/s-01")) and s.phase == "Streaming", "Streaming reported")
    op.send_assignment("pool-0-0", assignment("fleet/s-01"))
    await until(lambda: fleet.counters["repeated_assignments"] == 1, "the repeat counted")
    assert op.redis.llen(op.processing_key("pool-0-0")) == 0, "the repeat was not acknowledged"
    chunks = op.session_stats("fleet/s-01").chunks
    stats = await until(lambda: (s := op.session_stats("fleet/s-01")) and s.chunks > chunks + 2 and s, "more chunks")
    assert stats.phase == "Streaming" and fleet.active == {"fleet/s-01": "pool-0-0"}
    assert fleet.double[-1]["kind"] == "assignment-repeated"


def test_bench_config_rejects_bad_values_naming_the_field() -> None:
    with pytest.raises(ValueError, match="sessions: expected an integer >= 1"):
        FleetBenchConfig(sessions=0)
    with pytest.raises(ValueError, match="churn: expected 0..1"):
        FleetBenchConfig(churn=2.0)
    with pytest.raises(ValueError, match="pools: 1 pools need 1100 workers each"):
        FleetBenchConfig(sessions=1000, pools=1)
    with pytest.raises(ValueError, match="warmup_s: expected >= 0"):
        SimTiming(warmup_s=-1)
    cfg = FleetBenchConfig(sessions=1000, pools=5, gpus_per_node=8)
    assert (cfg.workers_per_pool, cfg.workers, cfg.nodes) == (220, 1100, 1100)  # one 5-GPU worker per 8-GPU node


def test_real_workers_mode_serves_with_the_real_worker_service(redis_url: str) -> None:
    """`sim_workers --real-workers`: a pod gets the real WorkerService (null engine); the operator side is the real
    registry. It warms up, streams an assignment at 24 fps, acknowledges the same assignment sent again and
    counts it, and ends on an end request - what a production worker does, with no model."""
    from vivant.bench.fleet.real_workers import RealFleet
    from vivant.sessions.models import SessionPhase

    def wait(check, what: str, timeout: float = 15.0) -> Any:  # noqa: ANN001
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if got := check():
                return got
            time.sleep(0.05)
        raise AssertionError(f"timed out waiting for {what}")

    op = Registry(redis_url, heartbeat_ttl_s=3.0)
    fleet = RealFleet(redis_url, SimTiming(warmup_s=0.05, connect_s=0.05, stats_interval_s=0.1), 3.0)
    try:
        fleet.pod_event("ADDED", pod("pool-0-0"))
        wait(lambda: op.idle_workers(POOL) == ["pool-0-0"], "the real worker idle")
        assert fleet.snapshot()["states"] == {"idle": 1}
        assert op.claim_idle_worker(POOL, "fleet/s-01") == "pool-0-0"
        op.send_assignment("pool-0-0", assignment("fleet/s-01"))
        wait(lambda: (s := op.session_stats("fleet/s-01")) and s.phase == "Streaming" and s.fps > 20, "Streaming")
        op.send_assignment("pool-0-0", assignment("fleet/s-01"))  # the operator's repeat
        wait(lambda: fleet.snapshot()["counters"].get("repeated_assignments") == 1, "the repeat counted")
        chunks = op.session_stats("fleet/s-01").chunks
        wait(lambda: op.session_stats("fleet/s-01").chunks > chunks + 3, "streaming on after the repeat")
        op.send_end("pool-0-0", "fleet/s-01", "Deleted")
        final = wait(lambda: (s := op.session_stats("fleet/s-01")) and s.phase == SessionPhase.ENDED and s, "Ended")
        assert final.end_reason == "Deleted"
        snap = fleet.snapshot(final=True)
        assert snap["counters"]["sessions_ended"] == 1 and snap["counters"]["lease_lost"] == 0, snap
        assert "fleet/s-01" in snap["streaming_at"] and snap["double_assignments"] == []
    finally:
        fleet.stop_all()
        op.close()
