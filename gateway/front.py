"""The session gateway's HTTP front, shared by its two backends (Kubernetes: `server.py`; Redis: `local.py`).

What every backend answers the same way: the routes and the one error shape (`ApiFailure`), the bearer key
check and the tenant a key stands for, the request body read within `body_timeout_s` and checked with
pydantic (400/408/413/422 naming the field), the admission gates (`admission.py`), `/healthz`, `/readyz` and
`/openapi.json`. A backend subclasses `ApiFront` and implements `create`, `get` and `delete`.

Tenants: a session belongs to the API key that created it. The key itself is never stored; its tenant is
`tenant_of(key)`, a SHA-256 fingerprint, recorded with the session by the backend. A GET or DELETE by
another key answers 404 `unknown_session`, exactly as for an id that does not exist (a key learns nothing
about other keys' sessions).

Slow clients: a connection must deliver its request line and headers within `header_timeout_s` of opening
(and of its previous response, on a kept-alive connection), else it is closed; a body must arrive within
`body_timeout_s` (408). `serve()` and `runner()` apply these settings.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import re
from abc import ABC, abstractmethod
from typing import Any

import pydantic
from aiohttp import web
from vivant.gateway import models
from vivant.gateway.admission import Abandoned, Gate, Overloaded
from vivant.gateway.config import ApiConfig, ApiKeys
from vivant.gateway.metrics import ApiMetrics
from vivant.gateway.openapi import openapi_document

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 64 * 1024
LINGER_S = 1.0  # seconds the server drains a body it answered before reading (aiohttp's default: 10)
MAX_JSON_DEPTH = 32  # the documented body nests 3 levels; anything deeper is refused, whatever the parser manages


class ApiFailure(Exception):
    """An answer other than success: HTTP status, machine code, message naming the field."""

    def __init__(self, status: int, code: str, message: str, field: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.field = status, code, message, field
        self.headers = headers or {}

    def response(self) -> web.Response:
        body = models.ApiError(error=models.ErrorDetail(code=self.code, message=self.message, field=self.field))
        return web.json_response(body.model_dump(exclude_none=True), status=self.status, headers=self.headers)


def json_depth(value: Any) -> int:
    """Nesting depth of parsed JSON, without recursion (a deep value must not exhaust the stack here)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, level = stack.pop()
        if isinstance(node, dict | list):
            deepest = max(deepest, level)
            stack.extend((child, level + 1) for child in (node.values() if isinstance(node, dict) else node))
    return deepest


def tenant_of(api_key: str) -> str:
    """The tenant an API key stands for: 64 hex of SHA-256 of the key (the key itself is never stored)."""
    return hashlib.sha256(api_key.encode("utf-8", "surrogateescape")).hexdigest()


def unknown_session(name: str) -> ApiFailure:
    """The one answer for an id that does not exist and for another tenant's session (they look the same)."""
    return ApiFailure(404, "unknown_session", f"no session {name!r}", "id")


class ApiFront(ABC):
    """Routes, keys, bodies, gates and errors of the gateway; subclasses serve `create`, `get` and `delete`."""

    # The backend client's error type answered 502 by the error middleware; () matches nothing.
    _api_exception: Any = ()

    def __init__(self, config: ApiConfig, keys: ApiKeys, metrics: ApiMetrics | None = None) -> None:
        self.config = config
        self.keys = keys
        self.metrics = metrics
        lim = config.limits
        self.creates = Gate("creates", lim.max_in_flight_creates, lim.max_queued_creates, lim.queue_timeout_s)
        self.reads = Gate("reads", lim.max_in_flight_reads, lim.max_queued_reads, lim.queue_timeout_s)

    # -- the backend's handlers -----------------------------------------------------------------------

    @abstractmethod
    async def create(self, request: web.Request) -> web.Response:
        """The backend's answer to this route."""

    @abstractmethod
    async def get(self, request: web.Request) -> web.Response:
        """The backend's answer to this route."""

    @abstractmethod
    async def delete(self, request: web.Request) -> web.Response:
        """The backend's answer to this route."""

    # -- app ----------------------------------------------------------------------------------------

    def app(self) -> web.Application:
        middlewares = [self.metrics.middleware()] if self.metrics is not None else []
        app = web.Application(middlewares=[*middlewares, self._errors], client_max_size=MAX_BODY_BYTES)
        app.router.add_post(models.ROUTE_COLLECTION, self.create)
        app.router.add_get(models.ROUTE_ITEM, self.get)
        app.router.add_delete(models.ROUTE_ITEM, self.delete)
        app.router.add_get("/healthz", self.healthz)
        app.router.add_get("/readyz", self.readyz)
        app.router.add_get(models.ROUTE_OPENAPI, self.openapi)
        if self.metrics is not None:  # unauthenticated, like /healthz: cluster-internal
            app.router.add_get("/metrics", self.metrics.handler)
        app.on_cleanup.append(self._close)
        return app

    def runner(self, app: web.Application | None = None) -> web.AppRunner:
        """An aiohttp runner of `app` (default `self.app()`) that closes a connection whose request line and
        headers did not arrive within `header_timeout_s` (aiohttp's keep-alive timer, which also runs from
        the moment a connection opens until its first request is complete), and that reads the unread rest
        of a body answered early (401, 408, 413) for at most LINGER_S."""
        return web.AppRunner(app if app is not None else self.app(), access_log=None, **self._server_timeouts())

    def serve(self, host: str, port: int) -> None:
        """Serve `self.app()` on host:port until interrupted, with the runner's timeouts."""
        web.run_app(self.app(), host=host, port=port, access_log=None, print=None, **self._server_timeouts())

    def _server_timeouts(self) -> dict[str, float]:
        return {"keepalive_timeout": self.config.limits.header_timeout_s, "lingering_time": LINGER_S}

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

    # -- the request's parts ----------------------------------------------------------------------------

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

    async def _parse(self, request: web.Request) -> models.CreateSessionRequest:
        timeout_s = self.config.limits.body_timeout_s
        try:
            async with asyncio.timeout(timeout_s):
                raw = await request.read()
        except TimeoutError:
            raise ApiFailure(408, "body_timeout", f"request body not received within {timeout_s:g}s", "body",
                             {"Connection": "close"}) from None
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
        if json_depth(data) > MAX_JSON_DEPTH:
            raise ApiFailure(400, "malformed_body", f"request body is nested too deeply (over {MAX_JSON_DEPTH} "
                             "levels): expected a JSON object of the documented shape", "body")
        try:
            return models.CreateSessionRequest.model_validate(data)
        except pydantic.ValidationError as exc:
            path, msg = models.first_validation_problem(exc)
            raise ApiFailure(422, "invalid_field", f"{path}: {msg}", path) from None

    def _session_name(self, request: web.Request) -> str:
        sid = request.match_info["id"]
        if not re.fullmatch(models.SESSION_ID_PATTERN, sid):
            raise ApiFailure(404, "unknown_session", "no session with this id: expected rt- and lowercase ASCII "
                             "letters, digits or '-'", "id")
        return sid
