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
from vivant.apis import resources
from vivant.gateway import capacity, models
from vivant.gateway.admission import Abandoned, Gate, client_gone
from vivant.gateway.config import ApiConfig, ApiKeys, ApiLimits, AvatarEntry  # noqa: F401 (re-exported)
from vivant.gateway.front import MAX_BODY_BYTES, ApiFailure, ApiFront, tenant_of, unknown_session  # noqa: F401
from vivant.gateway.local import run_local
from vivant.gateway.metrics import ApiMetrics

log = logging.getLogger(__name__)

TOKEN_KEY = "token"
LABEL_API = capacity.LABEL_API
API_CREATOR = capacity.API_CREATOR
ANNOTATION_AVATAR = "vivant.dev/avatar"
ANNOTATION_DIGEST = "vivant.dev/request-digest"
ANNOTATION_TENANT = "vivant.dev/tenant"  # front.tenant_of(the creating API key): only that key reads or deletes it
GROUP_VERSION = (resources.GROUP, resources.VERSION)  # of the CharacterSession and WorkerPool CRDs
TRANSIENT_STATUS = frozenset({429, 500, 502, 503, 504})
TOKEN_MISSING_REASON = "TokenSecretMissing"  # the operator's Ready reason while a session's Secret is missing


# ------------------------------------------------------------------------------------------- errors


class _Exists(Exception):  # noqa: N818
    """A create answered 409 AlreadyExists (an earlier attempt of ours, or a concurrent retry, made it)."""


def request_digest(body: models.CreateSessionRequest) -> str:
    """SHA-256 of the request body in canonical JSON, the LiveKit token included (never stored itself)."""
    data = body.model_dump(by_alias=True, mode="json")
    data["livekit"]["token"] = body.livekit.token.get_secret_value()
    return hashlib.sha256(json.dumps(data, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def session_name_for(digest: str, idempotency_key: str | None, api_key: str) -> str:
    """`rt-` + 20 hex: from the Idempotency-Key or the body's digest, either scoped by the caller's API key
    (its tenant), so two keys never name the same session."""
    scope = tenant_of(api_key)
    material = f"key:{scope}:{idempotency_key}" if idempotency_key is not None else f"body:{scope}:{digest}"
    return "rt-" + hashlib.sha256(material.encode()).hexdigest()[:20]


# ------------------------------------------------------------------------------------------- service


class SessionApi(ApiFront):
    """The handlers, over a `kubernetes.client.ApiClient` (in-cluster, kubeconfig, or any API server)."""

    def __init__(self, config: ApiConfig, keys: ApiKeys, kube_client: Any, metrics: ApiMetrics | None = None) -> None:
        import kubernetes

        super().__init__(config, keys, metrics)
        self.collected: list[str] = []  # sessions the janitor deleted (their token never arrived)
        self._custom = kubernetes.client.CustomObjectsApi(kube_client)
        self._core = kubernetes.client.CoreV1Api(kube_client)
        self._leases = kubernetes.client.CoordinationV1Api(kube_client)
        self._api_exception = kubernetes.client.exceptions.ApiException

    def app(self, *, janitor: bool = True) -> web.Application:
        app = super().app()
        if janitor:
            app.cleanup_ctx.append(self._janitor_ctx)
        return app

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

    @staticmethod
    def _idempotency_key(request: web.Request) -> str | None:
        key = request.headers.get(models.IDEMPOTENCY_HEADER)
        if key is None:
            return None
        if not re.fullmatch(models.IDEMPOTENCY_KEY_PATTERN, key):
            raise ApiFailure(400, "invalid_header", f"{models.IDEMPOTENCY_HEADER}: expected 1 to "
                             f"{models.IDEMPOTENCY_KEY_MAX} printable ASCII characters", models.IDEMPOTENCY_HEADER)
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
        tenant = tenant_of(api_key)
        async with self.creates.admit(request):
            existing = await self._read_optional(self.creates, name)
            if existing is not None:
                return await self._replay(existing, body, digest, tenant)
            slot = await self._claim_capacity(request, entry.pool, name)
            if client_gone(request):  # the last point before anything is written for it
                self.creates.abandoned += 1
                raise Abandoned(f"POST {request.path}: the client left before session {name} was created")
            cs = self._manifest(name, body, entry, digest, tenant)
            try:
                created = await self._create_named(self.creates, self._custom.create_namespaced_custom_object,
                                                   *GROUP_VERSION, self.config.namespace, resources.SESSION_PLURAL,
                                                   cs)
            except _Exists:  # a concurrent retry of the same request made it first
                existing = await self._read_optional(self.creates, name)
                if existing is None:
                    raise ApiFailure(409, "conflict", f"session {name} was deleted while it was being created",
                                     "id") from None
                return await self._replay(existing, body, digest, tenant)
            if not ((created or {}).get("metadata") or {}).get("uid"):  # a server that answers no object
                created = await self._read_optional(self.creates, name) or {}
            await self._store_token(created, body)
            await self._mark_holder_created(entry.pool, slot, name, (created.get("metadata") or {}).get("uid", ""))
        log.info("created session %s/%s (avatar %s, pool %s)", self.config.namespace, name, body.avatar_key,
                 entry.pool)
        return web.json_response(models.CreateSessionResponse(id=name).model_dump(), status=201)

    def _manifest(self, name: str, body: models.CreateSessionRequest, entry: AvatarEntry, digest: str,
                  tenant: str) -> dict[str, Any]:
        spec = resources.CharacterSessionSpec(
            character=entry.character, pool=entry.pool,
            livekit=resources.LiveKitTarget(url=body.livekit.url, room=body.livekit.room_name,
                                            agent_identity=body.livekit.agent_identity,
                                            token_secret=f"{name}-livekit-token"),
            max_duration_seconds=body.max_duration or self.config.default_max_duration_s,
        )
        cr = resources.CharacterSession(metadata=resources.ObjectMeta(
            name=name, namespace=self.config.namespace, labels={LABEL_API: API_CREATOR},
            annotations={ANNOTATION_AVATAR: body.avatar_key, ANNOTATION_DIGEST: digest, ANNOTATION_TENANT: tenant}),
            spec=spec)
        return cr.model_dump(by_alias=True, exclude_none=True, mode="json")

    async def _store_token(self, cs: dict[str, Any], body: models.CreateSessionRequest) -> None:
        """The session's token Secret, owned by the session from birth (never orphaned)."""
        meta = cs.get("metadata") or {}
        name, uid = meta.get("name", ""), meta.get("uid", "")
        # no blockOwnerDeletion: it would need update on charactersessions/finalizers (admission plugin)
        owner = {"apiVersion": resources.API_VERSION, "kind": resources.SESSION_KIND, "name": name, "uid": uid}
        secret = {
            "apiVersion": "v1", "kind": "Secret", "type": "Opaque",
            "metadata": {"name": f"{name}-livekit-token", "namespace": self.config.namespace,
                         "labels": {LABEL_API: API_CREATOR}, "ownerReferences": [owner]},
            "stringData": {TOKEN_KEY: body.livekit.token.get_secret_value()},
        }
        with contextlib.suppress(_Exists):
            await self._create_named(self.creates, self._core.create_namespaced_secret, self.config.namespace, secret)

    async def _replay(self, cs: dict[str, Any], body: models.CreateSessionRequest, digest: str,
                      tenant: str) -> web.Response:
        """A retry of a request whose session exists: complete it and answer the same id."""
        meta = cs.get("metadata") or {}
        name = meta.get("name", "")
        if (meta.get("annotations") or {}).get(ANNOTATION_TENANT) != tenant:
            raise ApiFailure(409, "conflict", f"session {name} exists and belongs to another API key", "id")
        if (meta.get("annotations") or {}).get(ANNOTATION_DIGEST) != digest:
            raise ApiFailure(422, "idempotency_key_reused", f"{models.IDEMPOTENCY_HEADER}: this key was used for "
                             "another request body; use a new key for a new session", models.IDEMPOTENCY_HEADER)
        if meta.get("deletionTimestamp"):
            raise ApiFailure(409, "session_deleted", f"session {name} of this request is being deleted", "id")
        await self._store_token(cs, body)
        log.info("replayed create of session %s/%s", self.config.namespace, name)
        return web.json_response(models.CreateSessionResponse(id=name).model_dump(), status=201)

    async def _claim_capacity(self, request: web.Request, pool: str, name: str) -> int:
        """The index of the slot of `pool` that session `name` now holds (503 `no_capacity` when full)."""
        ns = self.config.namespace
        retry = {"Retry-After": str(self.config.retry_after_s)}
        try:
            wp = await self._kube(self.creates, self._custom.get_namespaced_custom_object, *GROUP_VERSION, ns,
                                  resources.POOL_PLURAL, pool)
        except self._api_exception:
            raise ApiFailure(503, "unknown_pool", f"WorkerPool {ns}/{pool} does not exist", "avatar", retry) from None
        try:
            spec = resources.WorkerPoolSpec.model_validate(wp.get("spec") or {})
        except pydantic.ValidationError as exc:
            problem = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}"
                                for e in exc.errors(include_input=False, include_url=False))
            raise ApiFailure(409, "pool_invalid", f"WorkerPool {ns}/{pool} serving this avatar has a spec the operator "
                             f"rejects ({problem}); it takes no sessions until it is fixed", "avatar") from None
        try:
            listing = await self._kube(self.creates, self._custom.list_namespaced_custom_object, *GROUP_VERSION, ns,
                                       resources.SESSION_PLURAL)
        except self._api_exception:
            raise ApiFailure(503, "crd_missing", f"{resources.SESSION_PLURAL}.{resources.GROUP} is not installed", None,
                             retry) from None
        sessions = {(cs.get("metadata") or {}).get("name", ""): cs for cs in listing.get("items", [])}
        external = sum(1 for cs in sessions.values()
                       if (cs.get("spec") or {}).get("pool") == pool and capacity.is_active(cs)
                       and ((cs.get("metadata") or {}).get("labels") or {}).get(LABEL_API) != API_CREATOR)

        async def list_leases() -> list[dict[str, Any]]:
            got = await self._kube(self.creates, self._leases.list_namespaced_lease, ns,
                                   label_selector=f"{capacity.LABEL_POOL}={pool}")
            return [self._leases.api_client.sanitize_for_serialization(x) for x in got.items]

        async def create(body: dict[str, Any]) -> None:
            try:
                await self._create_named(self.creates, self._leases.create_namespaced_lease, ns, body)
            except _Exists:
                raise capacity.SlotConflict() from None

        async def replace(lease: str, body: dict[str, Any]) -> None:
            try:
                await self._kube(self.creates, self._leases.replace_namespaced_lease, lease, ns, body)
            except self._api_exception as exc:
                if exc.status in (404, 409):
                    raise capacity.SlotConflict() from None
                raise

        async def holder_active(holder: str) -> bool:
            cs = await self._read_optional(self.creates, holder)
            return cs is not None and capacity.is_active(cs)

        claim = await capacity.claim_slot(
            pool=pool, session=name, capacity=spec.max_workers, external_active=external,
            now=datetime.now(tz=UTC), claim_grace_s=self.config.limits.claim_grace_s, list_leases=list_leases,
            sessions=sessions, create=create, replace=replace, holder_active=holder_active,
            owner=capacity.owner_of_pool(wp))
        if claim.index is None:
            raise ApiFailure(503, "no_capacity", f"WorkerPool {ns}/{pool} is at capacity ({claim.active}/"
                             f"{claim.capacity} sessions); retry later", "avatar", retry)
        return claim.index

    async def _mark_holder_created(self, pool: str, slot: int, name: str, uid: str) -> None:
        """Record in the slot's Lease that its session exists (capacity.py: once that session is gone, the
        slot is free at once). A failure here costs only speed: the slot then frees after claim_grace_s."""
        try:
            await self._kube(self.creates, self._leases.patch_namespaced_lease, capacity.slot_name(pool, slot),
                             self.config.namespace, capacity.holder_created_patch(name, uid))
        except (ApiFailure, self._api_exception) as exc:
            log.warning("slot %d of pool %s: could not record that session %s exists: %s", slot, pool, name, exc)

    async def _release_slot(self, pool: str, name: str) -> None:
        """Delete the Lease of the slot session `name` holds in `pool`, if it still names it (a precondition on
        its resourceVersion: a slot another session took meanwhile is left alone)."""
        import kubernetes

        got = await self._kube(self.reads, self._leases.list_namespaced_lease, self.config.namespace,
                               label_selector=f"{capacity.LABEL_POOL}={pool}")
        for lease in got.items:
            if lease.spec.holder_identity != name:
                continue
            options = kubernetes.client.V1DeleteOptions(preconditions=kubernetes.client.V1Preconditions(
                resource_version=lease.metadata.resource_version, uid=lease.metadata.uid))
            try:
                await self._kube(self.reads, self._leases.delete_namespaced_lease, lease.metadata.name,
                                 self.config.namespace, body=options)
            except self._api_exception as exc:
                if exc.status not in (404, 409):
                    raise

    # -- janitor ---------------------------------------------------------------------------------

    async def collect_orphans(self) -> list[str]:
        """Delete this API's sessions whose token Secret never arrived (their create failed half way and
        was not retried): the operator reports them Pending with reason TokenSecretMissing."""
        ns, grace = self.config.namespace, self.config.limits.orphan_grace_s
        listing = await self._kube(self.reads, self._custom.list_namespaced_custom_object, *GROUP_VERSION, ns,
                                   resources.SESSION_PLURAL, label_selector=f"{LABEL_API}={API_CREATOR}")
        now = datetime.now(tz=UTC)
        gone = []
        for cs in listing.get("items", []):
            meta, status = cs.get("metadata") or {}, cs.get("status") or {}
            ready = next((c for c in status.get("conditions") or [] if c.get("type") == "Ready"), {})
            created = capacity._time(meta.get("creationTimestamp")) or now
            if (ready.get("reason") == TOKEN_MISSING_REASON and capacity.is_active(cs)
                    and (now - created).total_seconds() > grace):
                with contextlib.suppress(self._api_exception):
                    await self._kube(self.reads, self._custom.delete_namespaced_custom_object, *GROUP_VERSION, ns,
                                     resources.SESSION_PLURAL, meta.get("name", ""))
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

    async def _read_optional(self, gate: Gate, name: str) -> dict[str, Any] | None:
        try:
            return await self._kube(gate, self._custom.get_namespaced_custom_object, *GROUP_VERSION,
                                    self.config.namespace, resources.SESSION_PLURAL, name)
        except self._api_exception as exc:
            if exc.status == 404:
                return None
            raise

    async def _read(self, name: str, tenant: str) -> dict[str, Any]:
        """Session `name` if it exists and belongs to `tenant`; 404 otherwise (the same answer for both)."""
        cs = None
        with contextlib.suppress(self._api_exception):
            cs = await self._read_optional(self.reads, name)
        if cs is None or ((cs.get("metadata") or {}).get("annotations") or {}).get(ANNOTATION_TENANT) != tenant:
            raise unknown_session(name)
        return cs

    async def get(self, request: web.Request) -> web.Response:
        tenant = tenant_of(self._authorize(request))
        name = self._session_name(request)
        async with self.reads.admit(request):
            cs = await self._read(name, tenant)
        meta, status = cs.get("metadata") or {}, cs.get("status") or {}
        phase = status.get("phase") or resources.SessionPhase.PENDING.value
        out = models.SessionStatusResponse(
            id=name, status=models.STATUS_OF_PHASE.get(phase, "NOT_READY"), phase=phase,
            avatar=(meta.get("annotations") or {}).get(ANNOTATION_AVATAR), worker=status.get("worker"),
            message=status.get("message"), created_at=meta.get("creationTimestamp"), ended_at=status.get("endedAt"),
        )
        return web.json_response(out.model_dump(by_alias=True, exclude_none=True))

    async def delete(self, request: web.Request) -> web.Response:
        """Delete the session, then free its capacity slot at once (its Lease), not after claim_grace_s."""
        tenant = tenant_of(self._authorize(request))
        name = self._session_name(request)
        async with self.reads.admit(request):
            cs = await self._read(name, tenant)
            try:
                await self._kube(self.reads, self._custom.delete_namespaced_custom_object, *GROUP_VERSION,
                                 self.config.namespace, resources.SESSION_PLURAL, name)
            except self._api_exception:
                raise unknown_session(name) from None
            pool = (cs.get("spec") or {}).get("pool", "")
            try:
                await self._release_slot(pool, name)
            except (ApiFailure, self._api_exception) as exc:  # the Lease's uid record frees it on the next claim
                log.warning("session %s deleted; its slot of pool %s not released now: %s", name, pool, exc)
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
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    try:
        config = ApiConfig.from_file(args.avatars, args.namespace)
    except (OSError, ValueError) as exc:
        print(f"vivant api: --avatars: {exc}")
        return 2
    static = tuple(k.strip() for k in os.environ.get(args.keys_env, "").split(",") if k.strip())
    if args.keys_file is not None:
        try:
            ApiKeys.parse(args.keys_file.read_text(), f"--keys-file {args.keys_file}")
        except (OSError, ValueError) as exc:
            print(f"vivant api: {exc}")
            return 2
    keys = ApiKeys(path=args.keys_file, static=static)
    if not keys.current():
        print(f"vivant api: no API keys: give --keys-file or set ${args.keys_env}")
        return 2
    if args.local:
        return run_local(config, keys, args.redis, args.host or "127.0.0.1", args.port)
    import kubernetes  # the cluster's client: not needed by --local (a machine without it runs the local API)

    try:
        kubernetes.config.load_incluster_config()
    except kubernetes.config.ConfigException:
        kubernetes.config.load_kube_config()
    kube_config = kubernetes.client.Configuration.get_default_copy()
    # one pooled connection per thread of the two gates, so no call waits for a connection
    kube_config.connection_pool_maxsize = config.limits.max_in_flight_creates + config.limits.max_in_flight_reads
    api = SessionApi(config, keys, kubernetes.client.ApiClient(kube_config), ApiMetrics())
    api.serve(args.host or "0.0.0.0", args.port)
    return 0
