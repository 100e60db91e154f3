"""The operator's decisions, level-triggered: read the object and Redis, return what to write.

The kopf handlers (`handlers.py`) are thin: they parse the object, call one function here and apply
what it returns (status patch, Secret, Event). Everything here talks to Redis only through
`vivant.sessions.registry.Registry` and `vivant.sessions.flags.FlagStore`, and to Kubernetes not at
all (the token Secret is written through the `apply_secret` callable the handler passes), so the
tests drive these functions directly against a real Redis as well as through kopf.

Each function is idempotent: running it again on the same state changes nothing (claims are
idempotent per session id in the registry; releases check the lease; flag writes with equal values
do not bump the version). Times are wall-clock `datetime` in UTC; durations are seconds.

Session lifecycle (status.phase):
  Pending --claim+token+assignment--> Assigned --worker reports--> Connecting --> Streaming
  --> Ended (worker ended / deleted / max duration)  |  Failed (timeout, worker lost, bad spec).

Flag rule ("the spec wins on reconcile"): spec.flags are written to Redis when metadata.generation
differs from status.flagsAppliedGeneration, i.e. on creation and on every spec edit. A rollback by
the CLI (`vivant flags set`) or by the operator's auto-rollback therefore stays in force until the
user edits the WorkerPool spec; an operator restart does not undo it.

Auto-rollback: a session that ran on the fused path (flag fusedGemmAllReduce on) and either reports
a numerical fault, or averages below 23.5 fps after at least 1 s of streaming, turns the flag off for
its pool (actor `operator:auto-rollback`); the pool handler records the Event and a condition.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from vivant.apis import resources
from vivant.apis.feature_flags import FUSED_GEMM_ALL_REDUCE
from vivant.apis.livekit_token import LiveKitCredentials, avatar_identity, mint_avatar_token
from vivant.operator import builders
from vivant.sessions.flags import FlagStore
from vivant.sessions.models import Assignment, FlagSet, PoolCounts
from vivant.sessions.registry import Registry, RegistryUnavailable, SessionObservation

log = logging.getLogger(__name__)

AUTO_ROLLBACK_ACTOR = "operator:auto-rollback"
# The phases a worker's report may move a session to (Pending and Assigned are the operator's own).
_WORKER_REPORTED_PHASES = frozenset({resources.SessionPhase.CONNECTING, resources.SessionPhase.STREAMING, *resources.TERMINAL_PHASES})


@dataclass(frozen=True)
class Timeouts:
    """How long a session may wait in each phase before it is failed (seconds)."""

    pending_s: float = 300.0  # no idle worker in the pool
    connect_s: float = 60.0  # Assigned/Connecting -> Streaming


@dataclass(frozen=True)
class SessionRef:
    namespace: str
    name: str
    uid: str
    created: datetime

    @property
    def session_id(self) -> str:
        return f"{self.namespace}/{self.name}"

    def owner(self) -> builders.Owner:
        return builders.Owner(kind=resources.SESSION_KIND, name=self.name, uid=self.uid)


@dataclass
class Outcome:
    """What a reconcile step wants written. `retry_s` set = not converged yet, run again after it."""

    status: dict[str, Any] = field(default_factory=dict)
    events: list[tuple[str, str, str]] = field(default_factory=list)  # (type, reason, message)
    retry_s: float | None = None
    rollback: tuple[str, str] | None = None  # (pool key, reason) when the fused path burned the SLO
    assigned_after_s: float | None = None  # created -> assigned, for the latency histogram
    no_worker: bool = False  # the pool had no idle worker to claim


def _parse_time(text: str | None) -> datetime | None:
    if not text:
        return None
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


# ---------------------------------------------------------------------------------------- sessions


class SecretWriteError(RuntimeError):
    """The API server refused the session's token Secret (forbidden, invalid, quota, a foreign Secret of that
    name). The handler's `apply_secret` raises it with the server's message; nothing is claimed meanwhile."""


@dataclass(frozen=True)
class PoolView:
    """What Kubernetes says about a pool, read only while a session waits for a worker (to say why).

    `pool`: the WorkerPool object, None when there is none of that name; `pods`: its pods as the API serves
    them (dicts); `max_workers` comes from the pool's spec."""

    pool: dict[str, Any] | None
    pods: tuple[dict[str, Any], ...] = ()

    @property
    def max_workers(self) -> int | None:
        value = ((self.pool or {}).get("spec") or {}).get("maxWorkers")
        return value if isinstance(value, int) else None


def _condition(obj: dict[str, Any] | None, type_: str) -> dict[str, Any] | None:
    for c in ((obj or {}).get("status") or {}).get("conditions") or []:
        if c.get("type") == type_:
            return c
    return None


def unschedulable(pod: dict[str, Any]) -> str | None:
    """The scheduler's reason a pending pod has no node (its PodScheduled=False message), else None."""
    if (pod.get("status") or {}).get("phase") not in (None, "Pending"):
        return None
    c = _condition(pod, "PodScheduled")
    if c is None or c.get("status") != "False":
        return None
    return c.get("message") or c.get("reason") or "not scheduled"


def why_no_worker(pool_name: str, namespace: str, view: PoolView, counts: PoolCounts) -> tuple[str, str]:
    """(reason, message) of a session waiting for a worker of `pool_name`: the pool is missing or not ready,
    its pods cannot be scheduled (the scheduler's words), its workers are still starting, or all are busy."""
    if view.pool is None:
        return "PoolNotFound", f"WorkerPool {pool_name} not found in namespace {namespace}"
    ready = _condition(view.pool, "Ready")
    if ready is not None and ready.get("status") == "False":
        return "PoolNotReady", f"WorkerPool {pool_name} is not ready: {ready.get('reason')}: {ready.get('message', '')}"
    pods = [p for p in view.pods if not (p.get("metadata") or {}).get("deletionTimestamp")]
    stuck = [(p["metadata"]["name"], why) for p in pods if (why := unschedulable(p))]
    workers = f"{counts.idle} idle, {counts.busy} busy, {counts.loading} starting"
    if stuck:
        name, why = stuck[0]
        return "WorkersUnschedulable", (f"pool {pool_name} ({workers}): {len(stuck)} of {len(pods)} pods cannot be "
                                        f"scheduled; {name}: {why}")
    if not pods and not counts.busy:
        return "WaitingForWorker", f"pool {pool_name} has no worker pods yet"
    if counts.loading or len(pods) > counts.idle + counts.busy + counts.draining:
        return "WaitingForWorker", f"pool {pool_name} ({workers}): waiting for workers to warm up"
    limit = f" (maxWorkers {view.max_workers})" if view.max_workers is not None else ""
    return "NoIdleWorker", f"pool {pool_name} ({workers}): every worker is busy{limit}"


def assign_session(
    ref: SessionRef,
    spec: resources.CharacterSessionSpec,
    status: dict[str, Any],
    *,
    registry: Registry,
    credentials: LiveKitCredentials,
    apply_secret: Callable[[dict[str, Any]], None],
    timeouts: Timeouts,
    now: datetime,
    token_ttl: timedelta = timedelta(minutes=10),
    read_token: Callable[[str], str | None] | None = None,
    pool_view: Callable[[], PoolView] | None = None,
) -> Outcome:
    """Pending -> Assigned: lease an idle worker, mint the token into a Secret, send the assignment.

    With `spec.livekit.tokenSecret` the caller supplied the token (session API path): it is read with
    `read_token(secret_name)` (None = Secret or key missing) before any worker is claimed, and the
    operator writes no Secret of its own. If anything fails between the claim and the assignment (the
    Secret above all), the claimed worker is released before the error goes on (SecretWriteError: the
    session waits with reason TokenSecretFailed).
    While no worker is free, `pool_view()` (if given) tells why, and the status says it.
    """
    if status.get("phase") not in (None, resources.SessionPhase.PENDING.value) or status.get("worker"):
        return Outcome()
    pool = resources.pool_key(ref.namespace, spec.pool)
    waited = (now - ref.created).total_seconds()

    def wait(reason: str, msg: str, warn: bool = False) -> Outcome:
        if waited > timeouts.pending_s:
            msg = f"{msg} for {waited:.0f}s (limit {timeouts.pending_s:.0f}s)"
            return Outcome(status=builders.session_phase_patch(status, resources.SessionPhase.FAILED, reason, msg, now=now),
                           events=[("Warning", reason, msg)])
        if status.get("message") == msg:
            return Outcome(retry_s=2.0)
        return Outcome(status=builders.session_phase_patch(status, resources.SessionPhase.PENDING, reason, msg, now=now),
                       events=[("Warning", reason, msg)] if warn else [], retry_s=2.0)

    supplied = getattr(spec.livekit, "token_secret", None)
    holder = registry.worker_of(ref.session_id)
    if holder is not None and registry.session_of(pool, holder) == ref.session_id:
        return _already_assigned(ref, spec, status, holder, registry=registry, now=now, supplied=supplied,
                                 read_token=read_token)
    token = None
    if supplied:
        token = read_token(supplied) if read_token is not None else None
        if not token:
            return wait("TokenSecretMissing", f"Secret {supplied} with key 'token' (spec.livekit.tokenSecret) not found",
                        warn=True)
    worker = registry.claim_idle_worker(pool, ref.session_id)
    if worker is None:
        if pool_view is None:
            out = wait("NoIdleWorker" if waited > timeouts.pending_s else "WaitingForWorker",
                       f"waiting for an idle worker in pool {spec.pool}")
        else:
            reason, msg = why_no_worker(spec.pool, ref.namespace, pool_view(), registry.pool_counts(pool))
            out = wait(reason, msg, warn=reason not in ("WaitingForWorker", "NoIdleWorker"))
        out.no_worker = True
        return out

    try:
        if token is None:
            token = mint_avatar_token(
                credentials, room=spec.livekit.room, identity=avatar_identity(ref.name),
                agent_identity=spec.livekit.agent_identity, ttl=token_ttl,
            )
            apply_secret(builders.build_token_secret(ref.name, ref.namespace, ref.owner(), token))
        registry.send_assignment(worker, _assignment(ref, spec, token))
    except SecretWriteError as exc:
        registry.release(pool, worker, ref.session_id)
        return wait("TokenSecretFailed", f"cannot write token Secret {builders.token_secret_name(ref.name)}: {exc}", warn=True)
    except BaseException:
        registry.release(pool, worker, ref.session_id)  # nothing was sent: the worker is free again
        raise
    return _assigned(ref, status, worker, registry=registry, now=now, supplied=supplied)


def _assigned(ref: SessionRef, status: dict[str, Any], worker: str, *, registry: Registry, now: datetime,
              supplied: str | None) -> Outcome:
    """The status of a session whose assignment went to `worker`. The worker's node is looked up for the status
    only; Redis failing here loses the node, not the assignment (the assignment is out: raising would have the
    handler retried for a session that has a worker)."""
    msg = f"assigned to worker {worker}"
    try:
        info = registry.worker_info(worker)  # this worker only: never the whole pool per assignment
    except RegistryUnavailable:
        info = None
    patch = builders.session_phase_patch(
        status, resources.SessionPhase.ASSIGNED, "WorkerAssigned", msg, now=now,
        worker=worker, node=(info.node or None) if info else None,
        assigned_at=builders.now_iso(now), token_secret=supplied or builders.token_secret_name(ref.name),
    )
    return Outcome(status=patch, events=[("Normal", "WorkerAssigned", msg)],
                   assigned_after_s=max(0.0, (now - ref.created).total_seconds()))


def _already_assigned(ref: SessionRef, spec: resources.CharacterSessionSpec, status: dict[str, Any], holder: str, *,
                      registry: Registry, now: datetime, supplied: str | None,
                      read_token: Callable[[str], str | None] | None) -> Outcome:
    """A session whose status names no worker but which Redis says `holder` holds: an earlier attempt claimed
    it and its outcome was not recorded (the handler failed after the claim, or ran again on an older copy of
    the object). It is not handed out again and its token Secret is left as it is: the status records the
    holder. Only an assignment that never reached the holder (no message for it in the worker's inbox, no
    report from the worker: the operator stopped between the claim and the send) is sent again, to the same
    worker, with the token already written."""
    if not registry.assignment_delivered(holder, ref.session_id):
        token = read_token(supplied or builders.token_secret_name(ref.name)) if read_token is not None else None
        if not token:
            # nothing to send it with: free the worker; the session is assigned afresh (new token) on its next try
            registry.release(resources.pool_key(ref.namespace, spec.pool), holder, ref.session_id)
            return Outcome(retry_s=0.0)
        registry.send_assignment(holder, _assignment(ref, spec, token))
        log.warning("session %s: its claim of worker %s was never sent; sent now", ref.session_id, holder)
    return _assigned(ref, status, holder, registry=registry, now=now, supplied=supplied)


def _assignment(ref: SessionRef, spec: resources.CharacterSessionSpec, token: str) -> Assignment:
    overrides = spec.flags.model_dump(by_alias=True, exclude_none=True) if spec.flags else {}
    return Assignment(
        session_id=ref.session_id, namespace=ref.namespace, pool=resources.pool_key(ref.namespace, spec.pool),
        character=spec.character, room=spec.livekit.room, livekit_url=spec.livekit.url,
        agent_identity=spec.livekit.agent_identity, token=token, max_duration_s=float(spec.max_duration_seconds),
        flag_overrides=overrides,
    )


def _end(ref: SessionRef, pool: str, worker: str, registry: Registry, reason: str) -> None:
    """Ask the worker to stop. The lease stays until the worker gives it back (`Registry.finish`, once it
    has stopped streaming), so the worker is never handed a new session while it still streams this one;
    `release_stale_lease` frees it if the worker does not within the grace time."""
    registry.send_end(worker, ref.session_id, reason)


def progress_session(
    ref: SessionRef,
    spec: resources.CharacterSessionSpec,
    status: dict[str, Any],
    *,
    registry: Registry,
    timeouts: Timeouts,
    now: datetime,
    observed: SessionObservation | None = None,
) -> Outcome:
    """Assigned/Connecting/Streaming: mirror the worker's stats; fail on loss/timeouts; end at max duration.

    `observed`: what Redis holds about the session, read by the caller for many sessions at once
    (`Registry.observe_sessions`); read here when not given."""
    phase = status.get("phase")
    worker = status.get("worker")
    if phase not in (resources.SessionPhase.ASSIGNED, resources.SessionPhase.CONNECTING, resources.SessionPhase.STREAMING) or not worker:
        return Outcome()
    pool = resources.pool_key(ref.namespace, spec.pool)
    sid = ref.session_id
    obs = observed if observed is not None else registry.observe_sessions([sid])[sid]

    lost = obs.lost
    if lost is not None:
        msg = f"worker {worker} lost: {lost}"
        registry.send_end(worker, sid, "WorkerLost")  # a worker that is in fact still streaming it stops
        return Outcome(status=builders.session_phase_patch(status, resources.SessionPhase.FAILED, "WorkerLost", msg, now=now),
                       events=[("Warning", "WorkerLost", msg)])

    stats = obs.stats
    fields: dict[str, Any] = {}
    new_phase = resources.SessionPhase(phase)
    reason, message = "WorkerAssigned", f"assigned to worker {worker}"
    out = Outcome()
    if stats is not None:
        fields.update(avg_fps=round(stats.fps, 2), stalls=stats.stalls, chunk_p99_ms=round(stats.chunk_p99_ms, 2))
        if stats.numerical_fault:
            fields["numerical_fault"] = True
            if not status.get("numericalFault"):  # once: the status remembers it was said
                out.events.append(("Warning", "NumericalFault",
                                   f"worker {worker} made a chunk with NaN/Inf latents; the model restarted after it "
                                   "and the stream went on"))
        if stats.phase in _WORKER_REPORTED_PHASES:
            new_phase = resources.SessionPhase(stats.phase)
        if new_phase == resources.SessionPhase.STREAMING:
            reason, message = "Streaming", f"streaming on worker {worker}"
            if not status.get("startedAt"):
                fields["started_at"] = builders.now_iso(now)
        elif new_phase == resources.SessionPhase.CONNECTING:
            reason, message = "Connecting", f"worker {worker} is joining the room"
        elif new_phase in resources.TERMINAL_PHASES:
            reason = "WorkerEnded" if new_phase == resources.SessionPhase.ENDED else "WorkerFailed"
            message = f"worker {worker} ended the session: {stats.end_reason or 'no reason given'}"
            registry.release(pool, worker, sid)
        if getattr(stats.flags, FUSED_GEMM_ALL_REDUCE):
            if stats.numerical_fault:
                out.rollback = (pool, f"session {sid} reported a numerical fault on the fused path")
            elif stats.streamed_s >= resources.SLO_MIN_STREAMED_SECONDS and stats.fps < resources.SLO_MIN_FPS:
                out.rollback = (pool, f"session {sid} averaged {stats.fps:.1f} fps < {resources.SLO_MIN_FPS} on the fused path")
    elif obs.holder is None and not registry.restore_lease(pool, worker, sid):
        # Redis lost the lease (restarted empty) and it cannot be rebuilt from this CR without a double
        # assignment: the worker holds another session now, or the session another worker.
        new_phase, reason = resources.SessionPhase.FAILED, "LeaseLost"
        message = f"worker {worker} no longer holds the session and reported nothing"
        registry.send_end(worker, sid, "LeaseLost")

    assigned_at = _parse_time(status.get("assignedAt")) or ref.created
    age = (now - assigned_at).total_seconds()
    if new_phase in (resources.SessionPhase.ASSIGNED, resources.SessionPhase.CONNECTING) and age > timeouts.connect_s:
        _end(ref, pool, worker, registry, "ConnectTimeout")
        new_phase, reason = resources.SessionPhase.FAILED, "ConnectTimeout"
        message = f"worker {worker} did not start streaming within {timeouts.connect_s:.0f}s"
    elif new_phase not in resources.TERMINAL_PHASES and age > spec.max_duration_seconds:
        _end(ref, pool, worker, registry, "MaxDuration")
        new_phase, reason = resources.SessionPhase.ENDED, "MaxDuration"
        message = f"ended after maxDurationSeconds={spec.max_duration_seconds}"

    # the worker goes with every write: a status whose Assigned write was lost still names it
    patch = builders.session_phase_patch(status, new_phase, reason, message, now=now, worker=worker, **fields)
    changed = {k: v for k, v in patch.items() if k != "conditions" and status.get(k) != v}
    if changed or new_phase.value != phase:
        out.status = patch
    if new_phase.value != phase and new_phase in resources.TERMINAL_PHASES:
        # an Event where the session ended, and why; Connecting and Streaming are in its status only (an Event
        # is an API request each, and nothing a user acts on)
        kind = "Warning" if new_phase == resources.SessionPhase.FAILED else "Normal"
        out.events.append((kind, reason, message))
    return out


@dataclass(frozen=True)
class Release:
    """Where a deleted session's release stands. `done`: no lease is held for it any more (the finalizer
    may go); `end_sent`: an end request went to the worker in this step; `forced`: the operator freed the
    lease itself because the worker did not give it back within the grace time."""

    done: bool
    end_sent: bool = False
    forced: bool = False


def release_session(ref: SessionRef, spec: resources.CharacterSessionSpec, status: dict[str, Any], *, registry: Registry,
                    end_sent_at: datetime | None, now: datetime, grace_s: float, reason: str = "Deleted") -> Release:
    """On delete: ask the worker to stop, then wait until it has given the lease back.

    The end request goes, the first time, to the worker the status names and to the lease's holder, whatever
    the phase: a session marked Failed may still be streaming on a worker that outlived a Redis outage, and a
    worker that is not running it ignores the request. The lease is freed by the worker itself once it has
    stopped streaming (`Registry.finish`), so the slot is never handed to another session while this one still
    streams. Call again until `done`, passing when the end request was sent (`end_sent_at`, None the first
    time). A worker that has not given the lease back `grace_s` after the end request (hung; a dead one is
    reaped sooner) has it freed by the operator (`forced`)."""
    pool = resources.pool_key(ref.namespace, spec.pool)
    holder = registry.worker_of(ref.session_id)
    if end_sent_at is None:
        workers = list(dict.fromkeys(w for w in (status.get("worker"), holder) if w))
        for worker in workers:
            registry.send_end(worker, ref.session_id, reason)
        return Release(done=holder is None, end_sent=bool(workers))
    if holder is None:
        return Release(done=True)
    if (now - end_sent_at).total_seconds() >= grace_s:
        registry.release(pool, holder, ref.session_id)
        return Release(done=True, forced=True)
    return Release(done=False)


def release_orphan_leases(pool: str, registry: Registry, live_sessions: set[str]) -> list[tuple[str, str]]:
    """Leases of `pool` whose session is not a live CharacterSession (gone, or ended longer ago than the sweep's
    grace window) are ended and freed: e.g. an end request lost with a Redis that restarted empty, then the
    lease rebuilt by the streaming worker. `live_sessions`: ids (`namespace/name`) of the pool's sessions that
    are not terminal or ended recently (session_sweep.recently_ended).
    Returns the (worker, session) pairs released."""
    out = []
    for worker, session in registry.leases(pool).items():
        if session not in live_sessions:
            registry.send_end(worker, session, "SessionGone")
            if registry.release(pool, worker, session):
                out.append((worker, session))
                log.warning("released worker %s of pool %s from session %s, which is gone or terminal", worker, pool,
                            session)
    return out


def release_stale_lease(ref: SessionRef, spec: resources.CharacterSessionSpec, status: dict[str, Any], *,
                        holder: str | None, registry: Registry, now: datetime, grace_s: float) -> bool:
    """A session the operator ended (connect timeout, max duration) whose worker still holds the lease
    `grace_s` after the end: free it (the worker hung). True if a lease was freed."""
    ended = _parse_time(status.get("endedAt"))
    if holder is None or ended is None or (now - ended).total_seconds() < grace_s:
        return False
    return registry.release(resources.pool_key(ref.namespace, spec.pool), holder, ref.session_id)


def auto_rollback(flags: FlagStore, pool: str, reason: str) -> FlagSet | None:
    """Turn the fused path off for `pool` if it is on. Returns the new FlagSet, or None if already off."""
    current = flags.get(pool)
    if not getattr(current.values, FUSED_GEMM_ALL_REDUCE):
        return None
    log.warning("auto-rollback of %s in pool %s: %s", FUSED_GEMM_ALL_REDUCE, pool, reason)
    return flags.set(pool, {FUSED_GEMM_ALL_REDUCE: False}, actor=AUTO_ROLLBACK_ACTOR, reason=reason)


# ------------------------------------------------------------------------------------------- pools


@dataclass(frozen=True)
class ScalePlan:
    replicas: int
    drain: tuple[str, ...] = ()


def ordinal(worker_id: str, pool_name: str) -> int | None:
    """Pod `<pool>-<n>` -> n; None for a worker that is not one of this StatefulSet's pods."""
    prefix = f"{pool_name}-"
    tail = worker_id[len(prefix):] if worker_id.startswith(prefix) else ""
    return int(tail) if tail.isdigit() else None


def plan_scale(current: int, busy: set[int], idle: set[int], min_idle: int, max_workers: int) -> ScalePlan:
    """Replicas for busy + minIdle idle workers (<= maxWorkers). A StatefulSet removes its highest
    ordinals first, so scale-down stops at the highest busy ordinal: only idle (or not yet warm)
    workers are removed, and the idle ones are drained first so nothing claims them meanwhile."""
    want = min(max_workers, len(busy) + min_idle)
    if want >= current:
        return ScalePlan(replicas=want)
    floor = max(busy) + 1 if busy else 0
    replicas = max(want, floor)
    return ScalePlan(replicas=replicas, drain=tuple(str(i) for i in sorted(idle) if i >= replicas))


def pool_scale(name: str, namespace: str, spec: resources.WorkerPoolSpec, current: int, *, registry: Registry) -> ScalePlan:
    """Read the pool's workers from Redis, plan, and mark the workers to be removed as draining."""
    pool = resources.pool_key(namespace, name)
    registry.reap_dead_workers(pool)
    leases = registry.leases(pool)  # one HGETALL and one SMEMBERS, whatever the pool's size
    busy = {n for wid in leases if (n := ordinal(wid, name)) is not None}
    idle = {n for wid in registry.idle_workers(pool) if wid not in leases and (n := ordinal(wid, name)) is not None}
    plan = plan_scale(current, busy, idle, spec.min_idle, spec.max_workers)
    if plan.drain:
        ids = [f"{name}-{i}" for i in plan.drain]
        registry.set_draining(pool, ids)
        # A claim may have raced the drain: never remove a worker that got a session meanwhile.
        raced = [int(i) for i, wid in zip(plan.drain, ids, strict=True) if registry.session_of(pool, wid)]
        if raced:
            return ScalePlan(replicas=max(raced) + 1, drain=tuple(i for i in plan.drain if int(i) > max(raced)))
        plan = ScalePlan(replicas=plan.replicas, drain=tuple(ids))
    return plan


def pool_status(name: str, namespace: str, registry: Registry, replicas: int) -> dict[str, Any]:
    c = registry.pool_counts(resources.pool_key(namespace, name))
    return {
        "replicas": replicas,
        "ready": c.idle + c.busy + c.draining,
        "idle": c.idle,
        "busy": c.busy,
        "starting": c.loading,
        "draining": c.draining,
        "selector": builders.pool_selector(name),
    }


def apply_spec_flags(
    name: str, namespace: str, spec: resources.WorkerPoolSpec, generation: int, status: dict[str, Any], flags: FlagStore
) -> tuple[FlagSet, dict[str, Any]]:
    """Write spec.flags to Redis if this generation's spec was not applied yet; report flags + conditions."""
    pool = resources.pool_key(namespace, name)
    patch: dict[str, Any] = {}
    if status.get("flagsAppliedGeneration") != generation:
        current = flags.set(pool, spec.flags.model_dump(by_alias=True), actor=f"operator:spec(generation={generation})")
        patch["flagsAppliedGeneration"] = generation
    else:
        current = flags.get(pool)
    in_force = current.values.model_dump()
    patch["flagVersion"] = current.version
    patch["flags"] = in_force
    wanted = spec.flags.model_dump(by_alias=True)
    differs = {k: v for k, v in wanted.items() if in_force.get(k) != v}
    conditions = status.get("conditions") or []
    if differs:
        reason = "AutoRollback" if current.updated_by == AUTO_ROLLBACK_ACTOR else "OverriddenOutsideSpec"
        msg = f"flags {differs} of spec not in force: changed by {current.updated_by}; edit the spec to re-apply"
        patch["conditions"] = builders.set_condition(conditions, "FlagsMatchSpec", False, reason, msg, generation=generation)
    else:
        patch["conditions"] = builders.set_condition(conditions, "FlagsMatchSpec", True, "Applied", "", generation=generation)
    return current, patch


# A StatefulSet labels each pod with the revision of the template it was made from.
REVISION_LABEL = "controller-revision-hash"


@dataclass(frozen=True)
class RollStep:
    """One pod to delete so that the StatefulSet (updateStrategy OnDelete) re-creates it from the new template."""

    pod: str
    uid: str
    revision: str


def plan_roll(pods: list[dict[str, Any]], update_revision: str | None, replicas: int,
              busy: set[str], warm: set[str]) -> RollStep | None:
    """The next outdated pod to replace after a template edit, or None.

    A busy pod (it holds a session) is never chosen: it rolls once its session has ended. One pod at a
    time: nothing is chosen while a pod of the pool is terminating or missing, or while a pod already at
    `update_revision` is not warm yet (registered with its model loaded) — so warm capacity drops by at
    most one, and a new template whose workers never warm up stops the roll after its first pod. Among
    the outdated idle pods, one that is not warm (it serves nothing yet) goes first, then by name."""
    if not update_revision:
        return None
    if len(pods) < replicas or any((p.get("metadata") or {}).get("deletionTimestamp") for p in pods):
        return None

    def revision(p: dict[str, Any]) -> str | None:
        return ((p.get("metadata") or {}).get("labels") or {}).get(REVISION_LABEL)

    if any(revision(p) == update_revision and p["metadata"]["name"] not in warm for p in pods):
        return None
    outdated = [p for p in pods if revision(p) != update_revision and p["metadata"]["name"] not in busy]
    if not outdated:
        return None
    chosen = min(outdated, key=lambda p: (p["metadata"]["name"] in warm, p["metadata"]["name"]))
    return RollStep(pod=chosen["metadata"]["name"], uid=chosen["metadata"]["uid"], revision=revision(chosen) or "")


def roll_pool(name: str, namespace: str, pods: list[dict[str, Any]], sts: dict[str, Any], *,
              registry: Registry) -> RollStep | None:
    """Plan the next roll step from Redis (busy and warm workers) and the StatefulSet, and mark the chosen
    worker draining so nothing claims it before it is deleted. None when nothing is to be done now, or
    when a claim raced the drain (that worker now rolls after its session)."""
    pool = resources.pool_key(namespace, name)
    update_revision = (sts.get("status") or {}).get("updateRevision")
    replicas = int((sts.get("spec") or {}).get("replicas") or 0)
    infos = registry.workers(pool)
    warm = {w for w, info in infos.items() if info.warm}
    busy = set(registry.leases(pool))
    step = plan_roll(pods, update_revision, replicas, busy, warm)
    if step is None:
        return None
    registry.set_draining(pool, [step.pod])
    if registry.session_of(pool, step.pod) is not None:
        return None
    return step
