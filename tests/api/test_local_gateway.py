"""The session gateway's local mode (`vivant api --local`, vivant.gateway.local) over a real Redis: the Runway
plugin's body hands a session to an idle worker's inbox; no idle worker, an unknown avatar, a bad body, Redis
down and unknown sessions answer with the gateway's errors and change nothing; GET and DELETE follow the worker's
record. The worker is a registration in the registry (what `vivant worker` writes when it is warm): the full call
with a real worker and LiveKit server is tests/livekit/test_call_ends.py.
"""

from __future__ import annotations

import logging
import uuid
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer
from vivant.gateway.local import LocalSessionApi
from vivant.gateway.server import ApiConfig, ApiKeys, AvatarEntry
from vivant.ports import free_port
from vivant.sessions.models import Assignment, EndRequest, SessionStats, WorkerInfo
from vivant.sessions.registry import Registry

pytestmark = pytest.mark.timeout(60)
KEY = "vk_local_0123456789abcdef"
AUTH = {"Authorization": f"Bearer {KEY}"}
TOKEN = "eyJhbGciOiJIUzI1NiJ9.SECRET-LIVEKIT-TOKEN-" + uuid.uuid4().hex
POOL = "local"


def body(**over: Any) -> dict[str, Any]:
    """The body livekit-plugins-runway 1.8.9 posts (its avatar.py)."""
    b = {"model": "gwm1_avatars", "avatar": {"type": "custom", "avatarId": "ada"},
         "livekit": {"url": "ws://127.0.0.1:7880", "token": TOKEN, "roomName": "room-1", "agentIdentity": "agent-1"},
         "maxDuration": 30}
    return {**b, **over}


def api_for(redis_url: str) -> tuple[LocalSessionApi, Registry]:
    config = ApiConfig(namespace="local", avatars={"ada": AvatarEntry(character="ada", pool=POOL)})
    registry = Registry(redis_url)
    return LocalSessionApi(config, ApiKeys(static=(KEY,)), registry), registry


async def test_a_session_goes_to_the_idle_worker_and_follows_its_record(redis_url: str, caplog) -> None:  # noqa: ANN001
    api, reg = api_for(redis_url)
    caplog.set_level(logging.DEBUG)
    async with TestClient(TestServer(api.app())) as c:
        assert (await c.get("/readyz")).status == 503  # no worker yet
        assert (await c.post("/v1/realtime_sessions", json=body(), headers=AUTH)).status == 503
        reg.register(WorkerInfo(worker_id="w0", pool=POOL, warm=True))
        ready = await c.get("/readyz")
        assert (ready.status, await ready.json()) == (200, {"idleWorkers": {POOL: 1}})

        resp = await c.post("/v1/realtime_sessions", json=body(), headers={**AUTH, "X-Runway-Version": "2024-11-06"})
        assert resp.status == 201, await resp.text()
        sid = (await resp.json())["id"]
        msg = reg.next_message("w0", 1)
        assert isinstance(msg, Assignment), msg
        assert (msg.session_id, msg.room, msg.agent_identity, msg.max_duration_s, msg.pool) == (
            f"local/{sid}", "room-1", "agent-1", 30.0, POOL)
        assert msg.token.get_secret_value() == TOKEN
        again = await c.post("/v1/realtime_sessions", json=body(), headers=AUTH)  # the only worker is busy
        assert (again.status, again.headers.get("Retry-After")) == (503, "5")
        assert (await again.json())["error"]["code"] == "no_capacity"

        got = await (await c.get(f"/v1/realtime_sessions/{sid}", headers=AUTH)).json()
        assert (got["status"], got["phase"], got["worker"]) == ("NOT_READY", "Assigned", "w0")
        reg.report_session(f"local/{sid}", SessionStats(session_id=f"local/{sid}", worker_id="w0", phase="Streaming"))
        got = await (await c.get(f"/v1/realtime_sessions/{sid}", headers=AUTH)).json()
        assert (got["status"], got["phase"]) == ("RUNNING", "Streaming")

        assert (await c.delete(f"/v1/realtime_sessions/{sid}", headers=AUTH)).status == 204
        end = reg.next_message("w0", 1)
        assert isinstance(end, EndRequest) and (end.session_id, end.reason) == (f"local/{sid}", "Deleted")
        texts = [await (await c.get(f"/v1/realtime_sessions/{sid}", headers=AUTH)).text()]
    assert TOKEN not in caplog.text and TOKEN not in "".join(texts), "the token leaked into a log or an answer"
    reg.close()


async def test_bad_requests_change_nothing(redis_url: str) -> None:
    api, reg = api_for(redis_url)
    reg.register(WorkerInfo(worker_id="w0", pool=POOL, warm=True))
    async with TestClient(TestServer(api.app())) as c:
        cases = [
            (c.post("/v1/realtime_sessions", json=body()), 401, "missing_api_key", "Authorization"),
            (c.post("/v1/realtime_sessions", json=body(avatar={"type": "custom", "avatarId": "zed"}), headers=AUTH),
             404, "unknown_avatar", "avatar"),
            (c.post("/v1/realtime_sessions", json=body(maxDuration=5), headers=AUTH), 422, "invalid_field",
             "maxDuration"),
            (c.post("/v1/realtime_sessions", data=b"{", headers=AUTH), 400, "malformed_body", "body"),
            (c.get("/v1/realtime_sessions/rt-0123", headers=AUTH), 404, "unknown_session", "id"),
            (c.delete("/v1/realtime_sessions/rt-0123", headers=AUTH), 404, "unknown_session", "id"),
        ]
        for request, status, code, field in cases:
            resp = await request
            err = (await resp.json())["error"]
            assert (resp.status, err["code"], err.get("field")) == (status, code, field), err
    assert reg.idle_workers(POOL) == ["w0"] and reg.pending("w0") == [], "a refused request touched the registry"
    reg.close()


async def test_redis_down_is_503_with_retry_after() -> None:
    api, reg = api_for(f"redis://127.0.0.1:{free_port()}/0")  # nothing listens there
    async with TestClient(TestServer(api.app())) as c:
        resp = await c.post("/v1/realtime_sessions", json=body(), headers=AUTH)
        err = (await resp.json())["error"]
    assert (resp.status, resp.headers.get("Retry-After"), err["code"]) == (503, "5", "registry_unavailable")
    reg.close()


async def test_another_key_cannot_read_or_end_a_session(redis_url: str) -> None:
    """Item 8 of issue 36 in local mode: a session id carries its key's mark; another valid key's GET and
    DELETE answer 404 unknown_session, as for an id that does not exist, and the worker gets no end request."""
    other = "vk_local_other_tenant_0123"
    config = ApiConfig(namespace="local", avatars={"ada": AvatarEntry(character="ada", pool=POOL)})
    reg = Registry(redis_url)
    api = LocalSessionApi(config, ApiKeys(static=(KEY, other)), reg)
    reg.register(WorkerInfo(worker_id="w0", pool=POOL, warm=True))
    async with TestClient(TestServer(api.app())) as c:
        sid = (await (await c.post("/v1/realtime_sessions", json=body(), headers=AUTH)).json())["id"]
        assert isinstance(reg.next_message("w0", 1), Assignment)
        for method in ("GET", "DELETE"):
            resp = await c.request(method, f"/v1/realtime_sessions/{sid}", headers={"Authorization": f"Bearer {other}"})
            err = (await resp.json())["error"]
            assert (resp.status, err["code"], err["field"]) == (404, "unknown_session", "id"), (method, err)
        assert reg.pending("w0") == [], "another key's DELETE reached the worker"
        assert (await c.get(f"/v1/realtime_sessions/{sid}", headers=AUTH)).status == 200
    reg.close()
