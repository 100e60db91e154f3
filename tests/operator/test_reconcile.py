"""The operator's reconcile decisions against a real Redis (the `redis_url` fixture starts redis-server).

Workers are simulated over Redis with the registry's own worker-side API (register, heartbeat,
next_message, report_session), exactly what `vivant worker` calls.
"""

from __future__ import annotations

import concurrent.futures
import time
from datetime import UTC, datetime, timedelta

import pytest
from vivant.apis import resources
from vivant.apis.feature_flags import FlagValues
from vivant.apis.livekit_token import LiveKitCredentials
from vivant.operator import reconcile as rc
from vivant.operator.builders import token_secret_name
from vivant.sessions.flags import FlagStore
from vivant.sessions.models import Assignment, EndRequest, SessionStats, WorkerInfo
from vivant.sessions.registry import Registry

NS, POOL_NAME = "default", "h200"
POOL = resources.pool_key(NS, POOL_NAME)
CREDS = LiveKitCredentials("APIkey123", "x" * 32)
T0 = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)
SPEC = resources.CharacterSessionSpec.model_validate({
    "character": "ada-v1", "pool": POOL_NAME, "maxDurationSeconds": 60,
    "livekit": {"url": "wss://lk.example.com", "room": "demo-room", "agentIdentity": "agent-1"},
})
POOL_SPEC = resources.WorkerPoolSpec.model_validate({
    "model": {"preset": "tiny", "checkpoint": "/models/tiny.safetensors"}, "image": "vivant:dev",
    "minIdle": 1, "maxWorkers": 4, "flags": {"fusedGemmAllReduce": True},
})
TIMEOUTS = rc.Timeouts(pending_s=30, connect_s=10)


@pytest.fixture
def registry(redis_url):
    reg = Registry(redis_url, heartbeat_ttl_s=5.0)
    yield reg
    reg.close()


def add_workers(reg: Registry, n: int, start: int = 0) -> list[str]:
    ids = [f"{POOL_NAME}-{i}" for i in range(start, start + n)]
    for w in ids:
        reg.register(WorkerInfo(worker_id=w, pool=POOL, warm=True, node=f"gpu-node-{w[-1]}"))
    return ids


def ref(name: str = "ada") -> rc.SessionRef:
    return rc.SessionRef(namespace=NS, name=name, uid=f"uid-{name}", created=T0)


def assign(reg, name="ada", status=None, now=T0, secrets=None):
    secrets = [] if secrets is None else secrets
    return rc.assign_session(ref(name), SPEC, status or {}, registry=reg, credentials=CREDS,
                             apply_secret=secrets.append, timeouts=TIMEOUTS, now=now)


def progress(reg, status, now, name="ada"):
    return rc.progress_session(ref(name), SPEC, status, registry=reg, timeouts=TIMEOUTS, now=now)


def report(reg, phase, fps=0.0, streamed=0.0, fused=False, fault=False, name="ada", end_reason=None):
    reg.report_session(f"{NS}/{name}", SessionStats(
        session_id=f"{NS}/{name}", phase=phase, fps=fps, streamed_s=streamed, numerical_fault=fault,
        flags=FlagValues(fusedGemmAllReduce=fused), end_reason=end_reason))


class TestAssignment:
    def test_assigns_an_idle_worker_and_hands_over_the_token(self, registry):
        add_workers(registry, 2)
        secrets: list[dict] = []
        out = assign(registry, secrets=secrets)
        assert out.status["phase"] == "Assigned", out.status
        worker = out.status["worker"]
        assert out.status["node"] == f"gpu-node-{worker[-1]}", out.status
        assert registry.worker_of("default/ada") == worker
        token = secrets[0]["stringData"]["token"]
        assert secrets[0]["metadata"]["ownerReferences"][0]["uid"] == "uid-ada"
        msg = registry.next_message(worker, timeout_s=0)
        assert isinstance(msg, Assignment) and msg.token.get_secret_value() == token
        assert (msg.room, msg.agent_identity, msg.pool) == ("demo-room", "agent-1", POOL)
        assert token not in repr(out.status) and token not in repr(out.events), "token leaked into status/events"

    def test_waits_then_fails_without_idle_workers(self, registry):
        out = assign(registry)
        assert out.status["phase"] == "Pending" and out.retry_s, out
        assert out.status["conditions"][0]["reason"] == "WaitingForWorker"
        late = assign(registry, status=out.status, now=T0 + timedelta(seconds=31))
        assert late.status["phase"] == "Failed" and late.retry_s is None
        assert late.status["conditions"][0]["reason"] == "NoIdleWorker"

    def test_reassign_after_crash_returns_the_same_worker(self, registry):
        """Operator died after the claim but before the status patch: resume claims again, same worker."""
        add_workers(registry, 3)
        first = assign(registry)
        again = assign(registry)  # status still empty: as if the first patch was lost
        assert again.status["worker"] == first.status["worker"]
        assert len(registry.idle_workers(POOL)) == 2
        assert assign(registry, status=first.status).status == {}, "an Assigned session must not be re-assigned"

    def test_a_session_a_worker_streams_is_never_handed_out_again(self, registry):
        """The create handler ran again on a copy of the object without the worker in its status (its first
        run's outcome was not recorded): the holder in Redis is recorded, nothing is sent again, and the
        token Secret is not written again (a rewrite deletes and re-creates it under the streaming worker)."""
        add_workers(registry, 3)
        secrets: list[dict] = []
        first = assign(registry, secrets=secrets)
        worker = first.status["worker"]
        msg = registry.next_message(worker, timeout_s=0)  # the worker starts it (Connecting, then acks)
        registry.report_session("default/ada", SessionStats(session_id="default/ada", worker_id=worker,
                                                            phase="Streaming", fps=24.0, streamed_s=9.0))
        registry.ack(worker, msg)
        again = assign(registry, secrets=secrets)  # the status is still empty, as on the stale copy
        assert (again.status["phase"], again.status["worker"]) == ("Assigned", worker), again.status
        assert len(secrets) == 1, "the token Secret was written again for a session that has a worker"
        assert registry.redis.llen(registry.inbox_key(worker)) == 0, "the assignment was sent again"
        assert registry.worker_of("default/ada") == worker and len(registry.idle_workers(POOL)) == 2

    def test_a_claim_whose_assignment_was_never_sent_is_sent_once_to_its_holder(self, registry):
        """The operator stopped between the claim and the send: the next run sends the assignment to the worker
        that holds the lease, with the token already in the Secret (no new Secret), and only once."""
        add_workers(registry, 2)
        worker = registry.claim_idle_worker(POOL, "default/ada")
        secrets: list[dict] = []

        def run() -> rc.Outcome:
            return rc.assign_session(ref(), SPEC, {}, registry=registry, credentials=CREDS,
                                     apply_secret=secrets.append, timeouts=TIMEOUTS, now=T0,
                                     read_token=lambda name: "tok-1" if name == token_secret_name("ada") else None)

        assert run().status["worker"] == worker
        assert run().status["worker"] == worker
        assert secrets == [], "a new token Secret was written"
        sent = registry.pending(worker)
        assert [(m.session_id, m.token.get_secret_value()) for m in sent] == [("default/ada", "tok-1")], sent

    def test_concurrent_operators_never_double_assign(self, redis_url):
        """Two operator replicas race to assign 24 sessions onto 10 workers."""
        regs = [Registry(redis_url, heartbeat_ttl_s=30), Registry(redis_url, heartbeat_ttl_s=30)]
        add_workers(regs[0], 10)
        names = [f"s{i}" for i in range(24)]

        def run(args):
            i, name = args
            return name, assign(regs[i % 2], name=name).status

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            results = list(pool.map(run, [(i, n) for i in range(2) for n in names]))
        by_session: dict[str, set] = {}
        for name, status in results:
            if status.get("worker"):
                by_session.setdefault(name, set()).add(status["worker"])
        assert all(len(ws) == 1 for ws in by_session.values()), f"a session got two workers: {by_session}"
        holders = [next(iter(ws)) for ws in by_session.values()]
        assert len(holders) == len(set(holders)) == 10, f"workers held twice or left idle: {sorted(holders)}"
        for reg in regs:
            reg.close()


    def test_caller_supplied_token_secret_is_used_and_not_copied(self, registry):
        add_workers(registry, 1)
        spec = SPEC.model_copy(update={"livekit": SPEC.livekit.model_copy(update={"token_secret": "ada-token"})})
        secrets: list[dict] = []
        tokens = {"ada-token": "caller-minted-token"}

        def run(status=None, now=T0):
            return rc.assign_session(ref(), spec, status or {}, registry=registry, credentials=CREDS,
                                     apply_secret=secrets.append, timeouts=TIMEOUTS, now=now, read_token=tokens.get)

        tokens_missing = rc.assign_session(ref(), spec, {}, registry=registry, credentials=CREDS,
                                           apply_secret=secrets.append, timeouts=TIMEOUTS, now=T0,
                                           read_token=lambda name: None)
        assert tokens_missing.status["conditions"][0]["reason"] == "TokenSecretMissing", tokens_missing.status
        assert registry.idle_workers(POOL) == ["h200-0"], "no worker may be claimed without a token"
        out = run()
        assert out.status["phase"] == "Assigned" and out.status["tokenSecret"] == "ada-token", out.status
        assert secrets == [], "the operator must not write its own Secret when the caller supplied one"
        assert registry.next_message("h200-0", 0).token.get_secret_value() == "caller-minted-token"


class TestProgress:
    def test_mirrors_worker_stats_into_status(self, registry):
        add_workers(registry, 1)
        status = assign(registry).status
        report(registry, "Connecting")
        out = progress(registry, status, T0 + timedelta(seconds=1))
        assert out.status["phase"] == "Connecting"
        status.update(out.status)
        report(registry, "Streaming", fps=24.1, streamed=3.0)
        out = progress(registry, status, T0 + timedelta(seconds=4))
        assert out.status["phase"] == "Streaming" and out.status["avgFps"] == 24.1
        assert out.status["startedAt"] and out.status["conditions"][0]["status"] == "True"
        assert out.events == [], "an Event for Streaming (the status says it)"
        status.update(out.status)
        assert progress(registry, status, T0 + timedelta(seconds=5)).status == {}, "no change must write nothing"

    def test_worker_loss_fails_the_session_and_reclaims_the_slot(self, redis_url):
        reg = Registry(redis_url, heartbeat_ttl_s=0.3)
        add_workers(reg, 1)
        status = assign(reg).status
        time.sleep(0.45)  # the worker stops heart-beating
        assert reg.reap_dead_workers(POOL) == [("h200-0", "default/ada")]
        out = progress(reg, status, T0 + timedelta(seconds=2))
        assert out.status["phase"] == "Failed" and out.status["conditions"][0]["reason"] == "WorkerLost"
        assert reg.worker_of("default/ada") is None and reg.pool_counts(POOL).busy == 0
        add_workers(reg, 1)  # the pod restarts and re-registers: it is claimable again
        assert assign(reg, name="bob").status["worker"] == "h200-0"
        reg.close()

    def test_connect_timeout_ends_and_the_worker_gives_the_lease_back(self, registry):
        add_workers(registry, 1)
        status = assign(registry).status
        registry.next_message("h200-0", 0)
        out = progress(registry, status, T0 + timedelta(seconds=11))
        assert out.status["phase"] == "Failed" and out.status["conditions"][0]["reason"] == "ConnectTimeout"
        end = registry.next_message("h200-0", 0)
        assert isinstance(end, EndRequest) and end.reason == "ConnectTimeout"
        # the lease stays with the worker until it has stopped: nothing can claim it meanwhile
        assert registry.worker_of("default/ada") == "h200-0" and assign(registry, name="bob").no_worker
        assert registry.finish(POOL, "h200-0", "default/ada", "ConnectTimeout")
        assert registry.idle_workers(POOL) == ["h200-0"]

    def test_a_hung_worker_loses_the_lease_after_the_grace_time(self, registry):
        add_workers(registry, 1)
        status = assign(registry).status
        ended = progress(registry, status, T0 + timedelta(seconds=11)).status  # ConnectTimeout, endedAt = T0+11
        ended_at = datetime.fromisoformat(ended["endedAt"].replace("Z", "+00:00"))
        kw = dict(holder="h200-0", registry=registry, grace_s=15.0)
        assert not rc.release_stale_lease(ref(), SPEC, ended, now=ended_at + timedelta(seconds=14), **kw)
        assert registry.worker_of("default/ada") == "h200-0"
        assert rc.release_stale_lease(ref(), SPEC, ended, now=ended_at + timedelta(seconds=15), **kw)
        assert registry.idle_workers(POOL) == ["h200-0"]
        assert not rc.release_stale_lease(ref(), SPEC, ended, now=ended_at + timedelta(seconds=16), holder=None,
                                          registry=registry, grace_s=15.0)

    def test_max_duration_ends_the_session(self, registry):
        add_workers(registry, 1)
        status = assign(registry).status
        registry.next_message("h200-0", 0)
        report(registry, "Streaming", fps=24.0, streamed=50)
        out = progress(registry, status, T0 + timedelta(seconds=61))
        assert out.status["phase"] == "Ended" and out.status["conditions"][0]["reason"] == "MaxDuration"
        assert out.status["endedAt"]
        assert isinstance(registry.next_message("h200-0", 0), EndRequest)
        assert registry.worker_of("default/ada") == "h200-0", "released by the worker once it has stopped"

    def test_delete_keeps_the_lease_until_the_worker_has_stopped(self, registry):
        add_workers(registry, 1)
        status = assign(registry).status
        registry.next_message("h200-0", 0)
        first = rc.release_session(ref(), SPEC, status, registry=registry, end_sent_at=None, now=T0, grace_s=15)
        assert first == rc.Release(done=False, end_sent=True)
        end = registry.next_message("h200-0", 0)
        assert isinstance(end, EndRequest) and end.session_id == "default/ada" and end.reason == "Deleted"
        again = rc.release_session(ref(), SPEC, status, registry=registry, end_sent_at=T0,
                                   now=T0 + timedelta(seconds=1), grace_s=15)
        assert again == rc.Release(done=False) and registry.next_message("h200-0", 0) is None, "one end request"
        assert assign(registry, name="bob").no_worker, "the streaming worker is not claimable"
        registry.finish(POOL, "h200-0", "default/ada", "Deleted")  # the worker stopped and gave it back
        done = rc.release_session(ref(), SPEC, status, registry=registry, end_sent_at=T0,
                                  now=T0 + timedelta(seconds=2), grace_s=15)
        assert done == rc.Release(done=True) and registry.idle_workers(POOL) == ["h200-0"]

    def test_delete_frees_a_hung_workers_lease_after_the_grace_time(self, registry):
        add_workers(registry, 1)
        status = assign(registry).status
        rc.release_session(ref(), SPEC, status, registry=registry, end_sent_at=None, now=T0, grace_s=15)
        out = rc.release_session(ref(), SPEC, status, registry=registry, end_sent_at=T0,
                                 now=T0 + timedelta(seconds=15), grace_s=15)
        assert out == rc.Release(done=True, forced=True) and registry.idle_workers(POOL) == ["h200-0"]

    def test_delete_of_a_session_without_a_lease_is_done_at_once(self, registry):
        add_workers(registry, 1)
        out = rc.release_session(ref(), SPEC, {}, registry=registry, end_sent_at=None, now=T0, grace_s=15)
        assert out == rc.Release(done=True) and registry.next_message("h200-0", 0) is None


class TestAutoRollback:
    @pytest.mark.parametrize("fps,streamed,fault,expect", [
        (20.0, 2.0, False, True),    # burns the SLO after >= 1 s
        (20.0, 0.5, False, False),   # too early to judge
        (24.0, 5.0, False, False),   # healthy
        (24.0, 5.0, True, True),     # numerical fault
    ])
    def test_rule(self, registry, fps, streamed, fault, expect):
        add_workers(registry, 1)
        status = assign(registry).status
        report(registry, "Streaming", fps=fps, streamed=streamed, fused=True, fault=fault)
        out = progress(registry, status, T0 + timedelta(seconds=3))
        assert (out.rollback is not None) == expect, out.rollback

    @pytest.mark.parametrize("fused", [True, False])
    def test_a_numerical_fault_shows_on_the_session_once(self, registry, fused):
        """On either path the session's status says it (numericalFault) and one Warning Event says when; the next
        steps repeat neither (level-triggered: the status remembers), and the session stays Streaming."""
        add_workers(registry, 1)
        status = assign(registry).status
        report(registry, "Streaming", fps=24.0, streamed=2.0, fused=fused)
        out = progress(registry, status, T0 + timedelta(seconds=2))
        status = {**status, **out.status}
        assert not status.get("numericalFault") and not [e for e in out.events if e[1] == "NumericalFault"]
        report(registry, "Streaming", fps=24.0, streamed=3.0, fused=fused, fault=True)
        out = progress(registry, status, T0 + timedelta(seconds=3))
        status = {**status, **out.status}
        assert status["numericalFault"] is True and status["phase"] == "Streaming", status
        faults = [e for e in out.events if e[1] == "NumericalFault"]
        assert len(faults) == 1 and faults[0][0] == "Warning" and "NaN/Inf" in faults[0][2], out.events
        report(registry, "Streaming", fps=24.0, streamed=4.0, fused=fused, fault=True)
        again = progress(registry, status, T0 + timedelta(seconds=4))
        assert not [e for e in again.events if e[1] == "NumericalFault"], again.events
        assert again.status.get("numericalFault", status["numericalFault"]) is True

    def test_not_on_the_unfused_path(self, registry):
        add_workers(registry, 1)
        status = assign(registry).status
        report(registry, "Streaming", fps=10.0, streamed=5.0, fused=False)
        assert progress(registry, status, T0 + timedelta(seconds=3)).rollback is None

    def test_rollback_sticks_until_the_spec_changes(self, redis_url):
        flags = FlagStore(redis_url)
        _, patch = rc.apply_spec_flags(POOL_NAME, NS, POOL_SPEC, 1, {}, flags)
        assert flags.get(POOL).values.fusedGemmAllReduce is True and patch["flagsAppliedGeneration"] == 1
        status = dict(patch)
        new = rc.auto_rollback(flags, POOL, "fps 20 < 23.5")
        assert new is not None and new.updated_by == rc.AUTO_ROLLBACK_ACTOR and not new.values.fusedGemmAllReduce
        assert rc.auto_rollback(flags, POOL, "again") is None, "second rollback must be a no-op"
        _, patch = rc.apply_spec_flags(POOL_NAME, NS, POOL_SPEC, 1, status, flags)  # resync, same generation
        assert flags.get(POOL).values.fusedGemmAllReduce is False, "resync re-enabled a rolled-back flag"
        cond = patch["conditions"][0]
        assert (cond["type"], cond["status"], cond["reason"]) == ("FlagsMatchSpec", "False", "AutoRollback")
        status.update(patch)
        _, patch = rc.apply_spec_flags(POOL_NAME, NS, POOL_SPEC, 2, status, flags)  # the user edited the spec
        assert flags.get(POOL).values.fusedGemmAllReduce is True
        assert patch["conditions"][0]["status"] == "True"


class TestScale:
    def test_plan(self):
        assert rc.plan_scale(0, set(), set(), min_idle=1, max_workers=4) == rc.ScalePlan(1)
        assert rc.plan_scale(2, {0, 1}, set(), 1, 4) == rc.ScalePlan(3)
        assert rc.plan_scale(4, {0, 1, 2, 3}, set(), 2, 4) == rc.ScalePlan(4), "maxWorkers caps"
        assert rc.plan_scale(4, {0}, {1, 2, 3}, 1, 4) == rc.ScalePlan(2, ("2", "3"))
        assert rc.plan_scale(4, {3}, {0, 1, 2}, 1, 4) == rc.ScalePlan(4), "a busy top ordinal blocks scale-down"

    def test_scale_down_drains_only_idle_workers(self, registry):
        add_workers(registry, 4)
        for name in ("a", "b"):
            assign(registry, name=name)  # takes h200-0 and h200-1 (claims are sorted)
        plan = rc.pool_scale(POOL_NAME, NS, POOL_SPEC, 4, registry=registry)
        assert plan == rc.ScalePlan(3, ("h200-3",)), plan
        assert registry.pool_counts(POOL).draining == 1
        assert assign(registry, name="c").status["worker"] == "h200-2", "a draining worker was claimed"
        counts = rc.pool_status(POOL_NAME, NS, registry, plan.replicas)
        assert (counts["busy"], counts["idle"], counts["draining"]) == (3, 0, 1), counts


# ------------------------------------------------------------------------------ issue 14: defects 3, 7, 10


def _pod(name: str, revision: str = "rev-1", *, uid: str | None = None, deleting: bool = False,
         unschedulable: str | None = None) -> dict:
    """A pod as the API serves it (the fields the operator reads)."""
    meta = {"name": name, "uid": uid or f"uid-{name}", "labels": {rc.REVISION_LABEL: revision}}
    if deleting:
        meta["deletionTimestamp"] = "2026-11-29T12:00:00Z"
    status: dict = {"phase": "Running", "conditions": [{"type": "PodScheduled", "status": "True"}]}
    if unschedulable:
        status = {"phase": "Pending", "conditions": [{"type": "PodScheduled", "status": "False",
                                                      "reason": "Unschedulable", "message": unschedulable}]}
    return {"metadata": meta, "status": status}


class TestSecretFailureReleasesTheClaim:
    def test_a_refused_secret_leaves_the_worker_idle_and_says_why(self, registry):
        add_workers(registry, 1)

        def refuse(manifest):
            raise rc.SecretWriteError('secrets "ada-livekit" is forbidden: exceeded quota: q, requested: secrets=1')

        out = rc.assign_session(ref(), SPEC, {}, registry=registry, credentials=CREDS, apply_secret=refuse,
                                timeouts=TIMEOUTS, now=T0)
        assert out.status["phase"] == "Pending" and out.status["conditions"][0]["reason"] == "TokenSecretFailed"
        assert "exceeded quota" in out.status["message"] and out.events[0][:2] == ("Warning", "TokenSecretFailed")
        assert registry.worker_of("default/ada") is None, "the claim leaked"
        assert registry.idle_workers(POOL) == ["h200-0"]
        assert registry.next_message("h200-0", timeout_s=0) is None, "an assignment went out without a Secret"

    def test_an_unexpected_error_releases_the_claim_and_goes_on(self, registry):
        add_workers(registry, 1)

        def crash(manifest):
            raise ConnectionResetError("apiserver went away")

        with pytest.raises(ConnectionResetError):
            rc.assign_session(ref(), SPEC, {}, registry=registry, credentials=CREDS, apply_secret=crash,
                              timeouts=TIMEOUTS, now=T0)
        assert registry.worker_of("default/ada") is None and registry.idle_workers(POOL) == ["h200-0"]


class TestLongNames:
    def test_the_longest_session_name_is_assigned(self, registry):
        """Session ids are `<namespace>/<name>`: up to 63 + 1 + 253 characters in every message."""
        add_workers(registry, 1)
        name = ("talk." * 50)[:249] + "-ada"
        secrets: list[dict] = []
        out = assign(registry, name=name, secrets=secrets)
        assert out.status["phase"] == "Assigned", out.status
        assert registry.next_message("h200-0", timeout_s=0).session_id == f"default/{name}"
        assert len(secrets[0]["metadata"]["name"]) <= 253


class TestWhyNoWorker:
    counts = staticmethod(lambda **kw: rc.PoolCounts(pool=POOL, **kw))

    def run(self, registry, view, now=T0, status=None):
        return rc.assign_session(ref(), SPEC, status or {}, registry=registry, credentials=CREDS,
                                 apply_secret=lambda m: None, timeouts=TIMEOUTS, now=now, pool_view=lambda: view)

    def test_pool_not_found(self, registry):
        out = self.run(registry, rc.PoolView(pool=None))
        assert out.status["conditions"][0]["reason"] == "PoolNotFound"
        assert out.status["message"] == "WorkerPool h200 not found in namespace default"
        late = self.run(registry, rc.PoolView(pool=None), now=T0 + timedelta(seconds=31), status=out.status)
        assert late.status["phase"] == "Failed" and late.status["conditions"][0]["reason"] == "PoolNotFound"
        assert "not found" in late.status["message"] and "for 31s (limit 30s)" in late.status["message"]

    def test_the_schedulers_reason_is_quoted(self, registry):
        why = "0/3 nodes are available: 1 node(s) had untolerated taint(s), 2 Insufficient nvidia.com/gpu."
        view = rc.PoolView(pool={"spec": {"maxWorkers": 2}}, pods=(_pod("h200-0", unschedulable=why),))
        out = self.run(registry, view)
        assert out.status["conditions"][0]["reason"] == "WorkersUnschedulable"
        assert "1 of 1 pods cannot be scheduled" in out.status["message"] and why in out.status["message"]

    def test_a_pool_that_is_not_ready_says_so(self, registry):
        pool = {"spec": {"maxWorkers": 2}, "status": {"conditions": [
            {"type": "Ready", "status": "False", "reason": "StatefulSetRejected", "message": "denied by policy"}]}}
        out = self.run(registry, rc.PoolView(pool=pool))
        assert out.status["conditions"][0]["reason"] == "PoolNotReady" and "denied by policy" in out.status["message"]

    def test_busy_starting_and_empty_pools(self):
        pool = {"spec": {"maxWorkers": 2}}
        busy = rc.why_no_worker("h200", NS, rc.PoolView(pool, (_pod("h200-0"), _pod("h200-1"))),
                                self.counts(registry=2, busy=2))
        assert busy == ("NoIdleWorker", "pool h200 (0 idle, 2 busy, 0 starting): every worker is busy (maxWorkers 2)")
        warming = rc.why_no_worker("h200", NS, rc.PoolView(pool, (_pod("h200-0"),)), self.counts(registry=1, loading=1))
        assert warming[0] == "WaitingForWorker" and "warm up" in warming[1]
        empty = rc.why_no_worker("h200", NS, rc.PoolView(pool, ()), self.counts())
        assert empty == ("WaitingForWorker", "pool h200 has no worker pods yet")

    def test_an_unchanged_reason_writes_nothing(self, registry):
        first = self.run(registry, rc.PoolView(pool=None))
        again = self.run(registry, rc.PoolView(pool=None), status=first.status)
        assert again.status == {} and again.events == [] and again.retry_s


class TestRoll:
    def test_only_idle_outdated_pods_one_at_a_time(self):
        pods = [_pod("p-0", "old"), _pod("p-1", "old"), _pod("p-2", "old")]
        step = rc.plan_roll(pods, "new", 3, busy={"p-0"}, warm={"p-0", "p-1", "p-2"})
        assert step == rc.RollStep(pod="p-1", uid="uid-p-1", revision="old")
        # p-1 replaced, its successor not warm yet: wait
        pods[1] = _pod("p-1", "new", uid="uid-p-1b")
        assert rc.plan_roll(pods, "new", 3, busy={"p-0"}, warm={"p-0", "p-2"}) is None
        # warm now: the next idle one; the busy p-0 never
        assert rc.plan_roll(pods, "new", 3, busy={"p-0"}, warm={"p-0", "p-1", "p-2"}).pod == "p-2"
        pods[2] = _pod("p-2", "new", uid="uid-p-2b")
        assert rc.plan_roll(pods, "new", 3, busy={"p-0"}, warm={"p-0", "p-1", "p-2"}) is None
        # the session on p-0 ended
        assert rc.plan_roll(pods, "new", 3, busy=set(), warm={"p-0", "p-1", "p-2"}).pod == "p-0"

    def test_waits_for_terminating_or_missing_pods_and_prefers_cold_ones(self):
        pods = [_pod("p-0", "old"), _pod("p-1", "old", deleting=True)]
        assert rc.plan_roll(pods, "new", 2, busy=set(), warm={"p-0"}) is None
        assert rc.plan_roll([_pod("p-0", "old")], "new", 2, busy=set(), warm={"p-0"}) is None
        pods = [_pod("p-0", "old"), _pod("p-1", "old")]
        assert rc.plan_roll(pods, "new", 2, busy=set(), warm={"p-0"}).pod == "p-1", "a cold pod serves nothing"
        assert rc.plan_roll(pods, None, 2, busy=set(), warm=set()) is None

    def test_roll_pool_drains_the_chosen_worker(self, registry):
        add_workers(registry, 2)
        assign(registry, name="a")  # takes h200-0
        sts = {"spec": {"replicas": 2}, "status": {"updateRevision": "new"}}
        step = rc.roll_pool(POOL_NAME, NS, [_pod("h200-0", "old"), _pod("h200-1", "old")], sts, registry=registry)
        assert step is not None and step.pod == "h200-1"
        assert registry.claim_idle_worker(POOL, "default/b") is None, "a worker about to be deleted was claimed"
