"""The slot rules of `gateway/capacity.py` at interleavings a real apiserver cannot be made to produce on cue.

The Leases here are a dict behind `create`/`replace` with the apiserver's two rules (a name is created once, a
replace must carry the resourceVersion it read), because what is checked is one exact order of events: a
session listing read before another request created its session and recorded it in its Lease. The same code
against the real apiserver is tests/cluster/test_api_capacity.py.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from vivant.gateway import capacity

NOW = datetime(2026, 1, 1, tzinfo=UTC)


class Leases:
    def __init__(self) -> None:
        self.items: dict[str, dict[str, Any]] = {}
        self.version = 0

    async def list(self) -> list[dict[str, Any]]:
        return [dict(v) for v in self.items.values()]

    async def create(self, body: dict[str, Any]) -> None:
        name = body["metadata"]["name"]
        if name in self.items:
            raise capacity.SlotConflict()
        self._store(body)

    async def replace(self, name: str, body: dict[str, Any]) -> None:
        if self.items[name]["metadata"]["resourceVersion"] != body["metadata"].get("resourceVersion"):
            raise capacity.SlotConflict()
        self._store(body)

    def _store(self, body: dict[str, Any]) -> None:
        self.version += 1
        body = {**body, "metadata": {**body["metadata"], "resourceVersion": str(self.version)}}
        self.items[body["metadata"]["name"]] = body


async def claim(leases: Leases, session: str, sessions: dict[str, Any], active: set[str]) -> capacity.SlotClaim:
    async def holder_active(name: str) -> bool:
        return name in active

    return await capacity.claim_slot(
        pool="p", session=session, capacity=1, external_active=0, now=NOW, claim_grace_s=60,
        list_leases=leases.list, sessions=sessions, create=leases.create, replace=leases.replace,
        holder_active=holder_active, owner={"kind": "WorkerPool", "name": "p"})


async def test_a_holder_newer_than_the_session_listing_keeps_its_slot() -> None:
    """A Lease that records its holder's uid, where the holder is missing from this request's (older) session
    listing: the holder is read again, and a live one keeps the slot (the pool is full); a deleted one frees it."""
    leases = Leases()
    assert (await claim(leases, "rt-a", {}, set())).index == 0
    lease = leases.items[capacity.slot_name("p", 0)]
    lease["metadata"]["annotations"] = {capacity.ANNOTATION_HOLDER_UID: "uid-a"}  # rt-a was created
    full = await claim(leases, "rt-b", {}, active={"rt-a"})  # a listing from before rt-a existed
    assert (full.index, full.active) == (None, 1), full
    assert leases.items[capacity.slot_name("p", 0)]["spec"]["holderIdentity"] == "rt-a"
    freed = await claim(leases, "rt-b", {}, active=set())  # rt-a deleted since
    assert freed.index == 0 and leases.items[capacity.slot_name("p", 0)]["spec"]["holderIdentity"] == "rt-b"


async def test_a_holder_never_created_keeps_its_slot_for_the_grace() -> None:
    leases = Leases()
    assert (await claim(leases, "rt-a", {}, set())).index == 0  # its session not created (yet)
    assert (await claim(leases, "rt-b", {}, set())).index is None
