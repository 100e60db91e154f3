"""The session gateway (`vivant.gateway.server`) over HTTP, on the real apiserver.

Real: the kube-apiserver with the project's CRDs — it checks every CharacterSession the gateway writes
against the CRD's schema, stamps uid and creationTimestamp, keeps status in its subresource, folds a
Secret's stringData into data, answers 404 and quota refusals itself — and its garbage collector, which
deletes a session's token Secret with the session. The HTTP side is real too: the gateway's aiohttp app
on aiohttp's test server in this process, requested with an aiohttp client and the bodies
`livekit-plugins-runway` sends.

In this process rather than the helm-installed API pod: each test gets a namespace, pools and avatars of
its own, the gateway's log lines, and every request the gateway sends to the apiserver — recorded by its
own `kubernetes` client (`RecordingApiClient`, which sends them on unchanged) so that "a rejected request
writes nothing" is checked on the wire as well as in the namespace. The API pod of the chart is the flow
tests' subject. No operator runs meanwhile (`release_operators_paused`): where a test needs a phase, it
writes the status an operator would.

Behaviours: create/get/delete round trip; every malformed or unauthorized request answered with a
precise JSON error and nothing written; unknown pool and a full pool answered 503 + Retry-After; a
CharacterSession the apiserver refuses leaves no Secret behind; the caller's LiveKit token lands only in
the Secret (never in a CR, a request for anything else, a response or a log line).
"""

from __future__ import annotations

import base64
import copy
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer
from conftest import wait_for
from gateway_support import AUTH, KEY, TOKEN, GatewaySpace, RecordingApiClient, body
from vivant.apis import resources
from vivant.gateway import server as session_api

pytestmark = [pytest.mark.usefixtures("vivant_crds", "release_operators_paused"), pytest.mark.timeout(120)]


@pytest.fixture
async def client(gateway_space: GatewaySpace, gateway_kube: RecordingApiClient) -> AsyncIterator[TestClient]:
    config = session_api.ApiConfig(namespace=gateway_space.name, avatars={
        "ada": session_api.AvatarEntry(character="ada-v1", pool="h200"),
        "bob": session_api.AvatarEntry(character="bob-v1", pool="gone"),      # pool does not exist
        "cyd": session_api.AvatarEntry(character="cyd-v1", pool="full"),      # pool at capacity
    })
    api = session_api.SessionApi(config, session_api.ApiKeys(static=(KEY,)), gateway_kube)
    async with TestClient(TestServer(api.app())) as c:
        yield c


# ------------------------------------------------------------------------------------------ round trip


async def test_create_get_delete_round_trip(client: TestClient, gateway_space: GatewaySpace) -> None:
    resp = await client.post("/v1/realtime_sessions", json=body(), headers=AUTH)
    assert resp.status == 201, f"create: expected 201, got {resp.status}: {await resp.text()}"
    sid = (await resp.json())["id"]

    cr = gateway_space.session(sid)  # the apiserver took it: it passed the CRD's schema
    assert cr is not None and cr["metadata"]["uid"] and cr["metadata"]["creationTimestamp"], cr
    parsed = resources.CharacterSession.model_validate(cr)  # what the operator parses
    assert (parsed.spec.character, parsed.spec.pool) == ("ada-v1", "h200")
    assert (parsed.spec.livekit.room, parsed.spec.livekit.agent_identity) == ("room-1", "agent-1")
    assert parsed.spec.max_duration_seconds == 300
    [secret] = [s for s in gateway_space.secrets() if s["metadata"]["name"] == parsed.spec.livekit.token_secret]
    assert base64.b64decode(secret["data"]["token"]).decode() == TOKEN, "the caller's token must be in the Secret"
    [owner] = secret["metadata"]["ownerReferences"]
    assert (owner["kind"], owner["name"], owner["uid"]) == ("CharacterSession", sid, cr["metadata"]["uid"])

    resp = await client.get(f"/v1/realtime_sessions/{sid}", headers=AUTH)
    got = await resp.json()
    assert resp.status == 200 and got["status"] == "NOT_READY" and got["phase"] == "Pending", got
    assert got["avatar"] == "ada" and got["createdAt"] == cr["metadata"]["creationTimestamp"], got

    gateway_space.set_phase(sid, "Streaming", worker="h200-0")
    got = await (await client.get(f"/v1/realtime_sessions/{sid}", headers=AUTH)).json()
    assert (got["status"], got["worker"]) == ("RUNNING", "h200-0"), got

    resp = await client.delete(f"/v1/realtime_sessions/{sid}", headers=AUTH)
    assert resp.status == 204, f"delete: expected 204, got {resp.status}"
    assert gateway_space.session(sid) is None, "CR still there after DELETE"
    # the controller-manager's garbage collector deletes the Secret the session owned
    wait_for(lambda: all(s["metadata"]["name"] != parsed.spec.livekit.token_secret for s in gateway_space.secrets()),
             "the token Secret garbage-collected", 90)
    resp = await client.get(f"/v1/realtime_sessions/{sid}", headers=AUTH)
    assert resp.status == 404 and (await resp.json())["error"]["code"] == "unknown_session"
    resp = await client.delete(f"/v1/realtime_sessions/{sid}", headers=AUTH)
    assert resp.status == 404, "a second DELETE must say the session is unknown"


async def test_preset_avatar_and_default_duration(client: TestClient, gateway_space: GatewaySpace) -> None:
    b = body(avatar={"type": "runway-preset", "presetId": "ada"})
    del b["maxDuration"], b["model"]
    resp = await client.post("/v1/realtime_sessions", json=b, headers=AUTH)
    assert resp.status == 201, await resp.text()
    [cr] = gateway_space.sessions()
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
    ("room-too-long", AUTH, _with("livekit.roomName", "r" * 257), 422, "invalid_field", "livekit.roomName"),
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
    client: TestClient, gateway_space: GatewaySpace, gateway_kube: RecordingApiClient, caplog: pytest.LogCaptureFixture,
    headers: dict[str, str], payload: Any, status: int, code: str, field: str | None,
) -> None:
    caplog.set_level(logging.DEBUG)
    before = gateway_space.snapshot()
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
    assert gateway_kube.writes() == [], f"a rejected request sent writes: {gateway_kube.writes()}"
    assert gateway_space.snapshot() == before, "a rejected request changed the namespace"
    assert not gateway_space.sessions(), "nothing may be created"
    assert TOKEN not in text and TOKEN not in caplog.text, "the LiveKit token leaked into a response or log"


def test_there_are_at_least_twenty_bad_request_cases() -> None:
    assert len(BAD_REQUESTS) >= 20, f"only {len(BAD_REQUESTS)} bad-request cases"


@pytest.mark.parametrize(("method", "path", "status", "code"), [
    ("get", "/v1/realtime_sessions/rt-doesnotexist", 404, "unknown_session"),
    ("delete", "/v1/realtime_sessions/rt-doesnotexist", 404, "unknown_session"),
    ("get", "/v1/realtime_sessions/..%2Fsecrets", 404, "unknown_session"),
    ("put", "/v1/realtime_sessions", 405, "method_not_allowed"),
])
async def test_unknown_sessions_and_methods(client: TestClient, gateway_space: GatewaySpace, gateway_kube: RecordingApiClient,
                                            method: str, path: str, status: int, code: str) -> None:
    before = gateway_space.snapshot()
    resp = await getattr(client, method)(path, headers=AUTH)
    assert resp.status == status, f"{method.upper()} {path}: expected {status}, got {resp.status}"
    assert (await resp.json())["error"]["code"] == code
    assert gateway_space.snapshot() == before and gateway_kube.writes() == []


async def test_get_and_delete_need_a_key(client: TestClient, gateway_space: GatewaySpace) -> None:
    sid = (await (await client.post("/v1/realtime_sessions", json=body(), headers=AUTH)).json())["id"]
    for method in ("get", "delete"):
        resp = await getattr(client, method)(f"/v1/realtime_sessions/{sid}")
        assert resp.status == 401, f"{method.upper()} without a key: expected 401, got {resp.status}"
    assert [o["metadata"]["name"] for o in gateway_space.sessions()] == [sid], "an unauthorized DELETE deleted"


# ------------------------------------------------------------------------------------------ capacity


@pytest.mark.parametrize(("avatar", "code"), [("bob", "unknown_pool"), ("cyd", "no_capacity")])
async def test_unknown_or_full_pool_is_503_with_retry_after(client: TestClient, gateway_space: GatewaySpace,
                                                            gateway_kube: RecordingApiClient, avatar: str,
                                                            code: str) -> None:
    if avatar == "cyd":  # fill pool "full" (maxWorkers 1) with one live session
        gateway_space.add_session("busy", "full", "Streaming")
    before = gateway_space.snapshot()
    resp = await client.post("/v1/realtime_sessions", json=body(avatar={"type": "custom", "avatarId": avatar}),
                             headers=AUTH)
    assert resp.status == 503, f"expected 503, got {resp.status}: {await resp.text()}"
    assert resp.headers.get("Retry-After") == "5", f"Retry-After: got {resp.headers.get('Retry-After')!r}"
    assert (await resp.json())["error"]["code"] == code
    assert gateway_space.snapshot() == before and gateway_kube.writes() == [], "a 503 must write nothing"


async def test_ended_sessions_free_capacity(client: TestClient, gateway_space: GatewaySpace) -> None:
    gateway_space.add_session("done", "full", "Ended")
    resp = await client.post("/v1/realtime_sessions", json=body(avatar={"type": "custom", "avatarId": "cyd"}),
                             headers=AUTH)
    assert resp.status == 201, f"an Ended session must not count against capacity; got {resp.status}"


async def test_session_the_apiserver_refuses_leaves_no_secret(client: TestClient, gateway_space: GatewaySpace) -> None:
    """A quota of 0 CharacterSessions: the apiserver refuses the CR after the token Secret was written; the
    gateway answers with the apiserver's refusal and deletes the Secret again (no half-made session)."""
    gateway_space.core.create_namespaced_resource_quota(gateway_space.name, {
        "apiVersion": "v1", "kind": "ResourceQuota", "metadata": {"name": "no-sessions"},
        "spec": {"hard": {f"count/{resources.SESSION_PLURAL}.{resources.GROUP}": "0"}}})
    secrets_before = {s["metadata"]["name"] for s in gateway_space.secrets()}
    resp = await client.post("/v1/realtime_sessions", json=body(), headers=AUTH)
    text = await resp.text()
    assert resp.status == 502 and resp.headers.get("Retry-After") == "5", f"got {resp.status}: {text}"
    err = (await resp.json())["error"]
    assert err["code"] == "kubernetes_unavailable" and "403" in err["message"], err
    assert not gateway_space.sessions(), "no CharacterSession may exist"
    assert {s["metadata"]["name"] for s in gateway_space.secrets()} == secrets_before, "the token Secret was left behind"
    assert TOKEN not in text


# ------------------------------------------------------------------------------------------ the token


async def test_token_only_in_its_secret(client: TestClient, gateway_space: GatewaySpace, gateway_kube: RecordingApiClient,
                                        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    texts = []
    resp = await client.post("/v1/realtime_sessions", json=body(), headers=AUTH)
    texts.append(await resp.text())
    sid = (await resp.json())["id"]
    texts.append(await (await client.get(f"/v1/realtime_sessions/{sid}", headers=AUTH)).text())
    texts.append(await (await client.post("/v1/realtime_sessions", json=_with("maxDuration", 1),
                                          headers=AUTH)).text())
    for obj in [*gateway_space.sessions(), *gateway_space.events()]:
        assert TOKEN not in json.dumps(obj), f"token found in {obj['kind']} {obj['metadata']['name']}"
    for method, url, sent in gateway_kube.sent:
        if "/secrets" not in url:
            assert TOKEN not in sent, f"token sent to the apiserver outside a Secret: {method} {url}"
    held = [s for s in gateway_space.secrets() if base64.b64decode((s.get("data") or {}).get("token", "")).decode() == TOKEN]
    assert held, "positive control: the Secret holds it"
    assert any(TOKEN in sent for _, url, sent in gateway_kube.sent if "/secrets" in url), \
        "positive control: request bodies are recorded"
    assert len(gateway_kube.writes()) >= 3, f"positive control: writes are recorded, got {gateway_kube.writes()}"
    assert all(TOKEN not in t for t in texts), "token in an API response"
    texts.append(await (await client.delete(f"/v1/realtime_sessions/{sid}", headers=AUTH)).text())
    assert TOKEN not in caplog.text, "token in a log line"
    assert any("created session" in rec.getMessage() for rec in caplog.records), "positive control: logs captured"


async def test_oversized_body_is_413_and_writes_nothing(client: TestClient, gateway_space: GatewaySpace,
                                                        gateway_kube: RecordingApiClient) -> None:
    before = gateway_space.snapshot()
    big = body(model="x" * (session_api.MAX_BODY_BYTES + 10))
    resp = await client.post("/v1/realtime_sessions", json=big, headers=AUTH)
    assert resp.status == 413, f"expected 413, got {resp.status}"
    assert (await resp.json())["error"]["code"] == "body_too_large"
    assert gateway_space.snapshot() == before and gateway_kube.writes() == []


# ------------------------------------------------------------------------------------------ metrics


async def test_requests_are_counted_by_route_template(gateway_space: GatewaySpace, gateway_kube: RecordingApiClient) -> None:
    from prometheus_client import CollectorRegistry
    from vivant.gateway.metrics import ApiMetrics

    registry = CollectorRegistry()
    config = session_api.ApiConfig(namespace=gateway_space.name, avatars={})
    api = session_api.SessionApi(config, session_api.ApiKeys(static=(KEY,)), gateway_kube, ApiMetrics(registry))
    async with TestClient(TestServer(api.app())) as c:
        await c.get("/v1/realtime_sessions/rt-abc", headers=AUTH)  # the apiserver answers 404
        await c.post("/v1/realtime_sessions", json=body())

    def count(route: str, method: str, code: str) -> float | None:
        return registry.get_sample_value("vivant_api_requests_total", {"method": method, "route": route, "code": code})

    assert count("/v1/realtime_sessions/{id}", "GET", "404") == 1.0
    assert count("/v1/realtime_sessions", "POST", "401") == 1.0
    assert any(method == "GET" and url.endswith(f"/{resources.SESSION_PLURAL}/rt-abc") for method, url, _ in gateway_kube.sent)
    async with TestClient(TestServer(api.app())) as c:
        exposition = await (await c.get("/metrics")).text()
    assert 'vivant_api_requests_total{code="401",method="POST",route="/v1/realtime_sessions"} 1.0' in exposition

