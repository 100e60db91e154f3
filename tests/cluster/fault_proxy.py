"""A fault-injecting HTTP proxy on loopback in front of the real kube-apiserver (a test tool).

The session API talks plain HTTP to the proxy; the proxy forwards each call to the apiserver over TLS with
the cluster's admin client certificate. A fraction `rate` of the calls (chosen by a seeded RNG, so a run
repeats) meets one of these faults, in equal shares:

| fault | what the apiserver did | what the client sees |
|---|---|---|
| `error` | nothing | 500, 503 or 504 with a Status body |
| `drop_before` | nothing | the connection closed without an answer |
| `drop_after` | the call was carried out | the connection closed without an answer |
| `delay` | the call was carried out, `delay_s` late | no answer within its own timeout (when `delay_s` exceeds it) |

`delay_all_s` delays every call (no failure): a slow apiserver, for the load-shedding tests. `fail` (a
regular expression on "METHOD /path") answers every matching call 503 without forwarding it: one kind of
write that keeps failing. Counts of what was injected are in `counts`. The apiserver behind it is the real one: nothing is emulated.
"""

from __future__ import annotations

import asyncio
import random
import re
import ssl
import threading
from collections import Counter
from typing import Any

import aiohttp
from aiohttp import web

FAULTS = ("error", "drop_before", "drop_after", "delay")
HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "host", "content-encoding"}


class FaultProxy:
    def __init__(self, kubeconfig: str, *, rate: float = 0.0, seed: int = 0, delay_s: float = 3.0,
                 delay_all_s: float = 0.0, fail: str | None = None) -> None:
        import kubernetes

        cfg = kubernetes.client.Configuration()
        kubernetes.config.load_kube_config(config_file=kubeconfig, client_configuration=cfg)
        self.upstream = cfg.host.rstrip("/")
        self._ssl = ssl.create_default_context(cafile=cfg.ssl_ca_cert)
        self._ssl.load_cert_chain(cfg.cert_file, cfg.key_file)
        self.rate, self.delay_s, self.delay_all_s, self.fail = rate, delay_s, delay_all_s, fail
        self.rng = random.Random(seed)
        self.counts: Counter[str] = Counter()
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("fault proxy did not start")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self._start())
        self._ready.set()
        self._loop.run_forever()

    async def _start(self) -> None:
        self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=self._ssl, limit=64))
        app = web.Application(client_max_size=16 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    async def _forward(self, request: web.Request, data: bytes) -> tuple[int, dict[str, str], bytes]:
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP}
        if data and "Content-Type" not in request.headers:  # else aiohttp would send application/octet-stream
            headers["Content-Type"] = "application/json"  # what the apiserver assumes without one
        async with self._session.request(request.method, self.upstream + request.path_qs, headers=headers,
                                         data=data or None) as resp:
            body = await resp.read()
            out = {k: v for k, v in resp.headers.items() if k.lower() not in HOP_BY_HOP}
            return resp.status, out, body

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        data = await request.read()
        fault = self.rng.choice(FAULTS) if self.rng.random() < self.rate else None
        if self.fail and re.search(self.fail, f"{request.method} {request.path}"):
            fault = "error"
        self.counts["calls"] += 1
        if fault:
            self.counts[fault] += 1
        if self.delay_all_s:
            await asyncio.sleep(self.delay_all_s)
        if fault == "error":
            code = self.rng.choice((500, 503, 504))
            return web.json_response({"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": code,
                                      "message": "injected fault"}, status=code)
        if fault == "drop_before":
            request.transport.abort()  # type: ignore[union-attr]
            return web.Response(status=500)
        if fault == "delay":
            await asyncio.sleep(self.delay_s)
        status, headers, body = await self._forward(request, data)
        if fault == "drop_after":
            request.transport.abort()  # type: ignore[union-attr]
        return web.Response(status=status, headers=headers, body=body)

    def set(self, **changes: Any) -> None:
        """Change `rate`, `delay_s`, `delay_all_s` or `fail` while it runs."""
        for key, value in changes.items():
            setattr(self, key, value)

    def close(self) -> None:
        async def stop() -> None:
            await self._runner.cleanup()
            await self._session.close()

        asyncio.run_coroutine_threadsafe(stop(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
