"""Create-or-patch of the built-in objects the builders render, through the `kubernetes` client.

The operator owns these objects (ownerReferences point at the custom resource), so "apply" here is:
create; on 409 Conflict merge-patch the fields we render. Sync calls; kopf runs sync handlers in
its thread pool. Quantities in bodies are strings (`kubernetes` 37 validates bodies).
"""

from __future__ import annotations

import base64
import os
from typing import Any

import kubernetes
from kubernetes.client.rest import ApiException


def load_config() -> None:
    """In-cluster service account if present, else $KUBECONFIG / ~/.kube/config."""
    try:
        kubernetes.config.load_incluster_config()
    except kubernetes.config.ConfigException:
        kubernetes.config.load_kube_config(config_file=os.environ.get("KUBECONFIG") or None)


def _apis(kind: str) -> tuple[Any, str]:
    c = kubernetes.client
    table = {
        "StatefulSet": (c.AppsV1Api, "stateful_set"),
        "Service": (c.CoreV1Api, "service"),
        "Secret": (c.CoreV1Api, "secret"),
        "PodDisruptionBudget": (c.PolicyV1Api, "pod_disruption_budget"),
    }
    if kind not in table:
        raise ValueError(f"kind: expected one of {sorted(table)}, got {kind!r}")
    api_cls, noun = table[kind]
    return api_cls(), noun


def apply(manifest: dict[str, Any]) -> None:
    """Create the object, or merge-patch it if it exists already (idempotent)."""
    api, noun = _apis(manifest["kind"])
    ns, name = manifest["metadata"]["namespace"], manifest["metadata"]["name"]
    try:
        getattr(api, f"create_namespaced_{noun}")(ns, manifest)
    except ApiException as exc:
        if exc.status != 409:
            raise
        getattr(api, f"patch_namespaced_{noun}")(name, ns, manifest)


def statefulset_replicas(namespace: str, name: str) -> int | None:
    """Current spec.replicas of the pool's StatefulSet, None if it does not exist."""
    try:
        sts = kubernetes.client.AppsV1Api().read_namespaced_stateful_set(name, namespace)
    except ApiException as exc:
        if exc.status == 404:
            return None
        raise
    return int(sts.spec.replicas or 0)


def scale_statefulset(namespace: str, name: str, replicas: int) -> None:
    kubernetes.client.AppsV1Api().patch_namespaced_stateful_set(name, namespace, {"spec": {"replicas": replicas}})


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
