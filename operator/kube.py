"""The operator's calls to the Kubernetes API, through the `kubernetes` client (sync; kopf runs sync
handlers in its thread pool). Quantities in bodies are strings (`kubernetes` 37 validates bodies).

The pool's objects (StatefulSet, headless Service, PDB) are written with server-side apply under one
field manager, so a field removed from the WorkerPool spec (a toleration, a nodeSelector key) is removed
from the object too. The session's token Secret is created; an earlier Secret of ours in the way (a
re-created session) is deleted first: a merge would keep the old session's controller reference beside
the new one, which the API server refuses.
"""

from __future__ import annotations

import base64
import json
import os
from typing import Any

import kubernetes
from kubernetes.client.rest import ApiException
from vivant.apis import resources
from vivant.operator import builders

FIELD_MANAGER = "vivant-operator"
MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"


def load_config(pool_size: int | None = None) -> None:
    """In-cluster service account if present, else $KUBECONFIG / ~/.kube/config; and one shared API client.

    Every `kubernetes.client.XxxApi()` made without a client takes the default `ApiClient`; with none set it
    makes a new one, with its own connection pool, so each request paid a new TLS handshake (operator and API
    server CPU). The shared client keeps `pool_size` connections open (the client's default, 5 per core,
    makes threads beyond it open and drop a TLS connection per request); urllib3's pool is thread-safe."""
    try:
        kubernetes.config.load_incluster_config()
    except kubernetes.config.ConfigException:
        kubernetes.config.load_kube_config(config_file=os.environ.get("KUBECONFIG") or None)
    cfg = kubernetes.client.Configuration.get_default_copy()
    if pool_size is not None:
        cfg.connection_pool_maxsize = pool_size
    kubernetes.client.Configuration.set_default(cfg)
    kubernetes.client.ApiClient.set_default(kubernetes.client.ApiClient(cfg))


def api_message(exc: ApiException) -> str:
    """The API server's own message of a failed request (its Status body), else the HTTP reason."""
    try:
        body = json.loads(exc.body or "")
    except (TypeError, ValueError):
        body = None
    if isinstance(body, dict) and body.get("message"):
        return str(body["message"])
    return f"{exc.status} {exc.reason}"


def is_rejection(exc: ApiException) -> bool:
    """The API server refused the object itself (invalid, or a bad request): sending it again cannot help."""
    return exc.status in (400, 422)


def _apis(kind: str) -> tuple[Any, str]:
    c = kubernetes.client
    table = {
        "StatefulSet": (c.AppsV1Api, "stateful_set"),
        "Service": (c.CoreV1Api, "service"),
        "PodDisruptionBudget": (c.PolicyV1Api, "pod_disruption_budget"),
    }
    if kind not in table:
        raise ValueError(f"kind: expected one of {sorted(table)}, got {kind!r}")
    api_cls, noun = table[kind]
    return api_cls(), noun


def apply(manifest: dict[str, Any]) -> None:
    """Server-side apply of a pool object (created if absent; fields we no longer render are removed)."""
    api, noun = _apis(manifest["kind"])
    ns, name = manifest["metadata"]["namespace"], manifest["metadata"]["name"]
    getattr(api, f"patch_namespaced_{noun}")(name, ns, manifest, field_manager=FIELD_MANAGER, force=True,
                                             _content_type="application/apply-patch+yaml")


class SecretNotOurs(RuntimeError):
    """A Secret of the token Secret's name is in the way and may not be replaced: it was not written by the
    operator, or it is an earlier session's Secret still being deleted. It is left alone."""


def put_token_secret(manifest: dict[str, Any]) -> None:
    """Create the session's token Secret. If an earlier Secret of ours has its name (a re-created session
    whose predecessor's Secret the garbage collector has not removed yet), delete exactly that one and
    create ours: the new session becomes the only owner. (Changing the ownerReferences of the old one
    in place would need the same `delete` right, and a merge would keep the old controller reference.)
    Raises SecretNotOurs for somebody else's Secret of that name, ApiException otherwise."""
    core = kubernetes.client.CoreV1Api()
    ns, name = manifest["metadata"]["namespace"], manifest["metadata"]["name"]
    for _ in range(3):
        try:
            core.create_namespaced_secret(ns, manifest)
            return
        except ApiException as exc:
            if exc.status != 409:
                raise
        try:
            existing = core.read_namespaced_secret(name, ns)
        except ApiException as exc:
            if exc.status == 404:
                continue  # deleted meanwhile: create again
            raise
        if (existing.metadata.labels or {}).get(MANAGED_BY_LABEL) != manifest["metadata"]["labels"][MANAGED_BY_LABEL]:
            raise SecretNotOurs(f"Secret {ns}/{name} exists and is not managed by the operator "
                                f"(label {MANAGED_BY_LABEL}); delete or rename it")
        if existing.metadata.deletion_timestamp is not None:
            raise SecretNotOurs(f"Secret {ns}/{name} of an earlier session is still being deleted (finalizers "
                                f"{existing.metadata.finalizers}); retrying")
        pre = kubernetes.client.V1Preconditions(uid=existing.metadata.uid,
                                                resource_version=existing.metadata.resource_version)
        try:
            core.delete_namespaced_secret(name, ns, body=kubernetes.client.V1DeleteOptions(preconditions=pre))
        except ApiException as exc:
            if exc.status not in (404, 409):  # gone or changed meanwhile: start over
                raise
    raise ApiException(status=409, reason=f"Secret {ns}/{name} kept coming back while it was written")


def delete_token_secret(namespace: str, name: str) -> None:
    """Delete the operator's token Secret `name`, if it is there and carries the operator's managed-by label
    (one request: a collection delete narrowed to that name and label, so somebody else's Secret of that
    name is left alone). The garbage collector would delete it too, through its owner reference, but at a
    burst's pace that took tens of seconds after the session was gone."""
    kubernetes.client.CoreV1Api().delete_collection_namespaced_secret(
        namespace, field_selector=f"metadata.name={name}", label_selector=f"{MANAGED_BY_LABEL}={builders.MANAGED_BY}")


def statefulset(namespace: str, name: str) -> dict[str, Any] | None:
    """The pool's StatefulSet as a plain dict (camelCase, as the API serves it), None if absent."""
    api = kubernetes.client.AppsV1Api()
    try:
        sts = api.read_namespaced_stateful_set(name, namespace)
    except ApiException as exc:
        if exc.status == 404:
            return None
        raise
    return api.api_client.sanitize_for_serialization(sts)


def statefulset_replicas(namespace: str, name: str) -> int | None:
    """Current spec.replicas of the pool's StatefulSet, None if it does not exist."""
    sts = statefulset(namespace, name)
    return None if sts is None else int(sts["spec"].get("replicas") or 0)


def scale_statefulset(namespace: str, name: str, replicas: int) -> None:
    kubernetes.client.AppsV1Api().patch_namespaced_stateful_set(name, namespace, {"spec": {"replicas": replicas}})


def pool_pods(namespace: str, selector: str) -> list[dict[str, Any]]:
    """The pods of a pool (label selector `selector`) as plain dicts."""
    api = kubernetes.client.CoreV1Api()
    pods = api.list_namespaced_pod(namespace, label_selector=selector)
    return [api.api_client.sanitize_for_serialization(p) for p in pods.items]


def delete_pod(namespace: str, name: str, uid: str) -> bool:
    """Delete exactly this pod (uid precondition: never its replacement of the same name). False if gone."""
    try:
        kubernetes.client.CoreV1Api().delete_namespaced_pod(
            name, namespace, body=kubernetes.client.V1DeleteOptions(preconditions=kubernetes.client.V1Preconditions(uid=uid)))
    except ApiException as exc:
        if exc.status in (404, 409):
            return False
        raise
    return True


def worker_pool(namespace: str, name: str) -> dict[str, Any] | None:
    """A WorkerPool object, None if there is none of that name."""
    try:
        return kubernetes.client.CustomObjectsApi().get_namespaced_custom_object(
            resources.GROUP, resources.VERSION, namespace, resources.POOL_PLURAL, name)
    except ApiException as exc:
        if exc.status == 404:
            return None
        raise


def read_secret_token(namespace: str, name: str, key: str = "token") -> str | None:
    """The value under `key` of a Secret, or None if the Secret or the key does not exist."""
    try:
        secret = kubernetes.client.CoreV1Api().read_namespaced_secret(name, namespace)
    except ApiException as exc:
        if exc.status == 404:
            return None
        raise
    if secret.data and key in secret.data:
        return base64.b64decode(secret.data[key]).decode()
    if secret.string_data and key in secret.string_data:  # only seen before the API server folds it into data
        return secret.string_data[key]
    return None


def patch_session_status(namespace: str, name: str, status: dict[str, Any]) -> str | None:
    """Merge `status` into a CharacterSession's status subresource. Returns the object's resourceVersion
    after the write; None if the session is gone."""
    try:
        obj = kubernetes.client.CustomObjectsApi().patch_namespaced_custom_object_status(
            resources.GROUP, resources.VERSION, namespace, resources.SESSION_PLURAL, name, {"status": status})
    except ApiException as exc:
        if exc.status == 404:
            return None
        raise
    return str(((obj or {}).get("metadata") or {}).get("resourceVersion") or "")
