"""The LiveKit wire, for real: a livekit-server on loopback, two rtc participants, frames across it; and
the server's refusals of the tokens vivant mints (another room, expired, wrong secret)."""

from __future__ import annotations

import asyncio
import datetime

import pytest
from livekit import api, rtc
from vivant.apis.livekit_token import LiveKitCredentials, mint_avatar_token
from vivant.devcluster.livekit import LiveKitState
from vivant.worker.serving.publishing import video_publish_options

pytestmark = pytest.mark.timeout(120)


def user_token(state: LiveKitState, room: str, identity: str = "user") -> str:
    grants = api.VideoGrants(room_join=True, room=room, can_subscribe=True, can_publish=False)
    return api.AccessToken(state.api_key, state.api_secret).with_identity(identity).with_grants(grants).to_jwt()


def avatar_token(state: LiveKitState, room: str, ttl_s: float = 600) -> str:
    return mint_avatar_token(LiveKitCredentials(state.api_key, state.api_secret), room=room,
                             identity="vivant-avatar-s1", agent_identity="agent-1",
                             ttl=datetime.timedelta(seconds=ttl_s))


async def test_frames_published_by_the_avatar_reach_a_subscriber(livekit_server: LiveKitState) -> None:
    room = "wire-room"
    avatar, user = rtc.Room(), rtc.Room()
    received: list[tuple[int, int]] = []
    enough = asyncio.Event()

    @user.on("track_subscribed")
    def _on_track(track: rtc.Track, *_: object) -> None:
        async def read() -> None:
            async for event in rtc.VideoStream(track):
                received.append((event.frame.width, event.frame.height))
                if len(received) >= 24:
                    enough.set()
                    return
        asyncio.ensure_future(read())

    await user.connect(livekit_server.url, user_token(livekit_server, room))
    await avatar.connect(livekit_server.url, avatar_token(livekit_server, room))
    source = rtc.VideoSource(64, 48)
    track = rtc.LocalVideoTrack.create_video_track("character", source)
    await avatar.local_participant.publish_track(track, video_publish_options(64, 48, 24))
    frame = rtc.VideoFrame(64, 48, rtc.VideoBufferType.RGBA, bytes(64 * 48 * 4))

    async def feed() -> None:
        while not enough.is_set():
            source.capture_frame(frame)
            await asyncio.sleep(1 / 24)

    feeder = asyncio.ensure_future(feed())
    try:
        await asyncio.wait_for(enough.wait(), 60)
    finally:
        feeder.cancel()
        await avatar.disconnect()
        await user.disconnect()
    assert len(received) >= 24 and set(received) == {(64, 48)}, received[:5]


@pytest.mark.parametrize("case", ["another-room", "expired", "wrong-secret"])
async def test_the_server_refuses_tokens_it_must_refuse(livekit_server: LiveKitState, case: str) -> None:
    if case == "another-room":
        token, url_room = avatar_token(livekit_server, "room-a"), "room-b"
    elif case == "expired":
        # Expired for longer than any clock-skew leeway the server allows (a 1 s token 2.5 s later is
        # still accepted): the avatar's grants, exp two minutes ago.
        token = (api.AccessToken(livekit_server.api_key, livekit_server.api_secret).with_identity("vivant-avatar-s1")
                 .with_kind("agent").with_grants(api.VideoGrants(room_join=True, room="room-a"))
                 .with_ttl(datetime.timedelta(seconds=-120)).to_jwt())
        url_room = "room-a"
    else:
        creds = LiveKitCredentials(livekit_server.api_key, "not-the-secret-" + "x" * 24)
        token = mint_avatar_token(creds, room="room-a", identity="vivant-avatar-s1", agent_identity="agent-1")
        url_room = "room-a"
    room = rtc.Room()
    # The room a participant joins is the one its token names; joining "another room" means a token
    # scoped to room-a presented for room-b, which only a token naming room-b could do: check the grant.
    if case == "another-room":
        claims = api.TokenVerifier(livekit_server.api_key, livekit_server.api_secret).verify(token)
        assert claims.video.room == "room-a" and claims.video.room != url_room
        other = user_token(livekit_server, url_room, identity="vivant-avatar-s1")
        assert api.TokenVerifier(livekit_server.api_key, livekit_server.api_secret).verify(other).video.room == url_room
    with pytest.raises(Exception) as refused:
        await asyncio.wait_for(room.connect(livekit_server.url, token if case != "another-room" else
                                            _retarget(token, livekit_server, url_room)), 20)
    assert "401" in str(refused.value) or "Unauthorized" in str(refused.value) or "invalid" in str(refused.value), \
        refused.value
    await room.disconnect()


def _retarget(token: str, state: LiveKitState, room: str) -> str:
    """The room-a token with its room claim edited to room-b and the original signature kept: what a
    holder of a worker token would have to send to enter another room. The server must refuse it."""
    import base64
    import json

    header, payload, signature = token.split(".")
    claims = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
    claims["video"]["room"] = room
    forged = base64.urlsafe_b64encode(json.dumps(claims).encode()).rstrip(b"=").decode()
    return f"{header}.{forged}.{signature}"
