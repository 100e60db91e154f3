"""Pure builders: typed CR specs in, Kubernetes manifests (plain dicts) and status patches out.

No I/O here, so every object the operator writes can be rendered and checked offline (the tests run
each built-in object through `kubernetes-validate --strict`). The handlers in `handlers.py` only
decide *when* to apply these.

A WorkerPool `p` in namespace `ns` becomes:
- StatefulSet `p` (pods `p-0`, `p-1`, ...; pod name = worker id in Redis), Parallel pod management so
  warm-up (minutes: 57B of weights, CUDA graphs) happens side by side, `gpusPerWorker` GPUs per pod;
- headless Service `p` (stable DNS for the pods, metrics port);
- PodDisruptionBudget `p` with maxUnavailable 1: a node drain evicts at most one worker at a time.
A CharacterSession `s` gets a Secret `s-livekit` holding its LiveKit token, owned by the session so the
garbage collector deletes it with the session.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from vivant.apis import resources

MANAGED_BY = "vivant-operator"
METRICS_PORT = 9400
WORKER_COMMAND = ["vivant", "worker"]


@dataclass(frozen=True)
class Owner:
    """What an ownerReference needs to know about the owning custom resource."""

    kind: str
    name: str
    uid: str
    api_version: str = resources.API_VERSION

    def reference(self) -> dict[str, Any]:
        return {
            "apiVersion": self.api_version,
            "kind": self.kind,
            "name": self.name,
            "uid": self.uid,
            "controller": True,
            "blockOwnerDeletion": True,
        }


@dataclass(frozen=True)
class WorkerRuntime:
    """Operator-level settings every worker pod gets (from the operator's flags, not from a CR).

    `redis_secret` names a Secret in the pool's namespace whose key `redis_secret_key` holds the Redis
    URL (it may carry a password, so it never goes into a pod spec as plain text).
    """

    redis_secret: str = "vivant-redis"
    redis_secret_key: str = "url"
    service_account: str | None = None


def pool_labels(pool_name: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "vivant-worker",
        "app.kubernetes.io/instance": pool_name,
        "app.kubernetes.io/managed-by": MANAGED_BY,
        "vivant.dev/pool": pool_name,
    }


def pool_selector(pool_name: str) -> str:
    """The label selector string of a pool's pods (WorkerPool status.selector, for the scale subresource)."""
    return ",".join(f"{k}={v}" for k, v in sorted(pool_labels(pool_name).items()) if k != "app.kubernetes.io/managed-by")


def _selector_labels(pool_name: str) -> dict[str, str]:
    return {k: v for k, v in pool_labels(pool_name).items() if k != "app.kubernetes.io/managed-by"}


def _affinity(spec: resources.WorkerPoolSpec) -> dict[str, Any] | None:
    if spec.affinity is None:
        return None

    def term(t: resources.NodeSelectorTerm) -> dict[str, Any]:
        return {"matchExpressions": [e.model_dump(by_alias=True, exclude_none=True) for e in t.match_expressions]}

    node: dict[str, Any] = {}
    if spec.affinity.required:
        node["requiredDuringSchedulingIgnoredDuringExecution"] = {"nodeSelectorTerms": [term(t) for t in spec.affinity.required]}
    if spec.affinity.preferred:
        node["preferredDuringSchedulingIgnoredDuringExecution"] = [
            {"weight": p.weight, "preference": term(p.preference)} for p in spec.affinity.preferred
        ]
    return {"nodeAffinity": node} if node else None


def build_statefulset(
    name: str, namespace: str, owner: Owner, spec: resources.WorkerPoolSpec, replicas: int, runtime: WorkerRuntime
) -> dict[str, Any]:
    """The pool's StatefulSet at `replicas` pods (the scaler decides the number)."""
    if replicas < 0 or replicas > spec.max_workers:
        raise ValueError(f"replicas: expected 0..maxWorkers ({spec.max_workers}), got {replicas}")
    gpus = str(spec.gpus_per_worker)  # quantities are strings for the kubernetes client
    env = [
        {"name": "VIVANT_POOL", "value": resources.pool_key(namespace, name)},
        {"name": "VIVANT_WORKER_ID", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "VIVANT_NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
        {"name": "VIVANT_MODEL_PRESET", "value": spec.model.preset},
        {"name": "VIVANT_CHECKPOINT", "value": spec.model.checkpoint},
        {"name": "VIVANT_TENSOR_PARALLEL", "value": str(spec.tensor_parallel)},
        {"name": "VIVANT_METRICS_PORT", "value": str(METRICS_PORT)},
        # livekit: join the assigned LiveKit room; pipeline: frames to a null sink (trials)
        {"name": "VIVANT_RUNNER", "value": spec.runner},
        {
            "name": "VIVANT_REDIS_URL",
            "valueFrom": {"secretKeyRef": {"name": runtime.redis_secret, "key": runtime.redis_secret_key}},
        },
        # Never NVLink multicast / in-switch reduction on these machines (docs/ARCHITECTURE.md, the numbers).
        {"name": "NCCL_NVLS_ENABLE", "value": "0"},
        {"name": "TORCH_SYMM_MEM_DISABLE_MULTICAST", "value": "1"},
        {"name": "NVSHMEM_DISABLE_NVLS", "value": "1"},
    ]
    container: dict[str, Any] = {
        "name": "worker",
        "image": spec.image,
        "imagePullPolicy": "IfNotPresent",
        "command": WORKER_COMMAND,
        "env": env,
        "ports": [{"name": "metrics", "containerPort": METRICS_PORT, "protocol": "TCP"}],
        "resources": {"limits": {"nvidia.com/gpu": gpus}, "requests": {"nvidia.com/gpu": gpus}},
        "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}],
    }
    pod_spec: dict[str, Any] = {
        "containers": [container],
        "terminationGracePeriodSeconds": 60,
        "volumes": [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "16Gi"}}],
    }
    if spec.node_selector:
        pod_spec["nodeSelector"] = dict(spec.node_selector)
    if spec.tolerations:
        pod_spec["tolerations"] = [t.model_dump(by_alias=True, exclude_none=True) for t in spec.tolerations]
    affinity = _affinity(spec)
    if affinity:
        pod_spec["affinity"] = affinity
    if runtime.service_account:
        pod_spec["serviceAccountName"] = runtime.service_account
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": pool_labels(name),
            "ownerReferences": [owner.reference()],
        },
        "spec": {
            "serviceName": name,
            "replicas": replicas,
            "podManagementPolicy": "Parallel",
            # The controller never replaces a pod on a template edit: the operator deletes idle outdated pods
            # itself (reconcile.plan_roll), so a streaming worker is never killed by an edit.
            "updateStrategy": {"type": "OnDelete"},
            "selector": {"matchLabels": _selector_labels(name)},
            "template": {"metadata": {"labels": pool_labels(name)}, "spec": pod_spec},
        },
    }


def build_headless_service(name: str, namespace: str, owner: Owner) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "namespace": namespace, "labels": pool_labels(name), "ownerReferences": [owner.reference()]},
        "spec": {
            "clusterIP": "None",
            "selector": _selector_labels(name),
            "ports": [{"name": "metrics", "port": METRICS_PORT, "targetPort": "metrics", "protocol": "TCP"}],
        },
    }


def build_pdb(name: str, namespace: str, owner: Owner) -> dict[str, Any]:
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": {"name": name, "namespace": namespace, "labels": pool_labels(name), "ownerReferences": [owner.reference()]},
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": _selector_labels(name)}},
    }


TOKEN_SECRET_SUFFIX = "-livekit"
SESSION_ANNOTATION = "vivant.dev/session"


def token_secret_name(session_name: str) -> str:
    """`<session>-livekit`; a session name too long for that (a DNS subdomain of <= 253 characters) keeps its
    head and gets 10 hex digits of its SHA-256 instead, so two long names never share a Secret."""
    name = f"{session_name}{TOKEN_SECRET_SUFFIX}"
    if len(name) <= 253:
        return name
    digest = hashlib.sha256(session_name.encode()).hexdigest()[:10]
    head = session_name[: 253 - len(TOKEN_SECRET_SUFFIX) - len(digest) - 1].rstrip(".-")
    return f"{head}-{digest}{TOKEN_SECRET_SUFFIX}"


def build_token_secret(session_name: str, namespace: str, owner: Owner, token: str) -> dict[str, Any]:
    """The Secret that holds a session's LiveKit token; owned by the session (deleted with it).

    The session's name goes into an annotation, not a label: a label value holds at most 63 characters and
    a session name up to 253."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": {
            "name": token_secret_name(session_name),
            "namespace": namespace,
            "labels": {"app.kubernetes.io/managed-by": MANAGED_BY},
            "annotations": {SESSION_ANNOTATION: session_name},
            "ownerReferences": [owner.reference()],
        },
        "stringData": {"token": token},
    }


# ------------------------------------------------------------------------------------------ status


def now_iso(now: datetime | None = None) -> str:
    return (now or datetime.now(tz=UTC)).strftime("%Y-%m-%dT%H:%M:%SZ")


def set_condition(
    conditions: Sequence[dict[str, Any]],
    type_: str,
    status: bool | None,
    reason: str,
    message: str = "",
    *,
    now: datetime | None = None,
    generation: int | None = None,
) -> list[dict[str, Any]]:
    """A new conditions list with `type_` set; lastTransitionTime changes only when the status flips."""
    text = {True: "True", False: "False", None: "Unknown"}[status]
    out: list[dict[str, Any]] = []
    found = False
    for c in conditions:
        if c.get("type") != type_:
            out.append(dict(c))
            continue
        found = True
        changed = c.get("status") != text
        new = {"type": type_, "status": text, "reason": reason, "message": message[:1024]}
        new["lastTransitionTime"] = now_iso(now) if changed or not c.get("lastTransitionTime") else c["lastTransitionTime"]
        if generation is not None:
            new["observedGeneration"] = generation
        out.append(new)
    if not found:
        new = {"type": type_, "status": text, "reason": reason, "message": message[:1024], "lastTransitionTime": now_iso(now)}
        if generation is not None:
            new["observedGeneration"] = generation
        out.append(new)
    return out


def session_phase_patch(
    status: dict[str, Any],
    phase: resources.SessionPhase,
    reason: str,
    message: str = "",
    *,
    now: datetime | None = None,
    **fields: Any,
) -> dict[str, Any]:
    """A status patch moving a session to `phase`, with the `Ready` condition carrying reason/message.

    Extra keyword fields are status fields in snake_case (worker=..., avg_fps=...), written camelCase.
    """
    ready = phase == resources.SessionPhase.STREAMING
    patch: dict[str, Any] = {
        "phase": phase.value,
        "message": message[:1024] or None,
        "conditions": set_condition(status.get("conditions") or [], "Ready", ready, reason, message, now=now),
    }
    if phase in resources.TERMINAL_PHASES and not status.get("endedAt"):
        patch["endedAt"] = now_iso(now)
    for key, value in fields.items():
        patch[resources.CharacterSessionStatus.model_fields[key].alias or key] = value
    return patch
