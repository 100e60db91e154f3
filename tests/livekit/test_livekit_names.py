"""What LiveKit accepts as a room name and a participant identity, asked of a real livekit-server; the
API's models (`apis.resources.LiveKitRoomName`, `LiveKitIdentity`) accept exactly that and refuse what
the server refuses, with the server's reason (fact 11 of issue 15: `[A-Za-z0-9._-]` patterns refused
`my:room`, `room with space`, `agent@example.com`, `agent_`)."""

from __future__ import annotations

import asyncio

import pydantic
import pytest
from livekit import api, rtc
from vivant.apis import resources
from vivant.devcluster.livekit import LiveKitState

pytestmark = pytest.mark.timeout(120)
NAMES = pydantic.TypeAdapter(resources.LiveKitRoomName)
IDENTITIES = pydantic.TypeAdapter(resources.LiveKitIdentity)


def token(state: LiveKitState, room: str, identity: str) -> str:
    grants = api.VideoGrants(room_join=True, room=room, can_subscribe=True, can_publish=False)
    return api.AccessToken(state.api_key, state.api_secret).with_identity(identity).with_grants(grants).to_jwt()


@pytest.mark.parametrize(("room", "identity"), [("my:room", "agent@example.com"), ("room with space", "agent_"),
                                                ("комната/日本", "ägent 1"), ("r" * 256, "i" * 256)])
async def test_names_livekit_accepts_are_accepted(livekit_server: LiveKitState, room: str, identity: str) -> None:
    assert NAMES.validate_python(room) == room and IDENTITIES.validate_python(identity) == identity
    participant = rtc.Room()
    await asyncio.wait_for(participant.connect(livekit_server.url, token(livekit_server, room, identity)), 30)
    try:
        assert participant.name == room and participant.local_participant.identity == identity
    finally:
        await participant.disconnect()


@pytest.mark.parametrize(("room", "identity", "reason"), [
    ("r" * 257, "agent-1", "room name length exceeds limits"),
    ("é" * 129, "agent-1", "room name length exceeds limits"),  # 129 characters, 258 bytes
    ("room-1", "i" * 257, "participant identity length exceeds limits"),
])
async def test_names_livekit_refuses_are_refused_with_its_reason(livekit_server: LiveKitState, room: str,
                                                                 identity: str, reason: str) -> None:
    participant = rtc.Room()
    with pytest.raises(Exception) as refused:
        await asyncio.wait_for(participant.connect(livekit_server.url, token(livekit_server, room, identity)), 30)
    await participant.disconnect()
    assert f"{reason}: max length 256" in str(refused.value), refused.value
    bad, adapter = (identity, IDENTITIES) if "identity" in reason else (room, NAMES)
    with pytest.raises(pydantic.ValidationError) as ours:
        adapter.validate_python(bad)
    assert f"LiveKit refuses it: {reason}: max length 256" in str(ours.value), ours.value
