"""The operator end to end on the real apiserver: kopf's `KopfRunner` in this process, and a real Redis.

Real: the kube-apiserver (the CRDs' schemas and status subresources, resourceVersions, finalizers,
Events), the controller-manager (the pool's StatefulSet makes its pods; the garbage collector deletes a
session's token Secret with the session), the scheduler (the pods land on the simulated H100 nodes), kwok
(it keeps them Running), Redis, and the operator's handlers under kopf.

Why the operator runs in this process (KopfRunner, admin kubeconfig, watching only the test's namespace)
and not as the helm-installed release: each test then has a Redis of its own (flushed; stopped and
started for the outage case), 1 s worker heartbeats (a lost worker shows in seconds, not the chart's
10 s), the operator's Prometheus registry and log lines at hand, and can stop and start the operator at
exact points — none of which can be set on the shared release without disturbing the other tests. The
chart's RBAC and the operator as a pod are the release tests' subject (test_quickstart.py, test_flows*).
The release's own cluster-wide operator is paused for this module (`release_operators_paused`) so that no
object is handled by two operators.

Stand-in: `Fleet` plays the worker processes inside the pool's pods (see its docstring for why).
"""

from __future__ import annotations

import base64
import contextlib
import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import kubernetes
import prometheus_client
import pytest
from conftest import Kube, wait_for
from kopf.testing import KopfRunner
from kubernetes.client.rest import ApiException
from vivant.apis import resources
from vivant.apis.feature_flags import FlagValues
from vivant.sessions.flags import FlagStore
from vivant.sessions.models import Assignment, EndRequest, SessionStats, WorkerInfo
from vivant.sessions.registry import Registry, RegistryUnavailable

pytestmark = [pytest.mark.usefixtures("vivant_crds", "release_operators_paused"), pytest.mark.timeout(180)]

# Not `vivant...`: the cluster's pod runner starts real processes only for images named so.
SIM_IMAGE = "registry.example/sim-worker:1"
LIVEKIT_SECRET = "vivant-test-secret-" + "q" * 24
HEARTBEAT_TTL_S = 1.0


def pool_body(name: str = "h200", min_idle: int = 1, max_workers: int = 3, fused: bool = True) -> dict[str, Any]:
    """A pool on the simulated H100 nodes (their label and GPU taint), 2 GPUs a worker (4 fit a node)."""
    return {
        "apiVersion": resources.API_VERSION, "kind": resources.POOL_KIND, "metadata": {"name": name},
        "spec": {"model": {"preset": "tiny", "checkpoint": "random://tiny"}, "image": SIM_IMAGE,
                 "gpusPerWorker": 2, "tensorParallel": 1, "runner": "pipeline",
                 "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
                 "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
                 "minIdle": min_idle, "maxWorkers": max_workers, "flags": {"fusedGemmAllReduce": fused}},
    }


def session_body(name: str, pool: str = "h200") -> dict[str, Any]:
    return {
        "apiVersion": resources.API_VERSION, "kind": resources.SESSION_KIND, "metadata": {"name": name},
        "spec": {"character": "ada-v1", "pool": pool, "maxDurationSeconds": 600,
                 "livekit": {"url": "wss://lk.example.com", "room": f"room-{name}", "agentIdentity": "agent-1"}},
    }


class Space:
    """The test's namespace on the apiserver, read and written with the admin client."""

    def __init__(self, client: Any, name: str) -> None:
        self.client, self.name = client, name
        self.custom = kubernetes.client.CustomObjectsApi(client)
        self.core = kubernetes.client.CoreV1Api(client)
        self.apps = kubernetes.client.AppsV1Api(client)

    def create(self, body: dict[str, Any]) -> dict[str, Any]:
        plural = resources.SESSION_PLURAL if body["kind"] == resources.SESSION_KIND else resources.POOL_PLURAL
        return self.custom.create_namespaced_custom_object(resources.GROUP, resources.VERSION, self.name, plural, body)

    def _get(self, plural: str, name: str) -> dict[str, Any] | None:
        try:
            return self.custom.get_namespaced_custom_object(resources.GROUP, resources.VERSION, self.name, plural, name)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def session(self, name: str) -> dict[str, Any] | None:
        return self._get(resources.SESSION_PLURAL, name)

    def pool(self, name: str = "h200") -> dict[str, Any] | None:
        return self._get(resources.POOL_PLURAL, name)

    def phase(self, name: str) -> str | None:
        return ((self.session(name) or {}).get("status") or {}).get("phase")

    def pool_status(self, name: str = "h200") -> dict[str, Any]:
        return (self.pool(name) or {}).get("status") or {}

    def patch_pool(self, name: str, body: dict[str, Any]) -> None:
        self.custom.patch_namespaced_custom_object(resources.GROUP, resources.VERSION, self.name, resources.POOL_PLURAL, name, body)

    def delete_session(self, name: str) -> None:
        self.custom.delete_namespaced_custom_object(resources.GROUP, resources.VERSION, self.name, resources.SESSION_PLURAL, name)

    def secret(self, name: str) -> Any | None:
        try:
            return self.core.read_namespaced_secret(name, self.name)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def events(self) -> list[dict[str, Any]]:
        return [self.client.sanitize_for_serialization(e) for e in self.core.list_namespaced_event(self.name).items]

    def replicas(self, statefulset: str) -> int:
        """spec.replicas of the StatefulSet, 0 while it does not exist."""
        try:
            return int(self.apps.read_namespaced_stateful_set(statefulset, self.name).spec.replicas or 0)
        except ApiException as exc:
            if exc.status == 404:
                return 0
            raise

    def bound_pods(self, pool: str) -> dict[str, str]:
        """Pod name -> node of the pool's pods that the scheduler bound to a node and that are not being
        deleted: the pods whose processes run (what the cluster's pod runner starts processes for)."""
        pods = self.core.list_namespaced_pod(self.name, label_selector=f"vivant.dev/pool={pool}").items
        return {p.metadata.name: p.spec.node_name for p in pods
                if p.spec.node_name and p.metadata.deletion_timestamp is None}

    def clear(self) -> None:
        """Delete the test's sessions and pools now, so that no operator started later (the release's, when
        it is restored) finds them in the namespace while it is being deleted. The finalizers the sessions
        still hold are dropped first: the operator under test is gone, and the Redis they would have
        cleaned is the test's own."""
        listing = self.custom.list_namespaced_custom_object(resources.GROUP, resources.VERSION, self.name, resources.SESSION_PLURAL)
        for cs in listing["items"]:
            if cs["metadata"].get("finalizers"):
                self.custom.patch_namespaced_custom_object(resources.GROUP, resources.VERSION, self.name, resources.SESSION_PLURAL,
                                                           cs["metadata"]["name"], {"metadata": {"finalizers": None}})
        for plural in (resources.SESSION_PLURAL, resources.POOL_PLURAL):
            self.custom.delete_collection_namespaced_custom_object(resources.GROUP, resources.VERSION, self.name, plural)

    def dump(self, kube: Kube) -> str:
        """Every object of every listable namespaced kind in the namespace, as JSON text."""
        kinds = kube.kubectl("api-resources", "--namespaced=true", "--verbs=list", "-o", "name").stdout.split()
        return kube.kubectl("get", ",".join(kinds), "-n", self.name, "-o", "json").stdout


class Fleet:
    """The worker processes of one pool's pods, simulated over the registry's real worker protocol.

    The pods are real: the operator's StatefulSet makes them and the scheduler binds them to the simulated
    H100 nodes. For every bound pod (as the cluster's pod runner does for real processes) this plays the
    process inside, as `vivant worker` does in Redis: it registers warm, heart-beats, pops its inbox, reports session stats,
    finishes a session when told to end, and deregisters when its pod goes. A stand-in because real
    `vivant worker` processes (torch and the tiny model, each a CPU hog for its start and its chunk loop)
    are too heavy to run two or three per test, a dozen tests in a row, on the 2 CPU cores of CI; these
    tests are about the operator, and tests/cluster/test_quickstart.py and the flow tests run real workers.
    The pool's image (`SIM_IMAGE`) keeps the cluster's pod runner from starting real ones beside these.
    `kill` is a crashed process (heartbeats stop, no goodbye); `restart` the kubelet starting it again.
    """

    def __init__(self, space: Space, redis_url: str, pool_name: str = "h200", fps: float = 24.0) -> None:
        self.space, self.pool_name = space, pool_name
        self.pool = resources.pool_key(space.name, pool_name)
        self.registry = Registry(redis_url, heartbeat_ttl_s=HEARTBEAT_TTL_S)
        self.flags = FlagStore(self.registry.redis)
        self.fps = fps
        self.alive: set[str] = set()
        self.killed: set[str] = set()
        self.sessions: dict[str, str] = {}  # worker -> session id
        self.nodes: dict[str, str] = {}  # worker -> node its pod runs on
        self.assignments: list[Assignment] = []
        self.ends: list[EndRequest] = []
        self.error: BaseException | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"fleet-{pool_name}", daemon=True)

    def replicas(self) -> int:
        return self.space.replicas(self.pool_name)

    def kill(self, worker: str) -> None:
        """The worker's process dies: no more heartbeats (its lease expires after the heartbeat TTL)."""
        with self._lock:
            self.killed.add(worker)
            self.alive.discard(worker)
            self.sessions.pop(worker, None)

    def restart(self, worker: str) -> None:
        """The kubelet starts the crashed process again in its pod: it registers warm on the next tick."""
        with self._lock:
            self.killed.discard(worker)

    def _run(self) -> None:
        pods: dict[str, str] = {}
        next_list = 0.0
        while not self._stop.is_set():
            try:
                if time.monotonic() >= next_list:
                    pods = self.space.bound_pods(self.pool_name)
                    next_list = time.monotonic() + 0.25
                with self._lock:
                    self._tick(pods)
            except RegistryUnavailable:
                pass  # Redis is down: a real worker keeps streaming and retries
            except ApiException as exc:
                if exc.status < 500:
                    self.error = exc
                    return
            except BaseException as exc:  # a bug here: surfaced by __exit__
                self.error = exc
                return
            self._stop.wait(0.1)

    def _tick(self, pods: dict[str, str]) -> None:
        want = set(pods) - self.killed
        for w in sorted(want - self.alive):
            self.registry.register(WorkerInfo(worker_id=w, pool=self.pool, warm=True, node=pods[w]))
            self.alive.add(w)
            self.nodes[w] = pods[w]
        for w in sorted(self.alive - want):
            self.registry.deregister(w, self.pool, "pod deleted")
            self.alive.discard(w)
            self.sessions.pop(w, None)
        for w in sorted(self.alive):
            if not self.registry.heartbeat(w, self.pool):  # Redis came back empty: register again
                self.registry.register(WorkerInfo(worker_id=w, pool=self.pool, warm=True, node=self.nodes[w]),
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

    def __enter__(self) -> Fleet:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self.registry.close()
        if self.error is not None and exc[0] is None:
            raise AssertionError(f"the simulated fleet failed: {self.error!r}") from self.error


class History:
    """Every version of the namespace's CharacterSessions and Events while it runs: one watch of each,
    resumed from the last resourceVersion, so no write the apiserver accepted is missed."""

    def __init__(self, space: Space) -> None:
        self.space = space
        self.versions: list[dict[str, Any]] = []
        self.error: BaseException | None = None
        self._stop = threading.Event()
        custom, core = space.custom, space.core
        self._threads = [
            threading.Thread(target=self._follow, daemon=True, args=(
                custom.list_namespaced_custom_object, resources.GROUP, resources.VERSION, space.name, resources.SESSION_PLURAL)),
            threading.Thread(target=self._follow, daemon=True, args=(core.list_namespaced_event, space.name)),
        ]

    def _follow(self, list_fn: Callable[..., Any], *args: Any) -> None:
        try:
            self._watch(list_fn, *args)
        except BaseException as exc:  # surfaced by __exit__: a gap in the history must fail the test
            self.error = exc

    def _watch(self, list_fn: Callable[..., Any], *args: Any) -> None:
        version: str | None = None
        while not self._stop.is_set():
            try:
                for event in kubernetes.watch.Watch().stream(list_fn, *args, resource_version=version,
                                                             timeout_seconds=1):
                    obj = event["object"]
                    obj = obj if isinstance(obj, dict) else self.space.client.sanitize_for_serialization(obj)
                    self.versions.append(obj)
                    version = obj["metadata"]["resourceVersion"]
            except ApiException as exc:
                if exc.status == 410:
                    version = None  # expired: list again (every object comes again as ADDED)
                elif exc.status == 504:  # "Too large resource version": the watch cache lags; ask again
                    self._stop.wait(0.2)
                else:
                    raise

    def __enter__(self) -> History:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=5)
        if self.error is not None and exc[0] is None:
            raise AssertionError(f"the watch of the namespace failed: {self.error!r}") from self.error


class LogCapture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(level=logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))


@contextlib.contextmanager
def operator(namespace: str, logs: LogCapture | None = None) -> Iterator[KopfRunner]:
    """`kopf run --standalone -n <namespace> -m vivant.operator.handlers` in a thread of this process."""
    root = logging.getLogger()
    if logs is not None:
        root.addHandler(logs)
    try:
        with KopfRunner(["run", "--standalone", "--verbose", "-n", namespace, "-m", "vivant.operator.handlers"],
                        timeout=60) as runner:
            yield runner
    finally:
        if logs is not None:
            root.removeHandler(logs)


@pytest.fixture
def space(kube: Kube, kube_client: Any, namespace: str, redis_url: str,
          monkeypatch: pytest.MonkeyPatch) -> Iterator[Space]:
    """The test's namespace, and the operator's environment: the admin kubeconfig (read by kopf's login
    and by the operator's kubernetes client), the test's Redis, 1 s heartbeats, dev LiveKit credentials."""
    monkeypatch.setenv("KUBECONFIG", str(kube.kubeconfig))
    # the operator's kubernetes client sets the process-wide default configuration: undone after the test
    monkeypatch.setattr(kubernetes.client.Configuration, "_default", kubernetes.client.Configuration._default)
    # kubernetes reads $KUBECONFIG once, at import; kopf's login uses that default.
    monkeypatch.setattr(kubernetes.config.kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", str(kube.kubeconfig))
    monkeypatch.setenv("VIVANT_REDIS_URL", redis_url)
    monkeypatch.setenv("LIVEKIT_API_KEY", "APItestkey")
    monkeypatch.setenv("LIVEKIT_API_SECRET", LIVEKIT_SECRET)
    monkeypatch.setenv("VIVANT_HEARTBEAT_TTL_S", str(HEARTBEAT_TTL_S))
    # a silent worker is reaped after this (the default, 30 s, rides out Redis outages; docs/reliability.md)
    monkeypatch.setenv("VIVANT_REAP_GRACE_S", str(2 * HEARTBEAT_TTL_S))
    monkeypatch.setenv("VIVANT_CONNECT_TIMEOUT_S", "30")
    s = Space(kube_client, namespace)
    yield s
    s.clear()


def condition(status: dict[str, Any], type_: str) -> dict[str, Any] | None:
    return next((c for c in status.get("conditions", []) if c["type"] == type_), None)


def flag_rolled_back_kinds(space: Space) -> set[str]:
    return {e["involvedObject"]["kind"] for e in space.events() if e.get("reason") == "FlagRolledBack"}


class TestSessionLifecycle:
    def test_create_assign_stream_delete_release(self, space: Space, kube: Kube, redis_url: str) -> None:
        logs = LogCapture()
        ns = space.name
        with History(space) as history, Fleet(space, redis_url) as fleet, operator(ns, logs) as runner:
            space.create(pool_body(min_idle=1, max_workers=3))
            wait_for(lambda: fleet.replicas() == 1, "the pool's StatefulSet at minIdle = 1", 30)
            wait_for(lambda: fleet.alive, "a warm worker in a scheduled pod", 30)
            assert set(fleet.nodes.values()) <= {n.metadata.name for n in space.core.list_node(
                label_selector="vivant.dev/node-pool=h100").items}, f"pods not on the H100 nodes: {fleet.nodes}"
            space.create(session_body("ada"))
            wait_for(lambda: space.phase("ada") == "Streaming", "session Streaming", 30)
            cs = space.session("ada")
            status = cs["status"]
            assert status["worker"] == "h200-0" and status["avgFps"] == 24.0, status
            secret = wait_for(lambda: space.secret("ada-livekit"), "the token Secret")
            token = base64.b64decode(secret.data["token"]).decode()
            assert fleet.assignments[0].token.get_secret_value() == token
            [owner] = secret.metadata.owner_references
            assert (owner.kind, owner.name, owner.uid, owner.controller) == (resources.SESSION_KIND, "ada", cs["metadata"]["uid"],
                                                                            True), owner
            wait_for(lambda: fleet.replicas() == 2, "scale-up to busy + minIdle = 2")
            wait_for(lambda: len(fleet.alive) == 2, "the second pod scheduled, its worker warm")
            pool = wait_for(lambda: space.pool_status().get("busy") == 1 and space.pool_status(), "pool status busy=1")
            assert pool["flags"] == {"fusedGemmAllReduce": True}, pool

            metric = prometheus_client.REGISTRY.get_sample_value
            assert metric("vivant_operator_pool_workers", {"pool": f"{ns}/h200", "state": "busy"}) == 1
            assert metric("vivant_operator_assignment_latency_seconds_count", {"pool": f"{ns}/h200"}) >= 1
            wait_for(lambda: metric("vivant_operator_sessions",
                                    {"namespace": ns, "pool": f"{ns}/h200", "phase": "Streaming"}) == 1,
                     "sessions gauge: 1 Streaming")

            space.delete_session("ada")
            wait_for(lambda: space.session("ada") is None, "the session to be gone (finalizer released)")
            assert [e.session_id for e in fleet.ends] == [f"{ns}/ada"], fleet.ends
            assert fleet.registry.worker_of(f"{ns}/ada") is None
            # the operator deletes its token Secret with the session (the garbage collector, through the owner
            # reference, lagged tens of seconds behind a burst of deletes)
            wait_for(lambda: space.secret("ada-livekit") is None, "the token Secret deleted with the session", 2)
            wait_for(lambda: fleet.replicas() == 1, "scale-down to minIdle = 1")
        # The token never leaves the Secret and the worker's inbox: not in any object of the namespace
        # (every kind), nor in any version of a session or an Event written while it ran, nor in a log line.
        events = space.events()
        assert any(e.get("reason") == "WorkerAssigned" for e in events), f"no WorkerAssigned event in {events}"
        assert any("assigned to worker h200-0" in line for line in logs.lines), "operator logs were not captured"
        seen = json.dumps(history.versions)
        assert any(v.get("kind") == resources.SESSION_KIND and (v.get("status") or {}).get("phase") == "Streaming"
                   for v in history.versions), "positive control: the watch saw the session stream"
        everything = space.dump(kube)
        assert token not in seen, "the LiveKit token was written into a session or an Event"
        assert token not in everything, "the LiveKit token is in an object other than its Secret"
        output = "\n".join(logs.lines) + runner.output
        assert token not in output, "the token leaked into logs"
        assert LIVEKIT_SECRET not in output + seen + everything


class TestAssignedOnce:
    def test_each_session_is_handled_and_sent_once_and_no_version_shows_a_status_before_kopfs_record(
            self, space: Space, redis_url: str) -> None:
        """kopf runs a session's create handler again when it processes a version of the object without its
        record that the handler ran (the diff-base annotation) after that record was written: it waits for its
        own write in the watch for `consistency_timeout` (5 s), then takes the older version for the current one.
        The operator's status writer wrote Assigned between kopf's two writes, so under a lagging watch (a burst
        of 1,000) the handler ran again, and the session was handed to its worker a second time. The invariant
        that rules it out: no version of a session carries a status from the operator without kopf's record."""
        ns = space.name
        names = [f"s{i}" for i in range(6)]
        metric = prometheus_client.REGISTRY.get_sample_value
        runs_before = metric("vivant_operator_handler_runs_total", {"handler": "session_create"}) or 0.0
        with History(space) as history, Fleet(space, redis_url) as fleet, operator(ns):
            space.create(pool_body(min_idle=6, max_workers=6))
            wait_for(lambda: len(fleet.alive) == 6, "six warm workers", 60)
            for name in names:
                space.create(session_body(name))
            for name in names:
                wait_for(lambda n=name: space.phase(n) == "Streaming", f"{name} Streaming", 30)
            time.sleep(1.0)  # a sweep or two more: nothing may be sent again
            runs = (metric("vivant_operator_handler_runs_total", {"handler": "session_create"}) or 0.0) - runs_before
        sessions = [v for v in history.versions if v.get("kind") == resources.SESSION_KIND]
        assert any((v.get("status") or {}).get("worker") for v in sessions), "positive control: the watch saw an assignment"
        early = [(v["metadata"]["name"], v["metadata"]["resourceVersion"], v["status"].get("phase")) for v in sessions
                 if (v.get("status") or {}).get("phase")
                 and "vivant.dev/last-handled-configuration" not in (v["metadata"].get("annotations") or {})]
        assert early == [], f"versions with the operator's status but without kopf's record: {early}"
        sent = sorted(a.session_id for a in fleet.assignments)
        assert sent == sorted(f"{ns}/{n}" for n in names), f"assignments sent: {sent}"
        assert runs == len(names), f"create handler ran {runs} times for {len(names)} sessions"


class TestWorkerLoss:
    def test_lost_worker_fails_its_session_and_the_slot_is_reclaimed(self, space: Space, redis_url: str) -> None:
        with Fleet(space, redis_url) as fleet, operator(space.name):
            space.create(pool_body(min_idle=1, max_workers=2))
            wait_for(lambda: fleet.alive, "a warm worker", 30)
            space.create(session_body("ada"))
            wait_for(lambda: space.phase("ada") == "Streaming", "session Streaming", 30)
            fleet.kill("h200-0")  # the process dies mid-session: heartbeats stop
            wait_for(lambda: space.phase("ada") == "Failed", "session Failed")
            status = space.session("ada")["status"]
            ready = condition(status, "Ready")
            assert ready["reason"] == "WorkerLost" and "heartbeat" in ready["message"], status
            assert fleet.registry.worker_of(f"{space.name}/ada") is None
            failures = prometheus_client.REGISTRY.get_sample_value
            labels = {"pool": f"{space.name}/h200"}
            wait_for(lambda: failures("vivant_operator_worker_failures_total", {**labels, "kind": "lost"}) == 1,
                     "the reaped worker counted as lost in the operator's metrics")
            assert failures("vivant_operator_worker_failures_total", {**labels, "kind": "fault"}) == 0
            fleet.restart("h200-0")  # the kubelet restarts the container; it re-registers warm
            wait_for(lambda: "h200-0" in fleet.registry.idle_workers(fleet.pool), "h200-0 idle again")
            space.create(session_body("bob"))
            wait_for(lambda: space.phase("bob") == "Streaming", "bob Streaming")
            assert space.phase("ada") == "Failed", "a Failed session must stay Failed"
            before = failures("vivant_operator_inbox_dead_letters_total") or 0.0
            fleet.registry.redis.rpush(fleet.registry.inbox_key("h200-0"), b"{not json")  # a worker rejects it
            wait_for(lambda: failures("vivant_operator_inbox_dead_letters_total") == before + 1,
                     "the rejected inbox message counted in the operator's metrics")


class TestOperatorRestart:
    def test_sessions_converge_after_restart_without_double_assignment(self, space: Space, redis_url: str) -> None:
        ns = space.name
        with Fleet(space, redis_url) as fleet:
            with operator(ns):
                space.create(pool_body(min_idle=2, max_workers=3))
                wait_for(lambda: len(fleet.alive) == 2, "two warm workers", 30)
                space.create(session_body("s1"))
                wait_for(lambda: space.phase("s1") == "Streaming", "s1 Streaming", 30)
            # The operator is down: new sessions arrive, s1's worker ends it on its own.
            space.create(session_body("s2"))
            space.create(session_body("s3"))
            w1 = space.session("s1")["status"]["worker"]
            fleet.registry.send_end(w1, f"{ns}/s1", "user hung up")
            wait_for(lambda: w1 not in fleet.sessions, "s1's worker to finish")
            assert space.phase("s2") is None and space.phase("s3") is None
            with operator(ns):
                for name in ("s2", "s3"):
                    wait_for(lambda n=name: space.phase(n) == "Streaming", f"{name} Streaming", 30)
                wait_for(lambda: space.phase("s1") == "Ended", "s1 Ended")
                time.sleep(1.5)  # a few more reconcile ticks: nothing may move
                workers = {n: space.session(n)["status"]["worker"] for n in ("s2", "s3")}
            assert len(set(workers.values())) == 2, f"two sessions share a worker: {workers}"
            holders = [fleet.registry.worker_of(f"{ns}/{n}") for n in ("s2", "s3")]
            assert holders == [workers["s2"], workers["s3"]], holders
            assert sorted(a.session_id for a in fleet.assignments) == [f"{ns}/s1", f"{ns}/s2", f"{ns}/s3"], \
                [a.session_id for a in fleet.assignments]


class TestFlagRollback:
    def test_auto_rollback_sticks_until_the_spec_is_edited(self, space: Space, redis_url: str) -> None:
        with Fleet(space, redis_url, fps=20.0) as fleet, operator(space.name):
            space.create(pool_body(fused=True))
            wait_for(lambda: fleet.flags.get(fleet.pool).values.fusedGemmAllReduce, "fused flag on in Redis")
            wait_for(lambda: fleet.alive, "a warm worker", 30)
            space.create(session_body("slow"))
            wait_for(lambda: not fleet.flags.get(fleet.pool).values.fusedGemmAllReduce, "auto-rollback in Redis", 30)
            flagset = fleet.flags.get(fleet.pool)
            assert flagset.updated_by == "operator:auto-rollback", flagset
            cond = wait_for(lambda: (c := condition(space.pool_status(), "FlagsMatchSpec")) and c["status"] == "False"
                            and c, "pool condition FlagsMatchSpec=False")
            assert cond["reason"] == "AutoRollback", cond
            wait_for(lambda: flag_rolled_back_kinds(space) >= {resources.POOL_KIND, resources.SESSION_KIND},
                     "FlagRolledBack events on the pool and the session")
            fleet.fps = 24.0
            time.sleep(2.5)  # resyncs of the same generation must not re-enable it
            assert not fleet.flags.get(fleet.pool).values.fusedGemmAllReduce, "resync undid the rollback"
            generation = space.pool()["metadata"]["generation"]
            space.patch_pool("h200", {"spec": {"minIdle": 2}})  # the user edits the spec
            assert space.pool()["metadata"]["generation"] == generation + 1, "the apiserver bumps generation"
            wait_for(lambda: fleet.flags.get(fleet.pool).values.fusedGemmAllReduce, "spec re-applied: flag on")
            wait_for(lambda: (condition(space.pool_status(), "FlagsMatchSpec") or {}).get("status") == "True",
                     "pool condition FlagsMatchSpec=True")

    def test_cli_rollback_is_kept_and_the_spec_restores(self, space: Space, redis_url: str) -> None:
        with Fleet(space, redis_url) as fleet, operator(space.name):
            space.create(pool_body(fused=True))
            wait_for(lambda: fleet.flags.get(fleet.pool).values.fusedGemmAllReduce, "fused flag on")
            fleet.flags.set(fleet.pool, {"fusedGemmAllReduce": "false"}, actor="oncall@laptop", reason="incident 42")
            cond = wait_for(lambda: (c := condition(space.pool_status(), "FlagsMatchSpec")) and c["status"] == "False"
                            and c, "condition OverriddenOutsideSpec")
            assert cond["reason"] == "OverriddenOutsideSpec" and "oncall@laptop" in cond["message"], cond
            assert space.pool_status()["flags"] == {"fusedGemmAllReduce": False}
            time.sleep(2.5)
            assert not fleet.flags.get(fleet.pool).values.fusedGemmAllReduce, "the operator undid the CLI rollback"
            space.patch_pool("h200", {"spec": {"flags": {"fusedGemmAllReduce": True}, "minIdle": 0}})
            wait_for(lambda: fleet.flags.get(fleet.pool).values.fusedGemmAllReduce, "spec edit re-applies the flag")


class TestRedisOutage:
    def test_operator_retries_and_assigns_once_redis_is_back(self, space: Space, spare_redis: Any,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
        """Redis goes away (and comes back empty, no persistence); a session created meanwhile is assigned."""
        monkeypatch.setenv("VIVANT_REDIS_URL", spare_redis.url)
        with Fleet(space, spare_redis.url) as fleet, operator(space.name):
            space.create(pool_body(min_idle=1, max_workers=2, fused=False))
            wait_for(lambda: fleet.alive, "a warm worker", 30)
            spare_redis.stop()
            space.create(session_body("ada"))
            time.sleep(2.0)
            assert space.phase("ada") in (None, "Pending"), space.session("ada")
            spare_redis.start()
            wait_for(lambda: space.phase("ada") == "Streaming", "ada Streaming after the outage", 40)
            assert [a.session_id for a in fleet.assignments] == [f"{space.name}/ada"], fleet.assignments


class TestBadSpec:
    # (spec field, bad value, what the apiserver's answer must name)
    BAD = [
        ("maxDurationSeconds", "ten minutes", "spec.maxDurationSeconds"),
        ("maxDurationSeconds", 5, "spec.maxDurationSeconds"),
        ("pool", "H200!", "spec.pool"),
        ("character", "", "spec.character"),
    ]

    def test_malformed_session_is_rejected_naming_the_field_and_nothing_moves(self, space: Space,
                                                                              redis_url: str) -> None:
        """The CRD's schema rejects each malformed session at the apiserver (422 naming the field), so no
        such object exists for the operator to see: no assignment, the worker stays idle. (The operator's
        own check of what it reads, for a CRD older than the models, is tests/operator/test_handlers.py.)"""
        with Fleet(space, redis_url) as fleet, operator(space.name):
            space.create(pool_body())
            wait_for(lambda: fleet.alive, "a warm worker", 30)
            for field, value, named in self.BAD:
                bad = session_body("typo")
                bad["spec"][field] = value
                with pytest.raises(ApiException) as err:
                    space.create(bad)
                assert err.value.status == 422, f"{field}={value!r}: expected 422, got {err.value.status}"
                assert named in err.value.body, f"{field}={value!r}: the answer does not name {named}: {err.value.body}"
                assert space.session("typo") is None
            assert fleet.assignments == [] and fleet.registry.idle_workers(fleet.pool) == ["h200-0"]
            space.create(session_body("good"))  # the positive control: a valid one streams
            wait_for(lambda: space.phase("good") == "Streaming", "the valid session Streaming", 30)
            assert [a.session_id for a in fleet.assignments] == [f"{space.name}/good"], fleet.assignments
