"""Configuration of `vivant api` (gateway/server.py): avatars, limits, API keys. Frozen where it is read
once; the keys are re-read from their mounted Secret file when it changes (a rotation needs no restart).

The avatars file is YAML: `{avatars: {<id>: {character, pool}}, defaultMaxDurationS?, retryAfterS?,
limits?}`; `limits` holds `ApiLimits` in camelCase (load shedding and fault handling, seconds and counts).
"""

from __future__ import annotations

import hmac
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path

import pydantic
import yaml
from vivant.apis import resources

log = logging.getLogger(__name__)

KEY_COMMENT = re.compile(r"\s#")  # a comment after a key: whitespace, then '#'


class AvatarEntry(pydantic.BaseModel):
    """What an avatar id of the API means here: which character the worker renders, in which pool."""

    model_config = pydantic.ConfigDict(extra="forbid", strict=True)
    character: str = pydantic.Field(min_length=1, max_length=128, pattern=resources.IDENTIFIER)
    pool: resources.PoolName  # the name rule of WorkerPools (apis/resources.py)


class ApiLimits(pydantic.BaseModel):
    """Load shedding and fault handling (seconds, counts); YAML key `limits` of the avatars file."""

    model_config = pydantic.ConfigDict(extra="forbid", alias_generator=pydantic.alias_generators.to_camel,
                                       populate_by_name=True, frozen=True)
    max_in_flight_creates: int = pydantic.Field(default=8, ge=1, le=1024)
    max_queued_creates: int = pydantic.Field(default=32, ge=0, le=100_000)
    max_in_flight_reads: int = pydantic.Field(default=8, ge=1, le=1024)
    max_queued_reads: int = pydantic.Field(default=64, ge=0, le=100_000)
    queue_timeout_s: float = pydantic.Field(default=10.0, gt=0, le=600)
    header_timeout_s: float = pydantic.Field(default=10.0, gt=0, le=600, description="a connection's request line "
                                             "and headers must arrive within this, else it is closed")
    body_timeout_s: float = pydantic.Field(default=10.0, gt=0, le=600, description="a request body must arrive "
                                           "within this, else 408")
    kube_timeout_s: float = pydantic.Field(default=10.0, gt=0, le=600, description="one Kubernetes call")
    kube_attempts: int = pydantic.Field(default=3, ge=1, le=10, description="tries of one call on a transient error")
    claim_grace_s: float = pydantic.Field(default=60.0, gt=0, description="a slot claimed by a request that made "
                                          "no session is free again after this")
    orphan_grace_s: float = pydantic.Field(default=60.0, gt=0, description="a session whose token Secret never "
                                           "arrived is deleted after this")
    janitor_interval_s: float = pydantic.Field(default=15.0, gt=0)


class ApiConfig(pydantic.BaseModel):
    """Typed configuration of one API server (one namespace)."""

    model_config = pydantic.ConfigDict(extra="forbid")
    namespace: str = pydantic.Field(min_length=1, max_length=63, pattern=resources.DNS_LABEL)
    avatars: dict[str, AvatarEntry]
    default_max_duration_s: int = pydantic.Field(default=1800, ge=10, le=86_400)
    retry_after_s: int = pydantic.Field(default=5, ge=1, le=3600)
    limits: ApiLimits = ApiLimits()

    @classmethod
    def from_file(cls, path: Path, namespace: str) -> ApiConfig:
        """Avatars file: YAML `{avatars: {<id>: {character, pool}}, defaultMaxDurationS?, retryAfterS?, limits?}`."""
        raw = yaml.safe_load(Path(path).read_text()) or {}
        if not isinstance(raw, dict):
            raise ValueError(f"{path}: expected a mapping with key 'avatars', got {type(raw).__name__}")
        return cls(namespace=namespace, avatars=raw.get("avatars") or {},
                   default_max_duration_s=raw.get("defaultMaxDurationS", 1800),
                   retry_after_s=raw.get("retryAfterS", 5), limits=ApiLimits.model_validate(raw.get("limits") or {}))


@dataclass
class ApiKeys:
    """Bearer keys from a mounted Secret file (re-read on change) and/or a list given at start."""

    path: Path | None = None
    static: tuple[str, ...] = ()
    _mtime: float | None = field(default=None, init=False)
    _from_file: tuple[str, ...] = field(default=(), init=False)

    def __repr__(self) -> str:
        return f"ApiKeys(path={self.path!r}, keys=<{len(self.current())} hidden>)"

    @staticmethod
    def parse(text: str, source: str = "API keys") -> tuple[str, ...]:
        """Keys of a keys file: one per line, a key holds no whitespace; `#` starts a comment at the start of a
        line or after whitespace (`key  # who uses it`). Raises ValueError naming the line otherwise."""
        keys = []
        for number, line in enumerate(text.splitlines(), 1):
            content = KEY_COMMENT.split(line, maxsplit=1)[0].strip()
            if content.startswith("#"):
                continue
            if len(content.split()) > 1:
                raise ValueError(f"{source}: line {number}: expected one key (no spaces inside), optionally "
                                 "followed by whitespace and '# comment'")
            if content:
                keys.append(content)
        return tuple(keys)

    def current(self) -> tuple[str, ...]:
        if self.path is not None:
            try:
                mtime = self.path.stat().st_mtime
            except OSError:
                log.error("API keys file %s is unreadable; no key from it is accepted", self.path)
                self._from_file, self._mtime = (), None
            else:
                if mtime != self._mtime:
                    try:
                        self._from_file = self.parse(self.path.read_text(), str(self.path))
                    except (OSError, ValueError) as exc:
                        log.error("API keys file unusable; no key from it is accepted: %s", exc)
                        self._from_file = ()
                    self._mtime = mtime
        return self.static + self._from_file

    def accepts(self, presented: str) -> bool:
        """Constant time against every key; `presented` may hold any characters (it is compared as bytes)."""
        given = presented.encode("utf-8", "surrogateescape")
        ok = False
        for key in self.current():
            ok |= hmac.compare_digest(key.encode("utf-8", "surrogateescape"), given)
        return ok
