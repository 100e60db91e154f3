"""A session that cannot get a worker says why, and the operator does not shout about it (issue 14, defect 10).

Before, a session for a pool that does not exist and one for a pool whose pods can never be scheduled both
ended as `NoIdleWorker ... for 121s` with no hint of the cause, while the operator logged an ERROR every
2 s per waiting session and a line for every 1 s timer run. The pools here use an image the local pod
runner does not run (no worker processes); their pods need more GPUs than a node has, or lack the GPU
taint's toleration, so the real scheduler refuses them with its own words.
"""

from __future__ import annotations

import re
import time

import pytest
from conftest import RELEASE_NS, Kube, wait_for
from kube_objects import (
    SESSIONS,
    PodLog,
    condition,
    events,
    operator_pod,
    pool_manifest,
    session_manifest,
    status,
)
from vivant.sessions.registry import Registry

CASES = {  # session -> (its pool, the reason, words its message must hold)
    "for-nothing": ("no-such-pool", "PoolNotFound", "WorkerPool no-such-pool not found"),
    "for-big": ("big", "WorkersUnschedulable", "Insufficient nvidia.com/gpu"),
    "for-untolerated": ("untolerated", "WorkersUnschedulable", "untolerated taint"),
}


@pytest.mark.timeout(180)
def test_waiting_sessions_say_why_and_log_once_per_change(kube: Kube, vivant_release: str, namespace: str):
    big = pool_manifest(namespace, "big", gpusPerWorker=16, tensorParallel=1)  # a node has 8
    untolerated = pool_manifest(namespace, "untolerated")
    del untolerated["spec"]["tolerations"]
    kube.apply(big)
    kube.apply(untolerated)
    log = PodLog(kube, RELEASE_NS, operator_pod(kube), "operator")
    for name, (pool, _, _) in CASES.items():
        kube.apply(session_manifest(namespace, name, pool))

    def says(name: str) -> dict | None:
        _, reason, words = CASES[name]
        st = status(kube, SESSIONS, name, namespace)
        ready = condition(st, "Ready") or {}
        return st if ready.get("reason") == reason and words in (st.get("message") or "") else None

    for name in CASES:
        st = wait_for(lambda name=name: says(name), f"session {name} saying why it waits", 60)
        assert st["phase"] == "Pending", st
        assert events(kube, namespace, name, CASES[name][1]), f"no {CASES[name][1]} Event on {name}"

    # A waiting period: the sessions keep waiting, nothing changes, and the operator keeps quiet about them.
    mark = log.mark()
    time.sleep(8)
    window = log.since(mark)
    about = [line for line in window.splitlines() if any(f"{namespace}/{n}" in line for n in CASES)]
    assert not [line for line in window.splitlines() if "[ERROR" in line], window[-3000:]
    assert not re.search(r"Timer '[a-z_]+' succeeded", window), window[-3000:]
    assert len(about) <= len(CASES), f"{len(about)} lines about {len(CASES)} unchanged waiting sessions in 8 s:\n" + \
        "\n".join(about[-20:])
    for name in CASES:
        assert says(name), f"{name} lost its reason: {status(kube, SESSIONS, name, namespace)}"
        assert Registry(kube.state.redis_url).worker_of(f"{namespace}/{name}") is None
