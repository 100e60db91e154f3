"""Session gateway (`vivant.gateway.server`) over HTTP, against a Kubernetes API emulator.

Stand-in: no kube-apiserver can run here (ENVIRONMENT.md), so the Kubernetes API is kmock's
`KubernetesEmulator`, subclassed to stamp `uid`/`creationTimestamp` on create like a real server. It
does not validate against the CRD schema, so every CharacterSession the API writes is checked here with
jsonschema against the generated CRD and parsed with the operator's pydantic models. The HTTP side is
real: aiohttp's test server, requests with an aiohttp client, the same bodies `livekit-plugins-runway`
sends.

Behaviours: create/get/delete round trip; every malformed or unauthorized request answered with a
precise JSON error and nothing written; unknown pool and a full pool answered 503 + Retry-After; the
caller's LiveKit token lands only in the Secret (never in a CR, a response or a log line).
"""

from __future__ import annotations

import asyncio
import copy
import logging
import uuid
from datetime import UTC, datetime
from typing import Any

import jsonschema
import kmock
import kubernetes
import pytest
import yaml
from aiohttp.test_utils import TestClient, TestServer
from vivant.apis import crdgen
from vivant.apis import resources as r
from vivant.gateway import server as session_api

NS = "team-a"
KEY = "vk_test_0123456789abcdef"
TOKEN = "eyJhbGciOiJIUzI1NiJ9.SECRET-LIVEKIT-TOKEN-" + uuid.uuid4().hex  # unique: searchable everywhere
AUTH = {"Authorization": f"Bearer {KEY}"}
SESSIONS = kmock.resource(r.GROUP, r.VERSION, r.SESSION_PLURAL)
POOLS = kmock.resource(r.GROUP, r.VERSION, r.POOL_PLURAL)
SECRETS = kmock.resource("", "v1", "secrets")
EVENTS = kmock.resource("", "v1", "events")


class StampingEmulator(kmock.KubernetesEmulator):
    """kmock plus what a real API server adds on create: uid and creationTimestamp."""

    async def _handle(self, request: Any) -> Any:
        if request.action == kmock.action.CREATE and isinstance(request.data, dict):
            meta = request.data.setdefault("metadata", {})
            meta.setdefault("uid", str(uuid.uuid4()))
            meta.setdefault("creationTimestamp", datetime.now(tz=UTC).strftime("%Y-%m-%dT%H:%M:%SZ"))
        return await super()._handle(request)


def body(**overrides: Any) -> dict[str, Any]:
    """The body livekit-plugins-runway posts, with our avatar id."""
    b: dict[str, Any] = {
        "model": "gwm1_avatars",
        "avatar": {"type": "custom", "avatarId": "ada"},
        "livekit": {"url": "wss://lk.example.com", "token": TOKEN, "roomName": "room-1", "agentIdentity": "agent-1"},
        "maxDuration": 300,
    }
    b.update(overrides)
    return b


def _crd_schema() -> dict[str, Any]:
    return crdgen.session_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def _writes(emulator: Any) -> list[str]:
    """Every create/patch/delete request the emulator received, as 'METHOD url'."""
    writes = (kmock.action.CREATE, kmock.action.UPDATE, kmock.action.DELETE)
    return [f"{req.method} {req.url}" for req in list(emulator) if req.action in writes]


def _objects(emulator: Any, resource: Any) -> list[dict[str, Any]]:
    return [obj.raw for (res, _, _), obj in emulator.objects.items() if res == resource and not obj.deleted]


@pytest.fixture
def kube(kmock: Any) -> Any:
    cfg = kubernetes.client.Configuration(host=str(kmock.url).rstrip("/"))
    client = kubernetes.client.ApiClient(cfg)
    yield client
    client.close()


def _pool(name: str, max_workers: int) -> dict[str, Any]:
    return {"apiVersion": r.API_VERSION, "kind": r.POOL_KIND, "metadata": {"name": name, "namespace": NS},
            "spec": {"model": {"preset": "tiny", "checkpoint": "/weights/tiny.safetensors"},
                     "image": "vivant/worker:dev", "maxWorkers": max_workers}}


@pytest.fixture
async def client(kube: Any, kmock: Any) -> Any:
    for res in (SESSIONS, POOLS, SECRETS, EVENTS):
        kmock.resources[f"{res.group}/{res.version}/{res.plural}".lstrip("/")] = {}
    custom = kubernetes.client.CustomObjectsApi(kube)
    for pool in (_pool("h200", 2), _pool("full", 1)):
        await asyncio.to_thread(custom.create_namespaced_custom_object, r.GROUP, r.VERSION, NS, r.POOL_PLURAL, pool)
    config = session_api.ApiConfig(namespace=NS, avatars={
        "ada": session_api.AvatarEntry(character="ada-v1", pool="h200"),
        "bob": session_api.AvatarEntry(character="bob-v1", pool="gone"),      # pool does not exist
        "cyd": session_api.AvatarEntry(character="cyd-v1", pool="full"),      # pool at capacity
    })
    api = session_api.SessionApi(config, session_api.ApiKeys(static=(KEY,)), kube)
    async with TestClient(TestServer(api.app())) as c:
        yield c


pytestmark = [pytest.mark.kmock(cls=StampingEmulator), pytest.mark.timeout(60)]


# ------------------------------------------------------------------------------------------ round trip


async def test_create_get_delete_round_trip(client: Any, kmock: Any) -> None:
    resp = await client.post("/v1/realtime_sessions", json=body(), headers=AUTH)
    assert resp.status == 201, f"create: expected 201, got {resp.status}: {await resp.text()}"
    sid = (await resp.json())["id"]

    [cr] = [o for o in _objects(kmock, SESSIONS) if o["metadata"]["name"] == sid]
    jsonschema.validate(cr, _crd_schema())  # what the API server would check
    parsed = r.CharacterSession.model_validate(cr)  # what the operator parses
    assert (parsed.spec.character, parsed.spec.pool) == ("ada-v1", "h200")
    assert (parsed.spec.livekit.room, parsed.spec.livekit.agent_identity) == ("room-1", "agent-1")
    assert parsed.spec.max_duration_seconds == 300
    [secret] = [s for s in _objects(kmock, SECRETS) if s["metadata"]["name"] == parsed.spec.livekit.token_secret]
    assert secret["stringData"]["token"] == TOKEN, "the caller's token must be stored in the named Secret"
    owner = secret["metadata"]["ownerReferences"][0]
    assert (owner["kind"], owner["name"], owner["uid"]) == ("CharacterSession", sid, cr["metadata"]["uid"])

    resp = await client.get(f"/v1/realtime_sessions/{sid}", headers=AUTH)
    got = await resp.json()
    assert resp.status == 200 and got["status"] == "NOT_READY" and got["phase"] == "Pending", got
    assert got["avatar"] == "ada"

    custom = kubernetes.client.CustomObjectsApi(_kube_of(kmock))
    await asyncio.to_thread(custom.patch_namespaced_custom_object, r.GROUP, r.VERSION, NS, r.SESSION_PLURAL, sid,
                            {"status": {"phase": "Streaming", "worker": "h200-0"}})
    got = await (await client.get(f"/v1/realtime_sessions/{sid}", headers=AUTH)).json()
    assert (got["status"], got["worker"]) == ("RUNNING", "h200-0"), got

    resp = await client.delete(f"/v1/realtime_sessions/{sid}", headers=AUTH)
    assert resp.status == 204, f"delete: expected 204, got {resp.status}"
    assert not [o for o in _objects(kmock, SESSIONS) if o["metadata"]["name"] == sid], "CR still there after DELETE"
    resp = await client.get(f"/v1/realtime_sessions/{sid}", headers=AUTH)
    assert resp.status == 404 and (await resp.json())["error"]["code"] == "unknown_session"
    resp = await client.delete(f"/v1/realtime_sessions/{sid}", headers=AUTH)
    assert resp.status == 404, "a second DELETE must say the session is unknown"


def _kube_of(emulator: Any) -> Any:
    return kubernetes.client.ApiClient(kubernetes.client.Configuration(host=str(emulator.url).rstrip("/")))


async def test_preset_avatar_and_default_duration(client: Any, kmock: Any) -> None:
    b = body(avatar={"type": "runway-preset", "presetId": "ada"})
    del b["maxDuration"], b["model"]
    resp = await client.post("/v1/realtime_sessions", json=b, headers=AUTH)
    assert resp.status == 201, await resp.text()
    [cr] = _objects(kmock, SESSIONS)
    assert cr["spec"]["maxDurationSeconds"] == 1800, "missing maxDuration must take the configured default"


# ------------------------------------------------------------------------------------------ bad requests


def _without(path: str) -> dict[str, Any]:
    b = body()
    node = b
    *parents, leaf = path.split(".")
    for p in parents:
        node = node[p]
    del node[leaf]
    return b


def _with(path: str, value: Any) -> dict[str, Any]:
    b = copy.deepcopy(body())
    node = b
    *parents, leaf = path.split(".")
    for p in parents:
        node = node[p]
    node[leaf] = value
    return b


JSON = "application/json"
# (case id, headers, raw body or JSON object, expected status, expected error code, expected field)
BAD_REQUESTS: list[tuple[str, dict[str, str], Any, int, str, str | None]] = [
    ("no-auth", {}, body(), 401, "missing_api_key", "Authorization"),
    ("basic-auth", {"Authorization": "Basic dXNlcjpwYXNz"}, body(), 401, "malformed_authorization", "Authorization"),
    ("bearer-empty", {"Authorization": "Bearer "}, body(), 401, "malformed_authorization", "Authorization"),
    ("wrong-key", {"Authorization": "Bearer vk_wrong"}, body(), 401, "invalid_api_key", "Authorization"),
    ("key-prefix", {"Authorization": f"Bearer {KEY[:-1]}"}, body(), 401, "invalid_api_key", "Authorization"),
    ("empty-body", AUTH, b"", 400, "malformed_body", "body"),
    ("not-json", AUTH, b"{avatar: ada", 400, "malformed_body", "body"),
    ("json-array", AUTH, b"[1, 2]", 400, "malformed_body", "body"),
    ("json-string", AUTH, b'"hello"', 400, "malformed_body", "body"),
    ("no-avatar", AUTH, _without("avatar"), 422, "invalid_field", "avatar"),
    ("no-livekit", AUTH, _without("livekit"), 422, "invalid_field", "livekit"),
    ("no-token", AUTH, _without("livekit.token"), 422, "invalid_field", "livekit.token"),
    ("no-room", AUTH, _without("livekit.roomName"), 422, "invalid_field", "livekit.roomName"),
    ("no-agent", AUTH, _without("livekit.agentIdentity"), 422, "invalid_field", "livekit.agentIdentity"),
    ("no-url", AUTH, _without("livekit.url"), 422, "invalid_field", "livekit.url"),
    ("ftp-url", AUTH, _with("livekit.url", "ftp://lk.example.com"), 422, "invalid_field", "livekit.url"),
    ("short-token", AUTH, _with("livekit.token", "abc"), 422, "invalid_field", "livekit.token"),
    ("token-number", AUTH, _with("livekit.token", 12345678901234567890), 422, "invalid_field", "livekit.token"),
    ("room-spaces", AUTH, _with("livekit.roomName", "my room"), 422, "invalid_field", "livekit.roomName"),
    ("avatar-type", AUTH, _with("avatar", {"type": "hologram", "avatarId": "ada"}), 422, "invalid_field", "avatar"),
    ("avatar-no-id", AUTH, _with("avatar", {"type": "custom"}), 422, "invalid_field", "avatar.avatarId"),
    ("duration-string", AUTH, _with("maxDuration", "300"), 422, "invalid_field", "maxDuration"),
    ("duration-short", AUTH, _with("maxDuration", 5), 422, "invalid_field", "maxDuration"),
    ("duration-long", AUTH, _with("maxDuration", 90_000), 422, "invalid_field", "maxDuration"),
    ("unknown-field", AUTH, _with("priority", "high"), 422, "invalid_field", "priority"),
    ("unknown-lk-field", AUTH, _with("livekit.apiSecret", "x"), 422, "invalid_field", "livekit.apiSecret"),
    ("unknown-avatar", AUTH, _with("avatar", {"type": "custom", "avatarId": "zed"}), 404, "unknown_avatar", "avatar"),
]


@pytest.mark.parametrize(("headers", "payload", "status", "code", "field"),
                         [c[1:] for c in BAD_REQUESTS], ids=[c[0] for c in BAD_REQUESTS])
async def test_bad_request_answers_precisely_and_writes_nothing(
    client: Any, kmock: Any, caplog: pytest.LogCaptureFixture,
    headers: dict[str, str], payload: Any, status: int, code: str, field: str | None,
) -> None:
    caplog.set_level(logging.DEBUG)
    before, writes_before = len(kmock.objects), _writes(kmock)
    if isinstance(payload, bytes):
        resp = await client.post("/v1/realtime_sessions", data=payload, headers={**headers, "Content-Type": JSON})
    else:
        resp = await client.post("/v1/realtime_sessions", json=payload, headers=headers)
    text = await resp.text()
    assert resp.status == status, f"expected HTTP {status}, got {resp.status}: {text}"
    err = (await resp.json())["error"]
    assert (err["code"], err.get("field")) == (code, field), f"expected ({code}, {field}), got {err}"
    assert err["message"], "an error must say what was expected"
    if status == 401:
        assert resp.headers.get("WWW-Authenticate", "").startswith("Bearer")
    assert len(kmock.objects) == before, f"a rejected request wrote objects: {list(kmock.objects)}"
    assert _writes(kmock) == writes_before, f"a rejected request sent writes: {_writes(kmock)[len(writes_before):]}"
    assert not _objects(kmock, SESSIONS) and not _objects(kmock, SECRETS), "nothing may be created"
    assert TOKEN not in text and TOKEN not in caplog.text, "the LiveKit token leaked into a response or log"


def test_there_are_at_least_twenty_bad_request_cases() -> None:
    assert len(BAD_REQUESTS) >= 20, f"only {len(BAD_REQUESTS)} bad-request cases"


@pytest.mark.parametrize(("method", "path", "status", "code"), [
    ("get", "/v1/realtime_sessions/rt-doesnotexist", 404, "unknown_session"),
    ("delete", "/v1/realtime_sessions/rt-doesnotexist", 404, "unknown_session"),
    ("get", "/v1/realtime_sessions/..%2Fsecrets", 404, "unknown_session"),
    ("put", "/v1/realtime_sessions", 405, "method_not_allowed"),
])
async def test_unknown_sessions_and_methods(client: Any, kmock: Any, method: str, path: str, status: int,
                                            code: str) -> None:
    before = len(kmock.objects)
    resp = await getattr(client, method)(path, headers=AUTH)
    assert resp.status == status, f"{method.upper()} {path}: expected {status}, got {resp.status}"
    assert (await resp.json())["error"]["code"] == code
    assert len(kmock.objects) == before


async def test_get_and_delete_need_a_key(client: Any, kmock: Any) -> None:
    sid = (await (await client.post("/v1/realtime_sessions", json=body(), headers=AUTH)).json())["id"]
    for method in ("get", "delete"):
        resp = await getattr(client, method)(f"/v1/realtime_sessions/{sid}")
        assert resp.status == 401, f"{method.upper()} without a key: expected 401, got {resp.status}"
    assert [o["metadata"]["name"] for o in _objects(kmock, SESSIONS)] == [sid], "an unauthorized DELETE deleted"


# ------------------------------------------------------------------------------------------ capacity


@pytest.mark.parametrize(("avatar", "code"), [("bob", "unknown_pool"), ("cyd", "no_capacity")])
async def test_unknown_or_full_pool_is_503_with_retry_after(client: Any, kmock: Any, avatar: str, code: str) -> None:
    if avatar == "cyd":  # fill pool "full" (maxWorkers 1) with one live session
        custom = kubernetes.client.CustomObjectsApi(_kube_of(kmock))
        await asyncio.to_thread(custom.create_namespaced_custom_object, r.GROUP, r.VERSION, NS, r.SESSION_PLURAL, {
            "apiVersion": r.API_VERSION, "kind": r.SESSION_KIND, "metadata": {"name": "busy", "namespace": NS},
            "spec": {"character": "c", "pool": "full",
                     "livekit": {"url": "wss://x.example", "room": "r", "agentIdentity": "a"}},
            "status": {"phase": "Streaming"}})
    before, writes_before = len(kmock.objects), _writes(kmock)
    resp = await client.post("/v1/realtime_sessions", json=body(avatar={"type": "custom", "avatarId": avatar}),
                             headers=AUTH)
    assert resp.status == 503, f"expected 503, got {resp.status}: {await resp.text()}"
    assert resp.headers.get("Retry-After") == "5", f"Retry-After: got {resp.headers.get('Retry-After')!r}"
    assert (await resp.json())["error"]["code"] == code
    assert len(kmock.objects) == before and _writes(kmock) == writes_before, "a 503 must write nothing"


async def test_ended_sessions_free_capacity(client: Any, kmock: Any) -> None:
    custom = kubernetes.client.CustomObjectsApi(_kube_of(kmock))
    await asyncio.to_thread(custom.create_namespaced_custom_object, r.GROUP, r.VERSION, NS, r.SESSION_PLURAL, {
        "apiVersion": r.API_VERSION, "kind": r.SESSION_KIND, "metadata": {"name": "done", "namespace": NS},
        "spec": {"character": "c", "pool": "full", "livekit": {"url": "wss://x.example", "room": "r",
                                                              "agentIdentity": "a"}},
        "status": {"phase": "Ended"}})
    resp = await client.post("/v1/realtime_sessions", json=body(avatar={"type": "custom", "avatarId": "cyd"}),
                             headers=AUTH)
    assert resp.status == 201, f"an Ended session must not count against capacity; got {resp.status}"


# ------------------------------------------------------------------------------------------ the token


async def test_token_only_in_its_secret(client: Any, kmock: Any, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    texts = []
    resp = await client.post("/v1/realtime_sessions", json=body(), headers=AUTH)
    texts.append(await resp.text())
    sid = (await resp.json())["id"]
    texts.append(await (await client.get(f"/v1/realtime_sessions/{sid}", headers=AUTH)).text())
    texts.append(await (await client.post("/v1/realtime_sessions", json=_with("maxDuration", 1),
                                          headers=AUTH)).text())
    for obj in [*_objects(kmock, SESSIONS), *_objects(kmock, EVENTS)]:
        assert TOKEN not in yaml.safe_dump(obj), f"token found in {obj['kind']} {obj['metadata']['name']}"
    for request in list(kmock):
        if request.resource != SECRETS:
            assert TOKEN not in request.text, f"token sent to the API server outside a Secret: {request.url}"
    assert [s for s in _objects(kmock, SECRETS) if TOKEN in yaml.safe_dump(s)], "positive control: Secret holds it"
    assert len(_writes(kmock)) >= 3, f"positive control: writes are recorded, got {_writes(kmock)}"
    assert all(TOKEN not in t for t in texts), "token in an API response"
    texts.append(await (await client.delete(f"/v1/realtime_sessions/{sid}", headers=AUTH)).text())
    assert TOKEN not in caplog.text, "token in a log line"
    assert any("created session" in rec.getMessage() for rec in caplog.records), "positive control: logs captured"


async def test_oversized_body_is_413_and_writes_nothing(client: Any, kmock: Any) -> None:
    before = len(kmock.objects)
    big = body(model="x" * (session_api.MAX_BODY_BYTES + 10))
    resp = await client.post("/v1/realtime_sessions", json=big, headers=AUTH)
    assert resp.status == 413, f"expected 413, got {resp.status}"
    assert (await resp.json())["error"]["code"] == "body_too_large"
    assert len(kmock.objects) == before


# ------------------------------------------------------------------------------------------ CLI


def test_cli_refuses_to_start_without_keys_or_with_a_bad_avatars_file(tmp_path: Any, monkeypatch: Any,
                                                                      capsys: Any) -> None:
    import argparse

    monkeypatch.delenv("VIVANT_API_KEYS", raising=False)
    parser = argparse.ArgumentParser()
    session_api.add_arguments(parser)
    good = tmp_path / "avatars.yaml"
    good.write_text("avatars:\n  ada: {character: ada-v1, pool: h200}\n")
    assert session_api.run(parser.parse_args(["--avatars", str(good)])) == 2
    assert "no API keys" in capsys.readouterr().out
    bad = tmp_path / "bad.yaml"
    bad.write_text("avatars:\n  ada: {character: ada-v1, pool: H200!}\n")
    assert session_api.run(parser.parse_args(["--avatars", str(bad)])) == 2
    assert "pool" in capsys.readouterr().out, "the error must name the bad field"


def test_keys_file_is_reread_when_the_secret_changes(tmp_path: Any) -> None:
    import os

    path = tmp_path / "keys"
    path.write_text("# rotated weekly\nkey-one\n")
    keys = session_api.ApiKeys(path=path)
    assert keys.accepts("key-one") and not keys.accepts("key-two") and not keys.accepts("# rotated weekly")
    path.write_text("key-two\n")
    os.utime(path, (1, 1))  # a new mtime, as a Secret update swaps the file
    assert keys.accepts("key-two") and not keys.accepts("key-one")
    assert "key-two" not in repr(keys), "keys must not appear in repr"


# ------------------------------------------------------------------------------------------ outages, metrics


async def test_kubernetes_unreachable_is_503_with_retry_after(caplog: pytest.LogCaptureFixture) -> None:
    from conftest import free_port

    cfg = kubernetes.client.Configuration(host=f"http://127.0.0.1:{free_port()}")  # nothing listens there
    cfg.retries = 0
    config = session_api.ApiConfig(namespace=NS, avatars={"ada": session_api.AvatarEntry(character="a", pool="h200")})
    api = session_api.SessionApi(config, session_api.ApiKeys(static=(KEY,)), kubernetes.client.ApiClient(cfg))
    caplog.set_level(logging.DEBUG)
    async with TestClient(TestServer(api.app())) as c:
        resp = await c.post("/v1/realtime_sessions", json=body(), headers=AUTH)
        text = await resp.text()
    assert resp.status == 503 and resp.headers.get("Retry-After") == "5", f"got {resp.status}: {text}"
    assert (await resp.json())["error"]["code"] == "kubernetes_unavailable"
    assert TOKEN not in text and TOKEN not in caplog.text


async def test_requests_are_counted_by_route_template(kube: Any, kmock: Any) -> None:
    from prometheus_client import CollectorRegistry
    from vivant.gateway.metrics import ApiMetrics

    for res in (SESSIONS, POOLS, SECRETS, EVENTS):
        kmock.resources[f"{res.group}/{res.version}/{res.plural}".lstrip("/")] = {}
    registry = CollectorRegistry()
    config = session_api.ApiConfig(namespace=NS, avatars={})
    api = session_api.SessionApi(config, session_api.ApiKeys(static=(KEY,)), kube, ApiMetrics(registry))
    async with TestClient(TestServer(api.app())) as c:
        await c.get("/v1/realtime_sessions/rt-abc", headers=AUTH)
        await c.post("/v1/realtime_sessions", json=body())
    def count(route: str, method: str, code: str) -> float | None:
        return registry.get_sample_value("vivant_api_requests_total", {"method": method, "route": route, "code": code})
    assert count("/v1/realtime_sessions/{id}", "GET", "404") == 1.0
    assert count("/v1/realtime_sessions", "POST", "401") == 1.0
    async with TestClient(TestServer(api.app())) as c:
        exposition = await (await c.get("/metrics")).text()
    assert 'vivant_api_requests_total{code="401",method="POST",route="/v1/realtime_sessions"} 1.0' in exposition
