"""`vivant api`: the session gateway, the REST API that hosted-avatar plugins of LiveKit agents already speak.

Why it exists: a LiveKit voice agent that uses a hosted avatar (e.g. `livekit-plugins-runway`) starts
the avatar with one POST and stops it with a data message or a DELETE. Serving the same contract lets
such an agent switch to self-hosted vivant by changing a base URL and an API key. Each request becomes
Kubernetes objects; the operator does the rest (assignment, token hand-off, status):

    POST   /v1/realtime_sessions        -> Secret (the caller's LiveKit token) + CharacterSession; {"id"}
    GET    /v1/realtime_sessions/{id}   -> the CharacterSession's phase as {"status", "phase", ...}
    DELETE /v1/realtime_sessions/{id}   -> delete the CharacterSession (its finalizer ends the worker)

Order on create (no half-made session is left behind, and the token never enters the CR):
1. check the bearer key (401), the body (400 not JSON / 422 naming the field), the avatar (404),
   the pool and its capacity (503 + Retry-After) -- nothing is written before all of these pass;
2. create the token Secret (key `token`), then the CharacterSession that names it in
   `spec.livekit.tokenSecret`; if the CR cannot be created the Secret is deleted again;
3. give the Secret an ownerReference to the CR, so deleting the session garbage-collects the token.

Capacity: a pool has room when its non-terminal CharacterSessions are fewer than `spec.maxWorkers`
(counted from the API server, so it does not lag behind the pool's mirrored status).

API keys come from a Kubernetes Secret, mounted as a file (one key per line, `#` comments) or from
the environment variable named by `--keys-env`; the file is re-read when it changes, so rotating the
Secret needs no restart. The Kubernetes client is the synchronous `kubernetes` package, called in a
thread; `SessionApi` takes its `ApiClient`, so a test hands it a client of its own (one that records the
requests it sends, say) without global state.
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import json
import logging
import os
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pydantic
import urllib3
import yaml
from aiohttp import web
from vivant.apis import resources as r
from vivant.gateway import models as m
from vivant.gateway.metrics import ApiMetrics

log = logging.getLogger(__name__)

TOKEN_KEY = "token"
LABEL_API = "vivant.dev/created-by"
ANNOTATION_AVATAR = "vivant.dev/avatar"
MAX_BODY_BYTES = 64 * 1024


# ------------------------------------------------------------------------------------------- config


class AvatarEntry(pydantic.BaseModel):
    """What an avatar id of the API means here: which character the worker renders, in which pool."""

    model_config = pydantic.ConfigDict(extra="forbid", strict=True)
    character: str = pydantic.Field(min_length=1, max_length=128, pattern=r.IDENTIFIER)
    pool: r.PoolName  # the name rule of WorkerPools (apis/resources.py)


class ApiConfig(pydantic.BaseModel):
    """Typed configuration of one API server (one namespace)."""

    model_config = pydantic.ConfigDict(extra="forbid")
    namespace: str = pydantic.Field(min_length=1, max_length=63, pattern=r.DNS_LABEL)
    avatars: dict[str, AvatarEntry]
    default_max_duration_s: int = pydantic.Field(default=1800, ge=10, le=86_400)
    retry_after_s: int = pydantic.Field(default=5, ge=1, le=3600)

    @classmethod
    def from_file(cls, path: Path, namespace: str) -> ApiConfig:
        """Avatars file: YAML `{avatars: {<id>: {character, pool}}, defaultMaxDurationS?, retryAfterS?}`."""
        raw = yaml.safe_load(Path(path).read_text()) or {}
        if not isinstance(raw, dict):
            raise ValueError(f"{path}: expected a mapping with key 'avatars', got {type(raw).__name__}")
        return cls(namespace=namespace, avatars=raw.get("avatars") or {},
                   default_max_duration_s=raw.get("defaultMaxDurationS", 1800),
                   retry_after_s=raw.get("retryAfterS", 5))


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
    def parse(text: str) -> tuple[str, ...]:
        lines = (line.strip() for line in text.splitlines())
        return tuple(line for line in lines if line and not line.startswith("#"))

    def current(self) -> tuple[str, ...]:
        if self.path is not None:
            try:
                mtime = self.path.stat().st_mtime
            except OSError:
                log.error("API keys file %s is unreadable; no key from it is accepted", self.path)
                self._from_file, self._mtime = (), None
            else:
                if mtime != self._mtime:
                    self._from_file, self._mtime = self.parse(self.path.read_text()), mtime
        return self.static + self._from_file

    def accepts(self, presented: str) -> bool:
        ok = False
        for key in self.current():  # compare against every key, constant time each
            ok |= hmac.compare_digest(key.encode(), presented.encode())
        return ok


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


# ------------------------------------------------------------------------------------------- service


class SessionApi:
    """The handlers, over a `kubernetes.client.ApiClient` (in-cluster, or from a kubeconfig)."""

    def __init__(self, config: ApiConfig, keys: ApiKeys, kube_client: Any, metrics: ApiMetrics | None = None) -> None:
        import kubernetes

        self.config = config
        self.keys = keys
        self.metrics = metrics
        self._custom = kubernetes.client.CustomObjectsApi(kube_client)
        self._core = kubernetes.client.CoreV1Api(kube_client)
        self._api_exception = kubernetes.client.exceptions.ApiException

    # -- app -------------------------------------------------------------------------------------

    def app(self) -> web.Application:
        middlewares = [self.metrics.middleware()] if self.metrics is not None else []
        app = web.Application(middlewares=[*middlewares, self._errors], client_max_size=MAX_BODY_BYTES)
        app.router.add_post(m.ROUTE_COLLECTION, self.create)
        app.router.add_get(m.ROUTE_ITEM, self.get)
        app.router.add_delete(m.ROUTE_ITEM, self.delete)
        app.router.add_get("/healthz", self.healthz)
        if self.metrics is not None:  # unauthenticated, like /healthz: cluster-internal
            app.router.add_get("/metrics", self.metrics.handler)
        return app

    @web.middleware
    async def _errors(self, request: web.Request, handler: Any) -> web.StreamResponse:
        try:
            return await handler(request)
        except ApiFailure as exc:
            log.info("%s %s -> %d %s", request.method, request.path, exc.status, exc.code)
            return exc.response()
        except web.HTTPRequestEntityTooLarge:
            return ApiFailure(413, "body_too_large", f"request body over {MAX_BODY_BYTES} bytes", "body").response()
        except web.HTTPException as exc:
            if exc.status in (404, 405):
                code = "not_found" if exc.status == 404 else "method_not_allowed"
                return ApiFailure(exc.status, code, f"{request.method} {request.path}: {exc.reason}").response()
            raise

    async def healthz(self, request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    def _authorize(self, request: web.Request) -> None:
        header = request.headers.get("Authorization", "")
        scheme, _, presented = header.partition(" ")
        challenge = {"WWW-Authenticate": 'Bearer realm="vivant"'}
        if not header:
            raise ApiFailure(401, "missing_api_key", "Authorization header missing: expected 'Bearer <api key>'",
                             "Authorization", challenge)
        if scheme.lower() != "bearer" or not presented.strip():
            raise ApiFailure(401, "malformed_authorization", "Authorization: expected 'Bearer <api key>'",
                             "Authorization", challenge)
        if not self.keys.accepts(presented.strip()):
            raise ApiFailure(401, "invalid_api_key", "the API key is not valid", "Authorization", challenge)

    async def _kube(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return await asyncio.to_thread(fn, *args, **kwargs)
        except self._api_exception as exc:
            if exc.status == 404:
                raise
            log.error("Kubernetes API error %s on %s", exc.status, getattr(fn, "__name__", fn))
            raise ApiFailure(502, "kubernetes_unavailable", f"Kubernetes API answered {exc.status}",
                             headers={"Retry-After": str(self.config.retry_after_s)}) from None
        except (OSError, urllib3.exceptions.HTTPError) as exc:  # refused, DNS, retries exhausted, ...
            log.error("Kubernetes API unreachable: %s", type(exc).__name__)
            raise ApiFailure(503, "kubernetes_unavailable", "Kubernetes API unreachable",
                             headers={"Retry-After": str(self.config.retry_after_s)}) from None

    # -- create ----------------------------------------------------------------------------------

    async def _parse(self, request: web.Request) -> m.CreateSessionRequest:
        raw = await request.read()
        if not raw:
            raise ApiFailure(400, "malformed_body", "request body is empty: expected a JSON object", "body")
        try:
            data = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise ApiFailure(400, "malformed_body", "request body is not valid JSON", "body") from None
        if not isinstance(data, dict):
            raise ApiFailure(400, "malformed_body", f"request body: expected a JSON object, got {type(data).__name__}",
                             "body")
        try:
            return m.CreateSessionRequest.model_validate(data)
        except pydantic.ValidationError as exc:
            path, msg = m.first_validation_problem(exc)
            raise ApiFailure(422, "invalid_field", f"{path}: {msg}", path) from None

    async def _check_capacity(self, pool: str) -> None:
        ns = self.config.namespace
        retry = {"Retry-After": str(self.config.retry_after_s)}
        try:
            wp = await self._kube(self._custom.get_namespaced_custom_object, r.GROUP, r.VERSION, ns, r.POOL_PLURAL, pool)
        except self._api_exception:
            raise ApiFailure(503, "unknown_pool", f"WorkerPool {ns}/{pool} does not exist", "avatar", retry) from None
        try:
            max_workers = int(wp["spec"]["maxWorkers"])
        except (KeyError, TypeError, ValueError):
            raise ApiFailure(503, "pool_not_ready", f"WorkerPool {ns}/{pool} has no valid spec.maxWorkers",
                             "avatar", retry) from None
        try:
            listing = await self._kube(self._custom.list_namespaced_custom_object, r.GROUP, r.VERSION, ns,
                                       r.SESSION_PLURAL)
        except self._api_exception:
            raise ApiFailure(503, "crd_missing", f"{r.SESSION_PLURAL}.{r.GROUP} is not installed", None, retry) from None
        terminal = {p.value for p in r.TERMINAL_PHASES}
        active = sum(1 for cs in listing.get("items", [])
                     if (cs.get("spec") or {}).get("pool") == pool
                     and ((cs.get("status") or {}).get("phase") not in terminal)
                     and not (cs.get("metadata") or {}).get("deletionTimestamp"))
        if active >= max_workers:
            raise ApiFailure(503, "no_capacity", f"WorkerPool {ns}/{pool} is at capacity ({active}/{max_workers} "
                             "sessions); retry later", "avatar", retry)

    async def create(self, request: web.Request) -> web.Response:
        self._authorize(request)
        body = await self._parse(request)
        entry = self.config.avatars.get(body.avatar_key)
        if entry is None:
            raise ApiFailure(404, "unknown_avatar", f"avatar {body.avatar_key!r} is not served here", "avatar")
        await self._check_capacity(entry.pool)

        ns = self.config.namespace
        name = f"rt-{uuid.uuid4().hex[:20]}"
        secret_name = f"{name}-livekit-token"
        secret = {
            "apiVersion": "v1", "kind": "Secret", "type": "Opaque",
            "metadata": {"name": secret_name, "namespace": ns, "labels": {LABEL_API: "session-api"}},
            "stringData": {TOKEN_KEY: body.livekit.token.get_secret_value()},
        }
        spec = r.CharacterSessionSpec(
            character=entry.character, pool=entry.pool,
            livekit=r.LiveKitTarget(url=body.livekit.url, room=body.livekit.room_name,
                                    agent_identity=body.livekit.agent_identity, token_secret=secret_name),
            max_duration_seconds=body.max_duration or self.config.default_max_duration_s,
        )
        cr = r.CharacterSession(metadata=r.ObjectMeta(
            name=name, namespace=ns, labels={LABEL_API: "session-api"},
            annotations={ANNOTATION_AVATAR: body.avatar_key}), spec=spec)
        manifest = cr.model_dump(by_alias=True, exclude_none=True, mode="json")

        await self._kube(self._core.create_namespaced_secret, ns, secret)
        try:
            await self._kube(self._custom.create_namespaced_custom_object, r.GROUP, r.VERSION, ns,
                             r.SESSION_PLURAL, manifest)
        except BaseException:
            await self._kube(self._core.delete_namespaced_secret, secret_name, ns)
            raise
        created = await self._kube(self._custom.get_namespaced_custom_object, r.GROUP, r.VERSION, ns,
                                   r.SESSION_PLURAL, name)
        uid = (created.get("metadata") or {}).get("uid")
        if uid:
            # no blockOwnerDeletion: it would need update on charactersessions/finalizers (admission plugin)
            owner = {"apiVersion": r.API_VERSION, "kind": r.SESSION_KIND, "name": name, "uid": uid}
            await self._kube(self._core.patch_namespaced_secret, secret_name, ns,
                             {"metadata": {"ownerReferences": [owner]}})
        log.info("created session %s/%s (avatar %s, pool %s)", ns, name, body.avatar_key, entry.pool)
        return web.json_response(m.CreateSessionResponse(id=name).model_dump(), status=201)

    # -- get / delete ----------------------------------------------------------------------------

    def _session_name(self, request: web.Request) -> str:
        sid = request.match_info["id"]
        if not sid.startswith("rt-") or len(sid) > 63 or not all(c.isalnum() or c == "-" for c in sid):
            raise ApiFailure(404, "unknown_session", "no session with this id", "id")
        return sid

    async def _read(self, name: str) -> dict[str, Any]:
        try:
            return await self._kube(self._custom.get_namespaced_custom_object, r.GROUP, r.VERSION,
                                    self.config.namespace, r.SESSION_PLURAL, name)
        except self._api_exception:
            raise ApiFailure(404, "unknown_session", f"no session {name!r}", "id") from None

    async def get(self, request: web.Request) -> web.Response:
        self._authorize(request)
        name = self._session_name(request)
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
        await self._read(name)
        try:
            await self._kube(self._custom.delete_namespaced_custom_object, r.GROUP, r.VERSION,
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
    api = SessionApi(config, keys, kubernetes.client.ApiClient(), ApiMetrics())
    web.run_app(api.app(), host=args.host or "0.0.0.0", port=args.port, access_log=None)
    return 0
