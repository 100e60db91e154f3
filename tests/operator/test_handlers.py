"""The kopf handlers' own check of what they read (operator/handlers.py), called directly.

The apiserver rejects a malformed CharacterSession or WorkerPool by the CRD's schema (shown on the real
apiserver in tests/cluster/test_operator_kopf.py), but the operator still parses every object it reads
with the models: a CRD applied by hand may be older than the operator. No apiserver can hold an object
that the installed CRD rejects, so this part is shown without one: the handler gets the malformed spec as
kopf would hand it over, marks the object Failed naming the field, and gives up for good.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
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
    from prometheus_client import CollectorRegistry
    from vivant.operator.metrics import OperatorMetrics

    patch = kopf.Patch()
    with pytest.raises(kopf.PermanentError, match=field):
        handlers.session_assign(body={}, spec=_session_spec(**overrides), meta={}, status={}, namespace="ns",
                                name="typo", uid="u-1", patch=patch, retry=0, reason="create",
                                memo=kopf.Memo(metrics=OperatorMetrics(CollectorRegistry())))
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


def _invoke(fn: Any, **kwargs: Any) -> Any:
    """Call a handler as kopf does: a coroutine function on an event loop, a plain one as it is."""
    if inspect.iscoroutinefunction(fn):
        return asyncio.run(fn(**kwargs))
    return fn(**kwargs)


class _StatusThatChangesTheIndex(dict):
    """A session's status whose first read adds another session to kopf's index: the index changing between two
    steps of the handler's walk over it, as kopf's event loop changes it on a watch event (a new session) while
    the timer runs in its thread. Here at a fixed point of the walk, so the race happens every time."""

    def __init__(self, status: dict[str, Any], change: Any) -> None:
        super().__init__(status)
        self._change = change

    def get(self, *args: Any) -> Any:
        if self._change is not None:
            self._change, change = None, self._change
            change()
        return super().get(*args)


def test_pool_tick_reads_a_copy_of_the_session_index_not_the_index_while_it_changes(redis_url: str,
                                                                                    monkeypatch: Any) -> None:
    """The pool timer walked kopf's session index from its handler thread: a session created meanwhile crashed
    it with "dictionary changed size during iteration" (and the pool's scaling, reaping and status stopped until
    kopf's retry). Real: kopf's own index, Redis, the registry and flag store. Stand-in: the StatefulSet reads
    (the race is between the index and the timer; the API server takes no part in it)."""
    from kopf._core.engines.indexing import OperatorIndexer  # the index kopf hands to handlers
    from prometheus_client import CollectorRegistry
    from vivant.apis import resources
    from vivant.operator import kube, session_sweep
    from vivant.operator.metrics import OperatorMetrics
    from vivant.sessions.flags import FlagStore
    from vivant.sessions.models import WorkerInfo
    from vivant.sessions.registry import Registry

    pool = resources.pool_key("ns", "h200")
    registry = Registry(redis_url, heartbeat_ttl_s=30.0)
    registry.register(WorkerInfo(worker_id="h200-0", pool=pool, warm=True))
    indexer = OperatorIndexer()

    def session(name: str, status: dict[str, Any]) -> session_sweep.SessionView:
        return session_sweep.SessionView.from_body({
            "metadata": {"namespace": "ns", "name": name, "uid": f"uid-{name}"},
            "spec": _session_spec(), "status": status})

    def a_session_arrives() -> None:
        indexer.replace(("ns", "s-new", "uid-new"), {pool: session("s-new", {})})

    first = session("s-0", {"phase": "Pending"})
    indexer.replace(("ns", "s-0", "uid-s-0"), {pool: dataclasses.replace(
        first, status=_StatusThatChangesTheIndex(first.status, a_session_arrives))})
    monkeypatch.setattr(kube, "statefulset", lambda namespace, name: {"spec": {"replicas": 1}, "status": {}})
    memo = kopf.Memo(registry=registry, flags=FlagStore(registry.redis), sweep=session_sweep.SweepState(),
                     metrics=OperatorMetrics(CollectorRegistry()))
    spec = {"model": {"preset": "tiny", "checkpoint": "random://tiny"}, "image": "registry.example/w:1",
            "gpusPerWorker": 2, "tensorParallel": 1, "minIdle": 1, "maxWorkers": 3}
    patch = kopf.Patch()
    _invoke(handlers.pool_tick, body={}, spec=spec, meta={"generation": 1}, status={}, namespace="ns",
            name="h200", patch=patch, memo=memo, session_views=indexer.index)
    assert {len(views) for views in indexer.index.values()} == {2}, "the index did not change during the tick"
    assert patch["status"]["replicas"] == 1 and patch["status"]["idle"] == 1, patch
    registry.close()
