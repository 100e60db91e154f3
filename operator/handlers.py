"""kopf handlers for CharacterSession and WorkerPool: thin glue between kopf and `reconcile.py`.

Each handler parses the object with the pydantic models, calls one reconcile function, and applies
its outcome (status patch, Events, the token Secret, StatefulSet size). Errors by intent:
- a spec the models reject -> status Failed (session) or Ready=False InvalidSpec (pool), then
  `kopf.PermanentError`;
- an object the API server rejects (a pool's StatefulSet, Service or PDB) -> Ready=False
  `<Kind>Rejected` with the server's message, a Warning Event, then `kopf.PermanentError`: retried on
  the next spec change, not forever;
- Redis unreachable (`RegistryUnavailable`) or other Kubernetes API errors -> `kopf.TemporaryError`
  with exponential backoff (1 s, 2 s, 4 s ... 30 s) in event handlers; the timers try again next tick.
A session's create handler runs once (its status goes in kopf's patch, see session_assign); the pool
timers read a copy of kopf's session index taken on kopf's event loop (index_snapshot).
Nothing runs per session per second (docs/ARCHITECTURE.md, "The control plane at fleet scale"): a
session is assigned on its create/resume event; one that finds no idle worker says why in its status,
its pool's sweep (`session_sweep.py`, one kopf timer per pool) assigns it once a worker is idle, and
while it waits it re-checks on its own every WAITING_CHECK_S (why it waits, the pending timeout);
the same sweep mirrors, times out and ends all the pool's sessions, and their status is written through
a queue (`status_writer.py`). Deleting a session asks the worker to stop and keeps the finalizer until
the worker has given the lease back. The pool timer scales the StatefulSet and rolls its idle outdated
pods (the StatefulSet's updateStrategy is OnDelete, so no streaming worker is killed by a template edit).
Level-triggered: handlers and sweeps read the current state every time, so an operator restart converges
(claims are idempotent per session, so nothing is assigned twice). Progress and diff-base are kept in
annotations under vivant.dev (status stays schema-clean); the finalizer `vivant.dev/release-worker`
guarantees a deleted session's worker is told to stop and freed.
"""


from __future__ import annotations

import asyncio
import contextvars
import functools
import logging
import time
from datetime import UTC, datetime
from typing import Any

import kopf
import pydantic
from vivant.apis import resources
from vivant.apis.feature_flags import FUSED_GEMM_ALL_REDUCE
from vivant.operator import builders, kube, reconcile, session_sweep
from vivant.operator.config import OperatorConfig
from vivant.operator.metrics import default_metrics, serve
from vivant.operator.status_writer import StatusWriter
from vivant.sessions.flags import FlagStore
from vivant.sessions.registry import Registry, RegistryUnavailable

FINALIZER = "vivant.dev/release-worker"
SESSIONS = (resources.GROUP, resources.VERSION, resources.SESSION_PLURAL)
POOLS = (resources.GROUP, resources.VERSION, resources.POOL_PLURAL)
POOL_TICK_S = 2.0
TERMINAL = frozenset(p.value for p in resources.TERMINAL_PHASES)
HANDLER_THREADS = 16  # kopf's pool for sync handlers (its default is min(32, cores + 4): 6 on 2 cores)
STATUS_WRITERS = 8  # threads writing session status (status_writer.py)
WAITING_CHECK_S = 5.0  # how often a session waiting for a worker re-checks on its own (session_waiting)
END_ACK_WAIT_S = 3.0  # how long one delete-handler run waits for the worker's end before kopf retries it
log = logging.getLogger(__name__)



@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    config: OperatorConfig = memo.get("config") or OperatorConfig.from_env()
    settings.persistence.finalizer = FINALIZER
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=session_sweep.ANNOTATION_PREFIX)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=session_sweep.ANNOTATION_PREFIX)
    settings.watching.server_timeout = 60
    # kopf posts its own log lines as Events from INFO up ("Handler ... succeeded", "Creation is processed"):
    # two API requests per session event, nothing a user acts on. Warnings and errors are still posted.
    settings.posting.level = logging.WARNING
    # A deleted CharacterSession keeps its finalizer until its timers have exited; when one was running at the
    # delete, kopf looks again only after `cancellation_polling` (default 60 s), so the session outlived its
    # delete by up to a minute. Look again after one second.
    settings.background.cancellation_polling = 1.0
    settings.execution.max_workers = HANDLER_THREADS
    memo.executor = settings.execution.executor  # the pool timers' blocking part runs there too (_in_thread)
    settings.peering.priority = config.peering_priority
    settings.peering.lifetime = config.peering_lifetime_s
    kube.load_config(pool_size=HANDLER_THREADS + STATUS_WRITERS + 4)
    memo.config = config
    memo.registry = Registry(config.redis_url, heartbeat_ttl_s=config.heartbeat_ttl_s,
                             reap_grace_s=max(config.reap_grace_s, config.heartbeat_ttl_s))
    memo.flags = FlagStore(memo.registry.redis)
    memo.metrics = default_metrics()
    memo.pool_views = {}  # (namespace, pool) -> (monotonic time, PoolView); see _pool_view
    memo.sweep = session_sweep.SweepState()
    memo.writer = StatusWriter(kube.patch_session_status, threads=STATUS_WRITERS, on_written=memo.sweep.confirm)
    if config.metrics_port:
        serve(config.metrics_port, config.metrics_address, registry=memo.metrics.registry)


@kopf.on.cleanup()
def stop_writer(memo: kopf.Memo, **_: Any) -> None:
    """Write what is queued before the operator exits (a successor would recompute it anyway)."""
    memo.writer.flush(timeout=5.0)
    memo.writer.close()


def _retry(kind: str, memo: kopf.Memo, retry: int, exc: Exception) -> kopf.TemporaryError:
    memo.metrics.reconcile_error(kind)
    return kopf.TemporaryError(f"{type(exc).__name__}: {exc}", delay=min(30.0, 2.0**retry))


def _session(spec: Any, meta: Any, namespace: str, name: str, uid: str, patch: kopf.Patch) -> tuple:
    try:
        parsed = resources.CharacterSessionSpec.model_validate(dict(spec))
    except pydantic.ValidationError as exc:
        msg = "invalid spec: " + "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        patch.status.update(builders.session_phase_patch({}, resources.SessionPhase.FAILED, "InvalidSpec", msg))
        raise kopf.PermanentError(msg) from None
    created = reconcile._parse_time(meta.get("creationTimestamp")) or datetime.now(tz=UTC)
    return reconcile.SessionRef(namespace=namespace, name=name, uid=uid, created=created), parsed


POOL_VIEW_TTL_S = 5.0


def _pool_view(memo: kopf.Memo, namespace: str, pool: str) -> reconcile.PoolView:
    """What Kubernetes says about a pool, read at most every POOL_VIEW_TTL_S per pool (shared by all the
    sessions waiting on it), so waiting sessions do not multiply the API reads."""
    key, now = (namespace, pool), time.monotonic()
    cached = memo.pool_views.get(key)
    if cached is not None and now - cached[0] < POOL_VIEW_TTL_S:
        return cached[1]
    obj = kube.worker_pool(namespace, pool)
    pods = tuple(kube.pool_pods(namespace, builders.pool_selector(pool))) if obj is not None else ()
    view = reconcile.PoolView(pool=obj, pods=pods)
    memo.pool_views[key] = (now, view)
    return view


def _write_token_secret(manifest: dict[str, Any]) -> None:
    """kube.put_token_secret with the API server's refusals (4xx) as reconcile.SecretWriteError."""
    try:
        kube.put_token_secret(manifest)
    except kube.SecretNotOurs as exc:
        raise reconcile.SecretWriteError(str(exc)) from None
    except kube.ApiException as exc:
        if exc.status is not None and 400 <= exc.status < 500 and exc.status != 429:
            raise reconcile.SecretWriteError(kube.api_message(exc)) from None
        raise


def _assign(view: session_sweep.SessionView, memo: kopf.Memo,
            patch: kopf.Patch | None = None) -> reconcile.Outcome | None:
    """Try to assign a waiting session (create/resume handler, its pool's sweep, its waiting timer) and write
    its status: into `patch` (the create handler's: kopf writes it in the same round as its own record that the
    handler ran), else through the status writer's queue. None when there is nothing to do: another path
    assigned it meanwhile, or it is being deleted. The status patch is remembered before it is written, so
    the sweep never assigns it twice."""
    state: session_sweep.SweepState = memo.sweep
    assert view.spec is not None
    with state.lock(view.uid):
        status = state.status(view)
        if view.uid in state.releasing or status.get("worker") or status.get("phase") not in (
                None, resources.SessionPhase.PENDING.value):
            return None
        cfg: OperatorConfig = memo.config
        started = time.monotonic()
        out = reconcile.assign_session(
            view.ref, view.spec, status, registry=memo.registry, credentials=cfg.livekit,
            apply_secret=_write_token_secret, timeouts=cfg.timeouts, now=datetime.now(tz=UTC),
            token_ttl=cfg.token_ttl, read_token=lambda secret: kube.read_secret_token(view.namespace, secret),
            pool_view=lambda: _pool_view(memo, view.namespace, view.spec.pool),
        )
        if out.status:
            seq = state.remember(view.uid, out.status, by_kopf=patch is not None)
            if patch is not None:
                patch.status.update(out.status)
            else:
                memo.writer.put(view.namespace, view.name, view.uid, out.status, tag=seq)
            if out.status.get("phase") != status.get("phase") or out.status.get("message") != status.get("message"):
                log.info("session %s/%s: %s: %s", view.namespace, view.name, out.status.get("phase"),
                         out.status.get("message"))
    memo.metrics.observe_reconcile("assign", time.monotonic() - started)
    if out.assigned_after_s is not None:
        memo.metrics.observe_assignment(resources.pool_key(view.namespace, view.spec.pool), out.assigned_after_s)
    return out


@kopf.on.create(*SESSIONS)
@kopf.on.resume(*SESSIONS)
def session_assign(body, spec, meta, status, namespace, name, uid, patch, memo, retry, reason, **_: Any) -> None:
    """A new (or, at operator start, an unfinished) session: assign it, or say why it waits.

    Its status goes into kopf's own patch, not through the status writer: kopf writes it right after its
    record that this handler ran (the diff-base annotation), so no version of the object carries our status
    without that record. kopf would take such a version, once its watch lags past its consistency timeout
    (5 s), for a session not handled yet, and run this handler again on it (and the sweeps leave a session
    alone until the record shows: SessionView.handled)."""
    # kopf's cause: create, or resume (at operator start; mixed into an update made while it was down)
    memo.metrics.handler_run("session_create" if reason == "create" else "session_resume")
    if status.get("phase") in (p.value for p in resources.TERMINAL_PHASES):
        return
    _session(spec, meta, namespace, name, uid, patch)  # an invalid spec fails here, naming the field
    view = session_sweep.SessionView.from_body(body)
    try:
        out = _assign(view, memo, patch)
    except (RegistryUnavailable, kube.ApiException) as exc:
        raise _retry(resources.SESSION_KIND, memo, retry, exc) from None
    if out is None:
        # assigned before (an earlier run whose kopf patch was lost, or a sweep): what this process remembers
        # writing and the object does not show yet goes into this run's patch, so it is not lost with the other
        patch.status.update(memo.sweep.unshown(view))
        return
    for type_, reason_, message in out.events:  # waiting: the pool's sweep assigns it when a worker is idle
        kopf.event(body, type=type_, reason=reason_, message=message)


def _waiting(status: Any, meta: Any, **_: Any) -> bool:
    """Waiting for a worker after its create handler ran (before that, the create handler assigns it)."""
    return (status.get("phase") in (None, resources.SessionPhase.PENDING.value) and not status.get("worker")
            and not meta.get("deletionTimestamp") and session_sweep.HANDLED_ANNOTATION in (meta.get("annotations") or {}))


@kopf.timer(*SESSIONS, interval=WAITING_CHECK_S, initial_delay=WAITING_CHECK_S, when=_waiting)
def session_waiting(body, namespace, name, uid, memo, **_: Any) -> None:
    """A session still waiting for a worker, every WAITING_CHECK_S: try again, say why it waits, fail it
    past the pending timeout. Only waiting sessions run it (kopf stops the timer once one is assigned),
    and it covers a session whose pool does not exist (no sweep of that pool would ever see it)."""
    view = session_sweep.SessionView.from_body(body)
    if view.spec is None:
        return  # session_assign marked it Failed
    try:
        out = _assign(view, memo)
    except (RegistryUnavailable, kube.ApiException) as exc:
        memo.metrics.reconcile_error(resources.SESSION_KIND)
        log.warning("session %s/%s: %s; next try in %.0fs", namespace, name, exc, WAITING_CHECK_S)
        return
    if out is not None:
        for type_, reason, message in out.events:
            kopf.event(body, type=type_, reason=reason, message=message)


async def _in_thread(memo: kopf.Memo, fn: Any, *args: Any) -> None:
    """Run `fn(*args)` in kopf's handler threads (as kopf runs a sync handler: context copied, so kopf.event works
    there), not asyncio's default pool (min(32, cores + 4) threads: 6 on 2 cores, fewer than the pools' timers)."""
    ctx = contextvars.copy_context()
    await asyncio.get_running_loop().run_in_executor(memo.get("executor"), functools.partial(ctx.run, fn, *args))


def index_snapshot(index: kopf.Index) -> dict[str, list[session_sweep.SessionView]]:
    """A copy of the session index {pool id: views}. Taken on kopf's event loop, the thread that changes the
    index (on every watch event), so never while it changes; the pool timers then read the copy in a worker
    thread. Iterating the index itself from a handler thread raised "dictionary changed size during
    iteration" whenever a session came or went meanwhile, and the pool's timer stopped for its retry delay."""
    return {key: list(store) for key, store in index.items()}


@kopf.timer(*POOLS, interval=session_sweep.SWEEP_S, initial_delay=session_sweep.SWEEP_S)
async def pool_sessions(namespace, name, memo, session_views: kopf.Index, **_: Any) -> None:
    """Every second: reconcile all the pool's sessions at once (session_sweep.py)."""
    views = list(session_views.get(resources.pool_key(namespace, name), ()))  # on the loop: see index_snapshot
    await _in_thread(memo, _sweep_sessions, namespace, name, memo, views)


def _sweep_sessions(namespace: str, name: str, memo: kopf.Memo, views: list[session_sweep.SessionView]) -> None:
    pool = resources.pool_key(namespace, name)
    state: session_sweep.SweepState = memo.sweep
    started = time.monotonic()

    def assign(view: session_sweep.SessionView, _status: dict[str, Any]) -> bool:
        out = _assign(view, memo)
        if out is None:
            return True
        for type_, reason, message in out.events:
            kopf.event(view.event_body(), type=type_, reason=reason, message=message)
        return not out.no_worker

    try:
        res = session_sweep.sweep_pool(
            views, registry=memo.registry, state=state, timeouts=memo.config.timeouts,
            write_status=lambda view, p, seq, urgent: memo.writer.put(view.namespace, view.name, view.uid, p, tag=seq,
                                                                      urgent=urgent),
            assign=assign)
        for view, (type_, reason, message) in res.events:
            kopf.event(view.event_body(), type=type_, reason=reason, message=message)
        for view, rb_pool, reason in res.rollbacks:
            if reconcile.auto_rollback(memo.flags, rb_pool, reason) is not None:
                kopf.warn(view.event_body(), reason="FlagRolledBack", message=f"{FUSED_GEMM_ALL_REDUCE} turned off: {reason}")
                memo.metrics.flag_rollback(rb_pool, FUSED_GEMM_ALL_REDUCE, "fault" if "fault" in reason else "fps")
    except (RegistryUnavailable, kube.ApiException) as exc:
        memo.metrics.reconcile_error(resources.SESSION_KIND)
        log.warning("pool %s: session sweep failed (%s); next sweep in %.0fs", pool, exc, session_sweep.SWEEP_S)
        return
    memo.metrics.observe_reconcile("session_sweep", time.monotonic() - started)
    memo.metrics.set_queue_depth("waiting_for_worker", pool, res.waiting - res.assigned)
    memo.metrics.set_queue_depth("status_writes", "all", memo.writer.depth())


@kopf.on.delete(*SESSIONS)
async def session_release(spec, meta, status, namespace, name, uid, memo, retry, logger, **_: Any) -> None:
    """Ask the worker to stop; the finalizer goes once the worker has given the lease back (or, if it
    hangs, once the operator freed it after session_sweep.END_GRACE_S)."""
    try:
        parsed = resources.CharacterSessionSpec.model_validate(dict(spec))
    except pydantic.ValidationError:
        return  # never assigned: nothing to release
    memo.sweep.releasing.add(uid)  # nothing assigns it from now on
    ref = reconcile.SessionRef(namespace=namespace, name=name, uid=uid, created=datetime.now(tz=UTC))
    started, pause = time.monotonic(), 0.05
    pool = resources.pool_key(namespace, parsed.pool)
    memo.metrics.queue_change("awaiting_end", pool, +1)
    try:
        while True:
            try:
                step = reconcile.release_session(ref, parsed, dict(status), registry=memo.registry,
                                                 end_sent_at=memo.get("end_sent_at"), now=datetime.now(tz=UTC),
                                                 grace_s=session_sweep.END_GRACE_S)
            except RegistryUnavailable as exc:
                raise _retry(resources.SESSION_KIND, memo, retry, exc) from None
            if step.end_sent:
                memo["end_sent_at"] = datetime.now(tz=UTC)
            if step.done:
                break
            if time.monotonic() - started > END_ACK_WAIT_S:
                raise kopf.TemporaryError("waiting for the worker to stop the session", delay=1.0)
            await asyncio.sleep(pause)
            pause = min(0.4, pause * 2)
    finally:
        memo.metrics.queue_change("awaiting_end", pool, -1)
    memo.metrics.observe_reconcile("release", time.monotonic() - started)
    secret = status.get("tokenSecret")
    if secret and not parsed.livekit.token_secret:  # the operator's own Secret, not one the caller supplied
        try:
            await _in_thread(memo, kube.delete_token_secret, namespace, secret)
        except kube.ApiException as exc:  # its owner reference still has the garbage collector delete it
            logger.warning(f"token Secret {secret} not deleted ({kube.api_message(exc)}); left to the garbage collector")
    if step.forced:
        logger.warning(f"worker did not stop within {session_sweep.END_GRACE_S:.0f}s of the end request; lease freed")


@kopf.index(*SESSIONS)
def session_views(body, namespace, spec, **_: Any) -> dict[str, session_sweep.SessionView]:
    """Every session by its pool id, as the sweeps and the phase counts read them (no API read)."""
    return {resources.pool_key(namespace, spec.get("pool", "?")): session_sweep.SessionView.from_body(body)}


# ------------------------------------------------------------------------------------------- pools


def _parse_pool(spec: Any, name: str) -> resources.WorkerPoolSpec:
    """The pool's spec (and name) through the models; pydantic.ValidationError names the field."""
    resources.PoolMeta.model_validate({"name": name})
    return resources.WorkerPoolSpec.model_validate(dict(spec))


def _pool(spec: Any, name: str, status: Any, patch: kopf.Patch) -> resources.WorkerPoolSpec:
    try:
        return _parse_pool(spec, name)
    except pydantic.ValidationError as exc:
        msg = "invalid spec: " + "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        patch.status["conditions"] = builders.set_condition(status.get("conditions") or [], "Ready", False, "InvalidSpec", msg)
        raise kopf.PermanentError(msg) from None


@kopf.on.create(*POOLS)
@kopf.on.resume(*POOLS)
@kopf.on.update(*POOLS, field="spec")
def pool_apply(body, spec, meta, status, namespace, name, uid, patch, memo, retry, **_: Any) -> None:
    """Apply the pool's StatefulSet, headless Service and PDB; write spec.flags on a new generation.

    An object the API server rejects is reported (Ready=False `<Kind>Rejected` with the server's message,
    a Warning Event) and not retried until the spec changes."""
    parsed = _pool(spec, name, status, patch)
    owner = builders.Owner(kind=resources.POOL_KIND, name=name, uid=uid)
    generation = int(meta.get("generation") or 1)
    try:
        current = kube.statefulset_replicas(namespace, name) or 0
        plan = reconcile.pool_scale(name, namespace, parsed, current, registry=memo.registry)
        for manifest in (builders.build_statefulset(name, namespace, owner, parsed, plan.replicas, memo.config.runtime),
                         builders.build_headless_service(name, namespace, owner), builders.build_pdb(name, namespace, owner)):
            try:
                kube.apply(manifest)
            except kube.ApiException as exc:
                if not kube.is_rejection(exc):
                    raise
                reason, msg = f"{manifest['kind']}Rejected", kube.api_message(exc)
                patch.status["conditions"] = builders.set_condition(status.get("conditions") or [], "Ready", False, reason,
                                                             msg, generation=generation)
                patch.status["observedGeneration"] = generation
                kopf.warn(body, reason=reason, message=msg)
                raise kopf.PermanentError(f"{reason}: {msg}") from None
        _, flag_patch = reconcile.apply_spec_flags(name, namespace, parsed, generation, dict(status), memo.flags)
    except (RegistryUnavailable, kube.ApiException) as exc:
        raise _retry(resources.POOL_KIND, memo, retry, exc) from None
    flag_patch["conditions"] = builders.set_condition(flag_patch["conditions"], "Ready", True, "Applied",
                                               "StatefulSet, Service and PodDisruptionBudget applied",
                                               generation=generation)
    patch.status.update({**flag_patch, "observedGeneration": generation})
    log.info("pool %s/%s: generation %d applied (%d workers)", namespace, name, generation, plan.replicas)


@kopf.on.delete(*POOLS, optional=True)
def pool_deleted(namespace, name, memo, **_: Any) -> None:
    """The StatefulSet, Service and PDB go with the pool (ownerReferences); drop its metric series."""
    memo.metrics.pool_deleted(resources.pool_key(namespace, name))


def _roll(body: Any, namespace: str, name: str, sts: dict[str, Any], memo: kopf.Memo) -> None:
    """Replace one idle outdated pod, if the StatefulSet has pods of an older template (see reconcile.plan_roll)."""
    st = sts.get("status") or {}
    if not st.get("updateRevision") or int(st.get("updatedReplicas") or 0) >= int(st.get("replicas") or 0):
        return  # every pod is at the latest template (OnDelete never moves currentRevision, so not that)
    pods = kube.pool_pods(namespace, builders.pool_selector(name))
    step = reconcile.roll_pool(name, namespace, pods, sts, registry=memo.registry)
    if step is not None and kube.delete_pod(namespace, step.pod, step.uid):
        msg = f"replacing idle worker {step.pod} (template {step.revision} -> {st['updateRevision']})"
        log.info("pool %s/%s: %s", namespace, name, msg)
        kopf.info(body, reason="RollingWorker", message=msg)


@kopf.timer(*POOLS, interval=POOL_TICK_S, initial_delay=POOL_TICK_S)
async def pool_tick(body, spec, meta, status, namespace, name, patch, memo, session_views: kopf.Index,
                    **_: Any) -> None:
    """Every 2 s: size the StatefulSet (busy + minIdle), roll idle outdated pods, mirror the pool's state."""
    views = index_snapshot(session_views)  # on the loop: see index_snapshot
    await _in_thread(memo, _pool_tick, body, spec, meta, status, namespace, name, patch, memo, views)


def _pool_tick(body: Any, spec: Any, meta: Any, status: Any, namespace: str, name: str, patch: kopf.Patch,
               memo: kopf.Memo, session_views: dict[str, list[session_sweep.SessionView]]) -> None:
    try:
        parsed = _parse_pool(spec, name)
    except pydantic.ValidationError:
        return  # pool_apply reported it (Ready=False InvalidSpec)
    pool = resources.pool_key(namespace, name)
    try:
        sts = kube.statefulset(namespace, name)
        if sts is None:
            return  # pool_apply has not created it yet (or the API server rejected it: see the Ready condition)
        current = int(sts["spec"].get("replicas") or 0)
        plan = reconcile.pool_scale(name, namespace, parsed, current, registry=memo.registry)
        # leases of sessions that are gone, or ended long ago: the sweep gives a recently ended session's worker
        # END_GRACE_S to give its lease back itself (session_sweep.py); past that window the lease is an orphan
        now = datetime.now(tz=UTC)
        live = {f"{v.namespace}/{v.name}" for v in session_views.get(pool, ())
                if v.status.get("phase") not in TERMINAL
                or session_sweep.recently_ended(v.status, now)}
        reconcile.release_orphan_leases(pool, memo.registry, live)
        if plan.replicas != current:
            kube.scale_statefulset(namespace, name, plan.replicas)
            kopf.info(body, reason="Scaled", message=f"workers {current} -> {plan.replicas} (drained {list(plan.drain)})")
        else:
            _roll(body, namespace, name, sts, memo)
        counts = reconcile.pool_status(name, namespace, memo.registry, plan.replicas)
        failures = memo.registry.worker_failures(pool)
        dead_letters = memo.registry.dead_letters_total()
        flagset, flag_patch = reconcile.apply_spec_flags(
            name, namespace, parsed, int(meta.get("generation") or 1), dict(status), memo.flags)
    except (RegistryUnavailable, kube.ApiException) as exc:
        memo.metrics.reconcile_error(resources.POOL_KIND)
        log.warning("pool %s: %s; retrying next tick", pool,
                    kube.api_message(exc) if isinstance(exc, kube.ApiException) else exc)
        return
    if (flagset.updated_by == reconcile.AUTO_ROLLBACK_ACTOR and flagset.version != status.get("flagVersion")):
        kopf.warn(body, reason="FlagRolledBack",
                  message=f"{FUSED_GEMM_ALL_REDUCE} turned off by auto-rollback; edit spec.flags to re-enable")
    patch.status.update({**counts, **flag_patch})
    memo.metrics.set_pool_workers(pool, desired=plan.replicas, idle=counts["idle"], busy=counts["busy"],
                                  starting=counts["starting"], draining=counts["draining"])
    memo.metrics.observe_worker_failures(pool, failures)
    memo.metrics.observe_dead_letters(dead_letters)
    counts: dict[tuple[str, str, str], int] = {}
    for key, views in session_views.items():
        for v in views:
            k = (v.namespace, key, v.status.get("phase") or resources.SessionPhase.PENDING.value)
            counts[k] = counts.get(k, 0) + 1
    memo.metrics.set_session_counts(counts)
    memo.sweep.forget_all_but(v.uid for views in session_views.values() for v in views)
