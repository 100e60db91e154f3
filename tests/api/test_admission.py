"""The session gateway under a burst and under slow clients: what is beyond its gates is answered at once,
and a connection that sends its request too slowly is dropped.

The Kubernetes API here is `Tarpit`: a loopback TCP server that accepts every connection, reads what it is
sent and answers nothing until the test lets go (then it closes them all). Why not the real apiserver:
these tests need every admitted create to stay in flight, for as long as the test looks at the gates, and
then to finish at a moment the test picks; a real apiserver answers in milliseconds. Everything on the
gateway's side is real: aiohttp's server on a loopback port, the `kubernetes` client in the gates' threads,
and clients sending real HTTP.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import kubernetes
import pytest
from aiohttp import web
from vivant.gateway import models
from vivant.gateway import server as session_api

pytestmark = pytest.mark.timeout(120)
KEY = "vk_test_0123456789abcdef"
AUTH = {"Authorization": f"Bearer {KEY}"}


def body() -> dict[str, Any]:
    return {"avatar": {"type": "custom", "avatarId": "ada"},
            "livekit": {"url": "wss://lk.example.com", "token": "eyJhbGciOiJIUzI1NiJ9.admission-test-token",
                        "roomName": "room-1", "agentIdentity": "agent-1"}}


async def until(what: str, cond: Any, timeout: float) -> None:
    """Yield to the event loop (where the gateway runs) until `cond()` is true; AssertionError after `timeout` s."""
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        await asyncio.sleep(0.02)


class Tarpit:
    """A TCP server that accepts and reads, answers nothing, and closes every connection on `release()`."""

    def __init__(self) -> None:
        self.connections: list[asyncio.StreamWriter] = []
        self.released = asyncio.Event()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections.append(writer)
        with contextlib.suppress(ConnectionError):
            while not self.released.is_set() and await reader.read(65536):
                pass
        writer.close()

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self.server.sockets[0].getsockname()[1]

    def release(self) -> None:
        self.released.set()
        for writer in self.connections:
            writer.close()


@contextlib.asynccontextmanager
async def gateway(kube_url: str, **limits: Any) -> AsyncIterator[tuple[session_api.SessionApi, str]]:
    """The Kubernetes-backed gateway on a loopback port, served through its own runner (its timeouts)."""
    kube = kubernetes.client.ApiClient(kubernetes.client.Configuration(host=kube_url))
    config = session_api.ApiConfig(namespace="team-a", retry_after_s=2, avatars={
        "ada": session_api.AvatarEntry(character="ada-v1", pool="h200")},
        limits=session_api.ApiLimits(**limits))
    api = session_api.SessionApi(config, session_api.ApiKeys(static=(KEY,)), kube)
    runner = api.runner(api.app(janitor=False))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield api, f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()
        kube.close()


async def test_a_simultaneous_burst_beyond_running_and_queued_is_shed_at_once() -> None:
    """Defect 5 of issue 36: `in_flight` rose only after the awaited acquire, so every request of a burst
    queued (100 parallel creates: 0 shed against 8 running + 32 queued). Here 100 creates are sent at once
    while the Kubernetes API holds every admitted one: exactly 8 run, 32 wait, and the other 60 are answered
    503 overloaded with Retry-After before any admitted request has finished."""
    tarpit = Tarpit()
    port = await tarpit.start()
    burst, running, queued = 100, 8, 32
    async with gateway(f"http://127.0.0.1:{port}", max_in_flight_creates=running, max_queued_creates=queued,
                       queue_timeout_s=120, kube_timeout_s=120, kube_attempts=1) as (api, url):
        answers: list[tuple[int, dict[str, Any], dict[str, str]]] = []
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:

            async def create() -> None:
                async with http.post(url + models.ROUTE_COLLECTION, json=body(), headers=AUTH) as resp:
                    answers.append((resp.status, await resp.json(), dict(resp.headers)))

            tasks = [asyncio.create_task(create()) for _ in range(burst)]
            gate = api.creates
            # every request accounted for: answered, running or waiting
            await until("the whole burst arrived and the gate's running slots taken",
                        lambda: len(answers) + gate.in_flight + gate.waiting == burst and gate.in_flight == running, 60)
            shed_now = list(answers)
            held = (gate.in_flight, gate.waiting)
            async with http.get(url + "/readyz") as resp:
                ready = resp.status
            tarpit.release()
            await asyncio.gather(*tasks)
    assert held == (running, queued), f"(running, waiting) while Kubernetes held every call: {held}"
    codes = Counter(status for status, _, _ in shed_now)
    assert codes == {503: burst - running - queued}, f"answered before any admitted create finished: {codes}"
    assert all(got["error"]["code"] == "overloaded" and headers.get("Retry-After") for _, got, headers in shed_now), \
        shed_now[:3]
    assert ready == 503, "readiness must say 503 while the gate is full"
    later = Counter(got["error"]["code"] for _, got, _ in answers[len(shed_now):])
    assert later == {"kubernetes_unavailable": running + queued}, f"the admitted creates ended with {later}"
    assert gate.shed == burst - running - queued


async def _slow_headers(port: int, every_s: float, limit_s: float) -> float:
    """Send a request line, then one header byte every `every_s`; seconds until the server closed the
    connection (`limit_s` when it never did)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    start = time.monotonic()
    writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
    try:
        while time.monotonic() - start < limit_s:
            writer.write(b"X")
            await writer.drain()
            with contextlib.suppress(TimeoutError):
                if await asyncio.wait_for(reader.read(1024), every_s) == b"":
                    return time.monotonic() - start
    except ConnectionError:
        return time.monotonic() - start
    finally:
        writer.close()
    return limit_s


async def test_a_client_that_sends_its_headers_too_slowly_is_disconnected() -> None:
    """Defect 5: 200 clients trickling their headers held their connections for 60 s. With
    header_timeout_s = 1 the server closes such a connection while the client is still sending."""
    async with gateway("http://127.0.0.1:9", header_timeout_s=1) as (_, url):
        port = int(url.rsplit(":", 1)[1])
        held = await _slow_headers(port, every_s=0.1, limit_s=20)
    assert held < 20, "the server kept a connection whose headers never completed"


async def test_a_body_that_does_not_arrive_is_408() -> None:
    """Defect 5: a body sent too slowly held the request. With body_timeout_s = 1, a create whose body stops
    after 10 of 1,000 announced bytes is answered 408 `body_timeout`, naming the body."""
    async with gateway("http://127.0.0.1:9", body_timeout_s=1) as (_, url):
        port = int(url.rsplit(":", 1)[1])
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(f"POST {models.ROUTE_COLLECTION} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
                     "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"avatar\":".encode())
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30)
        length = int(next(line.split(b":", 1)[1] for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length:")))
        got = json.loads(await asyncio.wait_for(reader.readexactly(length), 30))
        writer.close()
    assert int(head.split(b" ", 2)[1]) == 408, head
    assert (got["error"]["code"], got["error"]["field"]) == ("body_timeout", "body"), got
