"""Helpers of the session-gateway tests on the real apiserver (test_api_*.py; their fixtures, `gateway_kube`
and `gateway_space`, are in conftest.py): the request body, the gateway's recording `kubernetes` client,
and a view of the test's namespace through the admin client.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import kubernetes
from vivant.apis import resources

KEY = "vk_test_0123456789abcdef"
TOKEN = "eyJhbGciOiJIUzI1NiJ9.SECRET-LIVEKIT-TOKEN-" + uuid.uuid4().hex  # unique: searchable everywhere
AUTH = {"Authorization": f"Bearer {KEY}"}
WRITES = ("POST", "PUT", "PATCH", "DELETE")


class RecordingApiClient(kubernetes.client.ApiClient):
    """The `kubernetes` client, keeping (method, url, JSON body) of every request it sends to the apiserver.

    Instrumentation, not a stand-in: each request goes on, unchanged, to the real apiserver."""

    def __init__(self, configuration: kubernetes.client.Configuration) -> None:
        super().__init__(configuration)
        self.sent: list[tuple[str, str, str]] = []

    def call_api(self, method: str, url: str, header_params: Any = None, body: Any = None, post_params: Any = None,
                 _request_timeout: Any = None) -> Any:
        self.sent.append((method, url, json.dumps(body, default=str) if body is not None else ""))
        return super().call_api(method, url, header_params, body, post_params, _request_timeout)

    def writes(self) -> list[str]:
        return [f"{method} {url}" for method, url, _ in self.sent if method in WRITES]


def body(**overrides: Any) -> dict[str, Any]:
    """The body livekit-plugins-runway posts, with our avatar id."""
    b: dict[str, Any] = {
        "model": "gwm1_avatars",
        "avatar": {"type": "custom", "avatarId": "ada"},
        "livekit": {"url": "wss://lk.example.com", "token": TOKEN, "roomName": "room-1", "agentIdentity": "agent-1"},
        "maxDuration": 300,
    }
    b.update(overrides)
    return b


def pool_manifest(name: str, max_workers: int) -> dict[str, Any]:
    return {"apiVersion": resources.API_VERSION, "kind": resources.POOL_KIND, "metadata": {"name": name},
            "spec": {"model": {"preset": "tiny", "checkpoint": "/weights/tiny.safetensors"},
                     "image": "registry.example/worker:dev", "minIdle": 0, "maxWorkers": max_workers}}


def recording_client(kubeconfig: str) -> RecordingApiClient:
    cfg = kubernetes.client.Configuration()
    kubernetes.config.load_kube_config(config_file=kubeconfig, client_configuration=cfg)
    return RecordingApiClient(cfg)


class GatewaySpace:
    """What the namespace holds, read with the admin client (not the gateway's)."""

    def __init__(self, client: Any, name: str) -> None:
        self.name = name
        self.custom = kubernetes.client.CustomObjectsApi(client)
        self.core = kubernetes.client.CoreV1Api(client)
        self.client = client

    def sessions(self) -> list[dict[str, Any]]:
        return self.custom.list_namespaced_custom_object(resources.GROUP, resources.VERSION, self.name, resources.SESSION_PLURAL)["items"]

    def session(self, name: str) -> dict[str, Any] | None:
        return next((s for s in self.sessions() if s["metadata"]["name"] == name), None)

    def secrets(self) -> list[dict[str, Any]]:
        return [self.client.sanitize_for_serialization(s) for s in self.core.list_namespaced_secret(self.name).items]

    def events(self) -> list[dict[str, Any]]:
        return [self.client.sanitize_for_serialization(e) for e in self.core.list_namespaced_event(self.name).items]

    def snapshot(self) -> dict[str, list[tuple[str, str]]]:
        """Name and resourceVersion of every session and Secret: equal snapshots = nothing written."""
        return {"sessions": sorted((s["metadata"]["name"], s["metadata"]["resourceVersion"]) for s in self.sessions()),
                "secrets": sorted((s["metadata"]["name"], s["metadata"]["resourceVersion"]) for s in self.secrets())}

    def add_session(self, name: str, pool: str, phase: str) -> None:
        """A session in `phase`, as the operator would have left it (status is a subresource: set after)."""
        self.custom.create_namespaced_custom_object(resources.GROUP, resources.VERSION, self.name, resources.SESSION_PLURAL, {
            "apiVersion": resources.API_VERSION, "kind": resources.SESSION_KIND, "metadata": {"name": name},
            "spec": {"character": "c", "pool": pool, "livekit": {"url": "wss://x.example", "room": "r",
                                                                 "agentIdentity": "a"}}})
        self.set_phase(name, phase)

    def set_phase(self, name: str, phase: str, **status: Any) -> None:
        self.custom.patch_namespaced_custom_object_status(resources.GROUP, resources.VERSION, self.name, resources.SESSION_PLURAL, name,
                                                          {"status": {"phase": phase, **status}})

    def add_pool(self, name: str, max_workers: int) -> None:
        self.custom.create_namespaced_custom_object(resources.GROUP, resources.VERSION, self.name, resources.POOL_PLURAL,
                                                    pool_manifest(name, max_workers))

    def clear(self) -> None:
        """Delete the test's sessions and pools now (none holds a finalizer: no operator ran), so that no
        operator started later finds them in the namespace while it is being deleted."""
        for plural in (resources.SESSION_PLURAL, resources.POOL_PLURAL):
            self.custom.delete_collection_namespaced_custom_object(resources.GROUP, resources.VERSION, self.name, plural)
