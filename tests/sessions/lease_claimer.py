"""Helper run as a separate process by test_registry_leases.py: claim/release cycles against a real Redis.

Usage: python lease_claimer.py REDIS_URL POOL TAG CYCLES THREADS
Prints one JSON object: {"intervals": [[worker, session, t_claimed, t_releasing], ...], "errors": [...]}
Times are time.monotonic() (CLOCK_MONOTONIC, comparable across processes on one Linux host).
"""

from __future__ import annotations

import json
import sys
import threading
import time

from vivant.sessions.registry import Registry


def claim_cycles(registry: Registry, pool: str, tag: str, cycles: int) -> tuple[list[list], list[str]]:
    """Run `cycles` successful claim -> check -> release cycles; return intervals and anomalies seen."""
    intervals: list[list] = []
    errors: list[str] = []
    i = 0
    while len(intervals) < cycles:
        session = f"{tag}-{i}"
        i += 1
        worker = registry.claim_idle_worker(pool, session)
        if worker is None:
            time.sleep(0.0005)
            continue
        t_claimed = time.monotonic()
        again = registry.claim_idle_worker(pool, session)
        if again != worker:
            errors.append(f"claim of {session} not idempotent: {worker} then {again}")
        if registry.session_of(pool, worker) != session:
            errors.append(f"{worker} should hold {session}, registry says {registry.session_of(pool, worker)}")
        if registry.worker_of(session) != worker:
            errors.append(f"{session} should map to {worker}, registry says {registry.worker_of(session)}")
        t_releasing = time.monotonic()
        intervals.append([worker, session, t_claimed, t_releasing])
        if not registry.release(pool, worker, session):
            errors.append(f"release of {worker}/{session} refused")
        if registry.release(pool, worker, session):
            errors.append(f"second release of {worker}/{session} accepted")
    return intervals, errors


def main() -> int:
    url, pool, tag, cycles, threads = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
    registry = Registry(url, heartbeat_ttl_s=120)
    results: list[tuple[list, list]] = []
    lock = threading.Lock()

    def one(k: int) -> None:
        r = claim_cycles(registry, pool, f"{tag}.{k}", cycles // threads)
        with lock:
            results.append(r)

    ts = [threading.Thread(target=one, args=(k,)) for k in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    print(json.dumps({"intervals": [x for r in results for x in r[0]], "errors": [e for r in results for e in r[1]]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
