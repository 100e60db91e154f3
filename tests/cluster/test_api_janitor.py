"""The session API's janitor, with the helm-installed operator running: a create that failed after its
CharacterSession was written (its token Secret could not be) is completed by the client's retry, or, when
no retry comes, deleted once the operator reports the token missing (docs/reliability.md)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
from api_server import KEY, ApiServer, body, call, pools_fixture, serve_fixture  # noqa: F401
from conftest import Kube, wait_for
from fault_proxy import FaultProxy
from vivant.gateway import models
from vivant.gateway.server import request_digest, session_name_for

CS = "charactersessions.vivant.dev"
pytestmark = pytest.mark.usefixtures("vivant_release")


def sessions(kube: Kube, ns: str) -> list[dict[str, Any]]:
    return kube.items(CS, ns)


@pytest.mark.timeout(300)
def test_a_half_made_session_is_completed_by_the_retry_or_collected(kube: Kube, pools: str,
                                                                   serve: Callable[..., ApiServer]) -> None:
    """The two ends of a create that failed after its session was written (its token Secret could not be):
    the client's retry of the same request completes that session and gets its id (no second session);
    without a retry, the janitor deletes the session once the operator reports its token missing."""
    proxy = FaultProxy(str(kube.kubeconfig), fail=r"^POST /api/v1/namespaces/[^/]+/secrets$")
    api = serve(proxy=proxy, orphan_grace_s=3, janitor_interval_s=3600)
    retried, dropped = body("big"), body("big")
    for b in (retried, dropped):
        status, got, _ = call(api.url, "POST", models.ROUTE_COLLECTION, b)
        assert status == 502 and got["error"]["code"] == "kubernetes_unavailable", (status, got)
    names = {b["livekit"]["roomName"]: session_name_for(request_digest(models.CreateSessionRequest.model_validate(b)), None,
                                                         KEY) for b in (retried, dropped)}
    assert {cs["metadata"]["name"] for cs in sessions(kube, pools)} == set(names.values())
    proxy.set(fail=None)
    status, got, _ = call(api.url, "POST", models.ROUTE_COLLECTION, retried)
    assert status == 201 and got["id"] == names[retried["livekit"]["roomName"]], got
    secret = kube.get("secret", f"{got['id']}-livekit-token", pools)
    assert secret["metadata"]["ownerReferences"][0]["name"] == got["id"]
    gone = names[dropped["livekit"]["roomName"]]

    def reported_missing() -> bool:
        cs = kube.get(CS, gone, pools) or {}
        return any(c.get("reason") == "TokenSecretMissing" for c in (cs.get("status") or {}).get("conditions") or [])

    wait_for(reported_missing, "the operator reporting the token Secret missing", 60)
    time.sleep(3)
    assert api.run(api.api.collect_orphans()) == [gone]
    wait_for(lambda: kube.get(CS, gone, pools) is None, "the half-made session deleted", 30)
    assert kube.get(CS, got["id"], pools) is not None, "the completed session was collected"
    proxy.close()
