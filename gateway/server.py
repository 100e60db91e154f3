"""`vivant api`: the session gateway, the REST API that hosted-avatar plugins of LiveKit agents already speak.

Why it exists: a LiveKit voice agent that uses a hosted avatar (e.g. `livekit-plugins-runway`) starts
the avatar with one POST and stops it with a data message or a DELETE. Serving the same contract lets
such an agent switch to self-hosted vivant by changing a base URL and an API key. Each request becomes
Kubernetes objects; the operator does the rest (assignment, token hand-off, status):

    POST   /v1/realtime_sessions        -> CharacterSession + Secret (the caller's LiveKit token); {"id"}
    GET    /v1/realtime_sessions/{id}   -> the CharacterSession's phase as {"status", "phase", ...}
    DELETE /v1/realtime_sessions/{id}   -> delete the CharacterSession (its finalizer ends the worker)
    GET    /openapi.json                -> the OpenAPI document of these routes (from `models.py`)
    GET    /healthz, /readyz            -> liveness; readiness (503 while a request queue is full)

Order on create (nothing is lost, nothing is made twice, and the token never enters the CR):
1. check the bearer key (401), the body (400 not JSON / 422 naming the field), the avatar (404),
   the `Idempotency-Key` header (400) -- nothing is written before all of these pass;
2. wait for a slot of the create gate (`admission.py`: 503 `overloaded` at once when the queue is full;
   a request whose client left while it waited is dropped);
3. the session's name is derived from the request: from `Idempotency-Key` (scoped by API key), else
   from the whole body (the LiveKit token included, so a client's retry of the same request is the same
   request). If that CharacterSession exists, the request is a retry: its missing parts are completed
   and the same id is answered (422 if the key was used for another body);
4. the pool: it must exist (503 `unknown_pool`) and have a spec the operator accepts (409
   `pool_invalid`, naming the problem); a capacity slot is claimed atomically (`capacity.py`;
   503 `no_capacity` + Retry-After when the pool is full);
5. create the CharacterSession (`spec.livekit.tokenSecret` names the Secret), then the Secret (key
   `token`) with an ownerReference to it, so the token is garbage-collected with the session and never
   orphaned. A failure after step 5's first write leaves a session that the client's retry completes;
   the janitor deletes one whose token never arrived (the operator reports `TokenSecretMissing`) after
   `orphan_grace_s`.

Every Kubernetes call is idempotent by name (creates of a known name answer 409 when done already) and
is retried on a transient failure (5xx, 429, dropped connection, timeout) before the request answers
502/503 with Retry-After.

API keys come from a Kubernetes Secret, mounted as a file (one key per line, `#` comments) or from
the environment variable named by `--keys-env`; the file is re-read when it changes, so rotating the
Secret needs no restart. The Kubernetes client is the synchronous `kubernetes` package, called in the
gates' thread pools; `SessionApi` takes its `ApiClient`, so tests point it at any API server.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import hashlib
import json
import logging
import os
import re
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pydantic
import urllib3
from aiohttp import web
from vivant.apis import resources as r
from vivant.gateway import capacity as cap
from vivant.gateway import models as m
from vivant.gateway.admission import Abandoned, Gate, Overloaded, client_gone
from vivant.gateway.config import ApiConfig, ApiKeys, ApiLimits, AvatarEntry  # noqa: F401 (re-exported)
from vivant.gateway.metrics import ApiMetrics
from vivant.gateway.openapi import openapi_document

log = logging.getLogger(__name__)

TOKEN_KEY = "token"
LABEL_API = cap.LABEL_API
API_CREATOR = cap.API_CREATOR
ANNOTATION_AVATAR = "vivant.dev/avatar"
ANNOTATION_DIGEST = "vivant.dev/request-digest"
MAX_BODY_BYTES = 64 * 1024
MAX_JSON_DEPTH = 32  # the documented body nests 3 levels; anything deeper is refused, whatever the parser manages
TRANSIENT_STATUS = frozenset({429, 500, 502, 503, 504})
TOKEN_MISSING_REASON = "TokenSecretMissing"  # the operator's Ready reason while a session's Secret is missing


# ------------------------------------------------------------------------------------------- errors


class ApiFailure(Exception):
    """An answer other than success: HTTP status, machine code, message naming the field."""

    def __init__(self, status: int, code: str, message: str, field: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.field = status, code, message, field
        self.headers = headers or {}

    def response(self) -> web.Response:
        body = m.ApiError(error=m.ErrorDetail(code=self.code, message=self.message, field=self.field))
        return web.json_response(body.model_dump(exclude_none=True), status=self.status, headers=self.headers)


class _Exists(Exception):  # noqa: N818
    """A create answered 409 AlreadyExists (an earlier attempt of ours, or a concurrent retry, made it)."""


def _depth(value: Any) -> int:
    """Nesting depth of parsed JSON, without recursion (a deep value must not exhaust the stack here)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, level = stack.pop()
        if isinstance(node, dict | list):
            deepest = max(deepest, level)
            stack.extend((child, level + 1) for child in (node.values() if isinstance(node, dict) else node))
    return deepest


def request_digest(body: m.CreateSessionRequest) -> str:
    """SHA-256 of the request body in canonical JSON, the LiveKit token included (never stored itself)."""
    data = body.model_dump(by_alias=True, mode="json")
    data["livekit"]["token"] = body.livekit.token.get_secret_value()
    return hashlib.sha256(json.dumps(data, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def session_name_for(digest: str, idempotency_key: str | None, api_key: str) -> str:
    """`rt-` + 20 hex: from the Idempotency-Key (scoped by the caller's API key) or the body's digest."""
    if idempotency_key is not None:
        scope = hashlib.sha256(api_key.encode("utf-8", "surrogateescape")).hexdigest()
        material = f"key:{scope}:{idempotency_key}"
    else:
        material = f"body:{digest}"
    return "rt-" + hashlib.sha256(material.encode()).hexdigest()[:20]


# ------------------------------------------------------------------------------------------- service


class SessionApi:
    """The handlers, over a `kubernetes.client.ApiClient` (in-cluster, kubeconfig, or any API server)."""

    # The Kubernetes client's error type; a backend without Kubernetes (local.py) keeps () (matches nothing).
    _api_exception: Any = ()

    def __init__(self, config: ApiConfig, keys: ApiKeys, kube_client: Any, metrics: ApiMetrics | None = None) -> None:
        import kubernetes

        self._init_front(config, keys, metrics)
        self._custom = kubernetes.client.CustomObjectsApi(kube_client)
        self._core = kubernetes.client.CoreV1Api(kube_client)
        self._leases = kubernetes.client.CoordinationV1Api(kube_client)
        self._api_exception = kubernetes.client.exceptions.ApiException

    def _init_front(self, config: ApiConfig, keys: ApiKeys, metrics: ApiMetrics | None) -> None:
        """What every backend's HTTP front needs: configuration, keys, metrics and the admission gates."""
        self.config = config
        self.keys = keys
        self.metrics = metrics
        lim = config.limits
        self.creates = Gate("creates", lim.max_in_flight_creates, lim.max_queued_creates, lim.queue_timeout_s)
        self.reads = Gate("reads", lim.max_in_flight_reads, lim.max_queued_reads, lim.queue_timeout_s)
        self.collected: list[str] = []  # sessions the janitor deleted (their token never arrived)

    # -- app -------------------------------------------------------------------------------------

    def app(self, *, janitor: bool = True) -> web.Application:
        middlewares = [self.metrics.middleware()] if self.metrics is not None else []
        app = web.Application(middlewares=[*middlewares, self._errors], client_max_size=MAX_BODY_BYTES)
        app.router.add_post(m.ROUTE_COLLECTION, self.create)
        app.router.add_get(m.ROUTE_ITEM, self.get)
        app.router.add_delete(m.ROUTE_ITEM, self.delete)
        app.router.add_get("/healthz", self.healthz)
        app.router.add_get("/readyz", self.readyz)
        app.router.add_get(m.ROUTE_OPENAPI, self.openapi)
        if self.metrics is not None:  # unauthenticated, like /healthz: cluster-internal
            app.router.add_get("/metrics", self.metrics.handler)
        if janitor:
            app.cleanup_ctx.append(self._janitor_ctx)
        app.on_cleanup.append(self._close)
        return app

    async def _close(self, app: web.Application) -> None:
        self.creates.close()
        self.reads.close()

    @web.middleware
    async def _errors(self, request: web.Request, handler: Any) -> web.StreamResponse:
        retry = {"Retry-After": str(self.config.retry_after_s)}
        try:
            return await handler(request)
        except ApiFailure as exc:
            log.info("%s %s -> %d %s", request.method, request.path, exc.status, exc.code)
            return exc.response()
        except Overloaded as exc:
            return ApiFailure(503, "overloaded", f"the session API is at its limit ({exc.why}); retry later",
                              None, {"Retry-After": "1"}).response()
        except Abandoned as exc:
            log.info("%s", exc)
            return ApiFailure(503, "abandoned", "the client closed the connection; nothing was done",
                              None, retry).response()
        except web.HTTPRequestEntityTooLarge:
            return ApiFailure(413, "body_too_large", f"request body over {MAX_BODY_BYTES} bytes", "body").response()
        except web.HTTPException as exc:
            if exc.status in (404, 405):
                code = "not_found" if exc.status == 404 else "method_not_allowed"
                return ApiFailure(exc.status, code, f"{request.method} {request.path}: {exc.reason}").response()
            raise
        except self._api_exception as exc:  # an answer of the apiserver no step expected (403, 415, ...)
            log.error("%s %s: Kubernetes API answered %s %s", request.method, request.path, exc.status, exc.reason)
            return ApiFailure(502, "kubernetes_unavailable", f"Kubernetes API answered {exc.status} {exc.reason}", None,
                              retry).response()

    async def healthz(self, request: web.Request) -> web.Response:
        """Liveness: the process answers."""
        return web.json_response({"ok": True})

    async def readyz(self, request: web.Request) -> web.Response:
        """Readiness: 503 while a gate's queue is full (a new request would be shed)."""
        gates = {g.name: {"inFlight": g.in_flight, "waiting": g.waiting, "saturated": g.saturated}
                 for g in (self.creates, self.reads)}
        ready = not any(g["saturated"] for g in gates.values())
        return web.json_response({"ready": ready, "gates": gates}, status=200 if ready else 503)

    async def openapi(self, request: web.Request) -> web.Response:
        return web.json_response(openapi_document(tuple(sorted(self.config.avatars))))

    def _authorize(self, request: web.Request) -> str:
        """The presented API key, once accepted (401 otherwise)."""
        header = request.headers.get("Authorization", "")
        scheme, _, presented = header.partition(" ")
        challenge = {"WWW-Authenticate": 'Bearer realm="vivant"'}
        expected = "Authorization: expected 'Bearer <api key>' (printable ASCII)"
        if not header:
            raise ApiFailure(401, "missing_api_key", "Authorization header missing: expected 'Bearer <api key>'",
                             "Authorization", challenge)
        presented = presented.strip()
        if scheme.lower() != "bearer" or not presented or not (presented.isascii() and presented.isprintable()):
            raise ApiFailure(401, "malformed_authorization", expected, "Authorization", challenge)
        if not self.keys.accepts(presented):
            raise ApiFailure(401, "invalid_api_key", "the API key is not valid", "Authorization", challenge)
        return presented

    async def _kube(self, gate: Gate, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """One Kubernetes call in `gate`'s threads, retried on a transient failure. Non-transient
        ApiExceptions (404, 409, 422, ...) are raised to the caller; exhausted retries answer 502/503."""
        lim = self.config.limits
        kwargs.setdefault("_request_timeout", lim.kube_timeout_s)
        call = functools.partial(fn, *args, **kwargs)
        loop = asyncio.get_running_loop()
        retry = {"Retry-After": str(self.config.retry_after_s)}
        name = getattr(fn, "__name__", "call")
        for attempt in range(lim.kube_attempts):
            if attempt:
                await asyncio.sleep(0.1 * 3 ** (attempt - 1))
            try:
                return await loop.run_in_executor(gate.executor, call)
            except self._api_exception as exc:
                if exc.status not in TRANSIENT_STATUS:
                    raise
                last = ApiFailure(502, "kubernetes_unavailable", f"Kubernetes API answered {exc.status}", None, retry)
            except (OSError, urllib3.exceptions.HTTPError) as exc:  # refused, reset, timed out, retries exhausted
                last = ApiFailure(503, "kubernetes_unavailable", f"Kubernetes API unreachable ({type(exc).__name__})",
                                  None, retry)
            log.warning("Kubernetes call %s failed (attempt %d/%d): %s", name, attempt + 1, lim.kube_attempts,
                        last.message)
        raise last

    async def _create_named(self, gate: Gate, fn: Any, *args: Any) -> Any:
        """A create whose 409 AlreadyExists means it is done already (raises _Exists)."""
        try:
            return await self._kube(gate, fn, *args)
        except self._api_exception as exc:
            if exc.status == 409:
                raise _Exists() from None
            raise

    # -- create ----------------------------------------------------------------------------------

    async def _parse(self, request: web.Request) -> m.CreateSessionRequest:
        raw = await request.read()
        if not raw:
            raise ApiFailure(400, "malformed_body", "request body is empty: expected a JSON object", "body")
        try:
            data = json.loads(raw)
        except RecursionError:
            raise ApiFailure(400, "malformed_body", "request body is nested too deeply: expected a JSON object "
                             "of the documented shape", "body") from None
        except ValueError as exc:  # not JSON, not UTF-8, or an integer beyond Python's digit limit
            what = "an integer with too many digits" if "digits" in str(exc) else "not valid JSON"
            raise ApiFailure(400, "malformed_body", f"request body is {what}: expected a JSON object",
                             "body") from None
        if not isinstance(data, dict):
            raise ApiFailure(400, "malformed_body", f"request body: expected a JSON object, got {type(data).__name__}",
                             "body")
        if _depth(data) > MAX_JSON_DEPTH:
            raise ApiFailure(400, "malformed_body", f"request body is nested too deeply (over {MAX_JSON_DEPTH} "
                             "levels): expected a JSON object of the documented shape", "body")
        try:
            return m.CreateSessionRequest.model_validate(data)
        except pydantic.ValidationError as exc:
            path, msg = m.first_validation_problem(exc)
            raise ApiFailure(422, "invalid_field", f"{path}: {msg}", path) from None

    @staticmethod
    def _idempotency_key(request: web.Request) -> str | None:
        key = request.headers.get(m.IDEMPOTENCY_HEADER)
        if key is None:
            return None
        if not re.fullmatch(m.IDEMPOTENCY_KEY_PATTERN, key):
            raise ApiFailure(400, "invalid_header", f"{m.IDEMPOTENCY_HEADER}: expected 1 to {m.IDEMPOTENCY_KEY_MAX} "
                             "printable ASCII characters", m.IDEMPOTENCY_HEADER)
        return key

    async def create(self, request: web.Request) -> web.Response:
        api_key = self._authorize(request)
        body = await self._parse(request)
        idempotency_key = self._idempotency_key(request)
        entry = self.config.avatars.get(body.avatar_key)
        if entry is None:
            raise ApiFailure(404, "unknown_avatar", f"avatar {body.avatar_key!r} is not served here", "avatar")
        digest = request_digest(body)
        name = session_name_for(digest, idempotency_key, api_key)
        async with self.creates.admit(request):
            existing = await self._read_optional(self.creates, name)
            if existing is not None:
                return await self._replay(existing, body, digest)
            await self._claim_capacity(request, entry.pool, name)
            if client_gone(request):  # the last point before anything is written for it
                self.creates.abandoned += 1
                raise Abandoned(f"POST {request.path}: the client left before session {name} was created")
            cs = self._manifest(name, body, entry, digest)
            try:
                created = await self._create_named(self.creates, self._custom.create_namespaced_custom_object,
                                                   r.GROUP, r.VERSION, self.config.namespace, r.SESSION_PLURAL, cs)
            except _Exists:  # a concurrent retry of the same request made it first
                existing = await self._read_optional(self.creates, name)
                if existing is None:
                    raise ApiFailure(409, "conflict", f"session {name} was deleted while it was being created",
                                     "id") from None
                return await self._replay(existing, body, digest)
            if not ((created or {}).get("metadata") or {}).get("uid"):  # a server that answers no object
                created = await self._read_optional(self.creates, name) or {}
            await self._store_token(created, body)
        log.info("created session %s/%s (avatar %s, pool %s)", self.config.namespace, name, body.avatar_key,
                 entry.pool)
        return web.json_response(m.CreateSessionResponse(id=name).model_dump(), status=201)

    def _manifest(self, name: str, body: m.CreateSessionRequest, entry: AvatarEntry, digest: str) -> dict[str, Any]:
        spec = r.CharacterSessionSpec(
            character=entry.character, pool=entry.pool,
            livekit=r.LiveKitTarget(url=body.livekit.url, room=body.livekit.room_name,
                                    agent_identity=body.livekit.agent_identity, token_secret=f"{name}-livekit-token"),
            max_duration_seconds=body.max_duration or self.config.default_max_duration_s,
        )
        cr = r.CharacterSession(metadata=r.ObjectMeta(
            name=name, namespace=self.config.namespace, labels={LABEL_API: API_CREATOR},
            annotations={ANNOTATION_AVATAR: body.avatar_key, ANNOTATION_DIGEST: digest}), spec=spec)
        return cr.model_dump(by_alias=True, exclude_none=True, mode="json")

    async def _store_token(self, cs: dict[str, Any], body: m.CreateSessionRequest) -> None:
        """The session's token Secret, owned by the session from birth (never orphaned)."""
        meta = cs.get("metadata") or {}
        name, uid = meta.get("name", ""), meta.get("uid", "")
        # no blockOwnerDeletion: it would need update on charactersessions/finalizers (admission plugin)
        owner = {"apiVersion": r.API_VERSION, "kind": r.SESSION_KIND, "name": name, "uid": uid}
        secret = {
            "apiVersion": "v1", "kind": "Secret", "type": "Opaque",
            "metadata": {"name": f"{name}-livekit-token", "namespace": self.config.namespace,
                         "labels": {LABEL_API: API_CREATOR}, "ownerReferences": [owner]},
            "stringData": {TOKEN_KEY: body.livekit.token.get_secret_value()},
        }
        with contextlib.suppress(_Exists):
            await self._create_named(self.creates, self._core.create_namespaced_secret, self.config.namespace, secret)

    async def _replay(self, cs: dict[str, Any], body: m.CreateSessionRequest, digest: str) -> web.Response:
        """A retry of a request whose session exists: complete it and answer the same id."""
        meta = cs.get("metadata") or {}
        name = meta.get("name", "")
        if (meta.get("annotations") or {}).get(ANNOTATION_DIGEST) != digest:
            raise ApiFailure(422, "idempotency_key_reused", f"{m.IDEMPOTENCY_HEADER}: this key was used for another "
                             "request body; use a new key for a new session", m.IDEMPOTENCY_HEADER)
        if meta.get("deletionTimestamp"):
            raise ApiFailure(409, "session_deleted", f"session {name} of this request is being deleted", "id")
        await self._store_token(cs, body)
        log.info("replayed create of session %s/%s", self.config.namespace, name)
        return web.json_response(m.CreateSessionResponse(id=name).model_dump(), status=201)

    async def _claim_capacity(self, request: web.Request, pool: str, name: str) -> None:
        ns = self.config.namespace
        retry = {"Retry-After": str(self.config.retry_after_s)}
        try:
            wp = await self._kube(self.creates, self._custom.get_namespaced_custom_object, r.GROUP, r.VERSION, ns,
                                  r.POOL_PLURAL, pool)
        except self._api_exception:
            raise ApiFailure(503, "unknown_pool", f"WorkerPool {ns}/{pool} does not exist", "avatar", retry) from None
        try:
            spec = r.WorkerPoolSpec.model_validate(wp.get("spec") or {})
        except pydantic.ValidationError as exc:
            problem = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}"
                                for e in exc.errors(include_input=False, include_url=False))
            raise ApiFailure(409, "pool_invalid", f"WorkerPool {ns}/{pool} serving this avatar has a spec the operator "
                             f"rejects ({problem}); it takes no sessions until it is fixed", "avatar") from None
        try:
            listing = await self._kube(self.creates, self._custom.list_namespaced_custom_object, r.GROUP, r.VERSION, ns,
                                       r.SESSION_PLURAL)
        except self._api_exception:
            raise ApiFailure(503, "crd_missing", f"{r.SESSION_PLURAL}.{r.GROUP} is not installed", None, retry) from None
        sessions = {(cs.get("metadata") or {}).get("name", ""): cs for cs in listing.get("items", [])}
        external = sum(1 for cs in sessions.values()
                       if (cs.get("spec") or {}).get("pool") == pool and cap.is_active(cs)
                       and ((cs.get("metadata") or {}).get("labels") or {}).get(LABEL_API) != API_CREATOR)

        async def list_leases() -> list[dict[str, Any]]:
            got = await self._kube(self.creates, self._leases.list_namespaced_lease, ns,
                                   label_selector=f"{cap.LABEL_POOL}={pool}")
            return [self._leases.api_client.sanitize_for_serialization(x) for x in got.items]

        async def create(body: dict[str, Any]) -> None:
            try:
                await self._create_named(self.creates, self._leases.create_namespaced_lease, ns, body)
            except _Exists:
                raise cap.SlotConflict() from None

        async def replace(lease: str, body: dict[str, Any]) -> None:
            try:
                await self._kube(self.creates, self._leases.replace_namespaced_lease, lease, ns, body)
            except self._api_exception as exc:
                if exc.status in (404, 409):
                    raise cap.SlotConflict() from None
                raise

        claim = await cap.claim_slot(
            pool=pool, session=name, capacity=spec.max_workers, external_active=external,
            now=datetime.now(tz=UTC), claim_grace_s=self.config.limits.claim_grace_s, list_leases=list_leases,
            sessions=sessions, create=create, replace=replace, owner=cap.owner_of_pool(wp))
        if claim.index is None:
            raise ApiFailure(503, "no_capacity", f"WorkerPool {ns}/{pool} is at capacity ({claim.active}/"
                             f"{claim.capacity} sessions); retry later", "avatar", retry)

    # -- janitor ---------------------------------------------------------------------------------

    async def collect_orphans(self) -> list[str]:
        """Delete this API's sessions whose token Secret never arrived (their create failed half way and
        was not retried): the operator reports them Pending with reason TokenSecretMissing."""
        ns, grace = self.config.namespace, self.config.limits.orphan_grace_s
        listing = await self._kube(self.reads, self._custom.list_namespaced_custom_object, r.GROUP, r.VERSION, ns,
                                   r.SESSION_PLURAL, label_selector=f"{LABEL_API}={API_CREATOR}")
        now = datetime.now(tz=UTC)
        gone = []
        for cs in listing.get("items", []):
            meta, status = cs.get("metadata") or {}, cs.get("status") or {}
            ready = next((c for c in status.get("conditions") or [] if c.get("type") == "Ready"), {})
            created = cap._time(meta.get("creationTimestamp")) or now
            if (ready.get("reason") == TOKEN_MISSING_REASON and cap.is_active(cs)
                    and (now - created).total_seconds() > grace):
                with contextlib.suppress(self._api_exception):
                    await self._kube(self.reads, self._custom.delete_namespaced_custom_object, r.GROUP, r.VERSION,
                                     ns, r.SESSION_PLURAL, meta.get("name", ""))
                gone.append(meta.get("name", ""))
                log.warning("janitor: deleted session %s/%s, whose token Secret never arrived", ns, gone[-1])
        self.collected += gone
        return gone

    async def _janitor_ctx(self, app: web.Application) -> AsyncIterator[None]:
        async def loop() -> None:
            while True:
                await asyncio.sleep(self.config.limits.janitor_interval_s)
                try:
                    await self.collect_orphans()
                except (ApiFailure, self._api_exception) as exc:
                    log.warning("janitor: %s", exc)

        task = asyncio.create_task(loop())
        yield
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    # -- get / delete ----------------------------------------------------------------------------

    def _session_name(self, request: web.Request) -> str:
        sid = request.match_info["id"]
        if not re.fullmatch(m.SESSION_ID_PATTERN, sid):
            raise ApiFailure(404, "unknown_session", "no session with this id: expected rt- and lowercase ASCII "
                             "letters, digits or '-'", "id")
        return sid

    async def _read_optional(self, gate: Gate, name: str) -> dict[str, Any] | None:
        try:
            return await self._kube(gate, self._custom.get_namespaced_custom_object, r.GROUP, r.VERSION,
                                    self.config.namespace, r.SESSION_PLURAL, name)
        except self._api_exception as exc:
            if exc.status == 404:
                return None
            raise

    async def _read(self, name: str) -> dict[str, Any]:
        cs = None
        with contextlib.suppress(self._api_exception):
            cs = await self._read_optional(self.reads, name)
        if cs is None:
            raise ApiFailure(404, "unknown_session", f"no session {name!r}", "id")
        return cs

    async def get(self, request: web.Request) -> web.Response:
        self._authorize(request)
        name = self._session_name(request)
        async with self.reads.admit(request):
            cs = await self._read(name)
        meta, status = cs.get("metadata") or {}, cs.get("status") or {}
        phase = status.get("phase") or r.SessionPhase.PENDING.value
        out = m.SessionStatusResponse(
            id=name, status=m.STATUS_OF_PHASE.get(phase, "NOT_READY"), phase=phase,
            avatar=(meta.get("annotations") or {}).get(ANNOTATION_AVATAR), worker=status.get("worker"),
            message=status.get("message"), created_at=meta.get("creationTimestamp"), ended_at=status.get("endedAt"),
        )
        return web.json_response(out.model_dump(by_alias=True, exclude_none=True))

    async def delete(self, request: web.Request) -> web.Response:
        self._authorize(request)
        name = self._session_name(request)
        async with self.reads.admit(request):
            await self._read(name)
            try:
                await self._kube(self.reads, self._custom.delete_namespaced_custom_object, r.GROUP, r.VERSION,
                                 self.config.namespace, r.SESSION_PLURAL, name)
            except self._api_exception:
                raise ApiFailure(404, "unknown_session", f"no session {name!r}", "id") from None
        log.info("deleted session %s/%s", self.config.namespace, name)
        return web.Response(status=204)


# ------------------------------------------------------------------------------------------- CLI


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default=None,
                        help="listen address (default 0.0.0.0: it serves a Service; 127.0.0.1 with --local)")
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument("--namespace", default=os.environ.get("VIVANT_NAMESPACE", "default"),
                        help="namespace of the CharacterSessions and WorkerPools it serves")
    parser.add_argument("--avatars", type=Path, required=True, help="YAML: {avatars: {<id>: {character, pool}}}")
    parser.add_argument("--keys-file", type=Path, default=None,
                        help="API keys, one per line (a mounted Kubernetes Secret); re-read on change")
    parser.add_argument("--keys-env", default="VIVANT_API_KEYS",
                        help="environment variable with comma-separated API keys (from a Secret)")
    parser.add_argument("--local", action="store_true",
                        help="no cluster: hand sessions to idle workers through the Redis registry "
                             "(vivant.gateway.local); avatars' pools are the workers' --pool names")
    parser.add_argument("--redis", default=os.environ.get("VIVANT_REDIS_URL", "redis://127.0.0.1:6379/0"),
                        help="with --local: the session registry's Redis URL (env VIVANT_REDIS_URL)")


def run(args: argparse.Namespace) -> int:
    import kubernetes

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    try:
        config = ApiConfig.from_file(args.avatars, args.namespace)
    except (OSError, ValueError) as exc:
        print(f"vivant api: --avatars: {exc}")
        return 2
    static = tuple(k.strip() for k in os.environ.get(args.keys_env, "").split(",") if k.strip())
    keys = ApiKeys(path=args.keys_file, static=static)
    if not keys.current():
        print(f"vivant api: no API keys: give --keys-file or set ${args.keys_env}")
        return 2
    if args.local:
        from vivant.gateway.local import run_local

        return run_local(config, keys, args.redis, args.host or "127.0.0.1", args.port)
    try:
        kubernetes.config.load_incluster_config()
    except kubernetes.config.ConfigException:
        kubernetes.config.load_kube_config()
    kube_config = kubernetes.client.Configuration.get_default_copy()
    # one pooled connection per thread of the two gates, so no call waits for a connection
    kube_config.connection_pool_maxsize = config.limits.max_in_flight_creates + config.limits.max_in_flight_reads
    api = SessionApi(config, keys, kubernetes.client.ApiClient(kube_config), ApiMetrics())
    web.run_app(api.app(), host=args.host or "0.0.0.0", port=args.port, access_log=None)
    return 0
