"""The one table of live feature flags, and the three models derived from it.

A flag is a name (the one users type: `vivant flags set`, WorkerPool and CharacterSession
`spec.flags`, the Redis hash), a type (bool, int or str), a default (the conservative path) and a
description. **Add a flag by adding one `Flag` row to `FLAGS`**: `make crds` carries it into both
CRDs, and the Redis store, the CLI, the operator and the workers learn it from the models below.

Derived from `FLAGS` (by `flag_models`; the field names are the flag names, so `model_dump()` and
the CRD's property names are the same):

| model | where | shape |
|---|---|---|
| `PoolFlags` | WorkerPool `spec.flags` | every flag, with its default; unknown names and coercions ("yes" → True) are errors |
| `FlagOverrides` | CharacterSession `spec.flags` | every flag optional; an unset one inherits the pool's value |
| `FlagValues` | Redis (`vivant.sessions.flags`), what workers apply | every flag with its default; frozen; names unknown to this version are ignored (a newer operator may have added a flag) |

`validate_flag_updates` checks user input against the table (CLI, per-session overrides) and names
the flag in its error. This module imports nothing of vivant.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, NamedTuple

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, create_model

FlagValue = bool | int | str
FLAG_NAME = r"^[a-z][A-Za-z0-9]{0,62}$"

# Names other modules act on by themselves (the operator's auto-rollback, the pool's printer column).
FUSED_GEMM_ALL_REDUCE = "fusedGemmAllReduce"


@dataclass(frozen=True)
class Flag:
    """One row of the flag table: `name` (lowerCamelCase, as typed by users), `type`, `default`, `description`."""

    name: str
    type: type
    default: FlagValue
    description: str

    def __post_init__(self) -> None:
        if not re.fullmatch(FLAG_NAME, self.name):
            raise ValueError(f"flag name {self.name!r}: expected lowerCamelCase letters and digits, at most 63")
        if hasattr(BaseModel, self.name):
            raise ValueError(f"flag name {self.name!r}: clashes with a pydantic BaseModel attribute")
        if self.type not in (bool, int, str):
            raise ValueError(f"flag {self.name!r}: type must be bool, int or str, got {self.type!r}")
        if type(self.default) is not self.type:
            raise ValueError(
                f"flag {self.name!r}: default {self.default!r} is a {type(self.default).__name__}, expected {self.type.__name__}"
            )
        if not self.description.strip():
            raise ValueError(f"flag {self.name!r}: description must say what the flag switches")


FLAGS: tuple[Flag, ...] = (
    Flag(
        name=FUSED_GEMM_ALL_REDUCE,
        type=bool,
        default=False,
        description="Use the GEMM fused with the tensor-parallel all-reduce (faster path).",
    ),
)


class _SpecFlags(BaseModel):
    """Base of the CRD flag models: unknown names and type coercions are errors (user input)."""

    model_config = ConfigDict(extra="forbid", strict=True)


class _StoredFlags(BaseModel):
    """Base of the Redis flag model: tolerant of names a newer version added; immutable once read."""

    model_config = ConfigDict(extra="ignore", frozen=True)


class FlagModels(NamedTuple):
    """The three models of one flag table (see the module doc)."""

    pool: type[BaseModel]
    overrides: type[BaseModel]
    values: type[BaseModel]


def flag_models(flags: tuple[Flag, ...]) -> FlagModels:
    """Build `PoolFlags`, `FlagOverrides` and `FlagValues` from a flag table (field order = table order)."""
    names = [f.name for f in flags]
    if len(set(names)) != len(names):
        raise ValueError(f"flag table: duplicate names in {names}")
    pool = create_model(
        "PoolFlags",
        __base__=_SpecFlags,
        __module__=__name__,
        __doc__="Live feature flags of a pool, applied by workers at the next chunk boundary (no restart).",
        **{f.name: (f.type, Field(default=f.default, description=f.description)) for f in flags},
    )
    overrides = create_model(
        "FlagOverrides",
        __base__=_SpecFlags,
        __module__=__name__,
        __doc__="Per-session overrides of pool flags; an unset field inherits the pool's value.",
        **{f.name: (f.type | None, None) for f in flags},
    )
    values = create_model(
        "FlagValues",
        __base__=_StoredFlags,
        __module__=__name__,
        __doc__="Live feature flags of a worker pool as stored in Redis and applied by workers.",
        **{f.name: (f.type, Field(default=f.default, description=f.description)) for f in flags},
    )
    return FlagModels(pool, overrides, values)


PoolFlags, FlagOverrides, FlagValues = flag_models(FLAGS)
KNOWN_FLAGS: dict[str, type] = {f.name: f.type for f in FLAGS}


class FlagError(ValueError):
    """A flag update names an unknown flag or gives a value of the wrong type."""


def validate_flag_updates(updates: dict[str, Any]) -> dict[str, FlagValue]:
    """Check names and coerce values ("false" -> False for bool flags). Raises FlagError naming the flag."""
    unknown = sorted(set(updates) - set(KNOWN_FLAGS))
    if unknown:
        raise FlagError(f"unknown flag(s) {', '.join(map(repr, unknown))}; known flags: {', '.join(KNOWN_FLAGS)}")
    out: dict[str, FlagValue] = {}
    for name, raw in updates.items():
        kind = KNOWN_FLAGS[name]
        try:
            value = TypeAdapter(kind).validate_python(raw, strict=False)
        except ValidationError as exc:
            raise FlagError(
                f"flag {name!r}: expected {kind.__name__}, got {raw!r} ({exc.errors()[0]['msg']})"
            ) from None
        if kind is int and isinstance(value, bool):
            raise FlagError(f"flag {name!r}: expected int, got {raw!r}")
        out[name] = value
    return out
