"""The kopf handlers' own check of what they read (operator/handlers.py), called directly.

The apiserver rejects a malformed CharacterSession or WorkerPool by the CRD's schema (shown on the real
apiserver in tests/cluster/test_operator_kopf.py), but the operator still parses every object it reads
with the models: a CRD applied by hand may be older than the operator. No apiserver can hold an object
that the installed CRD rejects, so this part is shown without one: the handler gets the malformed spec as
kopf would hand it over, marks the object Failed naming the field, and gives up for good.
"""

from __future__ import annotations

from typing import Any

import kopf
import pytest
from vivant.operator import handlers


def _session_spec(**overrides: Any) -> dict[str, Any]:
    spec = {"character": "ada-v1", "pool": "h200", "maxDurationSeconds": 600,
            "livekit": {"url": "wss://lk.example.com", "room": "room-1", "agentIdentity": "agent-1"}}
    spec.update(overrides)
    return spec


@pytest.mark.parametrize(("overrides", "field"), [
    ({"maxDurationSeconds": "ten minutes"}, "maxDurationSeconds"),
    ({"pool": "H200!"}, "pool"),
    ({"livekit": {"url": "ftp://x", "room": "r", "agentIdentity": "a"}}, "livekit.url"),
])
def test_malformed_session_is_marked_failed_naming_the_field(overrides: dict[str, Any], field: str) -> None:
    patch = kopf.Patch()
    with pytest.raises(kopf.PermanentError, match=field):
        handlers.session_assign(body={}, spec=_session_spec(**overrides), meta={}, status={}, namespace="ns",
                              name="typo", uid="u-1", patch=patch, memo=kopf.Memo(), retry=0)
    status = patch["status"]
    assert status["phase"] == "Failed" and field in status["message"], status
    assert status["conditions"][0]["reason"] == "InvalidSpec", status


def test_malformed_pool_gets_a_ready_false_condition_naming_the_field() -> None:
    patch = kopf.Patch()
    spec = {"model": {"preset": "tiny", "checkpoint": "random://tiny"}, "image": "registry.example/w:1",
            "gpusPerWorker": 2, "tensorParallel": 1, "minIdle": 3, "maxWorkers": 1}
    with pytest.raises(kopf.PermanentError, match="minIdle"):
        handlers.pool_apply(body={}, spec=spec, meta={}, status={}, namespace="ns", name="h200", uid="u-2",
                            patch=patch, memo=kopf.Memo(), retry=0)
    [ready] = patch["status"]["conditions"]
    assert (ready["type"], ready["status"], ready["reason"]) == ("Ready", "False", "InvalidSpec"), ready
