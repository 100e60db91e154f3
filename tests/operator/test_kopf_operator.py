"""The operator end to end: kopf's `KopfRunner` against kmock (a Kubernetes API emulator) and a real Redis.

Stand-ins, because nothing real can run here: kmock plays the kube-apiserver (see kube_emulator.py
for what it adds and what it does not do: no garbage collection, no schema checks); `Fleet` plays
kubelet + worker pods, over the registry's real worker-side API in Redis: it starts (registers) a
warm worker for every StatefulSet replica, heart-beats, pops its inbox, reports session stats and
finishes sessions when told to end.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from typing import Any

import kmock
import kubernetes
import prometheus_client
import pytest
from conftest import RedisServer
from kopf.testing import KopfRunner
from kube_emulator import ApiServerEmulator
from vivant.apis import resources as r
from vivant.apis.feature_flags import FlagValues
from vivant.sessions.flags import FlagStore
from vivant.sessions.models import Assignment, EndRequest, SessionStats, WorkerInfo
from vivant.sessions.registry import Registry, RegistryUnavailable

pytestmark = [pytest.mark.kmock(cls=ApiServerEmulator), pytest.mark.timeout(120)]

NS = "default"
CS = f"/apis/{r.GROUP}/{r.VERSION}/namespaces/{NS}/{r.SESSION_PLURAL}"
WP = f"/apis/{r.GROUP}/{r.VERSION}/namespaces/{NS}/{r.POOL_PLURAL}"
RES_CS = kmock.resource(r.GROUP, r.VERSION, r.SESSION_PLURAL)
RES_WP = kmock.resource(r.GROUP, r.VERSION, r.POOL_PLURAL)
RES_STS = kmock.resource("apps", "v1", "statefulsets")
RES_SECRET = kmock.resource("", "v1", "secrets")
RES_EVENT = kmock.resource("", "v1", "events")
LIVEKIT_SECRET = "vivant-test-secret-" + "q" * 24


def pool_body(name="h200", min_idle=1, max_workers=3, fused=True) -> dict[str, Any]:
    return {
        "apiVersion": r.API_VERSION, "kind": r.POOL_KIND, "metadata": {"name": name, "namespace": NS},
        "spec": {"model": {"preset": "tiny", "checkpoint": "/models/tiny.safetensors"}, "image": "vivant:dev",
                 "minIdle": min_idle, "maxWorkers": max_workers, "flags": {"fusedGemmAllReduce": fused}},
    }


def session_body(name: str, pool="h200") -> dict[str, Any]:
    return {
        "apiVersion": r.API_VERSION, "kind": r.SESSION_KIND, "metadata": {"name": name, "namespace": NS},
        "spec": {"character": "ada-v1", "pool": pool, "maxDurationSeconds": 600,
                 "livekit": {"url": "wss://lk.example.com", "room": f"room-{name}", "agentIdentity": "agent-1"}},
    }


class Fleet:
    """kubelet + warm workers of one pool, simulated over Redis with the registry's worker API."""

    def __init__(self, kube: kmock.KubernetesEmulator, redis_url: str, pool_name: str = "h200", fps: float = 24.0):
        self.kube, self.pool_name = kube, pool_name
        self.pool = r.pool_key(NS, pool_name)
        self.registry = Registry(redis_url, heartbeat_ttl_s=1.0)
        self.flags = FlagStore(self.registry.redis)
        self.fps = fps
        self.alive: set[str] = set()
        self.killed: set[str] = set()
        self.sessions: dict[str, str] = {}  # worker -> session id
        self.assignments: list[Assignment] = []
        self.ends: list[EndRequest] = []
        self._task: asyncio.Task | None = None

    def replicas(self) -> int:
        key = (RES_STS, NS, self.pool_name)
        if key not in self.kube.objects or self.kube.objects[key].deleted:
            return 0
        return int(self.kube.objects[key].raw["spec"]["replicas"])

    def tick(self) -> None:
        try:
            self._tick()
        except RegistryUnavailable:
            pass  # Redis is down: a real worker keeps streaming and retries next tick

    def _tick(self) -> None:
        want = {f"{self.pool_name}-{i}" for i in range(self.replicas())} - self.killed
        for w in sorted(want - self.alive):
            self.registry.register(WorkerInfo(worker_id=w, pool=self.pool, warm=True))
            self.alive.add(w)
        for w in sorted(self.alive - want):
            self.registry.deregister(w, self.pool, "pod deleted")
            self.alive.discard(w)
        for w in sorted(self.alive):
            if not self.registry.heartbeat(w, self.pool):  # Redis came back empty: register again
                self.registry.register(WorkerInfo(worker_id=w, pool=self.pool, warm=True),
                                       session_id=self.sessions.get(w))
            while (msg := self.registry.next_message(w, 0)) is not None:
                self.registry.ack(w, msg)
                if isinstance(msg, Assignment):
                    self.assignments.append(msg)
                    self.sessions[w] = msg.session_id
                    self._report(w, "Connecting")
                elif isinstance(msg, EndRequest):
                    self.ends.append(msg)
                    if self.sessions.get(w) == msg.session_id:
                        self._report(w, "Ended", end_reason=msg.reason)
                        self.registry.finish(self.pool, w, msg.session_id, msg.reason)
                        del self.sessions[w]
            if w in self.sessions:
                self._report(w, "Streaming")

    def _report(self, worker: str, phase: str, end_reason: str | None = None) -> None:
        fused = self.flags.get(self.pool).values.fusedGemmAllReduce
        self.registry.report_session(self.sessions[worker], SessionStats(
            session_id=self.sessions[worker], worker_id=worker, phase=phase, fps=self.fps, streamed_s=5.0,
            flags=FlagValues(fusedGemmAllReduce=fused), end_reason=end_reason))

    def kill(self, worker: str) -> None:
        """The pod dies: no more heartbeats (its lease expires after heartbeat_ttl_s)."""
        self.killed.add(worker)
        self.alive.discard(worker)
        self.sessions.pop(worker, None)

    async def _run(self) -> None:
        while True:
            self.tick()
            await asyncio.sleep(0.1)

    async def __aenter__(self) -> Fleet:
        self._task = asyncio.create_task(self._run())
        return self

    async def __aexit__(self, *exc) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self.registry.close()


@pytest.fixture
async def kube(kmock, redis_url, monkeypatch, tmp_path):
    """kmock as the cluster: a kubeconfig pointing at it (read by kopf's login and by the operator's
    kubernetes client), the resources the operator uses, and the operator's environment."""
    kubeconfig = tmp_path / "kubeconfig"
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    # kubernetes reads $KUBECONFIG once, at import; kopf's login uses that default.
    monkeypatch.setattr(kubernetes.config.kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", str(kubeconfig))
    kubeconfig.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "kmock",
        "clusters": [{"name": "kmock", "cluster": {"server": str(kmock.url).rstrip("/")}}],
        "users": [{"name": "kmock", "user": {"token": "test"}}],
        "contexts": [{"name": "kmock", "context": {"cluster": "kmock", "user": "kmock"}}],
    }))
    verbs = {"list", "watch", "get", "patch", "create", "delete", "update"}
    kmock.resources[f"{r.GROUP}/{r.VERSION}/{r.SESSION_PLURAL}"] = kmock.ResourceInfo(
        kind=r.SESSION_KIND, namespaced=True, verbs=verbs, subresources={"status"}, shortnames={"cs"})
    kmock.resources[f"{r.GROUP}/{r.VERSION}/{r.POOL_PLURAL}"] = kmock.ResourceInfo(
        kind=r.POOL_KIND, namespaced=True, verbs=verbs, subresources={"status", "scale"}, shortnames={"wp"})
    kmock.resources["apps/v1/statefulsets"] = kmock.ResourceInfo(kind="StatefulSet", namespaced=True, verbs=verbs)
    kmock.resources["v1/services"] = kmock.ResourceInfo(kind="Service", namespaced=True, verbs=verbs)
    kmock.resources["v1/secrets"] = kmock.ResourceInfo(kind="Secret", namespaced=True, verbs=verbs)
    kmock.resources["v1/events"] = kmock.ResourceInfo(kind="Event", namespaced=True, verbs=verbs)
    kmock.resources["apiextensions.k8s.io/v1/customresourcedefinitions"] = kmock.ResourceInfo(
        kind="CustomResourceDefinition", namespaced=False, verbs=verbs)
    kmock.resources["v1/namespaces"] = kmock.ResourceInfo(kind="Namespace", namespaced=False, verbs=verbs)
    kmock.resources["policy/v1/poddisruptionbudgets"] = kmock.ResourceInfo(
        kind="PodDisruptionBudget", namespaced=True, verbs=verbs)
    monkeypatch.setenv("VIVANT_REDIS_URL", redis_url)
    monkeypatch.setenv("LIVEKIT_API_KEY", "APItestkey")
    monkeypatch.setenv("LIVEKIT_API_SECRET", LIVEKIT_SECRET)
    monkeypatch.setenv("VIVANT_HEARTBEAT_TTL_S", "1.0")
    monkeypatch.setenv("VIVANT_CONNECT_TIMEOUT_S", "30")
    return kmock


class LogCapture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(level=logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))


@contextlib.asynccontextmanager
async def operator(logs: LogCapture | None = None):
    """Run the operator (kopf run -A --standalone -m vivant.operator.handlers) in a thread."""
    root = logging.getLogger()
    if logs is not None:
        root.addHandler(logs)
    runner = KopfRunner(["run", "-A", "--standalone", "--verbose", "-m", "vivant.operator.handlers"], timeout=30)
    runner.__enter__()
    try:
        yield runner
    finally:
        await asyncio.to_thread(runner.__exit__, None, None, None)
        if logs is not None:
            root.removeHandler(logs)


async def create(kube, path: str, body: dict[str, Any]) -> None:
    async with kube.post(path, json=body) as resp:
        assert resp.status < 300, f"create {path}: HTTP {resp.status}: {await resp.text()}"


async def merge_patch(kube, path: str, body: dict[str, Any]) -> None:
    async with kube.patch(path, json=body, headers={"Content-Type": "application/merge-patch+json"}) as resp:
        assert resp.status < 300, f"patch {path}: HTTP {resp.status}: {await resp.text()}"


async def delete(kube, path: str) -> None:
    async with kube.delete(path) as resp:
        assert resp.status < 300, f"delete {path}: HTTP {resp.status}: {await resp.text()}"


def obj(kube, resource, name) -> dict[str, Any] | None:
    key = (resource, NS, name)
    if key not in kube.objects or kube.objects[key].deleted:
        return None
    return kube.objects[key].raw


async def wait_for(what: str, probe, timeout: float = 20.0):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = probe()
        if last:
            return last
        await asyncio.sleep(0.1)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}; last seen: {last!r}")


def phase(kube, name):
    o = obj(kube, RES_CS, name)
    return (o or {}).get("status", {}).get("phase")


class TestSessionLifecycle:
    async def test_create_assign_stream_delete_release(self, kube, redis_url):
        logs = LogCapture()
        async with Fleet(kube, redis_url) as fleet, operator(logs) as runner:
            await create(kube, WP, pool_body(min_idle=1, max_workers=3))
            await wait_for("the pool's StatefulSet", lambda: obj(kube, RES_STS, "h200"))
            await wait_for("a warm worker", lambda: fleet.alive)
            await create(kube, CS, session_body("ada"))
            await wait_for("session Streaming", lambda: phase(kube, "ada") == "Streaming")
            status = obj(kube, RES_CS, "ada")["status"]
            assert status["worker"] == "h200-0" and status["avgFps"] == 24.0, status
            secret = await wait_for("the token Secret", lambda: obj(kube, RES_SECRET, "ada-livekit"))
            token = secret["stringData"]["token"]
            assert fleet.assignments[0].token.get_secret_value() == token
            assert secret["metadata"]["ownerReferences"][0]["uid"] == obj(kube, RES_CS, "ada")["metadata"]["uid"]
            await wait_for("scale-up to busy + minIdle = 2", lambda: fleet.replicas() == 2)
            pool = await wait_for("pool status busy=1", lambda: (obj(kube, RES_WP, "h200").get("status", {}).get("busy") == 1)
                                  and obj(kube, RES_WP, "h200")["status"])
            assert pool["flags"] == {"fusedGemmAllReduce": True}, pool

            metric = prometheus_client.REGISTRY.get_sample_value
            assert metric("vivant_operator_pool_workers", {"pool": "default/h200", "state": "busy"}) == 1
            assert metric("vivant_operator_assignment_latency_seconds_count", {"pool": "default/h200"}) >= 1
            await wait_for("sessions gauge: 1 Streaming", lambda: metric(
                "vivant_operator_sessions", {"namespace": NS, "pool": "default/h200", "phase": "Streaming"}) == 1)

            await delete(kube, f"{CS}/ada")
            await wait_for("the session to be gone (finalizer released)", lambda: obj(kube, RES_CS, "ada") is None)
            assert [e.session_id for e in fleet.ends] == [f"{NS}/ada"], fleet.ends
            assert fleet.registry.worker_of(f"{NS}/ada") is None
            await wait_for("scale-down to minIdle = 1", lambda: fleet.replicas() == 1)
        # The token never leaves the Secret and the worker's inbox.
        events = [o.raw for key, o in kube.objects.items() if key[0] == RES_EVENT and not o.deleted]
        assert any(e.get("reason") == "WorkerAssigned" for e in events), f"no WorkerAssigned event in {events}"
        assert any("assigned to worker h200-0" in line for line in logs.lines), "operator logs were not captured"
        recorded = json.dumps([{"url": str(q.url), "data": q.data} for q in list(kube)
                               if q.resource != RES_SECRET])
        assert token not in recorded, "the LiveKit token leaked into a non-Secret API request"
        for resource in (RES_CS, RES_EVENT):
            for key, o in kube.objects.items():
                if key[0] == resource:
                    assert token not in json.dumps([v.raw for v in o.history if v is not None]), f"token found in {key}"
        assert token not in "\n".join(logs.lines) + runner.output, "the token leaked into logs"
        assert LIVEKIT_SECRET not in "\n".join(logs.lines) + runner.output + recorded


def pool_status(kube, name="h200") -> dict[str, Any]:
    return (obj(kube, RES_WP, name) or {}).get("status", {})


def condition(status: dict[str, Any], type_: str) -> dict[str, Any] | None:
    return next((c for c in status.get("conditions", []) if c["type"] == type_), None)


class TestWorkerLoss:
    async def test_lost_worker_fails_its_session_and_the_slot_is_reclaimed(self, kube, redis_url):
        async with Fleet(kube, redis_url) as fleet, operator():
            await create(kube, WP, pool_body(min_idle=1, max_workers=2))
            await wait_for("a warm worker", lambda: fleet.alive)
            await create(kube, CS, session_body("ada"))
            await wait_for("session Streaming", lambda: phase(kube, "ada") == "Streaming")
            fleet.kill("h200-0")  # the pod dies mid-session: heartbeats stop
            await wait_for("session Failed", lambda: phase(kube, "ada") == "Failed")
            status = obj(kube, RES_CS, "ada")["status"]
            ready = condition(status, "Ready")
            assert ready["reason"] == "WorkerLost" and "heartbeat" in ready["message"], status
            assert fleet.registry.worker_of(f"{NS}/ada") is None
            fleet.killed.discard("h200-0")  # the StatefulSet restarts the pod; it re-registers warm
            await wait_for("h200-0 idle again", lambda: "h200-0" in fleet.registry.idle_workers(fleet.pool))
            await create(kube, CS, session_body("bob"))
            await wait_for("bob Streaming", lambda: phase(kube, "bob") == "Streaming")
            assert obj(kube, RES_CS, "ada")["status"]["phase"] == "Failed", "a Failed session must stay Failed"


class TestOperatorRestart:
    async def test_sessions_converge_after_restart_without_double_assignment(self, kube, redis_url):
        async with Fleet(kube, redis_url) as fleet:
            async with operator():
                await create(kube, WP, pool_body(min_idle=2, max_workers=3))
                await wait_for("two warm workers", lambda: len(fleet.alive) == 2)
                await create(kube, CS, session_body("s1"))
                await wait_for("s1 Streaming", lambda: phase(kube, "s1") == "Streaming")
            # The operator is down: new sessions arrive, s1's worker ends it on its own.
            await create(kube, CS, session_body("s2"))
            await create(kube, CS, session_body("s3"))
            w1 = obj(kube, RES_CS, "s1")["status"]["worker"]
            fleet.registry.send_end(w1, f"{NS}/s1", "user hung up")
            await wait_for("s1's worker to finish", lambda: w1 not in fleet.sessions)
            assert phase(kube, "s2") is None and phase(kube, "s3") is None
            async with operator():
                for name in ("s2", "s3"):
                    await wait_for(f"{name} Streaming", lambda n=name: phase(kube, n) == "Streaming")
                await wait_for("s1 Ended", lambda: phase(kube, "s1") == "Ended")
                await asyncio.sleep(1.5)  # a few more reconcile ticks: nothing may move
            workers = {n: obj(kube, RES_CS, n)["status"]["worker"] for n in ("s2", "s3")}
            assert len(set(workers.values())) == 2, f"two sessions share a worker: {workers}"
            per_session: dict[str, set[str]] = {}
            for a in fleet.assignments:
                per_session.setdefault(a.session_id, set()).add(fleet.registry.worker_of(a.session_id) or "")
            holders = [fleet.registry.worker_of(f"{NS}/{n}") for n in ("s2", "s3")]
            assert holders == [workers["s2"], workers["s3"]], holders
            assert sorted(a.session_id for a in fleet.assignments) == [f"{NS}/s1", f"{NS}/s2", f"{NS}/s3"], \
                [a.session_id for a in fleet.assignments]


class TestFlagRollback:
    async def test_auto_rollback_sticks_until_the_spec_is_edited(self, kube, redis_url):
        async with Fleet(kube, redis_url, fps=20.0) as fleet, operator():
            await create(kube, WP, pool_body(fused=True))
            await wait_for("fused flag on in Redis", lambda: fleet.flags.get(fleet.pool).values.fusedGemmAllReduce)
            await create(kube, CS, session_body("slow"))
            await wait_for("auto-rollback in Redis", lambda: not fleet.flags.get(fleet.pool).values.fusedGemmAllReduce)
            flagset = fleet.flags.get(fleet.pool)
            assert flagset.updated_by == "operator:auto-rollback", flagset
            cond = await wait_for("pool condition FlagsMatchSpec=False",
                                  lambda: (c := condition(pool_status(kube), "FlagsMatchSpec")) and c["status"] == "False" and c)
            assert cond["reason"] == "AutoRollback", cond
            kinds = await wait_for("FlagRolledBack events on the pool and the session", lambda: (k := {
                e.raw["involvedObject"]["kind"] for key, e in kube.objects.items()
                if key[0] == RES_EVENT and not e.deleted and e.raw.get("reason") == "FlagRolledBack"
            }) >= {"WorkerPool", "CharacterSession"} and k)
            assert kinds
            fleet.fps = 24.0
            await asyncio.sleep(2.5)  # resyncs of the same generation must not re-enable it
            assert not fleet.flags.get(fleet.pool).values.fusedGemmAllReduce, "resync undid the rollback"
            await merge_patch(kube, f"{WP}/h200", {"spec": {"minIdle": 2}})  # the user edits the spec
            await wait_for("spec re-applied: flag on", lambda: fleet.flags.get(fleet.pool).values.fusedGemmAllReduce)
            await wait_for("pool condition FlagsMatchSpec=True",
                           lambda: (condition(pool_status(kube), "FlagsMatchSpec") or {}).get("status") == "True")

    async def test_cli_rollback_is_kept_and_the_spec_restores(self, kube, redis_url):
        async with Fleet(kube, redis_url) as fleet, operator():
            await create(kube, WP, pool_body(fused=True))
            await wait_for("fused flag on", lambda: fleet.flags.get(fleet.pool).values.fusedGemmAllReduce)
            fleet.flags.set(fleet.pool, {"fusedGemmAllReduce": "false"}, actor="oncall@laptop", reason="incident 42")
            cond = await wait_for("condition OverriddenOutsideSpec",
                                  lambda: (c := condition(pool_status(kube), "FlagsMatchSpec")) and c["status"] == "False" and c)
            assert cond["reason"] == "OverriddenOutsideSpec" and "oncall@laptop" in cond["message"], cond
            assert pool_status(kube)["flags"] == {"fusedGemmAllReduce": False}
            await asyncio.sleep(2.5)
            assert not fleet.flags.get(fleet.pool).values.fusedGemmAllReduce, "the operator undid the CLI rollback"
            await merge_patch(kube, f"{WP}/h200", {"spec": {"flags": {"fusedGemmAllReduce": True}, "minIdle": 0}})
            await wait_for("spec edit re-applies the flag", lambda: fleet.flags.get(fleet.pool).values.fusedGemmAllReduce)


class TestRedisOutage:
    async def test_operator_retries_and_assigns_once_redis_is_back(self, kube, monkeypatch):
        """Redis goes away (and comes back empty, no persistence); a session created meanwhile is assigned."""
        server = RedisServer()
        monkeypatch.setenv("VIVANT_REDIS_URL", server.url)
        try:
            async with Fleet(kube, server.url) as fleet, operator():
                await create(kube, WP, pool_body(min_idle=1, max_workers=2, fused=False))
                await wait_for("a warm worker", lambda: fleet.alive)
                server.stop()
                await create(kube, CS, session_body("ada"))
                await asyncio.sleep(2.0)
                assert phase(kube, "ada") in (None, "Pending"), obj(kube, RES_CS, "ada")
                server.start()
                await wait_for("ada Streaming after the outage", lambda: phase(kube, "ada") == "Streaming", timeout=40)
                assert [a.session_id for a in fleet.assignments] == [f"{NS}/ada"], fleet.assignments
        finally:
            server.stop()


class TestBadSpec:
    async def test_malformed_session_is_marked_failed_naming_the_field(self, kube, redis_url):
        """kmock validates nothing (a CRD installed by hand may be older): the operator's own check answers."""
        async with Fleet(kube, redis_url) as fleet, operator():
            await create(kube, WP, pool_body())
            await wait_for("a warm worker", lambda: fleet.alive)
            bad = session_body("typo")
            bad["spec"]["maxDurationSeconds"] = "ten minutes"
            await create(kube, CS, bad)
            await wait_for("session Failed", lambda: phase(kube, "typo") == "Failed")
            status = obj(kube, RES_CS, "typo")["status"]
            assert "maxDurationSeconds" in status["message"] and status["conditions"][0]["reason"] == "InvalidSpec", status
            assert fleet.assignments == [] and fleet.registry.idle_workers(fleet.pool) == ["h200-0"]
