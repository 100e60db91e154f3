"""Typed messages shared by the worker and the operator over Redis.

Everything that crosses Redis is one of these pydantic models, serialised as JSON. Redis is a trust
boundary (anyone with the URL can write into an inbox), so every message is validated on the way in
and a bad one is rejected with an error that names the field (see `describe_validation_error`).

Wire shapes (all JSON objects):
  WorkerInfo     worker -> registry hash   who a worker is (pool, node, capabilities, warm or loading)
  Assignment     operator -> worker inbox  {"kind": "assign", ...}; carries the LiveKit token (secret)
  EndRequest     operator -> worker inbox  {"kind": "end", "session_id", "reason"}
  SessionStats   worker -> registry        phase, fps (frames/s), stalls, chunk p99 (ms), streamed (s)
  PoolCounts     registry -> operator      registered / loading / idle / busy / draining worker counts
  FlagSet        a pool's flag values plus their version and who changed them last
  FlagChange     one entry of a pool's flag history (who, when, old -> new, reason)

The token is a `SecretStr`: `repr`, `str` and plain `model_dump_json()` show `**********`. Only
`Assignment.to_wire()` writes the real value, for the worker's inbox. The flag values themselves
(`FlagValues`) and the session phases (`SessionPhase`) are defined once, in `vivant.apis`.
"""

from __future__ import annotations

import time
from typing import Annotated, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    SerializationInfo,
    TypeAdapter,
    ValidationError,
    field_serializer,
    field_validator,
)
from vivant.apis.feature_flags import FlagError, FlagValue, FlagValues, validate_flag_updates
from vivant.apis.resources import SessionPhase

# A Kubernetes-ish identifier: pod names, pool names ("namespace/name"), namespaces.
Ident = Annotated[str, Field(min_length=1, max_length=253, pattern=r"^[A-Za-z0-9][A-Za-z0-9._:/-]*$")]
# A session id: "namespace/name" of its CharacterSession (<= 63 + 1 + 253 characters), or a uid.
SessionId = Annotated[str, Field(min_length=1, max_length=317, pattern=r"^[A-Za-z0-9][A-Za-z0-9._:/-]*$")]


class _Strict(BaseModel):
    """Base of operator -> worker messages: unknown fields are errors (a typo must not be silently
    dropped). Rolling upgrades therefore update workers before the operator."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class _Tolerant(BaseModel):
    """Base of what workers report and what is read back from Redis: fields unknown to this version
    are ignored, so an operator one version behind its workers still reads their reports. User input
    (flag names from the CLI or a spec) is checked separately by `validate_flag_updates`."""

    model_config = ConfigDict(extra="ignore", frozen=True)


# ---------------------------------------------------------------------------------------------
# Flag sets and their history (the flag table itself: vivant.apis.feature_flags)
# ---------------------------------------------------------------------------------------------


class FlagSet(_Tolerant):
    """A pool's flags as stored in Redis. version 0 = never set (all defaults)."""

    pool: Ident
    version: int = Field(ge=0)
    values: FlagValues = FlagValues()
    updated_by: str = ""
    updated_at: float = Field(default=0.0, description="unix seconds of the last change; 0 = never")

    def with_overrides(self, overrides: dict[str, FlagValue]) -> FlagValues:
        """The effective flags of one session: the pool's values overlaid with per-session overrides."""
        return self.values.model_copy(update=validate_flag_updates(overrides))


class FlagChange(_Tolerant):
    """One flag history entry: `changes` maps flag name -> [old, new]."""

    pool: Ident
    version: int
    actor: str
    at: float
    reason: str = ""
    changes: dict[str, tuple[FlagValue, FlagValue]]


# ---------------------------------------------------------------------------------------------
# Worker registration and inbox messages
# ---------------------------------------------------------------------------------------------


class WorkerInfo(_Tolerant):
    """What a worker says about itself when it registers (the pod name is the worker id)."""

    worker_id: Ident
    pool: Ident
    node: str = ""
    model_preset: str = ""
    gpus: int = Field(default=5, ge=0, description="GPUs held by this worker (4 DiT + 1 decoder)")
    tp_size: int = Field(default=4, ge=1)
    capabilities: tuple[str, ...] = Field(default=(), description="e.g. flags this build can honour")
    warm: bool = Field(default=False, description="model loaded and graphs captured: may take sessions")
    started_at: float = Field(default_factory=time.time)


class Assignment(_Strict):
    """Operator -> worker: stream this CharacterSession. `token` is a LiveKit access token (secret)."""

    kind: Literal["assign"] = "assign"
    session_id: SessionId
    namespace: Ident
    pool: Ident
    character: str = Field(min_length=1)
    room: str = Field(min_length=1)
    livekit_url: str = Field(min_length=1)
    agent_identity: str = Field(min_length=1)
    token: SecretStr
    max_duration_s: float = Field(gt=0, le=7 * 24 * 3600)
    flag_overrides: dict[str, FlagValue] = Field(default_factory=dict)
    seed: int = 0
    issued_at: float = Field(default_factory=time.time)

    @field_validator("flag_overrides")
    @classmethod
    def _known_flags(cls, v: dict[str, FlagValue]) -> dict[str, FlagValue]:
        try:
            return validate_flag_updates(v)
        except FlagError as exc:
            raise ValueError(str(exc)) from None

    @field_serializer("token")
    def _token(self, token: SecretStr, info: SerializationInfo) -> str:
        ctx = info.context or {}
        return token.get_secret_value() if ctx.get("reveal_secrets") else str(token)

    def to_wire(self) -> str:
        """JSON for the worker's inbox, WITH the token. Never log this string."""
        return self.model_dump_json(context={"reveal_secrets": True})


class EndRequest(_Strict):
    """Operator -> worker: stop streaming this session (deleted, timed out, max duration)."""

    kind: Literal["end"] = "end"
    session_id: SessionId
    reason: str = Field(default="ended", min_length=1)


InboxMessage = Annotated[Assignment | EndRequest, Field(discriminator="kind")]
INBOX_MESSAGE: TypeAdapter[Assignment | EndRequest] = TypeAdapter(InboxMessage)


class SessionStats(_Tolerant):
    """Worker -> operator: progress of one session (mirrored into CharacterSession .status)."""

    session_id: SessionId
    worker_id: str = ""
    phase: SessionPhase
    fps: float = Field(default=0.0, ge=0, description="average frames per second delivered so far")
    stalls: int = Field(default=0, ge=0, description="times the pacer's buffer ran dry")
    chunk_p99_ms: float = Field(default=0.0, ge=0, description="p99 compute time of one chunk, ms")
    chunks: int = Field(default=0, ge=0)
    streamed_s: float = Field(default=0.0, ge=0, description="seconds of video delivered")
    end_reason: str | None = None
    numerical_fault: bool = Field(default=False, description="NaN/Inf seen in latents or frames")
    flag_version: int = Field(default=0, ge=0, description="pool flag version the latest chunk ran under")
    flags: FlagValues = FlagValues()
    updated_at: float = Field(default_factory=time.time)


class PoolCounts(_Tolerant):
    """A pool's workers as the registry sees them (only workers with a live heartbeat count)."""

    pool: Ident
    registered: int = 0
    loading: int = 0
    idle: int = 0
    busy: int = 0
    draining: int = 0
    dead: int = Field(default=0, description="registered but heartbeat expired, not reaped yet")


def describe_validation_error(exc: ValidationError) -> str:
    """One line per problem, each naming the field path: `room: Field required`."""
    parts = []
    for err in exc.errors():
        loc = [str(p) for p in err.get("loc", ()) if p not in ("assign", "end")]
        parts.append(f"{'.'.join(loc) or '<message>'}: {err['msg']}")
    return "; ".join(parts)
