"""The README's way to try vivant, on the real local cluster: `vivant dev cluster up`, `helm install`
with the chart's default values, `kubectl apply -f examples/` -> a Streaming session served by a real
`vivant worker` process; then delete -> lease released, token Secret and finalizer gone, worker idle."""

from __future__ import annotations

import json

import pytest
from conftest import REPO, Kube, wait_for
from vivant.sessions.registry import Registry

EXAMPLES = REPO / "examples"


def phase(kube: Kube, name: str, ns: str) -> str | None:
    obj = kube.get("charactersessions.vivant.dev", name, ns)
    return (obj or {}).get("status", {}).get("phase")


@pytest.mark.timeout(300)
def test_readme_quickstart_streams_and_cleans_up(kube: Kube, vivant_release: str) -> None:
    kube.kubectl("apply", "-f", str(EXAMPLES / "workerpool.yaml"))
    kube.kubectl("apply", "-f", str(EXAMPLES / "charactersession.yaml"))
    try:
        # pods scheduled on the simulated H100 nodes
        pods = wait_for(lambda: [p for p in kube.items("pods", "default", "vivant.dev/pool=h100")
                                 if p["spec"].get("nodeName", "").startswith("h100-")], "worker pods on h100 nodes", 60)
        assert all(p["spec"]["nodeName"].startswith("h100-") for p in pods)
        wait_for(lambda: phase(kube, "ada", "default") == "Streaming",
                 "session ada Streaming", 150)
        session = kube.get("charactersessions.vivant.dev", "ada", "default")
        worker = session["status"]["worker"]
        assert worker.startswith("h100-"), session["status"]
        table = kube.kubectl("get", "charactersessions", "-n", "default").stdout
        header, row = table.splitlines()[0].split(), table.splitlines()[1].split()
        assert {"PHASE", "WORKER", "FPS"} <= set(header), table
        assert "Streaming" in row and worker in row, table
        fps = wait_for(lambda: (kube.get("charactersessions.vivant.dev", "ada", "default") or {})
                       .get("status", {}).get("avgFps"), "an fps figure on the session", 30)
        assert fps > 0
        registry = Registry(kube.state.redis_url)
        assert registry.worker_of("default/ada") == worker
        secret = session["status"]["tokenSecret"]
        assert kube.get("secret", secret, "default") is not None
    finally:
        kube.kubectl("delete", "-f", str(EXAMPLES / "charactersession.yaml"), "--wait=true", "--timeout=60s", check=False)
    assert kube.get("charactersessions.vivant.dev", "ada", "default") is None  # finalizer removed
    wait_for(lambda: kube.get("secret", secret, "default") is None, "the token Secret garbage-collected", 30)
    wait_for(lambda: registry.worker_of("default/ada") is None, "the lease released", 10)
    wait_for(lambda: worker in registry.idle_workers("default/h100"), f"worker {worker} idle again", 30)
    kube.kubectl("delete", "-f", str(EXAMPLES / "workerpool.yaml"), "--wait=true", check=False)
    print(json.dumps({"worker": worker, "fps": fps}))
