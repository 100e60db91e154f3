"""Redis session registry: warm workers, their leases, inboxes and per-session stats.

Why Redis and Lua: several operator replicas (or an operator and its restarted self) may claim workers
at the same time; every state change that must not interleave — claim, release, register, reap — is ONE
Lua script (`registry_lua.py`), which Redis runs atomically. A worker never holds two sessions and a
session never has two workers. (Scripts build key names from a prefix, so this needs a single Redis or Sentinel, not Cluster.)

Key layout (prefix `vivant:`), per pool P and worker W, session S:
  pool:P:workers   set    registered workers of P (alive or not yet reaped)
  pool:P:warm      set    workers whose model is loaded (may take sessions)
  pool:P:idle      set    warm, free, not draining: claimable
  pool:P:busy      hash   W -> S  (the lease)
  pool:P:draining  set    workers to take no new sessions (scale-down)
  pool:P:worker_failures hash  fault | lost -> workers that stopped on a fault (deregistered, failed) | were reaped
  worker_pool      hash   W -> P
  session_worker   hash   S -> W
  worker:W         string WorkerInfo JSON
  worker:W:hb      string heartbeat, expires after heartbeat_ttl_s; value = the worker's stats JSON
  worker_seen      hash   W -> Redis time (ms) of its last registration or heartbeat
  worker:W:inbox   list   Assignment / EndRequest JSON, operator RPUSHes, worker LMOVEs ->
  worker:W:processing list  popped but not yet acknowledged (requeued if the worker restarts)
  session:S:stats  string SessionStats JSON (kept a day)
  session:S:lost   string why a session lost its worker (heartbeat expired, worker restarted), kept a day
  deadletter       list   malformed inbox messages with the error that rejected them (newest first)
  deadletter_total string how many were ever rejected (the list is capped at DEADLETTER_MAX)

Outages: every public method raises `RegistryUnavailable` (wrapping redis' ConnectionError/TimeoutError)
when Redis cannot be reached; callers decide to retry (operator) or carry on (a streaming worker).

Alive vs dead (docs/reliability.md): the heartbeat key (TTL `heartbeat_ttl_s`) decides who may be
*claimed*; a worker is *reaped* (its session failed) only once it has been silent for `reap_grace_s`,
and silence is counted from the latest of its last heartbeat, the moment Redis last started (a restart,
persisted or empty) and the moment this client last regained Redis after failing to reach it. So an
outage of Redis, or between the operator and Redis, never fails a session by itself: the workers, which
kept streaming, get `reap_grace_s` of reachable Redis to heartbeat again. A Redis restarted empty is
rebuilt from what the workers know (`register` with the session they stream) and what the CRs know
(`restore_lease`, called by the operator for a session whose status names its worker).
"""

from __future__ import annotations

import functools
import json
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, ParamSpec, TypeVar

import redis
from pydantic import ValidationError
from redis.backoff import ExponentialBackoff
from redis.retry import Retry
from vivant.sessions import registry_lua as lua
from vivant.sessions.models import (
    INBOX_MESSAGE,
    Assignment,
    EndRequest,
    PoolCounts,
    SessionStats,
    WorkerInfo,
    describe_validation_error,
)

log = logging.getLogger(__name__)

PREFIX = "vivant:"
SESSION_RECORD_TTL_S = 24 * 3600
WORKER_FAILURE_KINDS = ("fault", "lost")  # Registry.worker_failures
DEADLETTER_MAX = 10_000
MAX_BLOCK_S = 5.0  # longest single blocking inbox wait; keeps it under the client's socket timeout

P = ParamSpec("P")
T = TypeVar("T")


@dataclass(frozen=True)
class SessionObservation:
    """One session as Redis holds it: the worker's last report, why it lost its worker (if it did) and
    the worker holding its lease now (None = no lease)."""

    stats: SessionStats | None
    lost: str | None
    holder: str | None


class RegistryUnavailable(RuntimeError):
    """Redis could not be reached (connection refused, reset, timed out). Safe to retry."""


class SessionConflict(RuntimeError):
    """A session id is already held by a worker of another pool."""


def redis_client(url: str) -> redis.Redis:
    """A client tuned for the control plane: fail fast when Redis is down (one quick reconnect try
    for a stale pooled connection, then `RegistryUnavailable`), never hang forever."""
    return redis.Redis.from_url(
        url,
        socket_connect_timeout=2.0,
        socket_timeout=MAX_BLOCK_S + 5.0,
        retry=Retry(ExponentialBackoff(cap=0.1, base=0.01), 1),
        health_check_interval=0,
    )


def guarded(fn: Callable[P, T]) -> Callable[P, T]:
    """Turn redis' connection-level errors into RegistryUnavailable (keeps the cause). An object with a
    `last_unavailable` attribute has it set to the monotonic time of the failure."""

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> T:
        try:
            return fn(*args, **kwargs)
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            if args and hasattr(args[0], "last_unavailable"):
                args[0].last_unavailable = time.monotonic()  # type: ignore[attr-defined]
            raise RegistryUnavailable(f"redis unavailable during {fn.__name__}: {exc}") from exc

    return wrapper


def _s(value: bytes | str | None) -> str | None:
    if value is None:
        return None
    return value.decode() if isinstance(value, bytes) else value


def _redact_token(text: str) -> str:
    """A rejected message may still carry a LiveKit token: keep everything but its value."""
    try:
        body = json.loads(text)
    except ValueError:
        return text
    if isinstance(body, dict) and "token" in body:
        body["token"] = "**********"
        return json.dumps(body)
    return text


class Registry:
    """The session registry. One instance per process is enough; it is thread-safe (redis-py pools
    connections), so a worker's heartbeat thread and its main loop may share it.

    `redis`: a URL (a fail-fast client is built, see `redis_client`) or a ready `redis.Redis`.
    `heartbeat_ttl_s`: a worker whose heartbeat is older than this is not claimed; it beats every ttl/3.
    `reap_grace_s`: a worker silent this long while Redis was reachable is dead (its session failed);
    at least `heartbeat_ttl_s`, which is the default (the operator configures 30 s). Outages of Redis
    shorter than it, and restarts of Redis after any outage, lose no session (docs/reliability.md).
    """

    def __init__(self, redis_: str | redis.Redis, *, heartbeat_ttl_s: float = 10.0, reap_grace_s: float | None = None,
                 prefix: str = PREFIX) -> None:
        if heartbeat_ttl_s <= 0:
            raise ValueError(f"heartbeat_ttl_s: expected > 0 seconds, got {heartbeat_ttl_s}")
        reap_grace_s = heartbeat_ttl_s if reap_grace_s is None else reap_grace_s
        if reap_grace_s < heartbeat_ttl_s:
            raise ValueError(f"reap_grace_s: expected >= heartbeat_ttl_s ({heartbeat_ttl_s} s), got {reap_grace_s}")
        self.redis = redis_client(redis_) if isinstance(redis_, str) else redis_
        self.heartbeat_ttl_s = heartbeat_ttl_s
        self.reap_grace_s = reap_grace_s
        self.last_unavailable: float | None = None  # monotonic time of the last failure to reach Redis
        self.prefix = prefix
        r = self.redis
        self._claim = r.register_script(lua.CLAIM)
        self._release = r.register_script(lua.RELEASE)
        self._register = r.register_script(lua.REGISTER)
        self._heartbeat = r.register_script(lua.HEARTBEAT)
        self._set_warm = r.register_script(lua.SET_WARM)
        self._reap = r.register_script(lua.REAP)
        self._deregister = r.register_script(lua.DEREGISTER)
        self._abandon = r.register_script(lua.ABANDON)
        self._counts = r.register_script(lua.COUNTS)
        self._drain = r.register_script(lua.DRAIN)
        self._restore = r.register_script(lua.RESTORE)

    # -- key names ---------------------------------------------------------------------------------
    def _k(self, *parts: str) -> str:
        return self.prefix + ":".join(parts)

    def inbox_key(self, worker_id: str) -> str:
        return self._k("worker", worker_id, "inbox")

    def processing_key(self, worker_id: str) -> str:
        return self._k("worker", worker_id, "processing")

    @property
    def deadletter_key(self) -> str:
        return self._k("deadletter")

    @property
    def _ttl_ms(self) -> int:
        return max(1, int(self.heartbeat_ttl_s * 1000))

    def close(self) -> None:
        self.redis.close()

    # ==============================================================================================
    # worker side
    # ==============================================================================================
    @guarded
    def register(self, info: WorkerInfo, *, session_id: str | None = None) -> bool:
        """Register (or re-register after an outage) a worker and start its heartbeat.

        A warm worker with no lease becomes idle. `session_id`: the session this worker is streaming
        right now (re-registration after Redis came back empty): its lease is restored. Returns False
        when that session cannot be kept — it was reaped (heartbeat expired) or is held by another
        worker, or this worker already holds another lease — and the worker must stop streaming it. Always True without `session_id`. An existing
        lease is kept (an assignment for it may be waiting in the inbox; see `recover_unacked`)."""
        return bool(
            self._register(
                args=[self.prefix, info.pool, info.worker_id, info.model_dump_json(), "1" if info.warm else "0",
                      self._ttl_ms, session_id or ""]
            )
        )

    @guarded
    def heartbeat(self, worker_id: str, pool: str, stats: dict[str, Any] | None = None) -> bool:
        """Refresh the heartbeat TTL. False = the registry does not know this worker (Redis restarted
        empty, or it was reaped): call `register` again."""
        return bool(self._heartbeat(args=[self.prefix, pool, worker_id, self._ttl_ms, json.dumps(stats or {})]))

    @guarded
    def set_warm(self, worker_id: str, pool: str) -> bool:
        """The model is loaded: the worker may take sessions (becomes idle unless busy/draining)."""
        return bool(self._set_warm(args=[self.prefix, pool, worker_id]))

    @guarded
    def next_message(self, worker_id: str, timeout_s: float) -> Assignment | EndRequest | None:
        """Pop the next inbox message into the processing list (at-least-once delivery; `ack` removes
        it). `timeout_s <= 0` does not block; longer waits are capped at MAX_BLOCK_S. Returns None on
        timeout. A malformed message (bad JSON, missing or wrong fields) is logged with the field that
        is wrong, moved to the dead-letter list with the error, and skipped."""
        inbox, processing = self.inbox_key(worker_id), self.processing_key(worker_id)
        deadline = time.monotonic() + max(0.0, min(timeout_s, MAX_BLOCK_S))
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raw = self.redis.lmove(inbox, processing, "LEFT", "RIGHT")
            else:
                raw = self.redis.blmove(inbox, processing, max(0.01, left), "LEFT", "RIGHT")
            if raw is None:
                return None
            try:
                return INBOX_MESSAGE.validate_json(raw)
            except ValidationError as exc:
                self._dead_letter(worker_id, raw, describe_validation_error(exc))
            if time.monotonic() >= deadline:
                return None

    def _dead_letter(self, worker_id: str, raw: bytes | str, error: str) -> None:
        text = _redact_token(raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw)
        log.error("worker %s: rejected inbox message (%s); moved to %s", worker_id, error, self.deadletter_key)
        entry = json.dumps({"worker_id": worker_id, "error": error, "raw": text, "at": time.time()})
        pipe = self.redis.pipeline(transaction=True)
        pipe.lpush(self.deadletter_key, entry)
        pipe.ltrim(self.deadletter_key, 0, DEADLETTER_MAX - 1)
        pipe.incr(self._k("deadletter_total"))
        pipe.lrem(self.processing_key(worker_id), 1, raw)
        pipe.execute()

    @guarded
    def ack(self, worker_id: str, message: Assignment | EndRequest) -> bool:
        """Remove a handled message from the processing list (for an Assignment: once the session has
        started, or once it was refused). Matches by kind and session id."""
        key = self.processing_key(worker_id)
        for raw in self.redis.lrange(key, 0, -1):
            try:
                held = INBOX_MESSAGE.validate_json(raw)
            except ValidationError:
                continue
            if held.kind == message.kind and held.session_id == message.session_id:
                return bool(self.redis.lrem(key, 1, raw))
        return False

    @guarded
    def pending(self, worker_id: str) -> list[Assignment | EndRequest]:
        """Well-formed messages waiting in the inbox (not popped), oldest first; malformed ones are skipped."""
        out = []
        for raw in self.redis.lrange(self.inbox_key(worker_id), 0, -1):
            try:
                out.append(INBOX_MESSAGE.validate_json(raw))
            except ValidationError:
                continue
        return out

    @guarded
    def assignment_delivered(self, worker_id: str, session_id: str) -> bool:
        """Whether `session_id`'s assignment reached `worker_id`: it waits in the worker's inbox, or was popped
        and not yet acknowledged, or the worker reports the session live (Connecting/Streaming: it reports
        Connecting before it acknowledges). Operator side, to never send one session's assignment twice."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.lrange(self.inbox_key(worker_id), 0, -1)
        pipe.lrange(self.processing_key(worker_id), 0, -1)
        pipe.get(self._k("session", session_id, "stats"))
        inbox, processing, raw_stats = pipe.execute()
        for raw in (*inbox, *processing):
            try:
                msg = INBOX_MESSAGE.validate_json(raw)
            except ValidationError:
                continue
            if isinstance(msg, Assignment) and msg.session_id == session_id:
                return True
        if raw_stats is None:
            return False
        try:
            stats = SessionStats.model_validate_json(raw_stats)
        except ValidationError:
            return False
        return stats.worker_id == worker_id and stats.phase in ("Connecting", "Streaming")

    @guarded
    def recover_unacked(self, worker_id: str) -> int:
        """Worker start-up: put messages popped by a previous incarnation but never acknowledged back
        at the head of the inbox, in their order. Returns how many."""
        n = 0
        while self.redis.lmove(self.processing_key(worker_id), self.inbox_key(worker_id), "RIGHT", "LEFT") is not None:
            n += 1
        return n

    @guarded
    def report_session(self, session_id: str, stats: SessionStats) -> None:
        """Publish a session's progress (kept a day after the last report)."""
        self.redis.set(self._k("session", session_id, "stats"), stats.model_dump_json(), ex=SESSION_RECORD_TTL_S)

    @guarded
    def finish(self, pool: str, worker_id: str, session_id: str, reason: str) -> bool:
        """Worker side, at session end: give the lease back (the worker becomes idle again). The reason
        travels in the last `report_session`; it is logged here. False if the lease was already gone."""
        released = bool(self._release(args=[self.prefix, pool, worker_id, session_id]))
        log.info("worker %s finished session %s (%s); lease %s", worker_id, session_id, reason,
                 "released" if released else "was already gone")
        return released

    @guarded
    def abandon(self, pool: str, worker_id: str, session_id: str, reason: str) -> bool:
        """Give up a lease whose session this worker is not running (it restarted mid-session): the
        session is marked lost with `reason` (see `lost_reason`) and the worker becomes idle."""
        return bool(self._abandon(args=[self.prefix, pool, worker_id, session_id, reason, SESSION_RECORD_TTL_S]))

    @guarded
    def deregister(self, worker_id: str, pool: str, reason: str = "worker deregistered", *,
                   failed: bool = False) -> str | None:
        """Remove the worker everywhere. Returns the session it held (now marked lost with `reason`), if any.
        `failed`: the worker stops on a fault (it exits for Kubernetes to restart it); counted once in
        `worker_failures` as "fault" while it is still registered."""
        return _s(self._deregister(args=[self.prefix, pool, worker_id, reason, "1" if failed else "0",
                                          SESSION_RECORD_TTL_S])) or None

    # ==============================================================================================
    # operator side
    # ==============================================================================================
    @guarded
    def claim_idle_worker(self, pool: str, session_id: str) -> str | None:
        """Atomically lease an idle, alive, non-draining worker of `pool` to `session_id`. Idempotent:
        claiming again for the same session returns the same worker. None when no worker is idle.
        Raises SessionConflict if a worker of another pool holds this session."""
        try:
            return _s(self._claim(args=[self.prefix, pool, session_id]))
        except redis.ResponseError as exc:
            if str(exc).startswith("CONFLICT"):
                raise SessionConflict(str(exc).removeprefix("CONFLICT ")) from None
            raise

    @guarded
    def send_assignment(self, worker_id: str, assignment: Assignment) -> None:
        """Append an assignment (with its token) to the worker's inbox."""
        self.redis.rpush(self.inbox_key(worker_id), assignment.to_wire())

    @guarded
    def send_end(self, worker_id: str, session_id: str, reason: str) -> None:
        """Ask the worker to stop streaming `session_id` at its next chunk boundary."""
        self.redis.rpush(self.inbox_key(worker_id), EndRequest(session_id=session_id, reason=reason).model_dump_json())

    @guarded
    def restore_lease(self, pool: str, worker_id: str, session_id: str) -> bool:
        """Rebuild a lease the CharacterSession knows (its status names the worker) after Redis lost it.
        True if `worker_id` now holds `session_id`; False when that would double-assign (the worker holds
        another session, or the session another worker) or the session was marked lost."""
        return bool(self._restore(args=[self.prefix, pool, worker_id, session_id]))

    @guarded
    def leases(self, pool: str) -> dict[str, str]:
        """worker -> session of every lease in `pool`."""
        return {_s(w): _s(s) for w, s in self.redis.hgetall(self._k("pool", pool, "busy")).items()}  # type: ignore[misc]

    @guarded
    def release(self, pool: str, worker_id: str, session_id: str) -> bool:
        """Free the lease only if `worker_id` still holds `session_id` (True); otherwise change nothing."""
        return bool(self._release(args=[self.prefix, pool, worker_id, session_id]))

    @guarded
    def reap_dead_workers(self, pool: str) -> list[tuple[str, str | None]]:
        """Remove workers silent for `reap_grace_s` while Redis was reachable; returns (worker_id, session
        it held or None) so the operator can mark those sessions Failed. Their sessions are marked lost; each
        reaped worker counts in `worker_failures` as "lost"."""
        settled_s = float(self.redis.info("server")["uptime_in_seconds"]) + 1.0  # whole seconds, rounded down
        if self.last_unavailable is not None:
            settled_s = min(settled_s, time.monotonic() - self.last_unavailable)
        flat = [_s(x) for x in self._reap(args=[self.prefix, pool, int(self.reap_grace_s * 1000),
                                                int(settled_s * 1000), SESSION_RECORD_TTL_S])]
        return [(flat[i], flat[i + 1] or None) for i in range(0, len(flat), 2)]  # type: ignore[misc]

    @guarded
    def worker_failures(self, pool: str) -> dict[str, int]:
        """Workers of `pool` that failed, by kind, since the pool's keys were made (a Redis restarted empty counts
        from 0 again): "fault" (stopped themselves on a fault: a rank died, numerical faults in a row; exit code
        3) and "lost" (reaped after their heartbeat stopped: killed, out of memory, node gone)."""
        raw = self.redis.hgetall(self._k("pool", pool, "worker_failures"))
        counts = {_s(k): int(v) for k, v in raw.items()}
        return {kind: counts.get(kind, 0) for kind in WORKER_FAILURE_KINDS}

    @guarded
    def pool_counts(self, pool: str) -> PoolCounts:
        registered, loading, idle, busy, draining, dead = self._counts(args=[self.prefix, pool])
        return PoolCounts(pool=pool, registered=registered, loading=loading, idle=idle, busy=busy,
                          draining=draining, dead=dead)

    @guarded
    def session_stats(self, session_id: str) -> SessionStats | None:
        raw = self.redis.get(self._k("session", session_id, "stats"))
        return None if raw is None else SessionStats.model_validate_json(raw)

    @guarded
    def worker_of(self, session_id: str) -> str | None:
        """The worker holding `session_id`'s lease, if any."""
        return _s(self.redis.hget(self._k("session_worker"), session_id))

    @guarded
    def session_of(self, pool: str, worker_id: str) -> str | None:
        """The session `worker_id` holds a lease for, if any."""
        return _s(self.redis.hget(self._k("pool", pool, "busy"), worker_id))

    @guarded
    def observe_sessions(self, session_ids: list[str]) -> dict[str, SessionObservation]:
        """What Redis holds about many sessions, in one round trip of three commands (MGET stats, MGET
        lost, HMGET holder), for a fleet-wide mirror that must not cost a round trip per session. A
        malformed stats record reads as None (the worker's next report replaces it)."""
        if not session_ids:
            return {}
        pipe = self.redis.pipeline(transaction=False)
        pipe.mget([self._k("session", s, "stats") for s in session_ids])
        pipe.mget([self._k("session", s, "lost") for s in session_ids])
        pipe.hmget(self._k("session_worker"), session_ids)
        stats, lost, holders = pipe.execute()
        out = {}
        for sid, raw, why, holder in zip(session_ids, stats, lost, holders, strict=True):
            try:
                parsed = None if raw is None else SessionStats.model_validate_json(raw)
            except ValidationError:
                parsed = None
            out[sid] = SessionObservation(stats=parsed, lost=_s(why), holder=_s(holder))
        return out

    @guarded
    def worker_info(self, worker_id: str) -> WorkerInfo | None:
        """What one worker said about itself when it registered (one GET), None if it is not registered."""
        raw = self.redis.get(self._k("worker", worker_id))
        return None if raw is None else WorkerInfo.model_validate_json(raw)


    @guarded
    def lost_reason(self, session_id: str) -> str | None:
        """Why a session lost its worker (reaped, deregistered, abandoned), if it did."""
        return _s(self.redis.get(self._k("session", session_id, "lost")))

    @guarded
    def set_draining(self, pool: str, worker_ids: Iterable[str]) -> int:
        """Mark workers as draining: they take no new session (a busy one finishes its current one).
        Returns how many were newly marked."""
        ids = list(worker_ids)
        return int(self._drain(args=[self.prefix, pool, *ids])) if ids else 0

    @guarded
    def workers(self, pool: str) -> dict[str, WorkerInfo]:
        """Registered workers of a pool (alive or not yet reaped) with what they said about themselves."""
        ids = sorted(_s(w) for w in self.redis.smembers(self._k("pool", pool, "workers")))
        raws = self.redis.mget([self._k("worker", w) for w in ids]) if ids else []
        warm = {_s(w) for w in self.redis.smembers(self._k("pool", pool, "warm"))}  # the truth after set_warm
        return {w: WorkerInfo.model_validate_json(raw).model_copy(update={"warm": w in warm})
                for w, raw in zip(ids, raws, strict=True) if raw}

    @guarded
    def idle_workers(self, pool: str) -> list[str]:
        return sorted(_s(w) for w in self.redis.smembers(self._k("pool", pool, "idle")))

    @guarded
    def dead_letters_total(self) -> int:
        """How many inbox messages were ever rejected into the dead-letter list (the list keeps the last
        DEADLETTER_MAX); 0 again after Redis restarted empty."""
        return int(self.redis.get(self._k("deadletter_total")) or 0)

    @guarded
    def dead_letters(self, n: int = 100) -> list[dict[str, Any]]:
        """The newest `n` rejected inbox messages: {worker_id, error, raw, at}."""
        return [json.loads(x) for x in self.redis.lrange(self.deadletter_key, 0, n - 1)]
