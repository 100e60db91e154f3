"""The agent plugin (`VivantAvatarSession`) on its own: what it needs to start and the body it sends.

Its HTTP round trip with the session gateway over the real apiserver is tests/cluster/test_api_agent_plugin.py.
"""

from __future__ import annotations

import pytest
from vivant.gateway.agent_plugin import VivantAvatarError, VivantAvatarSession, session_request_body

KEY = "vk_plugin_key_0123456789"
TOKEN = "eyJhbGciOiJIUzI1NiJ9.SECRET-LIVEKIT-TOKEN-plugin-0123456789"


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
        session_request_body(avatar_id="ada", livekit_url="wss://lk.example.com", token=TOKEN, room="r" * 257,
                             agent_identity="agent-1", max_duration_s=120)
    assert TOKEN not in str(err.value)
    with pytest.raises(VivantAvatarError, match=r"maxDuration"):
        session_request_body(avatar_id="ada", livekit_url="wss://lk.example.com", token=TOKEN, room="room-1",
                             agent_identity="agent-1", max_duration_s=5)
