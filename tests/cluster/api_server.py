"""Run the session API (`vivant.gateway.server.SessionApi`) in this process on a loopback port, in a thread
with its own event loop, against the real apiserver of the local cluster (directly, or through a
`FaultProxy`); a small HTTP client that retries like a hosted-avatar plugin does; the pools and bodies
the API fault tests share (`pools` and `serve` are fixtures: a test module imports them)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import kubernetes
import pytest
from aiohttp import web
from vivant.gateway import server as session_api

if TYPE_CHECKING:
    from fault_proxy import FaultProxy

KEY = "vk_cluster_test_0123456789"
CS = "charactersessions.vivant.dev"


class ApiServer:
    def __init__(self, kubeconfig: str, namespace: str, avatars: dict[str, dict[str, str]], *,
                 upstream: str | None = None, limits: dict[str, Any] | None = None,
                 keys: tuple[str, ...] = (KEY,)) -> None:
        cfg = kubernetes.client.Configuration()
        if upstream is None:
            kubernetes.config.load_kube_config(config_file=kubeconfig, client_configuration=cfg)
        else:  # plain HTTP to the fault proxy, which holds the credentials
            cfg.host = upstream
        cfg.connection_pool_maxsize = 32
        self.client = client = kubernetes.client.ApiClient(cfg)
        config = session_api.ApiConfig(
            namespace=namespace, retry_after_s=1,
            avatars={k: session_api.AvatarEntry(**v) for k, v in avatars.items()},
            limits=session_api.ApiLimits.model_validate(limits or {}))
        self.api = session_api.SessionApi(config, session_api.ApiKeys(static=keys), client)
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        if not self._ready.wait(15):
            raise RuntimeError("session API did not start")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)

        async def start() -> None:
            self._runner = self.api.runner()
            await self._runner.setup()
            site = web.TCPSite(self._runner, "127.0.0.1", 0)
            await site.start()
            self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

        self._loop.run_until_complete(start())
        self._ready.set()
        self._loop.run_forever()

    def run(self, coro: Any, timeout: float = 120) -> Any:
        """Run a coroutine on the API's loop (e.g. `api.collect_orphans()`)."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self.client.close()


def call(base: str, method: str, path: str, body: Any = None, *, key: str = KEY, headers: dict[str, str] | None = None,
         timeout: float = 60) -> tuple[int, dict[str, Any], dict[str, str]]:
    """(status, JSON body, headers); status 0 when no answer came (refused, reset, timed out)."""
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(base + path, method=method, data=data,
                                 headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json",
                                          **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            raw = resp.read()
            return resp.status, json.loads(raw) if raw else {}, dict(resp.headers)
    except urllib.error.HTTPError as exc:
        raw = exc.read()
        return exc.code, json.loads(raw) if raw.startswith(b"{") else {"raw": raw.decode(errors="replace")}, dict(
            exc.headers)
    except (OSError, urllib.error.URLError) as exc:
        return 0, {"error": repr(exc)}, {}


def create_with_retries(base: str, body: dict[str, Any], *, attempts: int = 5,
                        headers: dict[str, str] | None = None) -> tuple[int, dict[str, Any], int]:
    """POST like a hosted-avatar plugin: the same body again on a 5xx or no answer, after a short wait.
    Returns (final status, final body, attempts made)."""
    status, got = 0, {}
    for i in range(attempts):
        status, got, _ = call(base, "POST", "/v1/realtime_sessions", body, headers=headers)
        if 0 < status < 500:
            return status, got, i + 1
        time.sleep(0.2 * (i + 1))
    return status, got, attempts


WP = "workerpools.vivant.dev"
AVATARS = {"ada": {"character": "ada-v1", "pool": "cap2"}, "big": {"character": "ada-v1", "pool": "big"},
           "bad": {"character": "ada-v1", "pool": "badspec"}}


def pool(name: str, ns: str, max_workers: int, image: str = "ghcr.io/vivant-dev/vivant-worker:0.1.0") -> dict[str, Any]:
    return {"apiVersion": "vivant.dev/v1alpha1", "kind": "WorkerPool", "metadata": {"name": name, "namespace": ns},
            "spec": {"model": {"preset": "tiny", "checkpoint": "random://tiny"}, "image": image,
                     "gpusPerWorker": 2, "tensorParallel": 1, "runner": "pipeline", "minIdle": 0,
                     "maxWorkers": max_workers}}


def body(avatar: str = "big", room: str | None = None, identity: str = "agent-1") -> dict[str, Any]:
    """A distinct request each call (its own token), as two agents would send."""
    return {"avatar": {"type": "custom", "avatarId": avatar},
            "livekit": {"url": "ws://127.0.0.1:7880", "token": f"tok-{uuid.uuid4().hex}-{uuid.uuid4().hex}",
                        "roomName": room or f"room-{uuid.uuid4().hex[:8]}", "agentIdentity": identity}}


@pytest.fixture(name="pools")
def pools_fixture(kube: Any, namespace: str) -> Iterator[str]:
    """Pools `cap2` (maxWorkers 2) and `big` (256) in a fresh namespace, minIdle 0 (no worker pod starts).
    At the end the namespace's sessions are deleted and waited for, so an operator that runs afterwards
    finds nothing of this test pending."""
    kube.apply(pool("cap2", namespace, 2))
    kube.apply(pool("big", namespace, 256))
    yield namespace
    kube.kubectl("delete", CS, "--all", "-n", namespace, "--wait=true", "--timeout=50s", check=False)
    kube.kubectl("delete", WP, "--all", "-n", namespace, "--wait=false", check=False)


@pytest.fixture(name="serve")
def serve_fixture(kube: Any, pools: str) -> Iterator[Callable[..., ApiServer]]:
    """Start session APIs on `pools`' namespace (directly on the apiserver, or through a FaultProxy)."""
    made: list[Any] = []

    def make(*, proxy: FaultProxy | None = None, avatars: dict[str, dict[str, str]] = AVATARS,
             keys: tuple[str, ...] = (KEY,), **limits: Any) -> ApiServer:
        api = ApiServer(str(kube.kubeconfig), pools, avatars, upstream=proxy.url if proxy else None, limits=limits,
                        keys=keys)
        made.append(api)
        return api

    yield make
    for api in made:
        api.close()
