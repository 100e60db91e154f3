"""`vivant api --local`: the session gateway without a Kubernetes cluster, handing sessions to warm workers
through the Redis session registry directly (what the operator does in a cluster).

Why it exists: a voice agent on a laptop or in a test wants the whole call (agent → API → worker → room)
without a cluster. The wire contract is the same as `vivant api` (vivant.gateway.server: the routes, the
bearer keys, the bodies and the errors of `/v1/realtime_sessions`), only the backend differs:

    POST   -> claim an idle worker of the avatar's pool (`Registry.claim_idle_worker`, one atomic Lua script)
              and send it the Assignment (room, URL, the caller's token, maxDuration); 503 no_capacity when
              no worker is idle. The token goes into the worker's inbox only (a SecretStr; never logged).
    GET    -> the worker's SessionStats (phase, end reason); "Assigned" while the worker holds the lease
              and has not reported yet.
    GET /readyz -> 200 when every avatar's pool has an idle worker, else 503 (what a launcher waits for).
    DELETE -> an EndRequest (reason Deleted) to the worker holding the session; 204. A session that already
              ended answers 204 too (nothing left to stop).

Session ids are `rt-<20 hex>` as in cluster mode, the second half a mark of the creating key's tenant
(`owned_id`): another key's GET or DELETE answers 404 as for an unknown id. The registry's session id is
`local/<id>`. The pool of an
avatar is the registry's pool name as the worker was started with (`vivant worker --pool`).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import secrets
from typing import Any

from aiohttp import web
from vivant.gateway import models
from vivant.gateway.config import ApiConfig, ApiKeys
from vivant.gateway.front import ApiFailure, ApiFront, tenant_of, unknown_session
from vivant.gateway.metrics import ApiMetrics
from vivant.sessions.models import Assignment, SessionStats
from vivant.sessions.registry import Registry, RegistryUnavailable

log = logging.getLogger(__name__)

LOCAL_NAMESPACE = "local"
DELETED_REASON = "Deleted"


def owned_id(tenant: str) -> str:
    """A new session id that carries its tenant's mark: `rt-` + 10 random hex + 10 hex of SHA-256 of the
    tenant and the random part. Only a key of that tenant can produce the mark again (`owns`), so ownership
    needs no state of its own and survives a restart of the gateway."""
    nonce = secrets.token_hex(5)
    return f"rt-{nonce}{_mark(tenant, nonce)}"


def _mark(tenant: str, nonce: str) -> str:
    return hashlib.sha256(f"{tenant}:{nonce}".encode()).hexdigest()[:10]


def owns(tenant: str, name: str) -> bool:
    """True when session id `name` was made by `owned_id(tenant)`."""
    tail = name.removeprefix("rt-")
    return len(tail) == 20 and secrets.compare_digest(_mark(tenant, tail[:10]), tail[10:])


class LocalSessionApi(ApiFront):
    """The gateway's handlers over a `Registry` (Redis) instead of the Kubernetes API (module docstring)."""

    def __init__(self, config: ApiConfig, keys: ApiKeys, registry: Registry, metrics: ApiMetrics | None = None) -> None:
        super().__init__(config, keys, metrics)
        self.registry = registry

    async def readyz(self, request: web.Request) -> web.Response:
        """200 when every avatar's pool has an idle worker (a session can start now), else 503; both bodies
        give `{"idleWorkers": {pool: n}}`. Unauthenticated, like /healthz: it names no session."""
        pools = sorted({entry.pool for entry in self.config.avatars.values()})
        idle = {pool: len(await self._redis(self.registry.idle_workers, pool)) for pool in pools}
        return web.json_response({"idleWorkers": idle}, status=200 if all(idle.values()) else 503)

    @staticmethod
    def registry_id(name: str) -> str:
        return f"{LOCAL_NAMESPACE}/{name}"

    async def _redis(self, fn: Any, *args: Any) -> Any:
        try:
            return await asyncio.to_thread(fn, *args)
        except RegistryUnavailable:
            log.error("Redis unreachable on %s", getattr(fn, "__name__", fn))
            raise ApiFailure(503, "registry_unavailable", "the session registry (Redis) is unreachable",
                             headers={"Retry-After": str(self.config.retry_after_s)}) from None

    async def create(self, request: web.Request) -> web.Response:
        tenant = tenant_of(self._authorize(request))
        body = await self._parse(request)
        entry = self.config.avatars.get(body.avatar_key)
        if entry is None:
            raise ApiFailure(404, "unknown_avatar", f"avatar {body.avatar_key!r} is not served here", "avatar")
        name = owned_id(tenant)
        sid = self.registry_id(name)
        worker = await self._redis(self.registry.claim_idle_worker, entry.pool, sid)
        if worker is None:
            raise ApiFailure(503, "no_capacity", f"pool {entry.pool} has no idle worker; retry later", "avatar",
                             {"Retry-After": str(self.config.retry_after_s)})
        assignment = Assignment(
            session_id=sid, namespace=LOCAL_NAMESPACE, pool=entry.pool, character=entry.character,
            room=body.livekit.room_name, livekit_url=body.livekit.url, agent_identity=body.livekit.agent_identity,
            token=body.livekit.token.get_secret_value(),
            max_duration_s=float(body.max_duration or self.config.default_max_duration_s))
        try:
            await self._redis(self.registry.send_assignment, worker, assignment)
        except ApiFailure:
            await asyncio.to_thread(self._release_quietly, entry.pool, worker, sid)
            raise
        log.info("created session %s (avatar %s) on worker %s of pool %s", name, body.avatar_key, worker, entry.pool)
        return web.json_response(models.CreateSessionResponse(id=name).model_dump(), status=201)

    def _release_quietly(self, pool: str, worker: str, sid: str) -> None:
        try:
            self.registry.release(pool, worker, sid)
        except RegistryUnavailable:
            log.error("could not release %s on %s after a failed assignment (Redis unreachable)", sid, worker)

    async def _state(self, tenant: str, name: str) -> tuple[SessionStats | None, str | None]:
        if not owns(tenant, name):  # another key's session, or none: the same answer
            raise unknown_session(name)
        sid = self.registry_id(name)
        stats = await self._redis(self.registry.session_stats, sid)
        worker = await self._redis(self.registry.worker_of, sid)
        if stats is None and worker is None:
            raise unknown_session(name)
        return stats, worker

    async def get(self, request: web.Request) -> web.Response:
        tenant = tenant_of(self._authorize(request))
        name = self._session_name(request)
        stats, worker = await self._state(tenant, name)
        phase = str(getattr(stats.phase, "value", stats.phase)) if stats is not None else "Assigned"
        out = models.SessionStatusResponse(
            id=name, status=models.STATUS_OF_PHASE.get(phase, "NOT_READY"), phase=phase,
            worker=(stats.worker_id if stats is not None and stats.worker_id else worker),
            message=stats.end_reason if stats is not None else None)
        return web.json_response(out.model_dump(by_alias=True, exclude_none=True))

    async def delete(self, request: web.Request) -> web.Response:
        tenant = tenant_of(self._authorize(request))
        name = self._session_name(request)
        _, worker = await self._state(tenant, name)
        if worker is not None:
            await self._redis(self.registry.send_end, worker, self.registry_id(name), DELETED_REASON)
            log.info("asked worker %s to end session %s (%s)", worker, name, DELETED_REASON)
        return web.Response(status=204)


def run_local(config: ApiConfig, keys: ApiKeys, redis_url: str, host: str, port: int) -> int:
    """Serve the local-mode gateway until interrupted."""
    api = LocalSessionApi(config, keys, Registry(redis_url), ApiMetrics())
    api.serve(host, port)
    return 0
