"""Live feature flags per worker pool, in Redis, versioned, with history and a change channel.

Why: a risky fast path (the GEMM fused with the tensor-parallel all-reduce) must be switchable on a
running fleet without restarts, and switchable back in one command when it misbehaves. Workers poll
the version at every chunk boundary (one GET, ~0.1 ms) and apply a change between chunks, never
inside one. The WorkerPool spec drives the flags on reconcile; `vivant flags set` is the emergency
path; both write through `FlagStore.set`, which records who, when, old -> new and why.

Keys for pool P (prefix `vivant:`):
  flags:P            hash    flag name -> JSON value (only flags ever set; defaults fill the rest)
  flags:P:version    string  integer, bumped once per effective change (0 = never set)
  flags:P:meta       hash    updated_by, updated_at (unix s)
  flags:P:history    stream  one entry per change: version, actor, at, reason, changes JSON {name: [old, new]}
  channel vivant:flags:P:changed   published with the new version after each change
"""

from __future__ import annotations

import json
import re
import time
from typing import Any

import redis
from vivant.apis.feature_flags import FlagError, FlagValue, FlagValues, validate_flag_updates
from vivant.apis.resources import POOL_ID
from vivant.sessions.models import FlagChange, FlagSet
from vivant.sessions.registry import PREFIX, guarded, redis_client

HISTORY_MAXLEN = 1000

# KEYS: values hash, version, meta hash, history stream. ARGV: actor, at, reason, channel, maxlen,
# defaults JSON, then name, json value pairs. Returns {version, changed (0|1), values (flat name, json
# pairs), updated_by, updated_at}: the pool's state as this very write left it, read in the same atomic
# step, so a concurrent writer's version or author is never reported as ours.
_SET_FLAGS = """
local defaults = cjson.decode(ARGV[6])
local changes = {}
local changed = false
for i = 7, #ARGV, 2 do
  local name, new = ARGV[i], ARGV[i + 1]
  local old = redis.call('HGET', KEYS[1], name)
  if not old then old = defaults[name] end
  if old ~= new then
    changes[name] = {old, new}
    changed = true
    redis.call('HSET', KEYS[1], name, new)
  end
end
local version = tonumber(redis.call('GET', KEYS[2]) or '0')
if changed then
  version = redis.call('INCR', KEYS[2])
  redis.call('HSET', KEYS[3], 'updated_by', ARGV[1], 'updated_at', ARGV[2])
  redis.call('XADD', KEYS[4], 'MAXLEN', '~', ARGV[5], '*', 'version', version, 'actor', ARGV[1], 'at', ARGV[2],
             'reason', ARGV[3], 'changes', cjson.encode(changes))
  redis.call('PUBLISH', ARGV[4], version)
end
local meta = redis.call('HMGET', KEYS[3], 'updated_by', 'updated_at')
return {version, changed and 1 or 0, redis.call('HGETALL', KEYS[1]), meta[1] or '', meta[2] or '0'}
"""


def _dec(x: bytes | str) -> str:
    return x.decode() if isinstance(x, bytes) else x


def check_pool(pool: str) -> str:
    """A pool id as the registry and the operator write it: `<namespace>/<name>` or `<name>`, DNS labels.
    Raises FlagError naming the field before anything is read or written."""
    if not isinstance(pool, str) or not re.fullmatch(POOL_ID, pool) or len(pool) > 127:
        raise FlagError(f"pool: expected <namespace>/<name> or <name>, each a DNS label (lowercase letters, digits, "
                        f"'-'), got {pool!r}")
    return pool


def _values(flat: list[bytes | str]) -> FlagValues:
    values = {_dec(flat[i]): json.loads(flat[i + 1]) for i in range(0, len(flat), 2)}
    return FlagValues.model_validate({k: v for k, v in values.items() if k in FlagValues.model_fields})


class FlagStore:
    """Read and change pools' flags. Raises RegistryUnavailable when Redis is down, FlagError on an
    unknown flag name or a value of the wrong type (nothing is written then)."""

    def __init__(self, redis_: str | redis.Redis, *, prefix: str = PREFIX) -> None:
        self.redis = redis_client(redis_) if isinstance(redis_, str) else redis_
        self.prefix = prefix
        self._set = self.redis.register_script(_SET_FLAGS)

    def _k(self, pool: str, what: str = "") -> str:
        return f"{self.prefix}flags:{pool}" + (f":{what}" if what else "")

    def channel(self, pool: str) -> str:
        """Pub/sub channel announcing each new version of `pool`'s flags."""
        return self._k(pool, "changed")

    @guarded
    def version(self, pool: str) -> int:
        """The current version (one GET): cheap enough to call at every chunk boundary."""
        return int(self.redis.get(self._k(pool, "version")) or 0)

    @guarded
    def get(self, pool: str) -> FlagSet:
        check_pool(pool)
        pipe = self.redis.pipeline(transaction=True)
        pipe.hgetall(self._k(pool))
        pipe.get(self._k(pool, "version"))
        pipe.hgetall(self._k(pool, "meta"))
        raw_values, version, meta = pipe.execute()
        values = {_dec(k): json.loads(v) for k, v in raw_values.items()}
        known = {k: v for k, v in values.items() if k in FlagValues.model_fields}  # a removed flag is ignored
        meta = {_dec(k): _dec(v) for k, v in meta.items()}
        return FlagSet(
            pool=pool,
            version=int(version or 0),
            values=FlagValues.model_validate(known),
            updated_by=meta.get("updated_by", ""),
            updated_at=float(meta.get("updated_at", 0.0)),
        )

    @guarded
    def set(self, pool: str, updates: dict[str, Any], actor: str, reason: str = "") -> FlagSet:
        """Change some flags of `pool` atomically: one version bump, one history entry, one publish.
        The pool id and the values are validated first (strings like "false" are accepted for bool
        flags); nothing is written when one is wrong. Setting values equal to the current ones changes
        nothing (no new version). Returns the pool's flags as this write left them."""
        return self.write(pool, updates, actor, reason)[0]

    @guarded
    def write(self, pool: str, updates: dict[str, Any], actor: str, reason: str = "") -> tuple[FlagSet, bool]:
        """`set`, also telling whether this write changed anything; both read in the write's own atomic
        step, so a concurrent writer's version or author is never reported as this one's."""
        check_pool(pool)
        if not actor:
            raise ValueError("actor: expected who is changing the flags (e.g. user@host), got an empty string")
        if not updates:
            raise ValueError("updates: expected at least one flag=value")
        clean = validate_flag_updates(updates)
        defaults = {name: json.dumps(f.default) for name, f in FlagValues.model_fields.items()}
        args: list[Any] = [actor, repr(time.time()), reason, self.channel(pool), HISTORY_MAXLEN, json.dumps(defaults)]
        for name, value in clean.items():
            args += [name, json.dumps(value)]
        version, changed, flat, updated_by, updated_at = self._set(
            keys=[self._k(pool), self._k(pool, "version"), self._k(pool, "meta"), self._k(pool, "history")], args=args)
        flagset = FlagSet(pool=pool, version=int(version), values=_values(flat), updated_by=_dec(updated_by),
                          updated_at=float(_dec(updated_at)))
        return flagset, bool(changed)

    @guarded
    def history(self, pool: str, n: int = 20) -> list[FlagChange]:
        """The newest `n` changes of `pool`'s flags, newest first."""
        check_pool(pool)
        out = []
        for _id, fields in self.redis.xrevrange(self._k(pool, "history"), count=n):
            f = {_dec(k): _dec(v) for k, v in fields.items()}
            changes: dict[str, tuple[FlagValue, FlagValue]] = {
                name: (json.loads(old), json.loads(new)) for name, (old, new) in json.loads(f["changes"]).items()
            }
            out.append(FlagChange(pool=pool, version=int(f["version"]), actor=f["actor"], at=float(f["at"]),
                                  reason=f.get("reason", ""), changes=changes))
        return out


class FlagWatcher:
    """What a worker polls at each chunk boundary: `changed_since(v)` costs one GET when nothing changed."""

    def __init__(self, store: FlagStore, pool: str) -> None:
        self.store = store
        self.pool = pool

    def current(self) -> FlagSet:
        return self.store.get(self.pool)

    def changed_since(self, version: int) -> FlagSet | None:
        """The pool's flags if their version differs from `version`, else None. Raises
        RegistryUnavailable when Redis is down (a worker keeps its current flags then)."""
        if self.store.version(self.pool) == version:
            return None
        return self.store.get(self.pool)
