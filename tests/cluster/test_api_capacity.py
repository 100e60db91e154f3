"""The session API's capacity slots and tenants on the real apiserver of the local cluster: a deleted session's
slot is free at once, parallel creates on one replica are not refused while the pool has room, and a key sees
its own sessions only.

Real: the kube-apiserver (its 409s on a Lease created twice or replaced with a stale resourceVersion are what
makes a claim atomic; its JSON-patch `test` guards the holder record), the CRDs, and the session API over
HTTP on a loopback port (`api_server.ApiServer`). No operator runs (`release_operators_paused`): without its
finalizer a deleted CharacterSession is gone at once, which is what an operator that ended the session
quickly leaves too.
"""

from __future__ import annotations

import concurrent.futures as cf
from collections import Counter
from collections.abc import Callable

import pytest
from api_server import (  # noqa: F401
    KEY,
    ApiServer,
    body,
    call,
    pools_fixture,
    serve_fixture,
)
from conftest import Kube
from vivant.gateway import capacity, models

CS = "charactersessions.vivant.dev"
LEASES = "leases.coordination.k8s.io"
OTHER_KEY = "vk_cluster_test_other_tenant_42"
pytestmark = [pytest.mark.usefixtures("vivant_crds", "release_operators_paused"), pytest.mark.timeout(300)]


def created(api: ApiServer, avatar: str = "ada", key: str = KEY) -> str:
    status, got, _ = call(api.url, "POST", models.ROUTE_COLLECTION, body(avatar), key=key)
    assert status == 201, (status, got)
    return got["id"]


def test_a_session_deleted_through_the_api_frees_its_slot_at_once(kube: Kube, pools: str,
                                                                  serve: Callable[..., ApiServer]) -> None:
    """Defect 3 of issue 36: with maxWorkers 2, two sessions created and DELETEd (204, gone at once) left
    creates answered 503 no_capacity for about 60 s: the Leases still named the deleted sessions, taken for
    sessions not created yet (claimGraceS from acquireTime). The DELETE frees the slot now."""
    api = serve()
    ids = [created(api), created(api)]
    status, got, _ = call(api.url, "POST", models.ROUTE_COLLECTION, body("ada"))
    assert (status, got["error"]["code"]) == (503, "no_capacity"), "positive control: the pool is full"
    for sid in ids:
        assert call(api.url, "DELETE", f"{models.ROUTE_ITEM.format(id=sid)}")[0] == 204
    assert not [cs for cs in kube.items(CS, pools) if cs["metadata"]["name"] in ids], "the sessions are gone"
    assert [created(api), created(api)], "a full pool again: both slots were free at once"


def test_a_session_deleted_with_kubectl_frees_its_slot_at_once(kube: Kube, pools: str,
                                                               serve: Callable[..., ApiServer]) -> None:
    """Defect 3, the other path: a session deleted without the API (kubectl, the operator's end of a session)
    leaves its Lease naming it. The Lease records that its holder existed (its uid), so a holder that is
    gone is told apart from one not created yet, and the slot is free at once."""
    api = serve()
    ids = [created(api), created(api)]
    leases = kube.items(LEASES, pools, f"{capacity.LABEL_POOL}=cap2")
    marks = {lease["spec"]["holderIdentity"]: (lease["metadata"].get("annotations") or {}).get(
        capacity.ANNOTATION_HOLDER_UID) for lease in leases}
    uids = {sid: kube.get(CS, sid, pools)["metadata"]["uid"] for sid in ids}
    assert marks == uids, f"each Lease must record its session's uid: {marks} vs {uids}"
    kube.kubectl("delete", CS, *ids, "-n", pools, "--wait=true")
    assert [created(api), created(api)], "both slots were free at once"


def test_a_claim_whose_session_is_not_created_yet_keeps_its_slot(kube: Kube, pools: str,
                                                                 serve: Callable[..., ApiServer]) -> None:
    """The half that must not change: a Lease naming a session that does not exist and never did (its create
    is under way, or failed a moment ago) holds its slot until claimGraceS, so a slow create is not
    overtaken by others."""
    api = serve()
    now = capacity._micro(capacity.datetime.now(tz=capacity.UTC))
    for i in range(2):
        kube.apply({"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                    "metadata": {"name": capacity.slot_name("cap2", i), "namespace": pools,
                                 "labels": {capacity.LABEL_POOL: "cap2", capacity.LABEL_API: capacity.API_CREATOR}},
                    "spec": {"holderIdentity": f"rt-in-flight-{i}", "acquireTime": now, "renewTime": now}})
    status, got, _ = call(api.url, "POST", models.ROUTE_COLLECTION, body("ada"))
    assert (status, got["error"]["code"]) == (503, "no_capacity"), (status, got)


def test_parallel_creates_on_one_replica_are_not_refused_while_the_pool_has_room(
        kube: Kube, pools: str, serve: Callable[..., ApiServer]) -> None:
    """Defect 4 of issue 36: 100 parallel creates on one API replica against maxWorkers 256 got 21 x 503
    "at capacity (5/256 sessions)": every claim tried the same first free slot and gave up after 4 lost
    races. All 100 get a session and a slot of their own now."""
    n = 100
    api = serve(max_in_flight_creates=n, max_queued_creates=n)
    with cf.ThreadPoolExecutor(n) as ex:
        answers = list(ex.map(lambda _: call(api.url, "POST", models.ROUTE_COLLECTION, body("big"), timeout=120),
                              range(n)))
    codes = Counter(status for status, _, _ in answers)
    assert codes == {201: n}, f"{codes}: {[got for status, got, _ in answers if status != 201][:3]}"
    leases = kube.items(LEASES, pools, f"{capacity.LABEL_POOL}=big")
    assert sorted(lease["spec"]["holderIdentity"] for lease in leases) == sorted(got["id"] for _, got, _ in answers)
    print(f"\n{n} parallel creates, maxWorkers 256: {dict(codes)}")


def test_a_key_sees_and_deletes_its_own_sessions_only(kube: Kube, pools: str, serve: Callable[..., ApiServer]) -> None:
    """Item 8 of issue 36: any valid API key could read any session by id. Another key's GET and DELETE now
    answer 404 unknown_session, exactly as for an id that does not exist, and delete nothing."""
    api = serve(keys=(KEY, OTHER_KEY))
    mine = created(api, "big", KEY)
    path = models.ROUTE_ITEM.format(id=mine)
    for method in ("GET", "DELETE"):
        status, got, _ = call(api.url, method, path, key=OTHER_KEY)
        assert (status, got["error"]["code"], got["error"]["field"]) == (404, "unknown_session", "id"), (method, got)
    unknown = call(api.url, "GET", models.ROUTE_ITEM.format(id="rt-0123456789abcdef0123"), key=OTHER_KEY)[1]
    assert call(api.url, "GET", path, key=OTHER_KEY)[1]["error"]["code"] == unknown["error"]["code"]
    assert kube.get(CS, mine, pools) is not None, "another key's DELETE deleted the session"
    status, got, _ = call(api.url, "GET", path, key=KEY)
    assert (status, got["id"]) == (200, mine), got
    same_body = body("big")
    first = call(api.url, "POST", models.ROUTE_COLLECTION, same_body, key=KEY)[1]["id"]
    second = call(api.url, "POST", models.ROUTE_COLLECTION, same_body, key=OTHER_KEY)[1]["id"]
    assert first != second, "the same body under two keys must make two sessions (one per tenant)"
    assert call(api.url, "DELETE", path, key=KEY)[0] == 204
