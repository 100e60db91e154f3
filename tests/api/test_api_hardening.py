"""The session gateway refuses hostile input with a 4xx naming the field, before it reaches Kubernetes.

No Kubernetes API is needed here and none is given: the API is pointed at a loopback port where nothing
listens, so a request that got past validation would answer 503 `kubernetes_unavailable` (or a 500),
never the 4xx each test expects. The HTTP side is real: aiohttp's server, raw bytes over a socket where an
HTTP client library would refuse to send them.
"""

from __future__ import annotations

import asyncio
import json
import random
import socket
from typing import Any

import kubernetes
import pytest
from aiohttp.test_utils import TestClient, TestServer
from vivant.gateway import models
from vivant.gateway import server as session_api

KEY = "vk_test_0123456789abcdef"
AUTH = {"Authorization": f"Bearer {KEY}"}
TOKEN = "eyJhbGciOiJIUzI1NiJ9.hardening-test-token"


def body(**livekit: Any) -> dict[str, Any]:
    lk = {"url": "wss://lk.example.com", "token": TOKEN, "roomName": "room-1", "agentIdentity": "agent-1"}
    lk.update(livekit)
    return {"avatar": {"type": "custom", "avatarId": "ada"}, "livekit": lk}


def closed_port() -> int:
    """A loopback port where nothing listens."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
async def client() -> Any:
    kube = kubernetes.client.ApiClient(kubernetes.client.Configuration(host=f"http://127.0.0.1:{closed_port()}"))
    config = session_api.ApiConfig(namespace="team-a", avatars={
        "ada": session_api.AvatarEntry(character="ada-v1", pool="h200")},
        limits=session_api.ApiLimits(kube_attempts=1, kube_timeout_s=2))
    api = session_api.SessionApi(config, session_api.ApiKeys(static=(KEY,)), kube)
    async with TestClient(TestServer(api.app(janitor=False))) as c:
        yield c
    kube.close()


async def raw_request(client: Any, head: bytes, payload: bytes = b"") -> tuple[int, dict[str, Any]]:
    """Send exact bytes (an HTTP library would refuse some of them); (status, JSON body)."""
    reader, writer = await asyncio.open_connection(client.server.host, client.server.port)
    writer.write(head + f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n".encode() + payload)
    await writer.drain()
    raw = await asyncio.wait_for(reader.read(), 30)
    writer.close()
    status = int(raw.split(b" ", 2)[1])
    text = raw.split(b"\r\n\r\n", 1)[1]
    return status, json.loads(text) if text.startswith(b"{") else {"raw": text.decode("latin-1")}


@pytest.mark.parametrize("value", [b"Bearer \xff\xfe\xfd", b"Bearer vk_\xc3\xa9t\xc3\xa9", b"\xff\xff \xff"])
async def test_non_utf8_authorization_is_401_not_500(client: Any, value: bytes) -> None:
    """Fact 1 of issue 15: non-UTF-8 bytes in Authorization were a 500 (UnicodeEncodeError in the key check)."""
    for head in (b"GET /v1/realtime_sessions/rt-abc HTTP/1.1\r\nHost: x\r\n",
                 b"POST /v1/realtime_sessions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"):
        status, got = await raw_request(client, head + b"Authorization: " + value + b"\r\n", json.dumps(body()).encode())
        assert status == 401, (value, status, got)
        assert got["error"]["field"] == "Authorization", got


@pytest.mark.parametrize(("name", "payload", "expect"), [
    ("nested-1000", b'{"a":' * 1000 + b"1" + b"}" * 1000, "nested too deeply"),
    ("nested-arrays", b"[" * 30_000 + b"]" * 30_000, "nested too deeply"),
    ("int-5000-digits", b'{"maxDuration": ' + b"9" * 5000 + b"}", "too many digits"),
    ("int-in-field", json.dumps(body()).encode()[:-1] + b', "maxDuration": ' + b"1" * 4400 + b"}", "too many digits"),
])
async def test_pathological_json_is_400_not_500(client: Any, name: str, payload: bytes, expect: str) -> None:
    """Fact 2: deeply nested JSON (RecursionError) and a 5,000-digit integer (ValueError) were 500s."""
    resp = await client.post(models.ROUTE_COLLECTION, data=payload, headers={**AUTH, "Content-Type": "application/json"})
    got = await resp.json()
    assert resp.status == 400, (name, resp.status, got)
    assert got["error"] == {"code": "malformed_body", "field": "body", "message": got["error"]["message"]}, got
    assert expect in got["error"]["message"], got


@pytest.mark.parametrize("sid", ["rt-ａｂｃ", "rt-٣٤٥", "rt-ß", "rt-abc\u00b2", "rt-ABC", "rt-a_b"])
async def test_session_ids_outside_ascii_are_unknown(client: Any, sid: str) -> None:
    """Fact 12: non-ASCII letters and digits (fullwidth, Arabic-Indic, ß, superscript two) passed the id check."""
    for method in ("GET", "DELETE"):
        resp = await client.request(method, f"/v1/realtime_sessions/{sid}", headers=AUTH)
        got = await resp.json()
        assert resp.status == 404 and got["error"]["code"] == "unknown_session", (method, sid, resp.status, got)
        assert got["error"]["field"] == "id", got


@pytest.mark.parametrize(("header", "value"), [("Idempotency-Key", "é-not-ascii"), ("Idempotency-Key", "x" * 256),
                                                ("Idempotency-Key", "")])
async def test_bad_idempotency_key_is_400_naming_the_header(client: Any, header: str, value: str) -> None:
    resp = await client.post(models.ROUTE_COLLECTION, json=body(), headers={**AUTH, header: value})
    got = await resp.json()
    assert resp.status == 400 and got["error"]["field"] == "Idempotency-Key", (resp.status, got)


@pytest.mark.parametrize(("field", "value", "reason"), [
    ("roomName", "", "no room name"),
    ("roomName", "r" * 257, "room name length exceeds limits: max length 256"),
    ("roomName", "é" * 129, "room name length exceeds limits: max length 256"),  # 129 chars, 258 bytes
    ("agentIdentity", "", "identity cannot be empty"),
    ("agentIdentity", "ü" * 200, "participant identity length exceeds limits: max length 256"),
])
async def test_only_what_livekit_refuses_is_refused_with_its_reason(client: Any, field: str, value: str,
                                                                    reason: str) -> None:
    """Fact 11, the refusing half: LiveKit refuses an empty name and one over 256 bytes; so does the API, in
    LiveKit's words (tests/livekit/test_livekit_names.py asks a real livekit-server)."""
    resp = await client.post(models.ROUTE_COLLECTION, json=body(**{field: value}), headers=AUTH)
    got = await resp.json()
    assert resp.status == 422 and got["error"]["field"] == f"livekit.{field}", (resp.status, got)
    assert reason in got["error"]["message"], got


@pytest.mark.parametrize("field", ["roomName", "agentIdentity"])
@pytest.mark.parametrize("escaped", ["\\ud800", "room-\\udfff-1", "\\udc80\\ud800"])
async def test_a_lone_surrogate_is_refused_naming_the_field(client: Any, field: str, escaped: str) -> None:
    """Item 9 of issue 36: JSON may escape a lone surrogate (\\ud800), which UTF-8 cannot hold; the room name
    was stored with U+FFFD in its place, without a word. It is a 422 naming the field now."""
    text = json.dumps(body(**{field: "PLACEHOLDER"})).replace("PLACEHOLDER", escaped)
    resp = await client.post(models.ROUTE_COLLECTION, data=text.encode(), headers={**AUTH, "Content-Type": "application/json"})
    got = await resp.json()
    assert resp.status == 422 and got["error"]["field"] == f"livekit.{field}", (resp.status, got)
    assert "lone surrogate" in got["error"]["message"], got


async def test_openapi_document_is_served_without_a_key(client: Any) -> None:
    resp = await client.get(models.ROUTE_OPENAPI)
    doc = await resp.json()
    assert resp.status == 200 and doc["openapi"].startswith("3.1"), doc
    assert set(doc["paths"]) == {models.ROUTE_COLLECTION, models.ROUTE_ITEM}
    lk = doc["components"]["schemas"]["LiveKitJoin"]["properties"]
    assert lk["roomName"]["maxLength"] == 256 and "pattern" not in lk["roomName"], lk["roomName"]


FUZZ_REQUESTS = 400


async def test_random_garbage_never_reaches_a_5xx_and_never_passes_auth(client: Any) -> None:
    """Our own fuzzing, beside schemathesis: random bytes as headers, bodies, paths and methods. Every answer
    is a 4xx; a request without the right key is never served. Seeded, so a failure repeats."""
    rnd = random.Random(15)
    alphabet = [bytes([b]) for b in range(32, 256) if b not in b"\r\n:"]
    seen: dict[int, int] = {}
    for i in range(FUZZ_REQUESTS):
        keyed = i % 2 == 0
        auth = b"Bearer " + KEY.encode() if keyed else b"Bearer " + b"".join(rnd.choices(alphabet, k=rnd.randint(0, 40)))
        method = rnd.choice([b"GET", b"POST", b"DELETE", b"PUT", b"PATCH"])
        path = rnd.choice([b"/v1/realtime_sessions", b"/v1/realtime_sessions/rt-" + bytes(rnd.choices(b"abc0-_%", k=8)),
                           b"/v1/realtime_sessions/" + b"".join(rnd.choices([b"%ff", b"%00", b"..", b"a"], k=4))])
        payload = rnd.choice([
            json.dumps(body(roomName="".join(chr(rnd.randint(1, 0x2FFF)) for _ in range(rnd.randint(0, 300))))).encode(),
            bytes(rnd.randint(0, 255) for _ in range(rnd.randint(0, 200))),
            b"[" * rnd.randint(1, 3000), b'{"avatar": ' + b"9" * rnd.randint(1, 6000) + b"}",
        ])
        head = method + b" " + path + b" HTTP/1.1\r\nHost: x\r\nAuthorization: " + auth + b"\r\n"
        status, got = await raw_request(client, head, payload)
        seen[status] = seen.get(status, 0) + 1
        assert status < 500 or (status == 503 and got.get("error", {}).get("code") == "kubernetes_unavailable"
                                and keyed), (i, method, path, status, got)
        if not keyed and path.startswith(b"/v1/"):
            assert status in (400, 401, 404, 405), (i, method, path, status, got)  # 400: unparsable; 404/405: no route
    assert seen.get(401, 0) > 0 and len(seen) > 2, seen
