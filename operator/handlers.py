"""kopf handlers for CharacterSession and WorkerPool: thin glue between kopf and `reconcile.py`.

Each handler parses the object with the pydantic models, calls one reconcile function, and applies
its outcome (status patch, Events, the token Secret, StatefulSet size). Errors by intent:
- a spec the models reject -> status Failed with the field named, then `kopf.PermanentError`;
- Redis unreachable (`RegistryUnavailable`) or Kubernetes API errors -> `kopf.TemporaryError`
  with exponential backoff (1 s, 2 s, 4 s ... 30 s);
- a session not converged yet (no idle worker) -> `kopf.TemporaryError` after the status says why.
Level-triggered: create/resume handlers and per-object timers read the current state every time,
so an operator restart converges (claims are idempotent per session, so nothing is assigned twice).
Progress and diff-base are kept in annotations under vivant.dev (status stays schema-clean); the
finalizer `vivant.dev/release-worker` guarantees a deleted session's worker is told to stop and freed.
"""

from __future__ import annotations

import logging
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
log = logging.getLogger(__name__)


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    config: OperatorConfig = memo.get("config") or OperatorConfig.from_env()
    settings.persistence.finalizer = FINALIZER
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="vivant.dev")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix="vivant.dev")
    settings.watching.server_timeout = 60
    kube.load_config()
    memo.config = config
    memo.registry = Registry(config.redis_url, heartbeat_ttl_s=config.heartbeat_ttl_s)
    memo.flags = FlagStore(memo.registry.redis)
    memo.metrics = default_metrics()
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


@kopf.on.create(*SESSIONS)
@kopf.on.resume(*SESSIONS)
def session_assign(body, spec, meta, status, namespace, name, uid, patch, memo, retry, **_: Any) -> None:
    if status.get("phase") in (p.value for p in r.TERMINAL_PHASES):
        return
    ref, parsed = _session(spec, meta, namespace, name, uid, patch)
    cfg: OperatorConfig = memo.config
    try:
        out = reconcile.assign_session(
            ref, parsed, dict(status), registry=memo.registry, credentials=cfg.livekit, apply_secret=kube.apply,
            timeouts=cfg.timeouts, now=datetime.now(tz=UTC), token_ttl=cfg.token_ttl,
            read_token=lambda secret: kube.read_secret_token(namespace, secret),
        )
    except (RegistryUnavailable, kube.ApiException) as exc:
        raise _retry(r.SESSION_KIND, memo, retry, exc) from None
    _apply(out, body, patch)
    if out.assigned_after_s is not None:
        memo.metrics.observe_assignment(r.pool_key(namespace, parsed.pool), out.assigned_after_s)
    if out.retry_s is not None:
        raise kopf.TemporaryError(out.status.get("message") or "waiting for an idle worker", delay=out.retry_s)


@kopf.timer(*SESSIONS, interval=SESSION_TICK_S, when=lambda status, **_: status.get("phase") not in ("Ended", "Failed"))
def session_progress(body, spec, meta, status, namespace, name, uid, patch, memo, **_: Any) -> None:
    if status.get("phase") in (None, r.SessionPhase.PENDING.value):
        return  # session_assign owns Pending
    ref, parsed = _session(spec, meta, namespace, name, uid, patch)
    try:
        out = reconcile.progress_session(ref, parsed, dict(status), registry=memo.registry,
                                         timeouts=memo.config.timeouts, now=datetime.now(tz=UTC))
        if out.rollback is not None:
            pool, reason = out.rollback
            if reconcile.auto_rollback(memo.flags, pool, reason) is not None:
                kopf.warn(body, reason="FlagRolledBack", message=f"{FUSED_GEMM_ALL_REDUCE} turned off: {reason}")
                memo.metrics.flag_rollback(pool, FUSED_GEMM_ALL_REDUCE, "fault" if "fault" in reason else "fps")
    except RegistryUnavailable as exc:
        memo.metrics.reconcile_error(r.SESSION_KIND)
        log.warning("session %s/%s: Redis unavailable (%s); retrying next tick", namespace, name, exc)
        return
    _apply(out, body, patch)


@kopf.on.delete(*SESSIONS)
def session_release(spec, meta, status, namespace, name, uid, memo, retry, logger, **_: Any) -> None:
    try:
        parsed = r.CharacterSessionSpec.model_validate(dict(spec))
    except pydantic.ValidationError:
        return  # never assigned: nothing to release
    ref = reconcile.SessionRef(namespace=namespace, name=name, uid=uid, created=datetime.now(tz=UTC))
    try:
        released = reconcile.release_session(ref, parsed, dict(status), registry=memo.registry)
    except RegistryUnavailable as exc:
        raise _retry(r.SESSION_KIND, memo, retry, exc) from None
    logger.info(f"session deleted; worker lease {'released' if released else 'was already free'}")


@kopf.index(*SESSIONS)
def session_phases(namespace, spec, status, name, **_: Any) -> dict[tuple[str, str, str], str]:
    return {(namespace, r.pool_key(namespace, spec.get("pool", "?")), status.get("phase", "Pending")): name}


# ------------------------------------------------------------------------------------------- pools


def _pool(spec: Any, name: str, patch: kopf.Patch) -> r.WorkerPoolSpec:
    try:
        return r.WorkerPoolSpec.model_validate(dict(spec))
    except pydantic.ValidationError as exc:
        msg = "invalid spec: " + "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        patch.status["conditions"] = b.set_condition([], "Ready", False, "InvalidSpec", msg)
        raise kopf.PermanentError(msg) from None


@kopf.on.create(*POOLS)
@kopf.on.resume(*POOLS)
@kopf.on.update(*POOLS, field="spec")
def pool_apply(spec, meta, status, namespace, name, uid, patch, memo, retry, **_: Any) -> None:
    parsed = _pool(spec, name, patch)
    owner = b.Owner(kind=r.POOL_KIND, name=name, uid=uid)
    try:
        current = kube.statefulset_replicas(namespace, name) or 0
        plan = reconcile.pool_scale(name, namespace, parsed, current, registry=memo.registry)
        kube.apply(b.build_statefulset(name, namespace, owner, parsed, plan.replicas, memo.config.runtime))
        kube.apply(b.build_headless_service(name, namespace, owner))
        kube.apply(b.build_pdb(name, namespace, owner))
        _, flag_patch = reconcile.apply_spec_flags(name, namespace, parsed, int(meta.get("generation") or 1),
                                                   dict(status), memo.flags)
    except (RegistryUnavailable, kube.ApiException) as exc:
        raise _retry(r.POOL_KIND, memo, retry, exc) from None
    patch.status.update({**flag_patch, "observedGeneration": int(meta.get("generation") or 1)})


@kopf.on.delete(*POOLS, optional=True)
def pool_deleted(namespace, name, memo, **_: Any) -> None:
    """The StatefulSet, Service and PDB go with the pool (ownerReferences); drop its metric series."""
    memo.metrics.pool_deleted(r.pool_key(namespace, name))


@kopf.timer(*POOLS, interval=POOL_TICK_S, initial_delay=POOL_TICK_S)
def pool_tick(body, spec, meta, status, namespace, name, patch, memo, session_phases: kopf.Index, **_: Any) -> None:
    parsed = _pool(spec, name, patch)
    pool = r.pool_key(namespace, name)
    try:
        current = kube.statefulset_replicas(namespace, name)
        if current is None:
            return  # pool_apply has not created it yet
        plan = reconcile.pool_scale(name, namespace, parsed, current, registry=memo.registry)
        if plan.replicas != current:
            kube.scale_statefulset(namespace, name, plan.replicas)
            kopf.info(body, reason="Scaled", message=f"workers {current} -> {plan.replicas} (drained {list(plan.drain)})")
        counts = reconcile.pool_status(name, namespace, memo.registry, plan.replicas)
        flagset, flag_patch = reconcile.apply_spec_flags(
            name, namespace, parsed, int(meta.get("generation") or 1), dict(status), memo.flags)
    except (RegistryUnavailable, kube.ApiException) as exc:
        memo.metrics.reconcile_error(r.POOL_KIND)
        log.warning("pool %s: %s; retrying next tick", pool, exc)
        return
    if (flagset.updated_by == reconcile.AUTO_ROLLBACK_ACTOR and flagset.version != status.get("flagVersion")):
        kopf.warn(body, reason="FlagRolledBack",
                  message=f"{FUSED_GEMM_ALL_REDUCE} turned off by auto-rollback; edit spec.flags to re-enable")
    patch.status.update({**counts, **flag_patch})
    memo.metrics.set_pool_workers(pool, desired=plan.replicas, idle=counts["idle"], busy=counts["busy"],
                                  starting=counts["starting"], draining=counts["draining"])
    memo.metrics.set_session_counts({key: len(names) for key, names in session_phases.items()})
