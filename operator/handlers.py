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
Sessions are driven by one 1 s timer per live session (assignment while Pending, then progress), so a
session waiting for a worker costs no API writes and logs only when its status message changes (INFO),
not at every try; the pool timer scales the StatefulSet and rolls its idle outdated pods (the
StatefulSet's updateStrategy is OnDelete, so no streaming worker is killed by a template edit).
Level-triggered: timers read the current state every time, so an operator restart converges (claims are
idempotent per session, so nothing is assigned twice). Progress and diff-base are kept in annotations
under vivant.dev (status stays schema-clean); the finalizer `vivant.dev/release-worker` guarantees a
deleted session's worker is told to stop and freed — and a per-session lock keeps the timer from
claiming a worker once the release has run.
"""

from __future__ import annotations

import logging
import threading
import time
from datetime import UTC, datetime
from typing import Any

import kopf
import pydantic
from vivant.apis import resources as r
from vivant.apis.feature_flags import FUSED_GEMM_ALL_REDUCE
from vivant.operator import builders as b
from vivant.operator import kube, reconcile
from vivant.operator.config import OperatorConfig
from vivant.operator.metrics import default_metrics, serve
from vivant.sessions.flags import FlagStore
from vivant.sessions.registry import Registry, RegistryUnavailable

FINALIZER = "vivant.dev/release-worker"
SESSIONS = (r.GROUP, r.VERSION, r.SESSION_PLURAL)
POOLS = (r.GROUP, r.VERSION, r.POOL_PLURAL)
SESSION_TICK_S = 1.0
POOL_TICK_S = 2.0
TERMINAL = frozenset(p.value for p in r.TERMINAL_PHASES)
log = logging.getLogger(__name__)


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    config: OperatorConfig = memo.get("config") or OperatorConfig.from_env()
    settings.persistence.finalizer = FINALIZER
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="vivant.dev")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix="vivant.dev")
    settings.watching.server_timeout = 60
    # A deleted CharacterSession keeps its finalizer until its session_tick timer has exited; when a tick was
    # running at the delete, kopf looks again only after `cancellation_polling` (default 60 s), so the session
    # outlived its delete by up to a minute. Look again after one tick.
    settings.background.cancellation_polling = SESSION_TICK_S
    kube.load_config()
    memo.config = config
    memo.registry = Registry(config.redis_url, heartbeat_ttl_s=config.heartbeat_ttl_s,
                             reap_grace_s=max(config.reap_grace_s, config.heartbeat_ttl_s))
    memo.flags = FlagStore(memo.registry.redis)
    memo.metrics = default_metrics()
    memo.pool_views = {}  # (namespace, pool) -> (monotonic time, PoolView); see _pool_view
    if config.metrics_port:
        serve(config.metrics_port, registry=memo.metrics.registry)


def _retry(kind: str, memo: kopf.Memo, retry: int, exc: Exception) -> kopf.TemporaryError:
    memo.metrics.reconcile_error(kind)
    return kopf.TemporaryError(f"{type(exc).__name__}: {exc}", delay=min(30.0, 2.0**retry))


def _session(spec: Any, meta: Any, namespace: str, name: str, uid: str, patch: kopf.Patch) -> tuple:
    try:
        parsed = r.CharacterSessionSpec.model_validate(dict(spec))
    except pydantic.ValidationError as exc:
        msg = "invalid spec: " + "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        patch.status.update(b.session_phase_patch({}, r.SessionPhase.FAILED, "InvalidSpec", msg))
        raise kopf.PermanentError(msg) from None
    created = reconcile._parse_time(meta.get("creationTimestamp")) or datetime.now(tz=UTC)
    return reconcile.SessionRef(namespace=namespace, name=name, uid=uid, created=created), parsed


def _apply(outcome: reconcile.Outcome, body: Any, patch: kopf.Patch) -> None:
    if outcome.status:
        patch.status.update(outcome.status)
    for type_, reason, message in outcome.events:
        kopf.event(body, type=type_, reason=reason, message=message)


POOL_VIEW_TTL_S = 5.0


def _session_lock(memo: kopf.Memo) -> threading.Lock:
    """The lock of one session's claim and release (kopf gives each object its own memo)."""
    return memo.setdefault("session_lock", threading.Lock())


def _pool_view(memo: kopf.Memo, namespace: str, pool: str) -> reconcile.PoolView:
    """What Kubernetes says about a pool, read at most every POOL_VIEW_TTL_S per pool (shared by all the
    sessions waiting on it), so waiting sessions do not multiply the API reads."""
    key, now = (namespace, pool), time.monotonic()
    cached = memo.pool_views.get(key)
    if cached is not None and now - cached[0] < POOL_VIEW_TTL_S:
        return cached[1]
    obj = kube.worker_pool(namespace, pool)
    pods = tuple(kube.pool_pods(namespace, b.pool_selector(pool))) if obj is not None else ()
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


def _log_session(namespace: str, name: str, status: dict[str, Any], out: reconcile.Outcome) -> None:
    """INFO when the session's phase or message changes, DEBUG otherwise (the timer runs every second)."""
    new = out.status
    if new and (new.get("phase") != status.get("phase") or new.get("message") != status.get("message")):
        log.info("session %s/%s: %s: %s", namespace, name, new.get("phase"), new.get("message"))
    else:
        log.debug("session %s/%s: unchanged (%s)", namespace, name, status.get("phase"))


@kopf.timer(*SESSIONS, interval=SESSION_TICK_S, when=lambda status, **_: status.get("phase") not in ("Ended", "Failed"))
def session_tick(body, spec, meta, status, namespace, name, uid, patch, memo, **_: Any) -> None:
    """Pending: try to assign a worker (and say why none is free); later phases: mirror the worker."""
    if meta.get("deletionTimestamp"):
        return  # session_release owns it now
    ref, parsed = _session(spec, meta, namespace, name, uid, patch)
    cfg: OperatorConfig = memo.config
    now = datetime.now(tz=UTC)
    try:
        if status.get("phase") in (None, r.SessionPhase.PENDING.value):
            with _session_lock(memo):
                if memo.get("released"):
                    return
                sent = memo.get("assigned")  # (worker, status patch) this operator sent and wrote already
                if sent is not None and memo.registry.worker_of(ref.session_id) == sent[0]:
                    # our own Assigned patch is not in the body yet (the watch lags): write it again, send nothing
                    _apply(reconcile.Outcome(status=sent[1]), body, patch)
                    return
                out = reconcile.assign_session(
                    ref, parsed, dict(status), registry=memo.registry, credentials=cfg.livekit,
                    apply_secret=_write_token_secret, timeouts=cfg.timeouts, now=now, token_ttl=cfg.token_ttl,
                    read_token=lambda secret: kube.read_secret_token(namespace, secret),
                    pool_view=lambda: _pool_view(memo, namespace, parsed.pool),
                )
            if out.assigned_after_s is not None:
                memo["assigned"] = (out.status.get("worker"), out.status)
                memo.metrics.observe_assignment(r.pool_key(namespace, parsed.pool), out.assigned_after_s)
        else:
            out = reconcile.progress_session(ref, parsed, dict(status), registry=memo.registry,
                                             timeouts=cfg.timeouts, now=now)
            if out.rollback is not None:
                pool, reason = out.rollback
                if reconcile.auto_rollback(memo.flags, pool, reason) is not None:
                    kopf.warn(body, reason="FlagRolledBack", message=f"{FUSED_GEMM_ALL_REDUCE} turned off: {reason}")
                    memo.metrics.flag_rollback(pool, FUSED_GEMM_ALL_REDUCE, "fault" if "fault" in reason else "fps")
    except (RegistryUnavailable, kube.ApiException) as exc:
        memo.metrics.reconcile_error(r.SESSION_KIND)
        log.warning("session %s/%s: %s: %s; retrying next tick", namespace, name, type(exc).__name__,
                    kube.api_message(exc) if isinstance(exc, kube.ApiException) else exc)
        return
    _apply(out, body, patch)
    _log_session(namespace, name, dict(status), out)


@kopf.on.delete(*SESSIONS)
def session_release(spec, meta, status, namespace, name, uid, memo, retry, logger, **_: Any) -> None:
    try:
        parsed = r.CharacterSessionSpec.model_validate(dict(spec))
    except pydantic.ValidationError:
        return  # never assigned: nothing to release
    ref = reconcile.SessionRef(namespace=namespace, name=name, uid=uid, created=datetime.now(tz=UTC))
    with _session_lock(memo):
        memo["released"] = True  # the timer claims nothing for this session from now on
        try:
            released = reconcile.release_session(ref, parsed, dict(status), registry=memo.registry)
        except RegistryUnavailable as exc:
            raise _retry(r.SESSION_KIND, memo, retry, exc) from None
    logger.info(f"session deleted; worker lease {'released' if released else 'was already free'}")


@kopf.index(*SESSIONS)
def session_phases(namespace, spec, status, name, **_: Any) -> dict[tuple[str, str, str], str]:
    return {(namespace, r.pool_key(namespace, spec.get("pool", "?")), status.get("phase", "Pending")): name}


# ------------------------------------------------------------------------------------------- pools


def _parse_pool(spec: Any, name: str) -> r.WorkerPoolSpec:
    """The pool's spec (and name) through the models; pydantic.ValidationError names the field."""
    r.PoolMeta.model_validate({"name": name})
    return r.WorkerPoolSpec.model_validate(dict(spec))


def _pool(spec: Any, name: str, status: Any, patch: kopf.Patch) -> r.WorkerPoolSpec:
    try:
        return _parse_pool(spec, name)
    except pydantic.ValidationError as exc:
        msg = "invalid spec: " + "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        patch.status["conditions"] = b.set_condition(status.get("conditions") or [], "Ready", False, "InvalidSpec", msg)
        raise kopf.PermanentError(msg) from None


@kopf.on.create(*POOLS)
@kopf.on.resume(*POOLS)
@kopf.on.update(*POOLS, field="spec")
def pool_apply(body, spec, meta, status, namespace, name, uid, patch, memo, retry, **_: Any) -> None:
    """Apply the pool's StatefulSet, headless Service and PDB; write spec.flags on a new generation.

    An object the API server rejects is reported (Ready=False `<Kind>Rejected` with the server's message,
    a Warning Event) and not retried until the spec changes."""
    parsed = _pool(spec, name, status, patch)
    owner = b.Owner(kind=r.POOL_KIND, name=name, uid=uid)
    generation = int(meta.get("generation") or 1)
    try:
        current = kube.statefulset_replicas(namespace, name) or 0
        plan = reconcile.pool_scale(name, namespace, parsed, current, registry=memo.registry)
        for manifest in (b.build_statefulset(name, namespace, owner, parsed, plan.replicas, memo.config.runtime),
                         b.build_headless_service(name, namespace, owner), b.build_pdb(name, namespace, owner)):
            try:
                kube.apply(manifest)
            except kube.ApiException as exc:
                if not kube.is_rejection(exc):
                    raise
                reason, msg = f"{manifest['kind']}Rejected", kube.api_message(exc)
                patch.status["conditions"] = b.set_condition(status.get("conditions") or [], "Ready", False, reason,
                                                             msg, generation=generation)
                patch.status["observedGeneration"] = generation
                kopf.warn(body, reason=reason, message=msg)
                raise kopf.PermanentError(f"{reason}: {msg}") from None
        _, flag_patch = reconcile.apply_spec_flags(name, namespace, parsed, generation, dict(status), memo.flags)
    except (RegistryUnavailable, kube.ApiException) as exc:
        raise _retry(r.POOL_KIND, memo, retry, exc) from None
    flag_patch["conditions"] = b.set_condition(flag_patch["conditions"], "Ready", True, "Applied",
                                               "StatefulSet, Service and PodDisruptionBudget applied",
                                               generation=generation)
    patch.status.update({**flag_patch, "observedGeneration": generation})
    log.info("pool %s/%s: generation %d applied (%d workers)", namespace, name, generation, plan.replicas)


@kopf.on.delete(*POOLS, optional=True)
def pool_deleted(namespace, name, memo, **_: Any) -> None:
    """The StatefulSet, Service and PDB go with the pool (ownerReferences); drop its metric series."""
    memo.metrics.pool_deleted(r.pool_key(namespace, name))


def _roll(body: Any, namespace: str, name: str, sts: dict[str, Any], memo: kopf.Memo) -> None:
    """Replace one idle outdated pod, if the StatefulSet has pods of an older template (see reconcile.plan_roll)."""
    st = sts.get("status") or {}
    if not st.get("updateRevision") or int(st.get("updatedReplicas") or 0) >= int(st.get("replicas") or 0):
        return  # every pod is at the latest template (OnDelete never moves currentRevision, so not that)
    pods = kube.pool_pods(namespace, b.pool_selector(name))
    step = reconcile.roll_pool(name, namespace, pods, sts, registry=memo.registry)
    if step is not None and kube.delete_pod(namespace, step.pod, step.uid):
        msg = f"replacing idle worker {step.pod} (template {step.revision} -> {st['updateRevision']})"
        log.info("pool %s/%s: %s", namespace, name, msg)
        kopf.info(body, reason="RollingWorker", message=msg)


@kopf.timer(*POOLS, interval=POOL_TICK_S, initial_delay=POOL_TICK_S)
def pool_tick(body, spec, meta, status, namespace, name, patch, memo, session_phases: kopf.Index, **_: Any) -> None:
    """Every 2 s: size the StatefulSet (busy + minIdle), roll idle outdated pods, mirror the pool's state."""
    try:
        parsed = _parse_pool(spec, name)
    except pydantic.ValidationError:
        return  # pool_apply reported it (Ready=False InvalidSpec)
    pool = r.pool_key(namespace, name)
    try:
        sts = kube.statefulset(namespace, name)
        if sts is None:
            return  # pool_apply has not created it yet (or the API server rejected it: see the Ready condition)
        current = int(sts["spec"].get("replicas") or 0)
        plan = reconcile.pool_scale(name, namespace, parsed, current, registry=memo.registry)
        live = {f"{ns}/{n}" for (ns, pk, phase), names in session_phases.items()
                if pk == pool and phase not in TERMINAL for n in names}
        reconcile.release_orphan_leases(pool, memo.registry, live)
        if plan.replicas != current:
            kube.scale_statefulset(namespace, name, plan.replicas)
            kopf.info(body, reason="Scaled", message=f"workers {current} -> {plan.replicas} (drained {list(plan.drain)})")
        else:
            _roll(body, namespace, name, sts, memo)
        counts = reconcile.pool_status(name, namespace, memo.registry, plan.replicas)
        flagset, flag_patch = reconcile.apply_spec_flags(
            name, namespace, parsed, int(meta.get("generation") or 1), dict(status), memo.flags)
    except (RegistryUnavailable, kube.ApiException) as exc:
        memo.metrics.reconcile_error(r.POOL_KIND)
        log.warning("pool %s: %s; retrying next tick", pool,
                    kube.api_message(exc) if isinstance(exc, kube.ApiException) else exc)
        return
    if (flagset.updated_by == reconcile.AUTO_ROLLBACK_ACTOR and flagset.version != status.get("flagVersion")):
        kopf.warn(body, reason="FlagRolledBack",
                  message=f"{FUSED_GEMM_ALL_REDUCE} turned off by auto-rollback; edit spec.flags to re-enable")
    patch.status.update({**counts, **flag_patch})
    memo.metrics.set_pool_workers(pool, desired=plan.replicas, idle=counts["idle"], busy=counts["busy"],
                                  starting=counts["starting"], draining=counts["draining"])
    memo.metrics.set_session_counts({key: len(names) for key, names in session_phases.items()})
