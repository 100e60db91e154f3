"""The vivant.dev/v1alpha1 custom resources: CharacterSession (`cs`) and WorkerPool (`wp`).

One set of pydantic models is the truth for three consumers:
- `vivant.apis.crdgen` turns them into the CRDs in `crds/` (openAPIV3Schema with bounds, enums,
  patterns and CEL rules), so the API server rejects malformed objects before the operator sees them;
- the operator parses every object it reconciles with them (defence in depth: a CRD installed by hand
  may be older than the operator);
- the session gateway writes CharacterSessions through them, and the worker's reports use the same
  `SessionPhase`.

Also here: the group/version/kind names, the SLO the auto-rollback guards, and `pool_key` (a pool's id
in Redis). The `spec.flags` models are derived from the flag table in `vivant.apis.feature_flags`.

Field names are camelCase in YAML (`alias_generator=to_camel`) and snake_case in Python; specs forbid
unknown fields. Units are in the field names (`...Seconds`, `...Fps`). This module imports neither kopf
nor kubernetes nor torch: it is plain data.

Scale subresource of WorkerPool: `spec.minIdle` is the scaled quantity ("how many warm, idle workers to
keep ready"), `status.idle` is what is there now. A HorizontalPodAutoscaler or `kubectl scale wp/x
--replicas=3` therefore adjusts the warm headroom; the operator still sizes the StatefulSet as
busy + minIdle, capped by `spec.maxWorkers`.
"""

from __future__ import annotations

import re
from datetime import datetime
from enum import StrEnum
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator
from pydantic.alias_generators import to_camel
from vivant.apis.feature_flags import FlagOverrides, PoolFlags

GROUP = "vivant.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"

SESSION_KIND = "CharacterSession"
SESSION_PLURAL = "charactersessions"
SESSION_SINGULAR = "charactersession"
# Not `cs`: that is the built-in ComponentStatus's short name, so `kubectl get cs` would never list sessions.
SESSION_SHORT_NAMES = ("chs",)

POOL_KIND = "WorkerPool"
POOL_PLURAL = "workerpools"
POOL_SINGULAR = "workerpool"
POOL_SHORT_NAMES = ("wp",)

# The SLO the auto-rollback guards (docs/ARCHITECTURE.md, the numbers): a session averages >= 23.5 fps once it streamed >= 1 s.
SLO_MIN_FPS = 23.5
SLO_MIN_STREAMED_SECONDS = 1.0

DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
IDENTIFIER = r"^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"
CONDITION_REASON = r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$"
# A pool's id in Redis and on the command line: `<namespace>/<name>` (pool_key) or a bare `<name>`.
POOL_ID = r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?/)?[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
# LiveKit's own limits on a room name and a participant identity (livekit-server's LimitConfig defaults,
# checked when a participant connects): non-empty, at most 256 bytes of UTF-8. Any characters otherwise.
LIVEKIT_NAME_MAX_BYTES = 256


def _livekit_name(empty: str, too_long: str) -> AfterValidator:
    """LiveKit's own checks, with its own words (livekit-server's ValidateConnectRequest)."""
    def check(value: str) -> str:
        if not value:
            raise ValueError(f"LiveKit refuses it: {empty}")
        lone = next((i for i, ch in enumerate(value) if "\ud800" <= ch <= "\udfff"), None)
        if lone is not None:  # JSON may escape one; UTF-8 cannot hold it (stored, it would become U+FFFD)
            raise ValueError(f"expected valid Unicode text: character {lone} is a lone surrogate "
                             f"(U+{ord(value[lone]):04X}), which UTF-8 cannot encode")
        if len(value.encode("utf-8", "surrogatepass")) > LIVEKIT_NAME_MAX_BYTES:
            raise ValueError(f"LiveKit refuses it: {too_long}: max length {LIVEKIT_NAME_MAX_BYTES} (bytes of UTF-8)")
        return value
    return AfterValidator(check)


# What LiveKit accepts, no more restricted (docs/livekit.md). The schema states the bounds (in characters:
# all a JSON schema can say); the validator checks LiveKit's byte limit and answers with LiveKit's reason.
_LIVEKIT_BOUNDS = Field(json_schema_extra={"minLength": 1, "maxLength": LIVEKIT_NAME_MAX_BYTES})
LiveKitRoomName = Annotated[str, _LIVEKIT_BOUNDS, _livekit_name("no room name", "room name length exceeds limits")]
LiveKitIdentity = Annotated[str, _LIVEKIT_BOUNDS, _livekit_name("identity cannot be empty",
                                                                 "participant identity length exceeds limits")]

# Kubernetes label syntax (what the API server checks on a pod's nodeSelector, tolerations and node affinity).
# A key is an optional DNS-subdomain prefix (<= 253 characters) and `/`, then a name of <= 63 characters
# (the regex bounds the name; the prefix length is a second check, `LABEL_KEY_PREFIX`). A value is empty or
# a name of <= 63 characters.
_LABEL_NAME = r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?"
LABEL_KEY = rf"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?{_LABEL_NAME}$"
LABEL_KEY_PREFIX = r"^([^/]{1,253}/)?[^/]*$"
LABEL_VALUE = rf"^({_LABEL_NAME})?$"
LABEL_KEY_MAX = 253 + 1 + 63

# A WorkerPool's name becomes the name of its StatefulSet, headless Service (an RFC 1035 label: starts with
# a letter, no dots) and PodDisruptionBudget, and the StatefulSet labels each pod with
# `controller-revision-hash: <name>-<hash of up to 10 characters>`, a label value of <= 63 characters.
POOL_NAME = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"
POOL_NAME_MAX = 52
# Every CharacterSession name the API server accepts (a DNS subdomain) is served; see operator/builders.py
# for how a long one still gets a valid token Secret name.
SESSION_NAME_MAX = 253


def _check_label_key_prefix(key: str) -> str:
    if "/" in key and len(key.split("/", 1)[0]) > 253:
        raise ValueError(f"the prefix of label key {key[:40]!r}... is longer than 253 characters")
    return key


def cel_string(text: str) -> str:
    """`text` as a CEL string literal (single quotes; backslashes and quotes escaped)."""
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _cel(rule: str, message: str, field_path: str | None = None) -> dict[str, str]:
    """One CEL rule of a CRD (`x-kubernetes-validations`); `field_path` names the field the error points at."""
    out = {"rule": rule, "message": message}
    if field_path:
        out["fieldPath"] = field_path
    return out


LabelKey = Annotated[
    str,
    Field(min_length=1, max_length=LABEL_KEY_MAX, pattern=LABEL_KEY, description=(
        "A label key: an optional DNS-subdomain prefix (<= 253 characters) and '/', then a name of 1-63 characters "
        "(A-Z, a-z, 0-9, '-', '_', '.'; alphanumeric at both ends)."), json_schema_extra={
        "x-kubernetes-validations": [_cel(f"self.matches({cel_string(LABEL_KEY_PREFIX)})",
                                          "the prefix of a label key (before '/') must be at most 253 characters")]}),
    AfterValidator(_check_label_key_prefix),
]
LabelValue = Annotated[str, Field(max_length=63, pattern=LABEL_VALUE)]
PoolName = Annotated[str, Field(min_length=1, max_length=POOL_NAME_MAX, pattern=POOL_NAME)]


def pool_key(namespace: str, name: str) -> str:
    """The id of a WorkerPool in Redis (registry and flags): `<namespace>/<name>`, unique per cluster."""
    return f"{namespace}/{name}"


class _Model(BaseModel):
    """camelCase on the wire, snake_case in Python; unknown fields and type coercions ("yes" -> True) are errors."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid", strict=True)


class _StatusModel(BaseModel):
    """Status is written by the operator; tolerate fields a newer operator may have added."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore")


# ---------------------------------------------------------------------------------------------- shared


class ConditionStatus(StrEnum):
    TRUE = "True"
    FALSE = "False"
    UNKNOWN = "Unknown"


class Condition(_StatusModel):
    """A Kubernetes-style condition: `type` is CamelCase, `reason` a machine-readable CamelCase word."""

    type: Annotated[str, Field(min_length=1, max_length=64, pattern=CONDITION_REASON)]
    status: ConditionStatus
    reason: Annotated[str, Field(min_length=1, max_length=128, pattern=CONDITION_REASON)]
    message: Annotated[str, Field(max_length=1024)] = ""
    last_transition_time: datetime | None = None
    observed_generation: Annotated[int, Field(ge=0)] | None = None


# ---------------------------------------------------------------------------------------- CharacterSession


class SessionPhase(StrEnum):
    PENDING = "Pending"
    ASSIGNED = "Assigned"
    CONNECTING = "Connecting"
    STREAMING = "Streaming"
    ENDED = "Ended"
    FAILED = "Failed"


TERMINAL_PHASES = frozenset({SessionPhase.ENDED, SessionPhase.FAILED})


class LiveKitTarget(_Model):
    """Where the character appears: a LiveKit server, a room on it and the voice agent it speaks for."""

    url: Annotated[str, Field(min_length=6, max_length=512, pattern=r"^(wss?|https?)://[^\s/]+(/\S*)?$")] = Field(
        description="LiveKit server URL (wss:// or https://)."
    )
    room: LiveKitRoomName = Field(
        description="LiveKit room name the worker joins (what LiveKit accepts: 1..256 bytes of UTF-8)."
    )
    agent_identity: LiveKitIdentity = Field(
        description="Identity of the voice agent the avatar publishes on behalf of (1..256 bytes of UTF-8)."
    )
    token_secret: Annotated[str, Field(min_length=1, max_length=253, pattern=DNS_LABEL)] | None = Field(
        default=None,
        description="Optional: name of a Secret (same namespace) whose key `token` holds a LiveKit token the "
        "caller minted for the avatar (session API path). Unset: the operator mints the worker's token.",
    )


class CharacterSessionSpec(_Model):
    character: Annotated[str, Field(min_length=1, max_length=128, pattern=IDENTIFIER)] = Field(
        description="Character (model/avatar) id the worker renders."
    )
    pool: PoolName = Field(description="Name of the WorkerPool (same namespace) that serves this session.")
    livekit: LiveKitTarget
    max_duration_seconds: Annotated[int, Field(ge=10, le=86_400)] = Field(
        default=1800, description="The session is ended after this many seconds of wall time since assignment."
    )
    flags: FlagOverrides | None = None


class CharacterSessionStatus(_StatusModel):
    phase: SessionPhase = SessionPhase.PENDING
    worker: Annotated[str, Field(max_length=253)] | None = None
    node: Annotated[str, Field(max_length=253)] | None = None
    message: Annotated[str, Field(max_length=1024)] | None = None
    conditions: list[Condition] = Field(default_factory=list)
    assigned_at: datetime | None = None
    started_at: datetime | None = None
    ended_at: datetime | None = None
    avg_fps: Annotated[float, Field(ge=0)] | None = None
    stalls: Annotated[int, Field(ge=0)] | None = None
    chunk_p99_ms: Annotated[float, Field(ge=0)] | None = None
    numerical_fault: bool | None = Field(
        default=None, description="True once the worker made a chunk with NaN/Inf latents for this session (the model "
        "restarted after it and the stream went on; a NumericalFault Event says when)."
    )
    token_secret: Annotated[str, Field(max_length=253)] | None = Field(
        default=None, description="Name of the Secret holding the session's LiveKit token (never the token)."
    )
    observed_generation: Annotated[int, Field(ge=0)] | None = None


# ---------------------------------------------------------------------------------------------- WorkerPool


class ModelSource(_Model):
    preset: Literal["tiny", "57b"] = Field(description="Model shape preset (docs/ARCHITECTURE.md, the numbers).")
    checkpoint: Annotated[str, Field(min_length=2, max_length=1024, pattern=r"^(/|[a-z][a-z0-9+.-]*://)\S+$")] = Field(
        description="Where the safetensors checkpoint lies: an absolute path in the image/volume or a URI."
    )


class Toleration(_Model):
    """A pod toleration; the API server's rules for it are checked here and by the CRD (CEL)."""

    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": [
        _cel("(has(self.key) && self.key != '') || self.operator == 'Exists'",
             "operator must be Exists when key is empty (a toleration of every taint)", ".operator"),
        _cel("self.operator != 'Exists' || !has(self.value) || self.value == ''",
             "value must be empty when operator is Exists", ".value"),
        _cel("!has(self.tolerationSeconds) || (has(self.effect) && self.effect == 'NoExecute')",
             "tolerationSeconds needs effect NoExecute", ".tolerationSeconds"),
    ]})

    key: LabelKey | None = None
    operator: Literal["Exists", "Equal"] = "Equal"
    value: LabelValue | None = None
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    toleration_seconds: Annotated[int, Field(ge=0, le=2**31 - 1)] | None = None

    @model_validator(mode="after")
    def _check_rules(self) -> Toleration:
        if not self.key and self.operator != "Exists":
            raise ValueError("operator must be Exists when key is empty (a toleration of every taint)")
        if self.operator == "Exists" and self.value:
            raise ValueError(f"value must be empty when operator is Exists, got value {self.value!r}")
        if self.toleration_seconds is not None and self.effect != "NoExecute":
            raise ValueError(f"tolerationSeconds needs effect NoExecute, got effect {self.effect!r}")
        return self


INTEGER = r"^[0-9]{1,18}$"  # a label value too, so no sign


class NodeSelectorRequirement(_Model):
    """One node-affinity expression; `values` as the API server wants them for each operator."""

    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": [
        _cel("!(self.operator in ['In', 'NotIn']) || (has(self.values) && size(self.values) >= 1)",
             "values must hold at least one value when operator is In or NotIn", ".values"),
        _cel("!(self.operator in ['Exists', 'DoesNotExist']) || !has(self.values) || size(self.values) == 0",
             "values must be empty when operator is Exists or DoesNotExist", ".values"),
        _cel(f"!(self.operator in ['Gt', 'Lt']) || (has(self.values) && size(self.values) == 1 "
             f"&& self.values[0].matches({cel_string(INTEGER)}))",
             "values must hold exactly one integer when operator is Gt or Lt", ".values"),
    ]})

    key: LabelKey
    operator: Literal["In", "NotIn", "Exists", "DoesNotExist", "Gt", "Lt"]
    values: list[LabelValue] | None = Field(default=None, max_length=64)

    @model_validator(mode="after")
    def _check_values(self) -> NodeSelectorRequirement:
        n = len(self.values or [])
        if self.operator in ("In", "NotIn") and n < 1:
            raise ValueError(f"values must hold at least one value when operator is {self.operator}")
        if self.operator in ("Exists", "DoesNotExist") and n:
            raise ValueError(f"values must be empty when operator is {self.operator}, got {self.values}")
        if self.operator in ("Gt", "Lt") and (n != 1 or not re.match(INTEGER, self.values[0])):
            raise ValueError(f"values must hold exactly one integer when operator is {self.operator}, got {self.values}")
        return self


class NodeSelectorTerm(_Model):
    match_expressions: list[NodeSelectorRequirement] = Field(min_length=1, max_length=16)


class PreferredTerm(_Model):
    weight: Annotated[int, Field(ge=1, le=100)]
    preference: NodeSelectorTerm


class NodeAffinity(_Model):
    """The node-affinity subset a GPU pool needs (required terms, weighted preferences)."""

    required: list[NodeSelectorTerm] | None = Field(
        default=None, max_length=16,
        description="requiredDuringSchedulingIgnoredDuringExecution node selector terms (ORed).",
    )
    preferred: list[PreferredTerm] | None = Field(
        default=None, max_length=16, description="preferredDuringSchedulingIgnoredDuringExecution terms."
    )


class WorkerPoolSpec(_Model):
    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                _cel("self.minIdle <= self.maxWorkers", "minIdle must be <= maxWorkers", ".minIdle"),
                _cel("(self.gpusPerWorker - 1) % self.tensorParallel == 0",
                     "tensorParallel must divide the DiT GPU count (gpusPerWorker - 1; one GPU decodes)", ".tensorParallel"),
            ]
        }
    )

    model: ModelSource
    image: Annotated[str, Field(min_length=1, max_length=512, pattern=r"^[^\s]+$")] = Field(
        description="Worker container image."
    )
    gpus_per_worker: Annotated[int, Field(ge=2, le=16)] = Field(
        default=5, description="GPUs per worker: tensor-parallel DiT GPUs + 1 decoder GPU."
    )
    tensor_parallel: Literal[1, 2, 4, 8] = Field(default=4, description="Tensor-parallel degree of the DiT.")
    node_selector: dict[LabelKey, LabelValue] | None = Field(
        default=None, max_length=32, description="Node labels the worker pods must match (label syntax)."
    )
    tolerations: list[Toleration] | None = Field(default=None, max_length=32)
    affinity: NodeAffinity | None = None
    runner: Literal["livekit", "pipeline"] = Field(
        default="livekit",
        description="What serves a session: livekit = join the session's LiveKit room as the avatar (production); "
        "pipeline = generate, decode and pace frames into a null sink (trials without a LiveKit server).",
    )
    min_idle: Annotated[int, Field(ge=0, le=256)] = Field(
        default=1, description="Warm idle workers to keep ready (the scale subresource's replicas)."
    )
    max_workers: Annotated[int, Field(ge=1, le=256)] = Field(description="Upper bound on workers (pods) in the pool.")
    flags: PoolFlags = Field(default_factory=PoolFlags)

    @model_validator(mode="after")
    def _check_bounds(self) -> WorkerPoolSpec:
        if self.min_idle > self.max_workers:
            raise ValueError(f"minIdle ({self.min_idle}) must be <= maxWorkers ({self.max_workers})")
        if (self.gpus_per_worker - 1) % self.tensor_parallel != 0:
            raise ValueError(
                f"tensorParallel ({self.tensor_parallel}) must divide the DiT GPU count "
                f"gpusPerWorker - 1 = {self.gpus_per_worker - 1}"
            )
        return self


class WorkerPoolStatus(_StatusModel):
    replicas: Annotated[int, Field(ge=0)] = 0
    ready: Annotated[int, Field(ge=0)] = 0
    idle: Annotated[int, Field(ge=0)] = 0
    busy: Annotated[int, Field(ge=0)] = 0
    starting: Annotated[int, Field(ge=0)] = Field(default=0, description="Workers registered but still warming up.")
    draining: Annotated[int, Field(ge=0)] = 0
    selector: Annotated[str, Field(max_length=512)] | None = Field(
        default=None, description="Label selector of the pool's pods (for the scale subresource)."
    )
    flag_version: Annotated[int, Field(ge=0)] | None = None
    flags: dict[str, bool] | None = Field(default=None, description="Flags in force in Redis (what workers apply).")
    flags_applied_generation: Annotated[int, Field(ge=0)] | None = Field(
        default=None,
        description="metadata.generation whose spec.flags were last written to Redis; the spec is re-applied "
        "only when the generation changes, so CLI and automatic rollbacks stick until the spec is edited.",
    )
    conditions: list[Condition] = Field(default_factory=list)
    observed_generation: Annotated[int, Field(ge=0)] | None = None


# ---------------------------------------------------------------------------------------- whole objects


class ObjectMeta(BaseModel):
    """The part of metadata the models check; the API server owns the rest."""

    model_config = ConfigDict(extra="allow")

    name: Annotated[str, Field(min_length=1, max_length=SESSION_NAME_MAX, pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")]
    namespace: str | None = None


class PoolMeta(ObjectMeta):
    """A WorkerPool's metadata: its name must also make a valid StatefulSet, Service and pod labels."""

    name: PoolName


# CEL at the root of the WorkerPool schema: the only place a CRD can check metadata.name.
POOL_NAME_RULES = [
    _cel(f"self.metadata.name.size() <= {POOL_NAME_MAX}",
         f"a WorkerPool name must be at most {POOL_NAME_MAX} characters (the StatefulSet's controller-revision-hash "
         "label is the name plus up to 11 characters, at most 63)", ".metadata.name"),
    _cel(f"self.metadata.name.matches({cel_string(POOL_NAME)})",
         "a WorkerPool name must start with a letter and hold only a-z, 0-9 and '-' (it names a Service)",
         ".metadata.name"),
]


class CharacterSession(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid")

    api_version: Literal["vivant.dev/v1alpha1"] = API_VERSION
    kind: Literal["CharacterSession"] = SESSION_KIND
    metadata: ObjectMeta
    spec: CharacterSessionSpec
    status: CharacterSessionStatus | None = None


class WorkerPool(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid",
                              json_schema_extra={"x-kubernetes-validations": POOL_NAME_RULES})

    api_version: Literal["vivant.dev/v1alpha1"] = API_VERSION
    kind: Literal["WorkerPool"] = POOL_KIND
    metadata: PoolMeta
    spec: WorkerPoolSpec
    status: WorkerPoolStatus | None = None
