"""The fleet benchmark's user side: creates, ends and watches CharacterSessions, and times them.

Sessions are created as a user would: most with a plain create of the custom resource (what
`kubectl apply` does), a share through the session API (`POST /v1/realtime_sessions`, the hosted-avatar
contract) and ended the same way they were made (delete of the resource, or `DELETE` through the API).
A watch on the namespace's CharacterSessions records, per session, the wall-clock time each phase was
first seen on the object, every worker it named, and when the object was gone; `SessionRecord`s are
the raw material of every latency in the report.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import kubernetes
from vivant.apis import resources
from vivant.apis.livekit_token import LiveKitCredentials, mint_avatar_token

log = logging.getLogger(__name__)
LIVEKIT_URL = "ws://127.0.0.1:7880"


@dataclass
class SessionRecord:
    """What the driver saw of one session (wall-clock seconds, time.time())."""

    name: str
    pool: str
    via: str  # "kube" | "api"
    wave: str  # "burst" | "churn"
    sent_at: float = 0.0  # just before the create request
    created_at: float = 0.0  # the create request returned
    phases: dict[str, float] = field(default_factory=dict)  # phase -> first seen on the object
    workers: list[str] = field(default_factory=list)  # every distinct status.worker, in order
    delete_sent_at: float | None = None
    gone_at: float | None = None
    failed_reason: str | None = None

    def after(self, phase: str) -> float | None:
        t = self.phases.get(phase)
        return None if t is None else t - self.sent_at


class SessionWatch:
    """Watches the namespace's CharacterSessions in a thread and fills the records."""

    def __init__(self, api: kubernetes.client.ApiClient, namespace: str) -> None:
        self.custom = kubernetes.client.CustomObjectsApi(api)
        self.namespace = namespace
        self.lock = threading.Lock()
        self.seen: dict[str, SessionRecord] = {}  # by name; the driver registers them, the watch fills them
        self.early: dict[str, list[tuple[str, dict[str, Any], float]]] = {}  # events before the driver knew the name
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="session-watch", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def register(self, rec: SessionRecord) -> None:
        with self.lock:
            self.seen[rec.name] = rec
            for kind, obj, at in self.early.pop(rec.name, []):
                self._apply(rec, kind, obj, at)

    def _apply(self, rec: SessionRecord, kind: str, obj: dict[str, Any], at: float) -> None:
        if kind == "DELETED":
            rec.gone_at = rec.gone_at or at
            return
        st = obj.get("status") or {}
        phase = st.get("phase")
        if phase and phase not in rec.phases:
            rec.phases[phase] = at
            if phase == resources.SessionPhase.FAILED.value:
                rec.failed_reason = st.get("message")
        w = st.get("worker")
        if w and (not rec.workers or rec.workers[-1] != w):
            rec.workers.append(w)

    def _event(self, kind: str, obj: dict[str, Any]) -> None:
        at = time.time()
        name = obj["metadata"]["name"]
        with self.lock:
            rec = self.seen.get(name)
            if rec is None:
                self.early.setdefault(name, []).append((kind, obj, at))
            else:
                self._apply(rec, kind, obj, at)

    def _run(self) -> None:
        """List once, then watch from the last resourceVersion seen; list again only when the server says
        that version is gone (410), never after each watch timeout (a list of a thousand objects is what
        loads an API server)."""
        args = (resources.GROUP, resources.VERSION, self.namespace, resources.SESSION_PLURAL)
        rv: str | None = None
        while not self.stop.is_set():
            try:
                if rv is None:
                    listing = self.custom.list_namespaced_custom_object(*args)
                    for obj in listing.get("items", []):
                        self._event("ADDED", obj)
                    rv = listing["metadata"]["resourceVersion"]
                w = kubernetes.watch.Watch()
                for ev in w.stream(self.custom.list_namespaced_custom_object, *args, resource_version=rv,
                                   timeout_seconds=300, allow_watch_bookmarks=True):
                    obj = ev["object"]
                    rv = (obj.get("metadata") or {}).get("resourceVersion") or rv
                    if ev["type"] in ("ADDED", "MODIFIED", "DELETED"):
                        self._event(ev["type"], obj)
                    if self.stop.is_set():
                        w.stop()
            except kubernetes.client.ApiException as exc:
                if exc.status == 410:
                    rv = None
                log.warning("session watch: %s %s; watching again", exc.status, exc.reason)
                self.stop.wait(0.5)
            except Exception as exc:  # noqa: BLE001 (a dropped connection: watch again from rv)
                log.warning("session watch: %s; watching again", exc)
                self.stop.wait(0.5)


class Driver:
    """Creates and ends sessions through the API server (admin user) and the session API."""

    def __init__(self, api: kubernetes.client.ApiClient, namespace: str, pools: list[str], gateway_url: str,
                 api_key: str, livekit: LiveKitCredentials, threads: int = 16) -> None:
        self.custom = kubernetes.client.CustomObjectsApi(api)
        self.namespace, self.pools = namespace, pools
        self.gateway_url, self.api_key, self.livekit = gateway_url, api_key, livekit
        self.watch = SessionWatch(api, namespace)
        self.records: dict[str, SessionRecord] = {}
        self.errors: list[str] = []
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="driver")
        self._n = 0
        self._lock = threading.Lock()

    def _next(self) -> int:
        with self._lock:
            self._n += 1
            return self._n

    # -- create ----------------------------------------------------------------------------------
    def _create_kube(self, i: int, wave: str) -> SessionRecord | None:
        name = f"s-{i:05d}"
        pool = self.pools[i % len(self.pools)]
        body = {
            "apiVersion": resources.API_VERSION, "kind": resources.SESSION_KIND,
            "metadata": {"name": name, "namespace": self.namespace},
            "spec": {"character": "ada", "pool": pool, "maxDurationSeconds": 86_400,
                     "livekit": {"url": LIVEKIT_URL, "room": f"room-{name}", "agentIdentity": f"agent-{name}"}},
        }
        rec = SessionRecord(name=name, pool=pool, via="kube", wave=wave)
        self.watch.register(rec)
        rec.sent_at = time.time()
        try:
            self.custom.create_namespaced_custom_object(resources.GROUP, resources.VERSION, self.namespace, resources.SESSION_PLURAL, body)
        except Exception as exc:  # noqa: BLE001 (counted and reported)
            self.errors.append(f"create {name}: {exc}")
            return None
        rec.created_at = time.time()
        return rec

    def _create_api(self, i: int, wave: str) -> SessionRecord | None:
        pool = self.pools[i % len(self.pools)]
        room, agent = f"room-api-{i}", f"agent-api-{i}"
        token = mint_avatar_token(self.livekit, room=room, identity=f"avatar-{i}", agent_identity=agent)
        body = {"avatar": {"type": "custom", "avatarId": f"ada-{pool}"},
                "livekit": {"url": LIVEKIT_URL, "token": token, "roomName": room, "agentIdentity": agent}}
        req = urllib.request.Request(f"{self.gateway_url}/v1/realtime_sessions", data=json.dumps(body).encode(),
                                     method="POST", headers={"Authorization": f"Bearer {self.api_key}",
                                                             "Content-Type": "application/json"})
        sent = time.time()
        try:
            with urllib.request.urlopen(req, timeout=120) as resp:
                name = json.loads(resp.read())["id"]
        except Exception as exc:  # noqa: BLE001 (counted and reported)
            self.errors.append(f"POST session {i}: {exc}")
            return None
        rec = SessionRecord(name=name, pool=pool, via="api", wave=wave, sent_at=sent, created_at=time.time())
        self.watch.register(rec)
        return rec

    def create(self, count: int, wave: str, api_share: float) -> list[SessionRecord]:
        """Create `count` sessions at once (in parallel); every 1/api_share-th goes through the session API."""
        every = round(1 / api_share) if api_share > 0 else 0
        idx = [self._next() for _ in range(count)]
        futs = [self.pool.submit(self._create_api if every and i % every == 0 else self._create_kube, i, wave)
                for i in idx]
        out = [f.result() for f in futs]
        made = [rec for rec in out if rec is not None]
        for rec in made:
            self.records[rec.name] = rec
        return made

    # -- end -------------------------------------------------------------------------------------
    def _end(self, rec: SessionRecord) -> None:
        rec.delete_sent_at = time.time()
        try:
            if rec.via == "api":
                req = urllib.request.Request(f"{self.gateway_url}/v1/realtime_sessions/{rec.name}", method="DELETE",
                                             headers={"Authorization": f"Bearer {self.api_key}"})
                urllib.request.urlopen(req, timeout=120).close()
            else:
                self.custom.delete_namespaced_custom_object(resources.GROUP, resources.VERSION, self.namespace, resources.SESSION_PLURAL,
                                                            rec.name)
        except Exception as exc:  # noqa: BLE001 (counted and reported)
            self.errors.append(f"delete {rec.name}: {exc}")

    def end(self, recs: list[SessionRecord]) -> None:
        for f in [self.pool.submit(self._end, rec) for rec in recs]:
            f.result()

    def live(self) -> list[SessionRecord]:
        """Sessions not ended by the driver, oldest first."""
        return sorted((x for x in self.records.values() if x.delete_sent_at is None), key=lambda x: x.sent_at)

    def count(self, predicate) -> int:  # noqa: ANN001
        with self.watch.lock:
            return sum(1 for x in self.records.values() if predicate(x))
