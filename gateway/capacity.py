"""Pool capacity claimed atomically, by the Kubernetes API server: one Lease per session slot of a pool.

Why: counting a pool's sessions and then creating one is a race (20 parallel creates against a pool of
2 workers all got 201). The API server enforces exactly two things we can build on: an object name is
created once (409 AlreadyExists for the second), and an update carrying a `resourceVersion` fails with
409 Conflict when someone else wrote the object first. So a pool with `spec.maxWorkers` = N has slots
`0..N-1`, each a `coordination.k8s.io/v1` Lease named `vivant-slot-<pool>-<i>` (owned by the WorkerPool,
so it goes with it) whose `spec.holderIdentity` is the CharacterSession holding the slot:

- a slot is free when its Lease does not exist, or its holder is terminal (Ended/Failed), being
  deleted, or gone: the Lease records the holder's uid (`ANNOTATION_HOLDER_UID`, written once the
  session exists) and no session of that name is there any more. A holder without that record was
  not created yet: its slot stays taken until the claim is older than `claim_grace_s` (then its
  request failed or was abandoned). A DELETE through the API also deletes its session's Lease;
- claiming = create the Lease, or replace it with the `resourceVersion` that was read; a 409 means
  another request won that slot. A claim takes a random free slot, so parallel claims spread over the
  pool instead of all racing for its first free slot; after a lost race it lists again and takes another,
  and the pool counts as full only when a listing shows no free slot (each lost race is a slot another
  claim took, so this ends);
- a claim for a session that already holds a slot returns that slot (a retried request).

Sessions created with kubectl (not through the API) hold no slot; they are counted from the session
list and leave fewer slots to the API, as before.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from vivant.apis import resources

LEASE_GROUP, LEASE_VERSION, LEASE_PLURAL = "coordination.k8s.io", "v1", "leases"
LABEL_POOL = "vivant.dev/slot-pool"
LABEL_API = "vivant.dev/created-by"
API_CREATOR = "session-api"
ANNOTATION_HOLDER_UID = "vivant.dev/holder-uid"  # the holding CharacterSession's uid, once it exists


def slot_name(pool: str, index: int) -> str:
    """Lease name of slot `index` of `pool` (a DNS subdomain; long pool names are hashed)."""
    base = f"vivant-slot-{pool}"
    if len(base) > 230:
        base = f"vivant-slot-{hashlib.sha256(pool.encode()).hexdigest()[:32]}"
    return f"{base}-{index}"


def _time(text: str | None) -> datetime | None:
    if not text:
        return None
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


def _micro(now: datetime) -> str:
    return now.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


@dataclass(frozen=True)
class SlotClaim:
    """The outcome of a claim: the slot taken (None = pool full) and how many sessions hold the pool."""

    index: int | None
    active: int
    capacity: int


def is_active(cs: dict[str, Any]) -> bool:
    """A session that holds capacity: not terminal and not being deleted."""
    terminal = {p.value for p in resources.TERMINAL_PHASES}
    return ((cs.get("status") or {}).get("phase") not in terminal
            and not (cs.get("metadata") or {}).get("deletionTimestamp"))


def choose_slots(leases: dict[int, dict[str, Any]], sessions: dict[str, dict[str, Any]], session: str,
                 slots: int, now: datetime, claim_grace_s: float) -> tuple[int | None, list[int], set[int]]:
    """(the slot `session` already holds, else None; the free slots in order; those of them free because
    their recorded holder is not in `sessions`) among `0..slots-1`.

    `leases`: slot index -> Lease object; `sessions`: name -> CharacterSession of the namespace. `sessions`
    may be older than `leases`: a holder missing from it may have been created since, so a caller checks
    that such a holder is really gone before it takes the slot (`claim_slot`'s `holder_active`)."""
    free: list[int] = []
    gone: set[int] = set()
    for i in range(slots):
        lease = leases.get(i)
        if lease is None:
            free.append(i)
            continue
        holder = (lease.get("spec") or {}).get("holderIdentity") or ""
        if holder == session:
            return i, [], set()
        cs = sessions.get(holder)
        if cs is not None:
            if not is_active(cs):
                free.append(i)
            continue
        if ((lease.get("metadata") or {}).get("annotations") or {}).get(ANNOTATION_HOLDER_UID):
            free.append(i)  # its session existed and is gone (deleted), or is newer than `sessions`
            gone.add(i)
            continue
        acquired = _time((lease.get("spec") or {}).get("acquireTime")) or now
        if not holder or (now - acquired).total_seconds() > claim_grace_s:
            free.append(i)  # its request never created the session (it failed or was abandoned)
    return None, free, gone


def lease_body(pool: str, index: int, session: str, owner: dict[str, Any], now: datetime,
               resource_version: str | None = None) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": slot_name(pool, index), "labels": {LABEL_POOL: pool, LABEL_API: API_CREATOR},
                            "ownerReferences": [owner]}
    if resource_version is not None:
        meta["resourceVersion"] = resource_version
    return {"apiVersion": f"{LEASE_GROUP}/{LEASE_VERSION}", "kind": "Lease", "metadata": meta,
            "spec": {"holderIdentity": session, "acquireTime": _micro(now), "renewTime": _micro(now)}}


def holder_created_patch(session: str, uid: str) -> list[dict[str, Any]]:
    """JSON patch of a slot's Lease once `session` exists: record its uid (so its deletion frees the slot at
    once), on the condition that the Lease still names it (the API server answers 422 otherwise)."""
    return [{"op": "test", "path": "/spec/holderIdentity", "value": session},
            {"op": "add", "path": "/metadata/annotations", "value": {ANNOTATION_HOLDER_UID: uid}}]


class SlotConflict(Exception):  # noqa: N818
    """Another request took the slot first (HTTP 409 from the API server)."""


async def claim_slot(
    *, pool: str, session: str, capacity: int, external_active: int, now: datetime, claim_grace_s: float,
    list_leases: Callable[[], Awaitable[list[dict[str, Any]]]],
    sessions: dict[str, dict[str, Any]],
    create: Callable[[dict[str, Any]], Awaitable[None]],
    replace: Callable[[str, dict[str, Any]], Awaitable[None]],
    holder_active: Callable[[str], Awaitable[bool]],
    owner: dict[str, Any], choose: Callable[[list[int]], int] = random.choice,
) -> SlotClaim:
    """Take a free slot of `pool` for `session` (or find the one it holds). `create`/`replace` raise
    SlotConflict on 409; `holder_active(name)` reads one session (a slot whose recorded holder `sessions`
    lacks is taken only when that holder is gone or terminal now). Each try takes `choose(free slots)` of a fresh listing; a lost race lists again
    (so a slot our own earlier, retried write took is found as held). The pool is full only when a listing
    shows no free slot: every lost race is a slot another claim took, so the tries are bounded by the slots."""
    slots = max(0, capacity - external_active)
    active = external_active
    sessions = dict(sessions)
    for _ in range(slots + 1):
        leases: dict[int, dict[str, Any]] = {}
        for lease in await list_leases():
            name = (lease.get("metadata") or {}).get("name", "")
            tail = name.rsplit("-", 1)[-1]
            if tail.isdigit() and name == slot_name(pool, int(tail)):
                leases[int(tail)] = lease
        held, free, gone = choose_slots(leases, sessions, session, slots, now, claim_grace_s)
        while free:
            i = choose(free)
            holder = (leases[i].get("spec") or {}).get("holderIdentity", "") if i in gone else ""
            if not holder or not await holder_active(holder):
                break
            free.remove(i)  # its holder was created after `sessions` was read: taken after all
            sessions[holder] = {"metadata": {"name": holder}}
        active = external_active + (slots - len(free))
        if held is not None:
            return SlotClaim(held, active, capacity)
        if not free:
            return SlotClaim(None, active, capacity)
        try:
            if i in leases:
                rv = (leases[i].get("metadata") or {}).get("resourceVersion")
                await replace(slot_name(pool, i), lease_body(pool, i, session, owner, now, rv))
            else:
                await create(lease_body(pool, i, session, owner, now))
            return SlotClaim(i, active + 1, capacity)
        except SlotConflict:
            continue  # another claim won slot i (or our own earlier attempt did): look again
    return SlotClaim(None, active, capacity)


def owner_of_pool(wp: dict[str, Any]) -> dict[str, Any]:
    meta = wp.get("metadata") or {}
    return {"apiVersion": resources.API_VERSION, "kind": resources.POOL_KIND, "name": meta.get("name", ""), "uid": meta.get("uid", "")}
