"""The agent plugin (`VivantAvatarSession`) talking HTTP to the real session API app.

The plugin's request is the hosted-avatar body; here it goes to `vivant.gateway.server` served by aiohttp
on a loopback port, over a Kubernetes API emulator (kmock: no kube-apiserver can run here). Shown: the
plugin's POST creates a CharacterSession whose token sits in a Secret, an API error reaches the plugin
as `VivantAvatarError` with status and code, and the plugin's DELETE ends the session. `start()` itself
needs a connected room and a job context (LiveKit server), which cannot run here.
"""

from __future__ import annotations

import asyncio
from typing import Any

import kubernetes
import pytest
from aiohttp.test_utils import TestServer
from test_session_api import EVENTS, NS, POOLS, SECRETS, SESSIONS, TOKEN, StampingEmulator, _objects, _pool
from vivant.apis import resources as r
from vivant.gateway import server as session_api
from vivant.gateway.agent_plugin import VivantAvatarError, VivantAvatarSession, session_request_body

pytestmark = [pytest.mark.kmock(cls=StampingEmulator), pytest.mark.timeout(60)]
KEY = "vk_plugin_key_0123456789"


@pytest.fixture
async def api_url(kmock: Any) -> Any:
    for res in (SESSIONS, POOLS, SECRETS, EVENTS):
        kmock.resources[f"{res.group}/{res.version}/{res.plural}".lstrip("/")] = {}
    kube = kubernetes.client.ApiClient(kubernetes.client.Configuration(host=str(kmock.url).rstrip("/")))
    custom = kubernetes.client.CustomObjectsApi(kube)
    await asyncio.to_thread(custom.create_namespaced_custom_object, r.GROUP, r.VERSION, NS, r.POOL_PLURAL,
                            _pool("h200", 2))
    config = session_api.ApiConfig(namespace=NS, avatars={"ada": session_api.AvatarEntry(character="ada-v1",
                                                                                          pool="h200")})
    server = TestServer(session_api.SessionApi(config, session_api.ApiKeys(static=(KEY,)), kube).app())
    await server.start_server()
    yield str(server.make_url("")).rstrip("/")
    await server.close()
    kube.close()


def _body(avatar: str = "ada") -> dict[str, Any]:
    return session_request_body(avatar_id=avatar, livekit_url="wss://lk.example.com", token=TOKEN, room="room-1",
                                agent_identity="agent-1", max_duration_s=120)


async def test_plugin_creates_and_deletes_a_session(api_url: str, kmock: Any) -> None:
    plugin = VivantAvatarSession(avatar_id="ada", api_url=api_url, api_key=KEY)
    sid = await plugin.create_session(_body())
    [cr] = _objects(kmock, SESSIONS)
    assert cr["metadata"]["name"] == sid and cr["spec"]["maxDurationSeconds"] == 120
    assert cr["spec"]["livekit"]["tokenSecret"], "the CR must name the token's Secret"
    await plugin.delete_session()
    assert not _objects(kmock, SESSIONS), "the plugin's DELETE must end the session"


@pytest.mark.parametrize(("key", "avatar", "status", "code"), [
    ("vk_wrong", "ada", 401, "invalid_api_key"),
    (KEY, "nobody", 404, "unknown_avatar"),
])
async def test_api_errors_reach_the_plugin(api_url: str, kmock: Any, key: str, avatar: str, status: int,
                                           code: str) -> None:
    plugin = VivantAvatarSession(avatar_id=avatar, api_url=api_url, api_key=key)
    with pytest.raises(VivantAvatarError) as err:
        await plugin.create_session(_body(avatar))
    assert (err.value.status, err.value.code) == (status, code)
    assert TOKEN not in str(err.value)
    assert not _objects(kmock, SESSIONS)


def test_plugin_needs_an_api_url_and_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VIVANT_API_URL", raising=False)
    monkeypatch.delenv("VIVANT_API_KEY", raising=False)
    with pytest.raises(VivantAvatarError, match="api_url"):
        VivantAvatarSession(avatar_id="ada", api_key=KEY)
    with pytest.raises(VivantAvatarError, match="api_key"):
        VivantAvatarSession(avatar_id="ada", api_url="http://x")


def test_plugin_checks_its_body_with_the_gateways_model() -> None:
    """The body is validated by the gateway's own request model before it is sent; the error names the field."""
    assert session_request_body(avatar_id="ada", livekit_url="wss://lk.example.com", token=TOKEN, room="room-1",
                                agent_identity="agent-1", max_duration_s=None)["livekit"]["roomName"] == "room-1"
    with pytest.raises(VivantAvatarError, match=r"^session request: livekit\.roomName: ") as err:
        session_request_body(avatar_id="ada", livekit_url="wss://lk.example.com", token=TOKEN, room="room 1",
                             agent_identity="agent-1", max_duration_s=120)
    assert TOKEN not in str(err.value)
    with pytest.raises(VivantAvatarError, match=r"maxDuration"):
        session_request_body(avatar_id="ada", livekit_url="wss://lk.example.com", token=TOKEN, room="room-1",
                             agent_identity="agent-1", max_duration_s=5)
