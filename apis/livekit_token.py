"""The LiveKit access token that puts a vivant avatar in a room: the one minter (livekit-api).

Two parties mint it, with the same function: the operator, for a worker it assigns a session to
(stored in a Secret owned by the CharacterSession, handed to the worker inside the Redis assignment),
and the voice agent's plugin (`vivant.gateway.agent_plugin`), which gives it to the session gateway.

The token is a JWT signed with the LiveKit API secret. Its shape follows LiveKit's avatar-worker
convention: participant kind `agent`, grants scoped to the one room (join, publish, subscribe, data;
no room creation or admin), a short time-to-live (the server refreshes tokens of connected
participants, so the TTL only bounds how long a leaked token can be used to join), and the attribute
`lk.publish_on_behalf` naming the voice agent whose speech the avatar's video belongs to.

Whoever mints it never writes it into a spec, status, event or log.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

from livekit import api as lkapi

PUBLISH_ON_BEHALF_ATTRIBUTE = "lk.publish_on_behalf"
DEFAULT_TTL = datetime.timedelta(minutes=10)
MAX_TTL = datetime.timedelta(hours=1)


@dataclass(frozen=True)
class LiveKitCredentials:
    """API key and secret of the LiveKit project (from a Secret or the environment, never from a CR)."""

    api_key: str
    api_secret: str

    def __post_init__(self) -> None:
        if not self.api_key or not self.api_secret:
            raise ValueError("LiveKit credentials: api_key and api_secret must both be non-empty")

    def __repr__(self) -> str:  # keep the secret out of logs and tracebacks
        return f"LiveKitCredentials(api_key={self.api_key!r}, api_secret=<hidden>)"


def avatar_identity(session_name: str) -> str:
    """The LiveKit identity the operator gives the avatar worker of a CharacterSession."""
    return f"vivant-avatar-{session_name}"


def mint_avatar_token(
    credentials: LiveKitCredentials,
    *,
    room: str,
    identity: str,
    agent_identity: str,
    ttl: datetime.timedelta = DEFAULT_TTL,
) -> str:
    """A room-scoped `agent` token for the avatar participant `identity`, publishing on behalf of
    `agent_identity`; `ttl` in (0, 1 h]. Returns the signed JWT."""
    for name, value in (("room", room), ("identity", identity), ("agent_identity", agent_identity)):
        if not value:
            raise ValueError(f"{name}: expected a non-empty LiveKit name for the avatar's token")
    if ttl <= datetime.timedelta(0) or ttl > MAX_TTL:
        raise ValueError(f"ttl must be in (0, 1 h] for an avatar token, got {ttl}")
    grants = lkapi.VideoGrants(
        room_join=True,
        room=room,
        room_create=False,
        room_admin=False,
        can_publish=True,
        can_subscribe=True,
        can_publish_data=True,
    )
    return (
        lkapi.AccessToken(credentials.api_key, credentials.api_secret)
        .with_identity(identity)
        .with_name(identity)
        .with_kind("agent")
        .with_grants(grants)
        .with_attributes({PUBLISH_ON_BEHALF_ATTRIBUTE: agent_identity})
        .with_ttl(ttl)
        .to_jwt()
    )
