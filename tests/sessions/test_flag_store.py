"""Live feature flags on a real redis-server: versions, history, the change channel, the watcher, bad input."""

from __future__ import annotations

import threading
import time

import pytest
from vivant.apis.feature_flags import FlagError, FlagValues
from vivant.sessions.flags import FlagStore, FlagWatcher
from vivant.sessions.models import FlagSet

POOL = "ns/gpu-pool"


@pytest.fixture
def store(redis_url: str) -> FlagStore:
    s = FlagStore(redis_url)
    yield s
    s.redis.close()


class TestRoundTrip:
    def test_defaults_then_versions_and_history(self, store: FlagStore):
        fresh = store.get(POOL)
        assert (fresh.version, fresh.values, fresh.updated_by) == (0, FlagValues(), ""), fresh

        on = store.set(POOL, {"fusedGemmAllReduce": "true"}, actor="alice@ops", reason="canary")
        assert (on.version, on.values.fusedGemmAllReduce, on.updated_by) == (1, True, "alice@ops"), on
        assert store.get(POOL) == on, "get after set differs from what set returned"

        same = store.set(POOL, {"fusedGemmAllReduce": True}, actor="bob@ops")
        assert same.version == 1 and same.updated_by == "alice@ops", "a no-op set bumped the version"

        off = store.set(POOL, {"fusedGemmAllReduce": False}, actor="bob@ops", reason="fps burn")
        assert (off.version, off.values.fusedGemmAllReduce) == (2, False), off

        hist = store.history(POOL)
        assert [h.version for h in hist] == [2, 1], f"history versions {[h.version for h in hist]}"
        assert hist[0].changes == {"fusedGemmAllReduce": (True, False)}
        assert (hist[0].actor, hist[0].reason) == ("bob@ops", "fps burn")
        assert hist[1].changes == {"fusedGemmAllReduce": (False, True)}
        assert abs(hist[0].at - time.time()) < 60
        assert store.history(POOL, n=1) == hist[:1]

    def test_pools_are_independent(self, store: FlagStore):
        store.set("pool-a", {"fusedGemmAllReduce": True}, actor="a")
        assert store.get("pool-b").version == 0 and not store.get("pool-b").values.fusedGemmAllReduce

    def test_session_overrides_overlay_pool_values(self, store: FlagStore):
        fs = store.set(POOL, {"fusedGemmAllReduce": True}, actor="a")
        assert fs.with_overrides({"fusedGemmAllReduce": False}).fusedGemmAllReduce is False
        assert fs.with_overrides({}).fusedGemmAllReduce is True


class TestBadInput:
    @pytest.mark.parametrize("updates, expected", [
        ({"fusedGemmAllreduce": True}, "unknown flag(s) 'fusedGemmAllreduce'; known flags: fusedGemmAllReduce"),
        ({"fusedGemmAllReduce": "sometimes"}, "flag 'fusedGemmAllReduce': expected bool, got 'sometimes'"),
        ({"fusedGemmAllReduce": 7}, "flag 'fusedGemmAllReduce': expected bool, got 7"),
    ])
    def test_rejected_and_nothing_written(self, store: FlagStore, updates, expected):
        store.set(POOL, {"fusedGemmAllReduce": True}, actor="a")
        with pytest.raises(FlagError) as exc:
            store.set(POOL, updates, actor="mallory")
        assert expected in str(exc.value), str(exc.value)
        after = store.get(POOL)
        assert (after.version, after.values.fusedGemmAllReduce) == (1, True), f"a rejected set wrote: {after}"
        assert len(store.history(POOL)) == 1

    def test_actor_and_updates_required(self, store: FlagStore):
        with pytest.raises(ValueError, match="actor"):
            store.set(POOL, {"fusedGemmAllReduce": True}, actor="")
        with pytest.raises(ValueError, match="updates"):
            store.set(POOL, {}, actor="a")


class TestChangeNotification:
    def test_change_is_published_with_the_new_version(self, store: FlagStore):
        pubsub = store.redis.pubsub()
        pubsub.subscribe(store.channel(POOL))
        assert pubsub.get_message(timeout=1.0)["type"] == "subscribe"
        store.set(POOL, {"fusedGemmAllReduce": True}, actor="a")
        msg = pubsub.get_message(timeout=2.0)
        assert msg is not None and msg["type"] == "message", f"no change message: {msg}"
        assert (msg["channel"], int(msg["data"])) == (store.channel(POOL).encode(), 1)
        pubsub.close()

    def test_watcher_reports_only_changes(self, store: FlagStore):
        watcher = FlagWatcher(store, POOL)
        assert watcher.changed_since(0) is None, "no change yet, watcher reported one"
        store.set(POOL, {"fusedGemmAllReduce": True}, actor="a")
        changed = watcher.changed_since(0)
        assert isinstance(changed, FlagSet) and changed.version == 1
        assert watcher.changed_since(1) is None


def test_concurrent_setters_get_one_version_per_effective_change(store: FlagStore):
    """8 threads flip the flag 25 times each: every effective change gets its own version and entry."""
    def flipper(k: int) -> None:
        for i in range(25):
            store.set(POOL, {"fusedGemmAllReduce": (i + k) % 2 == 0}, actor=f"t{k}")

    threads = [threading.Thread(target=flipper, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    final = store.get(POOL)
    hist = store.history(POOL, n=1000)
    versions = sorted(h.version for h in hist)
    assert versions == list(range(1, final.version + 1)), "versions skipped or repeated under concurrency"
    assert all(old != new for h in hist for old, new in h.changes.values()), "a no-op was recorded as a change"
    assert hist[0].changes["fusedGemmAllReduce"][1] == final.values.fusedGemmAllReduce
