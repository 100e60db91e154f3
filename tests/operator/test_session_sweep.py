"""One sweep per pool (operator/session_sweep.py) against a real Redis: what it reads, what it writes.

The writes go to a list instead of the API server (the kopf tests and the cluster tests run the sweep
against an API server); everything Redis-side is the real registry.
"""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from vivant.apis import resources
from vivant.apis.livekit_token import LiveKitCredentials
from vivant.operator import reconcile as rc
from vivant.operator import session_sweep as sw
from vivant.sessions.models import SessionStats, WorkerInfo
from vivant.sessions.registry import Registry

NS, POOL_NAME = "fleet", "pool-0"
POOL = resources.pool_key(NS, POOL_NAME)
T0 = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
TIMEOUTS = rc.Timeouts(pending_s=30, connect_s=10)
SPEC = resources.CharacterSessionSpec.model_validate({
    "character": "ada", "pool": POOL_NAME, "maxDurationSeconds": 3600,
    "livekit": {"url": "wss://lk.example.com", "room": "room", "agentIdentity": "agent"},
})


@pytest.fixture
def registry(redis_url):
    reg = Registry(redis_url, heartbeat_ttl_s=30.0)
    yield reg
    reg.close()


def view(i: int, status: dict[str, Any] | None = None, created: datetime = T0, deleting: bool = False,
         rv: int | None = None) -> sw.SessionView:
    return sw.SessionView(namespace=NS, name=f"s-{i}", uid=f"uid-{i}", created=created, spec=SPEC,
                          status=status or {}, deleting=deleting, resource_version=rv)


def workers(reg: Registry, n: int) -> list[str]:
    ids = [f"{POOL_NAME}-{i}" for i in range(n)]
    for w in ids:
        reg.register(WorkerInfo(worker_id=w, pool=POOL, warm=True, node=f"h200-{w[-1]}"))
    return ids


class Sweep:
    """Runs sweeps with list-backed writes and the real assignment (reconcile.assign_session)."""

    def __init__(self, reg: Registry) -> None:
        self.reg, self.state = reg, sw.SweepState()
        self.writes: list[tuple[str, dict[str, Any]]] = []
        self.seqs: dict[str, int] = {}  # uid -> number of the last patch queued
        self.urgent: dict[str, bool] = {}  # name -> whether its last patch was queued as urgent

    def assign(self, v: sw.SessionView, status: dict[str, Any]) -> bool:
        out = rc.assign_session(v.ref, SPEC, self.state.status(v), registry=self.reg,
                                credentials=LiveKitCredentials("key", "s" * 32), apply_secret=lambda _m: None,
                                timeouts=TIMEOUTS, now=self.now)
        if out.status:
            self.state.remember(v.uid, out.status)
            self.writes.append((v.name, out.status))
        return not out.no_worker

    def __call__(self, views: list[sw.SessionView], now: datetime) -> sw.SweepResult:
        self.now = now
        return sw.sweep_pool(views, registry=self.reg, state=self.state, timeouts=TIMEOUTS, now=now,
                             write_status=self.write, assign=self.assign)

    def write(self, v: sw.SessionView, patch: dict[str, Any], seq: int, urgent: bool) -> None:
        self.writes.append((v.name, patch))
        self.seqs[v.uid] = seq
        self.urgent[v.name] = urgent


def streaming(reg: Registry, i: int, fps: float = 23.9) -> None:
    reg.report_session(f"{NS}/s-{i}", SessionStats(session_id=f"{NS}/s-{i}", phase="Streaming", fps=fps,
                                                   streamed_s=5.0))


def calls(reg: Registry, command: str) -> int:
    return int(reg.redis.info("commandstats").get(f"cmdstat_{command}", {}).get("calls", 0))


def test_a_sweep_reads_all_its_sessions_in_one_round_trip_and_writes_only_changes(registry):
    workers(registry, 40)
    sweep = Sweep(registry)
    views = [view(i) for i in range(40)]
    res = sweep(views, T0)
    assert res.assigned == 40 and len(sweep.writes) == 40  # waiting sessions assigned, oldest first
    for i in range(40):
        streaming(registry, i)
    mget, hmget, get = calls(registry, "mget"), calls(registry, "hmget"), calls(registry, "get")
    sweep.writes.clear()
    res = sweep(views, T0 + timedelta(seconds=2))  # the index still shows {} (it lags): the overlay does not
    assert res.live == 40 and res.assigned == 0
    assert (calls(registry, "mget") - mget, calls(registry, "hmget") - hmget) == (2, 1), "one pipeline for 40"
    assert calls(registry, "get") == get, "no GET per session"
    assert {p["phase"] for _, p in sweep.writes} == {"Streaming"} and len(sweep.writes) == 40
    assert all(sweep.urgent.values()), "a phase change is urgent"
    sweep.writes.clear()
    for i in range(40):
        streaming(registry, i, fps=23.95)  # only the average fps moved
    assert sweep(views, T0 + timedelta(seconds=3)).written == 0, "stats alone wait for STATS_REFRESH_S"
    for uid in list(sweep.state.stats_written_at):
        sweep.state.stats_written_at[uid] -= sw.STATS_REFRESH_S
    assert sweep(views, T0 + timedelta(seconds=4)).written == 40
    assert all(p["avgFps"] == 23.95 for _, p in sweep.writes)
    assert not any(sweep.urgent.values()), "a stats refresh waits behind phase changes"


def test_waiting_sessions_get_freed_workers_oldest_first_and_time_out(registry):
    (w,) = workers(registry, 1)
    sweep = Sweep(registry)
    views = [view(i, created=T0 + timedelta(seconds=i)) for i in (2, 1, 3)]
    res = sweep(views, T0 + timedelta(seconds=5))
    assert res.assigned == 1 and registry.worker_of(f"{NS}/s-1") == w, "the oldest waiter gets the worker"
    assert res.waiting == 3
    registry.finish(POOL, w, f"{NS}/s-1", "ended")  # freed: the next oldest gets it
    sweep.state.remember("uid-1", {"phase": "Ended", "worker": w, "endedAt": "2026-12-01T12:00:06Z"})
    sweep(views, T0 + timedelta(seconds=6))
    assert registry.worker_of(f"{NS}/s-2") == w and registry.worker_of(f"{NS}/s-3") is None
    sweep.writes.clear()
    sweep(views, T0 + timedelta(seconds=40))  # s-3 has waited past pending_s (30 s) with no worker free
    failed = [p for name, p in sweep.writes if name == "s-3"]
    assert failed and failed[-1]["phase"] == "Failed"


def test_deleting_and_releasing_sessions_are_never_assigned(registry):
    workers(registry, 2)
    sweep = Sweep(registry)
    sweep.state.releasing.add("uid-1")
    res = sweep([view(0, deleting=True), view(1)], T0)
    assert res.assigned == 0 and registry.idle_workers(POOL) == [f"{POOL_NAME}-0", f"{POOL_NAME}-1"]


def test_a_lease_the_worker_keeps_after_the_end_is_freed_after_the_grace_time(registry):
    (w,) = workers(registry, 1)
    sweep = Sweep(registry)
    v = view(0)
    sweep([v], T0)
    ended = {"phase": "Ended", "worker": w, "endedAt": "2026-12-01T12:00:00Z"}  # MaxDuration, say
    sweep.state.remember(v.uid, ended)
    res = sweep([v], T0 + timedelta(seconds=sw.END_GRACE_S - 1))
    assert res.stale_released == 0 and registry.worker_of(f"{NS}/s-0") == w, "the worker is still stopping"
    res = sweep([v], T0 + timedelta(seconds=sw.END_GRACE_S + 1))
    assert res.stale_released == 1 and registry.idle_workers(POOL) == [w]


def test_a_lost_worker_fails_its_session_in_the_next_sweep(registry):
    (w,) = workers(registry, 1)
    sweep = Sweep(registry)
    v = view(0)
    sweep([v], T0)
    registry.deregister(w, POOL, reason="pod deleted")
    sweep.writes.clear()
    sweep([v], T0 + timedelta(seconds=1))
    (name, patch), = sweep.writes
    assert patch["phase"] == "Failed" and "pod deleted" in patch["message"]


def test_the_index_view_of_an_object_and_the_overlay_of_own_writes():
    body = {"metadata": {"namespace": NS, "name": "s-9", "uid": "u9", "creationTimestamp": "2026-12-01T12:00:00Z"},
            "spec": {"character": "ada", "pool": POOL_NAME,
                     "livekit": {"url": "wss://lk.example.com", "room": "room", "agentIdentity": "agent"}},
            "status": {"phase": "Pending", "message": "waiting"}}
    v = sw.SessionView.from_body(body)
    assert v.ref.session_id == f"{NS}/s-9" and v.created == T0 and v.spec is not None and not v.deleting
    assert sw.SessionView.from_body({**body, "spec": {"pool": POOL_NAME}}).spec is None  # invalid: skipped
    state = sw.SweepState()
    state.remember("u9", {"phase": "Assigned", "worker": "w"})
    assert state.status(v) == {"phase": "Assigned", "message": "waiting", "worker": "w"}
    state.forget_all_but([])
    assert state.status(v) == body["status"]
    assert sw.SessionView.from_body({**body, "metadata": {**body["metadata"], "resourceVersion": "41"}}
                                    ).resource_version == 41
    assert v.resource_version is None  # none given: the overlay holds until forgotten


def test_the_overlay_holds_until_the_index_shows_the_write_then_the_index_wins():
    state = sw.SweepState()
    v = view(0, {"phase": "Pending"}, rv=10)
    seq = state.remember(v.uid, {"phase": "Streaming", "worker": "w"})
    state.confirm(v.uid, "12", seq)  # written: the object is at version 12 now
    assert state.status(v)["phase"] == "Streaming", "the index (10) does not show it yet"
    later = view(0, {"phase": "Assigned", "worker": "w"}, rv=15)  # someone else wrote after us
    assert state.status(later) == {"phase": "Assigned", "worker": "w"}, "newer than our write: the index wins"
    assert state.status(view(0, {"phase": "Pending"}, rv=10)) == {"phase": "Pending"}, "the overlay is gone"


def test_a_write_of_an_older_patch_does_not_end_the_overlay_of_a_newer_one():
    state = sw.SweepState()
    first = state.remember("uid-0", {"phase": "Assigned", "worker": "w"})
    state.remember("uid-0", {"phase": "Streaming"})  # queued, not written yet
    state.confirm("uid-0", "12", first)
    assert state.status(view(0, {"phase": "Assigned", "worker": "w"}, rv=12))["phase"] == "Streaming"
    state.confirm("uid-0", "nonsense", 2)  # a version that is not a number: the overlay stays
    assert state.status(view(0, {"phase": "Assigned", "worker": "w"}, rv=99))["phase"] == "Streaming"


def test_a_status_another_replica_set_back_is_corrected_by_the_next_sweep(registry):
    """Two replicas during a peering hand-over: the other one resumed a session whose status it had not
    seen written yet and wrote Assigned over our Streaming. The sweep sees the index (newer than its own
    write) and writes Streaming again instead of trusting what it remembers."""
    workers(registry, 1)
    sweep = Sweep(registry)
    v = view(0, rv=5)
    sweep([v], T0)
    streaming(registry, 0)
    sweep([v], T0 + timedelta(seconds=1))
    assert sweep.writes[-1][1]["phase"] == "Streaming"
    sweep.state.confirm(v.uid, "20", sweep.seqs[v.uid])
    sweep.writes.clear()
    regressed = view(0, {"phase": "Assigned", "worker": f"{POOL_NAME}-0", "assignedAt": "2026-12-01T12:00:00Z"},
                     rv=23)
    sweep([regressed], T0 + timedelta(seconds=2))
    assert [p["phase"] for _, p in sweep.writes] == ["Streaming"]


def test_a_session_whose_create_handler_has_not_run_is_left_to_it(registry):
    """The create handler assigns a new session and its status goes in kopf's own patch, after kopf's record
    that the handler ran. A sweep that assigned it first wrote a status without that record; when the watch lagged
    past kopf's consistency timeout, kopf took that version for a session never handled and ran the handler
    again. So the sweep assigns, and writes the status of, only sessions that carry the record (SessionView.handled):
    a new one waits for its handler, an assigned one for kopf's record to show in the index."""
    workers(registry, 2)
    sweep = Sweep(registry)
    new = dataclasses.replace(view(0), handled=False)
    res = sweep([new, view(1)], T0)
    assert res.assigned == 1 and registry.worker_of(f"{NS}/s-0") is None and registry.worker_of(f"{NS}/s-1")
    assert [name for name, _ in sweep.writes] == ["s-1"]
    assert registry.claim_idle_worker(POOL, f"{NS}/s-2") is not None
    streaming(registry, 2)
    assigned = {"phase": "Assigned", "worker": registry.worker_of(f"{NS}/s-2")}
    sweep.writes.clear()
    res = sweep([dataclasses.replace(view(2, assigned), handled=False)], T0)
    assert (res.live, sweep.writes) == (0, []), "a status written before kopf's record shows in the index"
    res = sweep([view(2, assigned)], T0)
    assert res.live == 1 and [p["phase"] for _, p in sweep.writes] == ["Streaming"]


def test_the_handled_record_is_read_from_kopfs_annotation():
    body = {"metadata": {"namespace": NS, "name": "s-0", "uid": "uid-0", "annotations": {}},
            "spec": SPEC.model_dump(by_alias=True), "status": {}}
    assert not sw.SessionView.from_body(body).handled
    body["metadata"]["annotations"][sw.HANDLED_ANNOTATION] = "{}"
    assert sw.SessionView.from_body(body).handled


def test_the_overlay_of_a_status_kopf_writes_ends_once_the_index_shows_it():
    """kopf returns no resourceVersion for the create handler's patch: the overlay holds until the index shows
    every field of it, then the index is the truth again (a later change by another writer shows)."""
    state = sw.SweepState()
    assigned = {"phase": "Assigned", "worker": "w-1", "message": "assigned to worker w-1"}
    state.remember("uid-0", assigned, by_kopf=True)
    assert state.status(view(0, rv=5))["worker"] == "w-1", "the overlay before the index shows the write"
    assert state.unshown(view(0, rv=5)) == assigned
    assert state.status(view(0, {**assigned}, rv=6)) == assigned
    later = {**assigned, "phase": "Failed"}
    assert state.status(view(0, later, rv=7))["phase"] == "Failed", "the overlay hid a newer status"
    assert state.unshown(view(0, later, rv=7)) == {}
