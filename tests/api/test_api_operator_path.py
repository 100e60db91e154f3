"""A session made through the API, taken by the operator's assignment, reaches a worker with the caller's token.

Real parts: the API app over HTTP, the operator's `reconcile.assign_session` and `kube.read_secret_token`,
the Redis registry on a real redis-server (`redis_url`), the worker's inbox. Stand-in: the Kubernetes
API is kmock (no kube-apiserver can run here). The kopf event loop itself is covered by tests/operator.
"""

from __future__ import annotations

import asyncio
import logging
from datetime import UTC, datetime
from typing import Any

import kubernetes
import pytest
from aiohttp.test_utils import TestClient, TestServer
from test_session_api import (
    AUTH,
    EVENTS,
    KEY,
    NS,
    POOLS,
    SECRETS,
    SESSIONS,
    TOKEN,
    StampingEmulator,
    _pool,
    body,
)
from vivant.apis import resources as r
from vivant.apis.livekit_token import LiveKitCredentials
from vivant.gateway import server as session_api
from vivant.operator import kube as operator_kube
from vivant.operator import reconcile
from vivant.sessions.models import Assignment, WorkerInfo
from vivant.sessions.registry import Registry

pytestmark = [pytest.mark.kmock(cls=StampingEmulator), pytest.mark.timeout(60)]


async def test_api_session_is_assigned_with_the_callers_token(
    kmock: Any, redis_url: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    for res in (SESSIONS, POOLS, SECRETS, EVENTS):
        kmock.resources[f"{res.group}/{res.version}/{res.plural}".lstrip("/")] = {}
    cfg = kubernetes.client.Configuration(host=str(kmock.url).rstrip("/"))
    monkeypatch.setattr(kubernetes.client.Configuration, "_default", cfg)  # the operator's kube module uses it
    kube = kubernetes.client.ApiClient(cfg)
    custom = kubernetes.client.CustomObjectsApi(kube)
    await asyncio.to_thread(custom.create_namespaced_custom_object, r.GROUP, r.VERSION, NS, r.POOL_PLURAL,
                            _pool("h200", 2))
    config = session_api.ApiConfig(namespace=NS, avatars={"ada": session_api.AvatarEntry(character="ada-v1",
                                                                                          pool="h200")})
    api = session_api.SessionApi(config, session_api.ApiKeys(static=(KEY,)), kube)
    async with TestClient(TestServer(api.app())) as client:
        resp = await client.post("/v1/realtime_sessions", json=body(), headers=AUTH)
        assert resp.status == 201, await resp.text()
        sid = (await resp.json())["id"]

    cr = await asyncio.to_thread(custom.get_namespaced_custom_object, r.GROUP, r.VERSION, NS, r.SESSION_PLURAL, sid)
    spec = r.CharacterSessionSpec.model_validate(cr["spec"])
    registry = Registry(redis_url)
    pool = r.pool_key(NS, "h200")
    registry.register(WorkerInfo(worker_id="h200-0", pool=pool, warm=True, node="gpu-node-0"))
    written: list[dict[str, Any]] = []
    ref = reconcile.SessionRef(namespace=NS, name=sid, uid=cr["metadata"]["uid"], created=datetime.now(tz=UTC))
    out = await asyncio.to_thread(
        reconcile.assign_session, ref, spec, {}, registry=registry,
        credentials=LiveKitCredentials("APIkey123", "x" * 32), apply_secret=written.append,
        timeouts=reconcile.Timeouts(), now=datetime.now(tz=UTC),
        read_token=lambda name: operator_kube.read_secret_token(NS, name))

    assert out.status["phase"] == "Assigned" and out.status["worker"] == "h200-0", out.status
    assert out.status["tokenSecret"] == spec.livekit.token_secret
    assert written == [], "with a caller-supplied token the operator must not write a Secret of its own"
    message = registry.next_message("h200-0", 0)
    assert isinstance(message, Assignment) and message.token.get_secret_value() == TOKEN, \
        "the worker must receive the token the agent minted"
    assert (message.room, message.agent_identity, message.max_duration_s) == ("room-1", "agent-1", 300.0)
    assert TOKEN not in str(out.status) + str(out.events) + caplog.text, "token leaked into status/events/logs"
    registry.close()
    kube.close()
