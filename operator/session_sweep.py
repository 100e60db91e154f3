"""The sessions of one pool, reconciled together: a sweep per pool every SWEEP_S, not a timer per session.

Why: a kopf timer per CharacterSession costs a handler run per session per second (≈ 1 ms of operator
CPU each, in a pool of 6 threads under one GIL), a Redis round trip or three per session per second, and
a status write whenever the average fps moved; at a thousand sessions the timers starved the event
handlers (docs/ARCHITECTURE.md, "The control plane at fleet scale"). A sweep instead:
- takes the pool's sessions from kopf's index (kept current by the watch; no API read), overlaid with
  the status this operator wrote last until the index shows that write (it lags by a watch round trip);
  from then on the index wins, so a status another writer changed since (a second replica during a
  peering hand-over) is seen and corrected, not hidden behind what this process remembers;
- reads what Redis holds about all its live sessions in one round trip (`Registry.observe_sessions`);
- runs the same level-triggered decision per session (`reconcile.progress_session`);
- writes only what changed: a phase, worker or message change at once; the mirrored stats (avgFps,
  stalls, chunkP99Ms) at most every STATS_REFRESH_S per session (the worker's metrics are the live view);
  the writes are queued (`status_writer.StatusWriter`): the sweep never waits for the API server;
- assigns waiting (Pending) sessions, oldest first, while the pool has idle workers (a waiting session
  costs nothing per second, and a freed worker goes to the longest waiter);
- frees the lease of a session the operator ended (connect timeout, max duration) whose worker has not
  given it back END_GRACE_S after the end request (`reconcile.release_stale_lease`).
Worker loss needs no polling per session: the pool tick reaps dead workers (`Registry.reap_dead_workers`)
and the loss shows in the next sweep's observation.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import pydantic
from vivant.apis import resources
from vivant.operator import reconcile
from vivant.sessions.registry import Registry

log = logging.getLogger(__name__)
SWEEP_S = 1.0  # how often each pool's sessions are reconciled
STATS_REFRESH_S = 30.0  # the longest a session's mirrored stats may lag (phase changes are written at once)
END_GRACE_S = 15.0  # how long a worker has to give a lease back after an end request before it is freed
ANNOTATION_PREFIX = "vivant.dev"  # kopf's progress and diff-base annotations (handlers.configure)
# kopf writes it once the create/resume handler has succeeded: a session without it is the create handler's to assign
HANDLED_ANNOTATION = f"{ANNOTATION_PREFIX}/last-handled-configuration"
_LIVE = frozenset({resources.SessionPhase.ASSIGNED.value, resources.SessionPhase.CONNECTING.value, resources.SessionPhase.STREAMING.value})
_TERMINAL = frozenset(p.value for p in resources.TERMINAL_PHASES)
_STATS_FIELDS = frozenset({"avgFps", "stalls", "chunkP99Ms"})


@dataclass(frozen=True)
class SessionView:
    """A CharacterSession as the index keeps it: identity, parsed spec (None = invalid), status, deleting."""

    namespace: str
    name: str
    uid: str
    created: datetime
    spec: resources.CharacterSessionSpec | None
    status: dict[str, Any]
    deleting: bool
    resource_version: int | None = None  # metadata.resourceVersion when it is a number (etcd's revision)
    handled: bool = True  # its create handler has run (kopf's HANDLED_ANNOTATION is on the object)

    @classmethod
    def from_body(cls, body: Any) -> SessionView:
        meta = body.get("metadata") or {}
        try:
            spec = resources.CharacterSessionSpec.model_validate(dict(body.get("spec") or {}))
        except pydantic.ValidationError:
            spec = None
        created = reconcile._parse_time(meta.get("creationTimestamp")) or datetime.now(tz=UTC)
        return cls(namespace=meta.get("namespace", ""), name=meta.get("name", ""), uid=meta.get("uid", ""),
                   created=created, spec=spec, status=dict(body.get("status") or {}),
                   deleting=bool(meta.get("deletionTimestamp")),
                   resource_version=resource_version_number(meta.get("resourceVersion")),
                   handled=HANDLED_ANNOTATION in (meta.get("annotations") or {}))

    @property
    def ref(self) -> reconcile.SessionRef:
        return reconcile.SessionRef(namespace=self.namespace, name=self.name, uid=self.uid, created=self.created)

    def event_body(self) -> dict[str, Any]:
        """Enough of the object for kopf.event (an Event's involvedObject)."""
        return {"apiVersion": resources.API_VERSION, "kind": resources.SESSION_KIND,
                "metadata": {"name": self.name, "namespace": self.namespace, "uid": self.uid}}


def resource_version_number(value: Any) -> int | None:
    """A resourceVersion as a number, None when it is not one. The API server's are etcd revisions
    (increasing integers); a server whose are not only keeps the overlay longer (SweepState.status)."""
    return int(value) if isinstance(value, str) and value.isdigit() else None


@dataclass
class SweepState:
    """What the sweeps and the session handlers share in one operator process (kept in kopf's memo).

    `written` overlays the index with the status fields this process queued or wrote, until the index
    shows an object at least as new as this process's last write (`confirm`: the resourceVersion the API
    server returned for it); then the overlay is dropped and the index is the truth again."""

    written: dict[str, dict[str, Any]] = field(default_factory=dict)  # uid -> status fields written last
    stats_written_at: dict[str, float] = field(default_factory=dict)  # uid -> monotonic time
    releasing: set[str] = field(default_factory=set)  # uids being deleted: never assign them
    _seq: dict[str, int] = field(default_factory=dict)  # uid -> number of the last remembered patch
    _confirmed: dict[str, int] = field(default_factory=dict)  # uid -> resourceVersion after the last patch
    _kopf_seq: dict[str, int] = field(default_factory=dict)  # uid -> number of the last patch kopf writes
    _locks: dict[str, threading.Lock] = field(default_factory=dict)
    _guard: threading.Lock = field(default_factory=threading.Lock)

    def status(self, view: SessionView) -> dict[str, Any]:
        """The session's status as it is after this operator's last write (the index may not show it yet)."""
        with self._guard:
            seen = self._confirmed.get(view.uid)
            written = self.written.get(view.uid, {})
            if (seen is not None and view.resource_version is not None and view.resource_version >= seen) or (
                    written and self._seq.get(view.uid) == self._kopf_seq.get(view.uid)
                    and all(view.status.get(k) == v for k, v in written.items())):
                # the index has our last write, or something newer (the writer's resourceVersion says so; a
                # write kopf made for the create handler returns none, so there the index showing it says so)
                self._confirmed.pop(view.uid, None)
                self.written.pop(view.uid, None)
                return dict(view.status)
            return {**view.status, **written}

    def unshown(self, view: SessionView) -> dict[str, Any]:
        """The status fields this process wrote or queued last that the object (`view`) does not show."""
        with self._guard:
            return {k: v for k, v in self.written.get(view.uid, {}).items() if view.status.get(k) != v}

    def remember(self, uid: str, patch: dict[str, Any], by_kopf: bool = False) -> int:
        """Overlay `patch` (about to be queued for writing, or with `by_kopf` written in kopf's patch of the
        create handler); returns its number, the status writer's tag."""
        with self._guard:
            self.written[uid] = {**self.written.get(uid, {}), **patch}
            if _STATS_FIELDS & patch.keys():
                self.stats_written_at[uid] = time.monotonic()
            self._seq[uid] = seq = self._seq.get(uid, 0) + 1
            if by_kopf:
                self._kopf_seq[uid] = seq
            self._confirmed.pop(uid, None)  # a newer patch waits: the overlay holds until it is written
            return seq

    def confirm(self, uid: str, resource_version: str, seq: int) -> None:
        """The status writer wrote patches up to number `seq`; the object is at `resource_version` after it.
        Ignored when a newer patch was remembered since (its own write will confirm)."""
        number = resource_version_number(resource_version)
        with self._guard:
            if number is not None and self._seq.get(uid) == seq and uid in self.written:
                self._confirmed[uid] = number

    def lock(self, uid: str) -> threading.Lock:
        """One session's assignment lock (the create handler and a sweep may both try it)."""
        with self._guard:
            return self._locks.setdefault(uid, threading.Lock())

    def forget_all_but(self, uids: Iterable[str]) -> None:
        """Drop what is remembered about sessions that are gone."""
        keep = set(uids)
        with self._guard:
            for table in (self.written, self.stats_written_at, self._locks, self._seq, self._confirmed,
                          self._kopf_seq):
                for uid in [u for u in table if u not in keep]:
                    del table[uid]
            self.releasing &= keep


@dataclass
class SweepResult:
    """One sweep's work, for the operator's metrics: sessions looked at, written, assigned, waiting."""

    live: int = 0
    waiting: int = 0
    written: int = 0
    assigned: int = 0
    stale_released: int = 0
    rollbacks: list[tuple[SessionView, str, str]] = field(default_factory=list)  # (session, pool, reason)
    events: list[tuple[SessionView, tuple[str, str, str]]] = field(default_factory=list)


def _material(patch: dict[str, Any], status: dict[str, Any]) -> bool:
    """True when the patch changes more than the mirrored stats (a phase, the worker, the message, ...)."""
    return any(status.get(k) != v for k, v in patch.items() if k not in _STATS_FIELDS and k != "conditions")


def sweep_pool(
    views: list[SessionView],
    *,
    registry: Registry,
    state: SweepState,
    timeouts: reconcile.Timeouts,
    write_status: Callable[[SessionView, dict[str, Any], int, bool], None],
    assign: Callable[[SessionView, dict[str, Any]], bool],
    now: datetime | None = None,
) -> SweepResult:
    """Reconcile one pool's sessions (`views`: every CharacterSession of the pool in the index).

    `write_status(view, patch, seq, urgent)` queues a status patch for the object (it must not wait for the
    API server; `seq` is the patch's number from SweepState.remember, for SweepState.confirm; `urgent` is
    False for a patch that only refreshes the mirrored stats);
    `assign(view, status)` tries to assign a waiting session and returns False when no worker was free
    (the sweep stops trying then)."""
    now = now or datetime.now(tz=UTC)
    res = SweepResult()
    live: list[tuple[SessionView, dict[str, Any]]] = []
    waiting: list[tuple[SessionView, dict[str, Any]]] = []
    ended: list[tuple[SessionView, dict[str, Any]]] = []
    for v in views:
        if v.deleting or v.spec is None or not v.handled:
            # not handled: its create handler has not run, or kopf has not recorded it yet; until then a status
            # write of ours would make a version without that record, which kopf may take for a new session
            continue
        st = state.status(v)
        phase = st.get("phase")
        if phase in _LIVE and st.get("worker"):
            live.append((v, st))
        elif phase in (None, resources.SessionPhase.PENDING.value) and not st.get("worker"):
            waiting.append((v, st))
        elif phase in _TERMINAL and st.get("worker") and recently_ended(st, now):
            ended.append((v, st))
    res.live, res.waiting = len(live), len(waiting)
    seen = registry.observe_sessions([v.ref.session_id for v, _ in live + ended])
    writes: list[tuple[SessionView, dict[str, Any], dict[str, Any], bool]] = []  # (session, patch, before, urgent)
    mono = time.monotonic()
    for v, st in live:
        assert v.spec is not None
        out = reconcile.progress_session(v.ref, v.spec, st, registry=registry, timeouts=timeouts, now=now,
                                         observed=seen[v.ref.session_id])
        if out.rollback is not None:
            res.rollbacks.append((v, *out.rollback))
        material = bool(out.status) and _material(out.status, st)
        if out.status and (material or mono - state.stats_written_at.get(v.uid, 0.0) >= STATS_REFRESH_S):
            writes.append((v, out.status, st, material))
        res.events.extend((v, e) for e in out.events)
    for v, st in ended:
        assert v.spec is not None
        if reconcile.release_stale_lease(v.ref, v.spec, st, holder=seen[v.ref.session_id].holder,
                                         registry=registry, now=now, grace_s=END_GRACE_S):
            res.stale_released += 1
    for v, patch, before, material in writes:
        seq = state.remember(v.uid, patch)
        if patch.get("phase") != before.get("phase"):
            log.info("session %s/%s: %s: %s", v.namespace, v.name, patch.get("phase"), patch.get("message"))
        write_status(v, patch, seq, material)
    res.written = len(writes)
    exhausted = False  # once a claim found no idle worker, only sessions past their pending timeout are tried
    for v, st in sorted(waiting, key=lambda x: x[0].created):
        if v.uid in state.releasing:
            continue
        if exhausted and (now - v.created).total_seconds() <= timeouts.pending_s:
            continue
        if assign(v, st):
            res.assigned += 1
        else:
            exhausted = True
    return res


def recently_ended(status: dict[str, Any], now: datetime) -> bool:
    """The session ended within 4 × END_GRACE_S: its worker may still be giving the lease back (the sweep
    frees it after END_GRACE_S); later, a lease still held for it is an orphan (the pool tick frees it)."""
    return _recent(status.get("endedAt"), now, 4 * END_GRACE_S)


def _recent(stamp: str | None, now: datetime, within_s: float) -> bool:
    t = reconcile._parse_time(stamp)
    return t is not None and (now - t).total_seconds() <= within_s
