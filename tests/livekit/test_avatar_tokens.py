"""The avatar's LiveKit token, verified with `livekit.api.TokenVerifier` (real livekit-api, no server).

One function mints it (`vivant.apis.livekit_token.mint_avatar_token`): the operator calls it for the
worker it assigns a session to, the agent plugin calls it for the token it hands to the session
gateway. It must carry exactly: kind `agent`, the avatar's identity, a join grant for the one room with
publish/subscribe/data and nothing else, and the attribute `lk.publish_on_behalf` naming the voice
agent. A wrong secret or an expired token fails; bad arguments are refused with the argument named.
"""

from __future__ import annotations

import dataclasses
import datetime
import time

import jwt
import pytest
from livekit import api
from vivant.apis.livekit_token import PUBLISH_ON_BEHALF_ATTRIBUTE, LiveKitCredentials, mint_avatar_token
from vivant.gateway.agent_plugin import VivantAvatarError, livekit_credentials

KEY, SECRET = "APIvivanttest", "s" * 40
CREDS = LiveKitCredentials(KEY, SECRET)

EXPECTED_GRANTS = api.VideoGrants(room_join=True, room="room-1", can_publish=True, can_subscribe=True,
                                  can_publish_data=True)


def _token(**overrides: object) -> str:
    kwargs: dict[str, object] = {"room": "room-1", "identity": "vivant-avatar", "agent_identity": "agent-1"}
    kwargs.update(overrides)
    return mint_avatar_token(CREDS, **kwargs)  # type: ignore[arg-type]


def test_token_carries_exactly_the_intended_claims() -> None:
    claims = api.TokenVerifier(KEY, SECRET).verify(_token())
    assert (claims.identity, claims.name, claims.kind) == ("vivant-avatar", "vivant-avatar", "agent"), claims
    assert claims.attributes == {PUBLISH_ON_BEHALF_ATTRIBUTE: "agent-1"} == {"lk.publish_on_behalf": "agent-1"}, (
        f"attributes {claims.attributes}")
    v = claims.video
    got = {k: getattr(v, k) for k in ("room_join", "room", "can_publish", "can_subscribe", "can_publish_data")}
    want = {k: getattr(EXPECTED_GRANTS, k) for k in got}
    assert got == want, f"grants {got} != {want}"
    for power in ("room_create", "room_list", "room_record", "room_admin", "ingress_admin", "hidden", "recorder"):
        assert not getattr(v, power, False), f"the avatar must not hold {power}"
    for other in ("sip", "agent", "inference"):
        grant = getattr(claims, other, None)
        held = {k: x for k, x in dataclasses.asdict(grant).items() if x} if grant is not None else {}
        assert not held, f"unexpected {other} grants {held}"


def test_ttl_is_what_was_asked_and_bounded() -> None:
    payload = jwt.decode(_token(ttl=datetime.timedelta(minutes=5)), options={"verify_signature": False})
    assert 0 < payload["exp"] - payload["nbf"] <= 300, payload
    for bad in (datetime.timedelta(hours=6), datetime.timedelta(0), datetime.timedelta(seconds=-1)):
        with pytest.raises(ValueError, match="ttl"):
            _token(ttl=bad)


def test_wrong_secret_and_expiry_are_rejected() -> None:
    with pytest.raises(Exception, match="(?i)signature"):
        api.TokenVerifier(KEY, "x" * 40).verify(_token())
    short = _token(ttl=datetime.timedelta(seconds=1))
    time.sleep(1.1)
    with pytest.raises(Exception, match="(?i)expired"):
        api.TokenVerifier(KEY, SECRET, leeway=datetime.timedelta(0)).verify(short)


@pytest.mark.parametrize("argument", ["room", "identity", "agent_identity"])
def test_empty_names_are_refused_with_the_argument_named(argument: str) -> None:
    with pytest.raises(ValueError, match=f"^{argument}: expected a non-empty"):
        _token(**{argument: ""})


def test_credentials_must_be_complete_and_keep_the_secret_out_of_repr() -> None:
    for key, secret in (("key", ""), ("", "secret")):
        with pytest.raises(ValueError, match="api_key and api_secret"):
            LiveKitCredentials(key, secret)
    assert SECRET not in repr(CREDS) and KEY in repr(CREDS)


def test_plugin_takes_credentials_from_arguments_or_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LIVEKIT_API_KEY", raising=False)
    monkeypatch.delenv("LIVEKIT_API_SECRET", raising=False)
    with pytest.raises(VivantAvatarError, match="LIVEKIT_API_KEY and LIVEKIT_API_SECRET"):
        livekit_credentials()
    with pytest.raises(VivantAvatarError, match="api_key and api_secret"):
        livekit_credentials(api_key=KEY)
    assert livekit_credentials(KEY, SECRET) == CREDS
    monkeypatch.setenv("LIVEKIT_API_KEY", KEY)
    monkeypatch.setenv("LIVEKIT_API_SECRET", SECRET)
    assert livekit_credentials() == CREDS
