"""Fixtures of the `cluster` tests: one real local Kubernetes for the whole test session.

`kube` starts `vivant.devcluster.LocalCluster` (etcd, kube-apiserver with RBAC and
OwnerReferencesPermissionEnforcement, kube-controller-manager, kube-scheduler, kwok with two simulated
8-GPU H100 nodes, a Redis, and the pod runner that runs the real processes behind vivant's pods) and
stops it afterwards. `vivant_release` installs `charts/vivant` into it with `helm install` (default
values: cluster-wide operator, the session API, real RBAC under their own ServiceAccounts).
`namespace` gives each test a fresh namespace holding the Secrets the chart's defaults name.

Nothing here stands in for the Kubernetes API: every request goes to the real apiserver.
"""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import polling
import pytest
from vivant.devcluster.binaries import tool
from vivant.devcluster.cluster import ClusterSpec, LocalCluster, NodePoolSpec

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "vivant"
RELEASE = "vivant"
RELEASE_NS = "vivant-system"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.cluster)


def wait_for(check: Callable[[], Any], what: str, timeout: float = 30.0, period: float = 0.25) -> Any:
    """`polling.wait_for` in the cluster tests' argument order, an error from `check` counting as not yet."""
    return polling.wait_for(what, check, timeout, period, retry_on=(Exception,))


class Kube:
    """The running cluster plus kubectl/helm bound to its admin kubeconfig."""

    def __init__(self, cluster: LocalCluster) -> None:
        self.cluster = cluster
        assert cluster.state is not None
        self.state = cluster.state
        self.kubeconfig = cluster.kubeconfig

    def kubectl(self, *args: str, check: bool = True, input: str | None = None) -> subprocess.CompletedProcess:
        return self.cluster.kubectl(*args, check=check, input=input)

    def get(self, kind: str, name: str, namespace: str | None = None) -> dict[str, Any] | None:
        ns = ["-n", namespace] if namespace else []
        out = self.kubectl("get", kind, name, *ns, "-o", "json", check=False)
        if out.returncode != 0:
            if "NotFound" in out.stderr:
                return None
            raise RuntimeError(out.stderr)
        return json.loads(out.stdout)

    def items(self, kind: str, namespace: str | None = None, selector: str | None = None) -> list[dict[str, Any]]:
        args = ["get", kind, "-o", "json"] + (["-n", namespace] if namespace else ["-A"])
        if selector:
            args += ["-l", selector]
        return json.loads(self.kubectl(*args).stdout)["items"]

    def apply(self, manifest: dict[str, Any] | str, check: bool = True) -> subprocess.CompletedProcess:
        text = manifest if isinstance(manifest, str) else json.dumps(manifest)
        return self.kubectl("apply", "-f", "-", input=text, check=check)

    def helm(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        proc = subprocess.run([tool("helm"), f"--kubeconfig={self.kubeconfig}", *args], capture_output=True, text=True,
                              timeout=300)
        if check and proc.returncode != 0:
            raise RuntimeError(f"helm {' '.join(args)} failed: {proc.stderr.strip()}")
        return proc

    def pod_log(self, namespace: str, pod: str, container: str | None = None) -> str:
        logs = sorted((self.cluster.dir / "pods").glob(f"{namespace}_{pod}_*/{container or '*'}.log"))
        return "\n".join(p.read_text(errors="replace")[-4000:] for p in logs)

    def new_namespace(self, prefix: str = "t") -> str:
        name = f"{prefix}-{uuid.uuid4().hex[:6]}"
        self.cluster._write_chart_secrets(name)
        return name


@pytest.fixture(scope="session")
def kube(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Kube]:
    spec = ClusterSpec(state_dir=tmp_path_factory.mktemp("cluster"),
                       node_pool=NodePoolSpec(nodes=2, gpus_per_node=8), run_pods=True, redis=True)
    cluster = LocalCluster(spec, log=lambda msg: print(msg, file=sys.stderr, flush=True))
    cluster.up()
    try:
        yield Kube(cluster)
    finally:
        cluster.down()


@pytest.fixture
def namespace(kube: Kube) -> Iterator[str]:
    ns = kube.new_namespace()
    yield ns
    kube.kubectl("delete", "namespace", ns, "--wait=false", check=False)


@pytest.fixture(scope="session")
def vivant_release(kube: Kube) -> Iterator[str]:
    """`helm install vivant charts/vivant -n vivant-system` with the chart's default values."""
    kube.helm("install", RELEASE, str(CHART), "-n", RELEASE_NS, "--wait", "--timeout", "120s")
    yield RELEASE
    kube.helm("uninstall", RELEASE, "-n", RELEASE_NS, "--wait", check=False)


# ================================================================================================
# Added for the tests that run vivant's components in this process against the cluster
# (test_operator_kopf.py: the operator under kopf's KopfRunner; test_api_*.py: the session gateway's
# aiohttp app). They talk to the real apiserver with the admin credentials; nothing stands in for it.
# ================================================================================================

OPERATOR_SELECTOR = "app.kubernetes.io/name=vivant,app.kubernetes.io/component=operator"


@pytest.fixture(scope="session")
def kube_client(kube: Kube) -> Iterator[Any]:
    """A `kubernetes.client.ApiClient` for the apiserver with the admin kubeconfig (no global default set)."""
    import kubernetes

    client = kubernetes.config.new_client_from_config(config_file=str(kube.kubeconfig))
    yield client
    client.close()


@pytest.fixture(scope="session")
def vivant_crds(kube: Kube) -> None:
    """The project's CRDs (`crds/`, what the chart installs), applied and Established. `helm install` of the
    chart afterwards skips CRDs that exist, so this and `vivant_release` may come in either order."""
    kube.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(REPO / "crds"))
    kube.kubectl("wait", "--for=condition=Established", "--timeout=60s", "-f", str(REPO / "crds"))


@pytest.fixture(scope="module")
def release_operators_paused(kube: Kube) -> Iterator[None]:
    """No helm-installed vivant operator runs while this module's tests do; restored afterwards.

    Why: an installed release's operator is standalone and, by default, cluster-wide, so it would handle
    the objects of these tests' namespaces too — a second operator writing status and finalizers beside
    the one under test (or beside none, where a test needs the API alone). Each such Deployment is scaled
    to 0 for the module (its process stopped by the pod runner before the first test) and scaled back to
    its replicas after the last, waiting until the pod runner has started its process again. Nothing is
    uninstalled."""
    from vivant.devcluster.cluster import RUN_BY_ANNOTATION

    deployments = [d for d in kube.items("deployments", selector=OPERATOR_SELECTOR)
                   if int(d["spec"].get("replicas") or 0) > 0]
    for d in deployments:
        kube.kubectl("scale", "deployment", d["metadata"]["name"], "-n", d["metadata"]["namespace"], "--replicas=0")
    for d in deployments:
        ns = d["metadata"]["namespace"]
        wait_for(lambda ns=ns: not kube.items("pods", ns, OPERATOR_SELECTOR),
                 f"the operator pods of {ns} to stop", 60, 0.5)
    try:
        yield
    finally:
        for d in deployments:
            ns, name, replicas = d["metadata"]["namespace"], d["metadata"]["name"], int(d["spec"]["replicas"])
            kube.kubectl("scale", "deployment", name, "-n", ns, f"--replicas={replicas}")
            wait_for(lambda ns=ns, n=replicas: len([p for p in kube.items("pods", ns, OPERATOR_SELECTOR)
                                                     if RUN_BY_ANNOTATION in p["metadata"].get("annotations", {})
                                                     and not p["metadata"].get("deletionTimestamp")]) >= n,
                     f"the operator of {ns} running again (its process started by the pod runner)", 60, 0.5)


@pytest.fixture
def bare_namespace(kube_client: Any) -> Iterator[str]:
    """A fresh, empty namespace (none of the chart's Secrets: for tests that write their own objects only)."""
    import kubernetes

    core = kubernetes.client.CoreV1Api(kube_client)
    name = f"t-{uuid.uuid4().hex[:6]}"
    core.create_namespace({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})
    yield name
    core.delete_namespace(name)


@pytest.fixture
def gateway_kube(kube: Kube) -> Iterator[Any]:
    """A `kubernetes` client with the admin kubeconfig for a session gateway under test; it records every
    request it sends (gateway_support.RecordingApiClient)."""
    from gateway_support import recording_client

    client = recording_client(str(kube.kubeconfig))
    yield client
    client.close()


@pytest.fixture
def gateway_space(kube_client: Any, bare_namespace: str) -> Iterator[Any]:
    """A fresh namespace with WorkerPools `h200` (2 workers) and `full` (1 worker), as a
    gateway_support.GatewaySpace (read and written with the admin client, not the gateway's); its sessions
    and pools are deleted after the test."""
    from gateway_support import GatewaySpace

    space = GatewaySpace(kube_client, bare_namespace)
    space.add_pool("h200", 2)
    space.add_pool("full", 1)
    yield space
    space.clear()
