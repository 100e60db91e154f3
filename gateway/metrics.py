"""Prometheus metrics of the session gateway: requests by method, route and status code, and their duration.

Why `route` and not the path: the route template (`/v1/realtime_sessions/{id}`) keeps the label set
bounded; a raw path would mint a series per session name. `middleware()` gives an aiohttp middleware
that records both series for every request, including ones answered by an exception (`HTTPNotFound`
and friends carry `.status`; anything else counts as 500). This module imports aiohttp only inside
`handler`, so the metric set can be used and tested without a web server. `handler` serves the
registry at `/metrics` on the gateway's own port (the chart's monitors scrape it there):
`app.router.add_get("/metrics", metrics.handler)`.

Series:

| series | type | labels |
|---|---|---|
| vivant_api_requests_total | counter | method, route, code |
| vivant_api_request_duration_seconds | histogram | method, route |
"""

from __future__ import annotations

import math
import time
from collections.abc import Awaitable, Callable
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    REGISTRY,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)

DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
UNMATCHED_ROUTE = "unmatched"


class ApiMetrics:
    """The API's metric set on one registry (a fresh `CollectorRegistry` in tests)."""

    def __init__(self, registry: CollectorRegistry = REGISTRY) -> None:
        self.registry = registry
        self._requests = Counter(
            "vivant_api_requests", "Session API requests by method, route template and status code.",
            ["method", "route", "code"], registry=registry,
        )
        self._duration = Histogram(
            "vivant_api_request_duration_seconds", "Session API request handling time.",
            ["method", "route"], buckets=DURATION_BUCKETS, registry=registry,
        )

    def observe_request(self, method: str, route: str, code: int, seconds: float) -> None:
        if not isinstance(method, str) or not method:
            raise ValueError(f"method: expected an HTTP method, got {method!r}")
        if not isinstance(route, str) or not route:
            raise ValueError(f"route: expected a route template, got {route!r}")
        if isinstance(code, bool) or not isinstance(code, int) or not 100 <= code <= 599:
            raise ValueError(f"code: expected an HTTP status 100..599, got {code!r}")
        v = float(seconds)
        if math.isnan(v) or math.isinf(v) or v < 0:
            raise ValueError(f"seconds: expected a finite non-negative duration, got {seconds!r}")
        m = method.upper()
        self._requests.labels(method=m, route=route, code=str(code)).inc()
        self._duration.labels(method=m, route=route).observe(v)

    def middleware(self) -> Callable[[Any, Callable[[Any], Awaitable[Any]]], Awaitable[Any]]:
        """An aiohttp (new-style) middleware: `web.Application(middlewares=[metrics.middleware()])`."""

        async def record_request(request: Any, handler: Callable[[Any], Awaitable[Any]]) -> Any:
            start = time.perf_counter()
            code = 500
            try:
                response = await handler(request)
                code = int(getattr(response, "status", 200))
                return response
            except Exception as exc:  # aiohttp's HTTPException subclasses carry the status
                code = int(getattr(exc, "status", 500) or 500)
                raise
            finally:
                self.observe_request(request.method, route_template(request), code, time.perf_counter() - start)

        # What aiohttp's `@web.middleware` sets: marks a (request, handler) middleware, not an old-style factory.
        record_request.__middleware_version__ = 1  # type: ignore[attr-defined]
        return record_request

    async def handler(self, request: Any) -> Any:
        """aiohttp handler of GET /metrics: the registry in the Prometheus text format."""
        from aiohttp import web

        response = web.Response(body=generate_latest(self.registry))
        response.headers["Content-Type"] = CONTENT_TYPE_LATEST
        return response


def route_template(request: Any) -> str:
    """The matched route's template (e.g. `/v1/realtime_sessions/{id}`), or 'unmatched'."""
    try:
        info = request.match_info.route.resource
    except AttributeError:
        return UNMATCHED_ROUTE
    if info is None:
        return UNMATCHED_ROUTE
    return getattr(info, "canonical", None) or UNMATCHED_ROUTE
