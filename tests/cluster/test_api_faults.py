"""The session API on the real apiserver of the local cluster: atomic capacity, LiveKit's own name rules,
pools the operator rejects, a failing apiserver (through a fault-injecting proxy), bursts, and schemathesis
fuzzing the live API against its own OpenAPI document (bounded examples, loopback only).

The API runs in this process (`api_server.ApiServer`) so a test can give it limits, put the fault proxy in
front of its apiserver, and count what it did. No operator runs meanwhile (`release_operators_paused`):
these tests are about what the API writes (test_api_janitor.py has the one that needs the operator).
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import shutil
import socket
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pydantic
import pytest
from api_server import (  # noqa: F401
    AVATARS,
    KEY,
    WP,
    ApiServer,
    body,
    call,
    create_with_retries,
    pool,
    pools_fixture,
    serve_fixture,
)
from conftest import Kube, wait_for
from fault_proxy import FaultProxy
from vivant.apis import resources
from vivant.gateway import models
from vivant.gateway.server import request_digest, session_name_for

CS = "charactersessions.vivant.dev"
pytestmark = pytest.mark.usefixtures("vivant_crds", "release_operators_paused")


def sessions(kube: Kube, ns: str) -> list[dict[str, Any]]:
    return kube.items(CS, ns)


@pytest.mark.timeout(300)
def test_parallel_creates_never_exceed_pool_capacity(kube: Kube, pools: str, serve: Callable[..., ApiServer]) -> None:
    """Fact 3 of issue 15: 20 parallel creates against a pool with maxWorkers 2 all got 201."""
    api = serve(max_in_flight_creates=20, max_queued_creates=20)
    with cf.ThreadPoolExecutor(20) as ex:
        answers = list(ex.map(lambda _: call(api.url, "POST", models.ROUTE_COLLECTION, body("ada")), range(20)))
    codes = Counter(status for status, _, _ in answers)
    assert codes[201] == 2, codes
    assert codes[503] == 18 and all(got["error"]["code"] == "no_capacity" for s, got, _ in answers if s == 503), answers
    assert len([cs for cs in sessions(kube, pools) if cs["spec"]["pool"] == "cap2"]) == 2
    leases = kube.items("leases.coordination.k8s.io", pools, "vivant.dev/slot-pool=cap2")
    assert sorted(lease["spec"]["holderIdentity"] for lease in leases) == sorted(
        got["id"] for s, got, _ in answers if s == 201)


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("room", "identity"), [("my:room", "agent-1"), ("room with space", "agent-1"),
                                                ("room-1", "agent@example.com"), ("room-1", "agent_"),
                                                ("комната/日本", "ägent")])
def test_room_names_and_identities_livekit_accepts_are_accepted(kube: Kube, pools: str, serve: Callable[..., ApiServer],
                                                                room: str, identity: str) -> None:
    """Fact 11: `[A-Za-z0-9._-]` patterns refused names LiveKit accepts; the apiserver's CRD takes them too."""
    api = serve()
    status, got, _ = call(api.url, "POST", models.ROUTE_COLLECTION, body("big", room=room, identity=identity))
    assert status == 201, got
    cs = kube.get(CS, got["id"], pools)
    assert (cs["spec"]["livekit"]["room"], cs["spec"]["livekit"]["agentIdentity"]) == (room, identity)


@pytest.mark.timeout(300)
def test_a_pool_the_operator_rejects_takes_no_session(kube: Kube, pools: str, serve: Callable[..., ApiServer]) -> None:
    """Fact 12: the API accepted sessions for a pool whose spec the operator rejects. This one passes the CRD
    (the apiserver's Go regexp takes U+2003 as a non-space in `^[^\\s]+$`) but not the operator's models."""
    kube.apply(pool("badspec", pools, 2, image="ghcr.io/vivant-dev/vivant-worker:0.1.0\u2003latest"))
    with pytest.raises(pydantic.ValidationError, match="image"):  # what the operator parses every pool with
        resources.WorkerPoolSpec.model_validate(kube.get(WP, "badspec", pools)["spec"])
    api = serve()
    status, got, _ = call(api.url, "POST", models.ROUTE_COLLECTION, body("bad"))
    assert status == 409, got
    assert got["error"]["code"] == "pool_invalid" and "image" in got["error"]["message"], got
    assert not [cs for cs in sessions(kube, pools) if cs["spec"]["pool"] == "badspec"]


CREATES_UNDER_FAULTS = 30


@pytest.mark.timeout(600)
def test_creates_through_a_failing_apiserver_leave_nothing_unowned(kube: Kube, pools: str,
                                                                  serve: Callable[..., ApiServer]) -> None:
    """Fact 5: with 20% of apiserver calls failing, creates answered 502 left sessions behind (duplicated by
    the client's retry), Secrets without an ownerReference, and orphaned Secrets. Here every fault kind hits
    20% of the calls; the client retries 5xx like a hosted-avatar plugin. Afterwards: one session per request
    that got 201, none for a request that finally failed, no Secret without an owner, none orphaned."""
    proxy = FaultProxy(str(kube.kubeconfig), rate=0.2, seed=15, delay_s=2.5)
    api = serve(proxy=proxy, kube_timeout_s=1.5, orphan_grace_s=5, janitor_interval_s=3600)
    bodies = [body("big") for _ in range(CREATES_UNDER_FAULTS)]
    try:
        with cf.ThreadPoolExecutor(6) as ex:
            answers = list(ex.map(lambda b: create_with_retries(api.url, b), bodies))
    finally:
        proxy.set(rate=0.0)
    ns = pools
    ok = {got["id"] for status, got, _ in answers if status == 201}
    failed = [(b, status, got) for b, (status, got, _) in zip(bodies, answers, strict=True) if status != 201]
    # the janitor: a session whose token Secret never arrived (the operator says TokenSecretMissing) goes
    time.sleep(8)
    api.run(api.api.collect_orphans())
    names = Counter(cs["metadata"]["name"] for cs in sessions(kube, ns) if cs["spec"]["pool"] == "big"
                    and not cs["metadata"].get("deletionTimestamp"))
    assert len(ok) >= CREATES_UNDER_FAULTS // 2, ("positive control: most requests succeed", answers)
    assert ok <= set(names), ("a 201 without its session", ok - set(names))
    assert all(n == 1 for n in names.values())
    for b, status, got in failed:  # a request that finally failed left no session (it never became one)
        digest = request_digest(models.CreateSessionRequest.model_validate(b))
        assert session_name_for(digest, None, "") not in names, (status, got)
    assert set(names) == ok, ("sessions nobody was told about", set(names) - ok)

    def secrets_settled() -> bool:
        secrets = kube.items("secrets", ns, "vivant.dev/created-by=session-api")
        live = {cs["metadata"]["uid"] for cs in sessions(kube, ns)}
        unowned = [s["metadata"]["name"] for s in secrets if not s["metadata"].get("ownerReferences")]
        assert not unowned, f"Secrets without an ownerReference: {unowned}"
        orphans = [s for s in secrets if s["metadata"]["ownerReferences"][0]["uid"] not in live]
        return not orphans  # the garbage collector deletes a Secret whose session is gone

    wait_for(secrets_settled, "no orphaned token Secret", 60)
    assert proxy.counts["calls"] > 100 and all(proxy.counts[f] > 0 for f in ("error", "drop_before", "drop_after",
                                                                             "delay")), proxy.counts
    print(f"\nfault proxy: {dict(proxy.counts)}; answers: {Counter(s for s, _, _ in answers)}; "
          f"attempts: {Counter(a for _, _, a in answers)}; janitor collected {len(api.api.collected)}")
    proxy.close()


def _abandon(url: str, key: str, payload: dict[str, Any], hold_s: float) -> None:
    """Send a create, wait `hold_s` without reading the answer, hang up (a client that gave up)."""
    host, port = url.removeprefix("http://").split(":")
    data = json.dumps(payload).encode()
    with socket.create_connection((host, int(port))) as s:
        s.sendall(b"POST /v1/realtime_sessions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  + f"Authorization: Bearer {KEY}\r\n{models.IDEMPOTENCY_HEADER}: {key}\r\n"
                    f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
        time.sleep(hold_s)


@pytest.mark.timeout(600)
def test_a_burst_is_shed_at_once_and_abandoned_requests_are_not_carried_out(
        kube: Kube, pools: str, serve: Callable[..., ApiServer]) -> None:
    """Fact 4: a burst left every client waiting past 120 s while the API kept writing sessions for abandoned
    requests; a GET got no answer while /healthz said 200. Here the apiserver is slow (every call 0.5 s late),
    2 creates run at once and 4 wait: requests whose clients left while they waited are dropped; the rest of
    a burst is answered 503 overloaded with Retry-After at once; /readyz says 503 while the queue is full;
    a GET is still answered."""
    proxy = FaultProxy(str(kube.kubeconfig), delay_all_s=0.5)
    api = serve(proxy=proxy, max_in_flight_creates=2, max_queued_creates=4, queue_timeout_s=60,
                max_in_flight_reads=4, max_queued_reads=8)
    gate = api.api.creates
    burst = 40
    with cf.ThreadPoolExecutor(burst + 8) as ex:
        first = [ex.submit(call, api.url, "POST", models.ROUTE_COLLECTION, body("big"), timeout=90) for _ in range(2)]
        wait_for(lambda: gate.in_flight == 2, "two creates in flight", 30)
        abandoned = [f"abandon-{uuid.uuid4().hex}" for _ in range(3)]
        for key in abandoned:  # they wait in the queue, and their clients leave
            ex.submit(_abandon, api.url, key, body("big"), 1.0)
        wait_for(lambda: gate.waiting == 3, "the abandoned requests queued", 30)
        time.sleep(1.5)  # their clients are gone now; the first two still run
        futures = first + [ex.submit(call, api.url, "POST", models.ROUTE_COLLECTION, body("big"), timeout=90)
                           for _ in range(burst)]
        wait_for(lambda: gate.saturated, "the create queue full", 30)
        ready, ready_body, _ = call(api.url, "GET", "/readyz")
        got_status, got_body, _ = call(api.url, "GET", "/v1/realtime_sessions/rt-0123456789abcdef0123", timeout=30)
        health, _, _ = call(api.url, "GET", "/healthz")
        answers = [f.result() for f in futures]
    codes = Counter(status for status, _, _ in answers)
    assert 0 not in codes, f"requests without an answer: {codes}"
    assert codes[201] + codes[503] == burst + 2 and 2 <= codes[201] <= 6, codes
    shed = [(got, headers) for status, got, headers in answers if status == 503]
    assert all(got["error"]["code"] == "overloaded" and headers.get("Retry-After") for got, headers in shed), shed[:3]
    assert (ready, ready_body["ready"]) == (503, False), ready_body
    assert health == 200 and got_status == 404, (health, got_status, got_body)
    wait_for(lambda: not gate.in_flight and not gate.waiting, "the burst drained", 120)
    assert call(api.url, "GET", "/readyz")[0] == 200
    names = {cs["metadata"]["name"] for cs in sessions(kube, pools)}
    assert not {session_name_for("", key, KEY) for key in abandoned} & names, "an abandoned request was carried out"
    assert gate.abandoned == len(abandoned), gate.abandoned
    assert len(names) == codes[201], (len(names), codes)
    print(f"\nburst {burst}+2: {dict(codes)}; shed {gate.shed}, abandoned {gate.abandoned}")
    proxy.close()


# ------------------------------------------------------------------------------ schemathesis

MAX_EXAMPLES = 15
CHECKS = ("not_a_server_error,status_code_conformance,content_type_conformance,response_headers_conformance,"
          "response_schema_conformance,negative_data_rejection,ignored_auth")


@pytest.mark.timeout(300)
def test_schemathesis_finds_no_server_error_and_no_auth_bypass(kube: Kube, pools: str,
                                                               serve: Callable[..., ApiServer], tmp_path: Path) -> None:
    api = serve(avatars={"big": AVATARS["big"]})  # a pool with room for every session the fuzzer creates
    exe = shutil.which("schemathesis", path=str(Path(sys.executable).parent))
    assert exe, "schemathesis is in the dev extra (make install)"
    out = subprocess.run(
        [exe, "run", f"{api.url}/openapi.json", "-H", f"Authorization: Bearer {KEY}", "--checks", CHECKS,
         "--max-examples", str(MAX_EXAMPLES), "--seed", "15", "--workers", "1", "--no-shrink",
         "--request-timeout", "30", "--report", "ndjson", "--report-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=240, cwd=tmp_path)  # its cache folder goes there
    tail = (out.stdout + out.stderr)[-6000:]
    assert out.returncode == 0, tail
    statuses: dict[int, int] = {}
    for line in (tmp_path / next(p.name for p in tmp_path.iterdir() if p.suffix == ".ndjson")).read_text().splitlines():
        for status in _statuses(json.loads(line)):
            statuses[status] = statuses.get(status, 0) + 1
    requests = sum(statuses.values())
    print(f"\nschemathesis: {requests} requests, answers {dict(sorted(statuses.items()))}")
    assert requests >= 3 * MAX_EXAMPLES, (statuses, tail)
    assert not [s for s in statuses if s >= 500], statuses
    assert statuses.get(401, 0) > 0, "positive control: the auth check ran"
    assert statuses.get(201, 0) > 0, "positive control: generated creates reached the apiserver"


def _statuses(event: object) -> list[int]:
    """Every HTTP status recorded in one ndjson event (responses sit at varying depths of the event)."""
    found: list[int] = []
    stack = [event]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            response = node.get("response")
            if isinstance(response, dict) and isinstance(response.get("status_code"), int):
                found.append(response["status_code"])
            stack.extend(v for k, v in node.items() if k != "response")
        elif isinstance(node, list):
            stack.extend(node)
    return found
