"""Editing a pool's pod template never kills a worker that is streaming (issue 14, defect 7).

Before, the StatefulSet rolled its pods itself (RollingUpdate) and replaced the busy worker's pod with the
rest. Now its updateStrategy is OnDelete and the operator replaces idle outdated pods one at a time; a busy
one rolls once its session has ended. Real workers (`vivant worker`, tiny preset, frames to a null sink)
serve the session; the edit is the image tag of the vivant worker image, as in a release upgrade.
"""

from __future__ import annotations

import time

import pytest
from conftest import Kube, wait_for
from kube_objects import POOLS, SESSIONS, WORKER_IMAGE, pool_manifest, session_manifest, status
from vivant.apis import resources
from vivant.sessions.registry import Registry

NEW_IMAGE = WORKER_IMAGE.rsplit(":", 1)[0] + ":0.1.1"


def pods(kube: Kube, ns: str) -> dict[str, tuple[str, str]]:
    """pod name -> (uid, controller-revision-hash) of the pool's live pods."""
    return {p["metadata"]["name"]: (p["metadata"]["uid"], p["metadata"]["labels"].get("controller-revision-hash"))
            for p in kube.items("pods", ns, "vivant.dev/pool=roll") if not p["metadata"].get("deletionTimestamp")}


@pytest.mark.timeout(420)
def test_a_template_edit_rolls_idle_workers_and_spares_the_streaming_one(kube: Kube, vivant_release: str, namespace: str):
    registry = Registry(kube.state.redis_url)
    pool = resources.pool_key(namespace, "roll")
    kube.apply(pool_manifest(namespace, "roll", image=WORKER_IMAGE, minIdle=1, maxWorkers=2))
    wait_for(lambda: registry.idle_workers(pool), "a warm idle worker", 120)
    kube.apply(session_manifest(namespace, "live", "roll", maxDurationSeconds=900))
    wait_for(lambda: status(kube, SESSIONS, "live", namespace).get("phase") == "Streaming", "session live Streaming", 90)
    busy = status(kube, SESSIONS, "live", namespace)["worker"]
    wait_for(lambda: len(registry.idle_workers(pool)) == 1, "a second, idle worker (busy + minIdle)", 120)
    (idle,) = registry.idle_workers(pool)
    before = pods(kube, namespace)
    assert set(before) == {busy, idle}, before

    kube.kubectl("patch", POOLS, "roll", "-n", namespace, "--type=merge", "-p", f'{{"spec": {{"image": "{NEW_IMAGE}"}}}}')
    update = wait_for(lambda: (lambda s: s["status"].get("updateRevision") != before[busy][1] and s["status"]["updateRevision"])(
        kube.get("statefulset", "roll", namespace)), "the StatefulSet's new revision", 30)

    def idle_replaced_and_warm() -> bool:
        now = pods(kube, namespace)
        assert now.get(busy) == before[busy], f"the streaming worker's pod was replaced: {before} -> {now}"
        phase = status(kube, SESSIONS, "live", namespace).get("phase")
        assert phase == "Streaming", f"the session left Streaming during the roll: {phase}"
        return now.get(idle, ("", ""))[1] == update and idle in registry.idle_workers(pool)

    wait_for(idle_replaced_and_warm, "the idle worker replaced by one of the new template, warm", 150, period=0.5)
    deadline = time.monotonic() + 6  # the busy one must stay while its session streams
    while time.monotonic() < deadline:
        idle_replaced_and_warm()
        time.sleep(0.5)
    sts = kube.get("statefulset", "roll", namespace)
    assert sts["spec"]["updateStrategy"] == {"type": "OnDelete"}, sts["spec"]["updateStrategy"]
    assert sts["spec"]["template"]["spec"]["containers"][0]["image"] == NEW_IMAGE

    kube.kubectl("delete", SESSIONS, "live", "-n", namespace, "--wait=true", "--timeout=60s")
    wait_for(lambda: pods(kube, namespace).get(busy, ("", ""))[1] == update, "the formerly busy pod rolled", 120)
    after = pods(kube, namespace)
    assert after[busy][0] != before[busy][0] and all(rev == update for _, rev in after.values()), after
    assert registry.worker_of(f"{namespace}/live") is None
    kube.kubectl("delete", POOLS, "roll", "-n", namespace, "--wait=false")
    registry.close()
