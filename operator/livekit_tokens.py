"""Mint the LiveKit access token a worker uses to join a session's room (livekit-api).

The token is a JWT signed with the LiveKit API secret. Its shape follows LiveKit's avatar-worker
convention: participant kind `agent`, grants scoped to the one room (join, publish, subscribe, data;
no room creation or admin), a short time-to-live (the server refreshes tokens of connected
participants, so the TTL only bounds how long a leaked token can be used to join), and the attribute
`lk.publish_on_behalf` naming the voice agent whose speech the avatar's video belongs to.

The operator stores the token in a Secret owned by the CharacterSession and passes it to the worker
inside the Redis assignment; it never writes it into spec, status, events or logs.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

from livekit import api as lkapi

PUBLISH_ON_BEHALF_ATTRIBUTE = "lk.publish_on_behalf"
DEFAULT_TTL = datetime.timedelta(minutes=10)


@dataclass(frozen=True)
class LiveKitCredentials:
    """API key and secret of the LiveKit project (from the operator's Secret/env, never from a CR)."""

    api_key: str
    api_secret: str

    def __post_init__(self) -> None:
        if not self.api_key or not self.api_secret:
            raise ValueError("LiveKit credentials: api_key and api_secret must both be non-empty")

    def __repr__(self) -> str:  # keep the secret out of logs and tracebacks
        return f"LiveKitCredentials(api_key={self.api_key!r}, api_secret=<hidden>)"


def avatar_identity(session_name: str) -> str:
    """The LiveKit identity of the avatar worker in a session's room."""
    return f"vivant-avatar-{session_name}"


def mint_worker_token(
    credentials: LiveKitCredentials,
    *,
    room: str,
    identity: str,
    agent_identity: str,
    ttl: datetime.timedelta = DEFAULT_TTL,
) -> str:
    """A room-scoped `agent` token for the avatar worker; returns the signed JWT."""
    if ttl <= datetime.timedelta(0) or ttl > datetime.timedelta(hours=1):
        raise ValueError(f"ttl must be in (0, 1 h] for a worker token, got {ttl}")
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
