"""The session gateway's wire contract (`vivant api`): its routes and its request and response bodies,
checked with pydantic at the door. The server (`vivant.gateway.server`) and its client, the agent plugin
(`vivant.gateway.agent_plugin`), both build on these.

Why these shapes: `POST /v1/realtime_sessions` accepts the body that LiveKit's hosted-avatar plugins
send (the `livekit-plugins-runway` contract), so an existing agent only changes its base URL and key:

    {"model": "...",                                     # optional, accepted and ignored
     "avatar": {"type": "custom", "avatarId": "ada"}     # or {"type": "runway-preset", "presetId": "ada"}
     "livekit": {"url": "wss://...", "token": "<JWT>", "roomName": "...", "agentIdentity": "..."},
     "maxDuration": 300}                                 # optional, seconds, 10..86400

Room names and agent identities take what LiveKit takes (1..256 bytes of UTF-8, any characters).
The LiveKit token is a `SecretStr`: it prints as `**********`, is never echoed in an error (errors name
the field and what was expected, never the input) and leaves this process only inside a Secret.
`ApiError` is the one error shape: `{"error": {"code", "message", "field"}}`.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError
from pydantic.alias_generators import to_camel
from vivant.apis import resources

ROUTE_COLLECTION = "/v1/realtime_sessions"
ROUTE_ITEM = "/v1/realtime_sessions/{id}"
ROUTE_OPENAPI = "/openapi.json"
MAX_TOKEN_CHARS = 8192
# A session id: the CharacterSession's name, `rt-` and lowercase ASCII (never a non-ASCII letter or digit).
SESSION_ID_PATTERN = r"^rt-[a-z0-9]([-a-z0-9]{0,58}[a-z0-9])?$"
# Optional request header: a retry with the same key (and the same API key) never makes a second session.
IDEMPOTENCY_HEADER = "Idempotency-Key"
IDEMPOTENCY_KEY_MAX = 255
IDEMPOTENCY_KEY_PATTERN = r"^[\x21-\x7e]{1,255}$"


class _Body(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid", strict=True)


class CustomAvatar(_Body):
    type: Literal["custom"]
    avatar_id: Annotated[str, Field(min_length=1, max_length=128, pattern=resources.IDENTIFIER)]


class PresetAvatar(_Body):
    type: Literal["runway-preset", "preset"]
    preset_id: Annotated[str, Field(min_length=1, max_length=128, pattern=resources.IDENTIFIER)]


Avatar = Annotated[CustomAvatar | PresetAvatar, Field(discriminator="type")]


class LiveKitJoin(_Body):
    """Where the avatar joins, with the token the caller minted for it (kind agent, publish_on_behalf)."""

    url: Annotated[str, Field(min_length=6, max_length=512, pattern=r"^(wss?|https?)://[^\s/]+(/\S*)?$")]
    token: SecretStr = Field(min_length=16, max_length=MAX_TOKEN_CHARS)
    room_name: resources.LiveKitRoomName
    agent_identity: resources.LiveKitIdentity


class CreateSessionRequest(_Body):
    model: Annotated[str, Field(min_length=1, max_length=128)] | None = None
    avatar: Avatar
    livekit: LiveKitJoin
    max_duration: Annotated[int, Field(ge=10, le=86_400)] | None = None

    @property
    def avatar_key(self) -> str:
        return self.avatar.avatar_id if isinstance(self.avatar, CustomAvatar) else self.avatar.preset_id


class CreateSessionResponse(_Body):
    id: str


class SessionStatusResponse(_Body):
    """`status` follows the hosted-avatar vocabulary; `phase` is the CharacterSession's own."""

    id: str
    status: Literal["NOT_READY", "RUNNING", "COMPLETED", "FAILED"]
    phase: str
    avatar: str | None = None
    worker: str | None = None
    message: str | None = None
    created_at: str | None = None
    ended_at: str | None = None


STATUS_OF_PHASE: dict[resources.SessionPhase, str] = {
    resources.SessionPhase.PENDING: "NOT_READY",
    resources.SessionPhase.ASSIGNED: "NOT_READY",
    resources.SessionPhase.CONNECTING: "NOT_READY",
    resources.SessionPhase.STREAMING: "RUNNING",
    resources.SessionPhase.ENDED: "COMPLETED",
    resources.SessionPhase.FAILED: "FAILED",
}


class ErrorDetail(BaseModel):
    code: str
    message: str
    field: str | None = None


class ApiError(BaseModel):
    error: ErrorDetail


def first_validation_problem(exc: ValidationError) -> tuple[str, str]:
    """(field path in wire names, what was expected) of the first error; never includes the input value."""
    err = exc.errors(include_input=False, include_url=False, include_context=False)[0]
    loc = [str(p) for p in err["loc"] if not (isinstance(p, str) and p in ("custom", "runway-preset", "preset"))]
    path = ".".join(loc) or "body"
    return path, err["msg"]
