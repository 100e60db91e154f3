"""The operator's API calls share one client (one pool of kept-open TLS connections), not a new client
and a new TLS handshake per request."""

from __future__ import annotations

import kubernetes
from vivant.operator import kube

KUBECONFIG = """
apiVersion: v1
kind: Config
clusters: [{name: c, cluster: {server: "https://127.0.0.1:6443", insecure-skip-tls-verify: true}}]
users: [{name: u, user: {token: t}}]
contexts: [{name: x, context: {cluster: c, user: u}}]
current-context: x
"""


def test_api_objects_share_one_client_with_the_pool_size(tmp_path, monkeypatch) -> None:
    path = tmp_path / "kubeconfig"
    path.write_text(KUBECONFIG)
    monkeypatch.setenv("KUBECONFIG", str(path))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setattr(kubernetes.client.ApiClient, "_default", None)
    monkeypatch.setattr(kubernetes.client.Configuration, "_default", None)

    kube.load_config(pool_size=23)

    custom, core = kubernetes.client.CustomObjectsApi(), kubernetes.client.CoreV1Api()
    assert custom.api_client is core.api_client is kubernetes.client.AppsV1Api().api_client
    assert custom.api_client.configuration.host == "https://127.0.0.1:6443"
    assert custom.api_client.rest_client.pool_manager.connection_pool_kw["maxsize"] == 23
