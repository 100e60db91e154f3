"""The agent plugin (`VivantAvatarSession`) talking HTTP to the session gateway, over the real apiserver.

The plugin's request is the hosted-avatar body; here it goes to `vivant.gateway.server` served by aiohttp
on a loopback port in this process, whose Kubernetes client talks to the real apiserver (see
test_api_sessions.py for why in-process). Shown: the plugin's POST creates a CharacterSession whose token
sits in a Secret, an API error reaches the plugin as `VivantAvatarError` with status and code, and the
plugin's DELETE ends the session. `start()` itself needs a connected room and a job context (a LiveKit
server), which this test does not run.
"""

from __future__ import annotations

import base64
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp.test_utils import TestServer
from gateway_support import TOKEN, GatewaySpace, RecordingApiClient
from vivant.gateway import server as session_api
from vivant.gateway.agent_plugin import VivantAvatarError, VivantAvatarSession, session_request_body

pytestmark = [pytest.mark.usefixtures("vivant_crds", "release_operators_paused"), pytest.mark.timeout(60)]
KEY = "vk_plugin_key_0123456789"


@pytest.fixture
async def api_url(gateway_space: GatewaySpace, gateway_kube: RecordingApiClient) -> AsyncIterator[str]:
    config = session_api.ApiConfig(namespace=gateway_space.name, avatars={"ada": session_api.AvatarEntry(character="ada-v1",
                                                                                                  pool="h200")})
    server = TestServer(session_api.SessionApi(config, session_api.ApiKeys(static=(KEY,)), gateway_kube).app())
    await server.start_server()
    yield str(server.make_url("")).rstrip("/")
    await server.close()


def _body(avatar: str = "ada") -> dict[str, Any]:
    return session_request_body(avatar_id=avatar, livekit_url="wss://lk.example.com", token=TOKEN, room="room-1",
                                agent_identity="agent-1", max_duration_s=120)


async def test_plugin_creates_and_deletes_a_session(api_url: str, gateway_space: GatewaySpace) -> None:
    plugin = VivantAvatarSession(avatar_id="ada", api_url=api_url, api_key=KEY)
    sid = await plugin.create_session(_body())
    [cr] = gateway_space.sessions()
    assert cr["metadata"]["name"] == sid and cr["spec"]["maxDurationSeconds"] == 120
    secret_name = cr["spec"]["livekit"]["tokenSecret"]
    [secret] = [s for s in gateway_space.secrets() if s["metadata"]["name"] == secret_name]
    assert base64.b64decode(secret["data"]["token"]).decode() == TOKEN, "the CR must name the token's Secret"
    await plugin.delete_session()
    assert not gateway_space.sessions(), "the plugin's DELETE must end the session"


@pytest.mark.parametrize(("key", "avatar", "status", "code"), [
    ("vk_wrong", "ada", 401, "invalid_api_key"),
    (KEY, "nobody", 404, "unknown_avatar"),
])
async def test_api_errors_reach_the_plugin(api_url: str, gateway_space: GatewaySpace, gateway_kube: RecordingApiClient,
                                           key: str, avatar: str, status: int, code: str) -> None:
    plugin = VivantAvatarSession(avatar_id=avatar, api_url=api_url, api_key=key)
    with pytest.raises(VivantAvatarError) as err:
        await plugin.create_session(_body(avatar))
    assert (err.value.status, err.value.code) == (status, code)
    assert TOKEN not in str(err.value)
    assert not gateway_space.sessions() and gateway_kube.writes() == []
