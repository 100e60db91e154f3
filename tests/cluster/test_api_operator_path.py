"""A session made through the API, taken by the operator's assignment, reaches a worker with the caller's token.

Real parts: the real apiserver (through the session gateway's client and the operator's default
`kubernetes` configuration, both with the admin kubeconfig), the gateway's app over HTTP, the operator's
`reconcile.assign_session` and `kube.read_secret_token` (which reads the Secret as the apiserver serves it:
the token base64-encoded under `data`), the Redis registry on a real redis-server (`redis_url`), the
worker's inbox. The kopf event loop itself is covered by test_operator_kopf.py; the whole path with the
helm-installed API and operator and a real worker by the flow tests.
"""

from __future__ import annotations

import asyncio
import logging
from datetime import UTC, datetime

import kubernetes
import pytest
from aiohttp.test_utils import TestClient, TestServer
from conftest import Kube
from gateway_support import AUTH, KEY, TOKEN, GatewaySpace, RecordingApiClient, body
from vivant.apis import resources
from vivant.apis.livekit_token import LiveKitCredentials
from vivant.gateway import server as session_api
from vivant.operator import kube as operator_kube
from vivant.operator import reconcile
from vivant.sessions.models import Assignment, WorkerInfo
from vivant.sessions.registry import Registry

pytestmark = [pytest.mark.usefixtures("vivant_crds", "release_operators_paused"), pytest.mark.timeout(60)]


async def test_api_session_is_assigned_with_the_callers_token(
    kube: Kube, gateway_space: GatewaySpace, gateway_kube: RecordingApiClient, redis_url: str,
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    ns = gateway_space.name
    operator_cfg = kubernetes.client.Configuration()
    kubernetes.config.load_kube_config(config_file=str(kube.kubeconfig), client_configuration=operator_cfg)
    monkeypatch.setattr(kubernetes.client.Configuration, "_default", operator_cfg)  # the operator's kube module uses it
    config = session_api.ApiConfig(namespace=ns, avatars={"ada": session_api.AvatarEntry(character="ada-v1",
                                                                                          pool="h200")})
    api = session_api.SessionApi(config, session_api.ApiKeys(static=(KEY,)), gateway_kube)
    async with TestClient(TestServer(api.app())) as client:
        resp = await client.post("/v1/realtime_sessions", json=body(), headers=AUTH)
        assert resp.status == 201, await resp.text()
        sid = (await resp.json())["id"]

    cr = gateway_space.session(sid)
    spec = resources.CharacterSessionSpec.model_validate(cr["spec"])
    registry = Registry(redis_url)
    pool = resources.pool_key(ns, "h200")
    registry.register(WorkerInfo(worker_id="h200-0", pool=pool, warm=True, node="gpu-node-0"))
    written: list[dict] = []
    ref = reconcile.SessionRef(namespace=ns, name=sid, uid=cr["metadata"]["uid"], created=datetime.now(tz=UTC))
    out = await asyncio.to_thread(
        reconcile.assign_session, ref, spec, {}, registry=registry,
        credentials=LiveKitCredentials("APIkey123", "x" * 32), apply_secret=written.append,
        timeouts=reconcile.Timeouts(), now=datetime.now(tz=UTC),
        read_token=lambda name: operator_kube.read_secret_token(ns, name))

    assert out.status["phase"] == "Assigned" and out.status["worker"] == "h200-0", out.status
    assert out.status["tokenSecret"] == spec.livekit.token_secret
    assert written == [], "with a caller-supplied token the operator must not write a Secret of its own"
    message = registry.next_message("h200-0", 0)
    assert isinstance(message, Assignment) and message.token.get_secret_value() == TOKEN, \
        "the worker must receive the token the agent minted"
    assert (message.room, message.agent_identity, message.max_duration_s) == ("room-1", "agent-1", 300.0)
    assert TOKEN not in str(out.status) + str(out.events) + caplog.text, "token leaked into status/events/logs"
    registry.close()
