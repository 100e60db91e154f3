"""LiveKit tokens of the avatar, verified with `livekit.api.TokenVerifier` (real livekit-api, no server).

Two tokens put an avatar in a room: the one the operator mints for a worker
(`vivant.operator.livekit_tokens.mint_worker_token`) and the one the agent plugin mints and hands to the
session API (`vivant.sessions.agent_plugin.mint_avatar_token`). Both must carry exactly: kind `agent`,
the avatar's identity, a join grant for the one room with publish/subscribe/data and nothing else, and
the attribute `lk.publish_on_behalf` naming the voice agent. A wrong secret or an expired token fails.
"""

from __future__ import annotations

import dataclasses
import datetime
import time

import pytest
from livekit import api
from vivant.operator.livekit_tokens import LiveKitCredentials, mint_worker_token
from vivant.sessions.agent_plugin import VivantAvatarError, mint_avatar_token

KEY, SECRET = "APIvivanttest", "s" * 40

EXPECTED_GRANTS = api.VideoGrants(room_join=True, room="room-1", can_publish=True, can_subscribe=True,
                                  can_publish_data=True)


def _tokens() -> dict[str, str]:
    return {
        "plugin": mint_avatar_token(api_key=KEY, api_secret=SECRET, room="room-1", avatar_identity="vivant-avatar",
                                    agent_identity="agent-1"),
        "operator": mint_worker_token(LiveKitCredentials(KEY, SECRET), room="room-1",
                                      identity="vivant-avatar", agent_identity="agent-1"),
    }


@pytest.mark.parametrize("minted_by", ["plugin", "operator"])
def test_token_carries_exactly_the_intended_claims(minted_by: str) -> None:
    claims = api.TokenVerifier(KEY, SECRET).verify(_tokens()[minted_by])
    assert (claims.identity, claims.kind) == ("vivant-avatar", "agent"), f"{minted_by}: {claims}"
    assert claims.attributes == {"lk.publish_on_behalf": "agent-1"}, f"{minted_by}: attributes {claims.attributes}"
    v = claims.video
    got = {k: getattr(v, k) for k in ("room_join", "room", "can_publish", "can_subscribe", "can_publish_data")}
    want = {k: getattr(EXPECTED_GRANTS, k) for k in got}
    assert got == want, f"{minted_by}: grants {got} != {want}"
    for power in ("room_create", "room_list", "room_record", "room_admin", "ingress_admin", "hidden", "recorder"):
        assert not getattr(v, power, False), f"{minted_by}: the avatar must not hold {power}"
    for other in ("sip", "agent", "inference"):
        grant = getattr(claims, other, None)
        held = {k: x for k, x in dataclasses.asdict(grant).items() if x} if grant is not None else {}
        assert not held, f"{minted_by}: unexpected {other} grants {held}"


def test_wrong_secret_and_expiry_are_rejected() -> None:
    token = _tokens()["plugin"]
    with pytest.raises(Exception, match="(?i)signature"):
        api.TokenVerifier(KEY, "x" * 40).verify(token)
    short = mint_avatar_token(api_key=KEY, api_secret=SECRET, room="room-1", avatar_identity="a",
                              agent_identity="agent-1", ttl=datetime.timedelta(seconds=1))
    time.sleep(1.1)
    with pytest.raises(Exception, match="(?i)expired"):
        api.TokenVerifier(KEY, SECRET, leeway=datetime.timedelta(0)).verify(short)


def test_plugin_refuses_to_mint_without_credentials() -> None:
    with pytest.raises(VivantAvatarError, match="api_key and api_secret"):
        mint_avatar_token(api_key="", api_secret=SECRET, room="r", avatar_identity="a", agent_identity="b")
