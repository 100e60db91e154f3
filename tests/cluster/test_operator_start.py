"""The operator as the chart deploys it starts and works under the chart's own RBAC (issue 14, defects 1, 6, 9).

- cluster-wide (default values): `vivant operator` without `--namespace` used to exit at start
  (`Namespace observer has failed: 'NoneType' object is not iterable`);
- OwnerReferencesPermissionEnforcement is on in the local cluster (as on OpenShift): the operator's
  ServiceAccount must have `update` on the owners' finalizers to create objects whose ownerReferences set
  `blockOwnerDeletion`, as its StatefulSets and token Secrets do;
- namespaced (`operator.watchNamespaces`): kopf used to be refused `list namespaces` for ~30 s before it
  handled anything. A second release is installed for it (its own name and namespace, `--skip-crds`:
  the CRDs belong to the shared release) and uninstalled afterwards.
"""

from __future__ import annotations

import json

import pytest
from conftest import CHART, RELEASE_NS, Kube, wait_for
from kube_objects import PodLog, condition, operator_pods, pool_manifest, status

OPERATOR_SA = f"system:serviceaccount:{RELEASE_NS}:vivant-operator"


def _statefulset_of(kube: Kube, namespace: str, name: str) -> dict:
    return wait_for(lambda: kube.get("statefulset", name, namespace), f"StatefulSet {namespace}/{name}", 30)


@pytest.mark.timeout(120)
def test_cluster_wide_operator_starts_and_serves_a_new_namespace(kube: Kube, vivant_release: str, namespace: str):
    kube.apply(pool_manifest(namespace, "start"))
    _statefulset_of(kube, namespace, "start")
    wait_for(lambda: (condition(status(kube, "wp", "start", namespace), "Ready") or {}).get("status") == "True",
             "the pool Ready", 30)
    for pod in operator_pods(kube):  # the active replica and the standby
        log = PodLog(kube, RELEASE_NS, pod, "operator").text()
        assert "has failed" not in log, log[-3000:]
    kube.kubectl("delete", "wp", "start", "-n", namespace, "--wait=false")


@pytest.mark.timeout(120)
def test_operator_may_set_block_owner_deletion_under_the_charts_rbac(kube: Kube, vivant_release: str, namespace: str):
    """The enforcement is real (a ServiceAccount without finalizers rights is refused), and the chart's
    operator ServiceAccount creates its StatefulSet with a blocking controller reference."""
    kube.apply(pool_manifest(namespace, "owned"))
    uid = wait_for(lambda: (kube.get("wp", "owned", namespace) or {}).get("metadata", {}).get("uid"), "pool uid", 10)
    sts = _statefulset_of(kube, namespace, "owned")
    assert sts["metadata"]["ownerReferences"] == [{
        "apiVersion": "vivant.dev/v1alpha1", "kind": "WorkerPool", "name": "owned", "uid": uid,
        "controller": True, "blockOwnerDeletion": True}], sts["metadata"]["ownerReferences"]
    fields = json.loads(kube.kubectl("get", "statefulset", "owned", "-n", namespace, "-o", "json",
                                     "--show-managed-fields").stdout)["metadata"]["managedFields"]
    assert "vivant-operator" in {f.get("manager") for f in fields}, f"not written by the operator: {fields}"
    for resource in ("workerpools", "charactersessions"):
        can = kube.kubectl("auth", "can-i", "update", f"{resource}.vivant.dev", "--subresource=finalizers",
                           "-n", namespace, f"--as={OPERATOR_SA}", check=False)
        assert can.stdout.strip() == "yes", f"{OPERATOR_SA} may not update {resource}/finalizers: {can.stdout}{can.stderr}"

    # The admission plugin is on: without that right, the same ownerReference is refused.
    kube.kubectl("create", "serviceaccount", "no-finalizers", "-n", namespace)
    kube.kubectl("create", "role", "secrets-only", "--verb=create", "--resource=secrets", "-n", namespace)
    kube.kubectl("create", "rolebinding", "secrets-only", "--role=secrets-only",
                 f"--serviceaccount={namespace}:no-finalizers", "-n", namespace)
    secret = {"apiVersion": "v1", "kind": "Secret", "metadata": {
        "name": "blocked", "namespace": namespace, "ownerReferences": [{
            "apiVersion": "vivant.dev/v1alpha1", "kind": "WorkerPool", "name": "owned", "uid": uid,
            "controller": True, "blockOwnerDeletion": True}]}, "stringData": {"token": "x"}}
    refused = wait_for(lambda: (lambda p: p if "cannot set blockOwnerDeletion" in p.stderr else None)(
        kube.kubectl("create", "-f", "-", f"--as=system:serviceaccount:{namespace}:no-finalizers",
                     input=json.dumps(secret), check=False)), "the refusal of blockOwnerDeletion", 15)
    assert refused.returncode != 0
    kube.kubectl("delete", "wp", "owned", "-n", namespace, "--wait=false")


@pytest.mark.timeout(240)
def test_namespaced_release_handles_its_namespace_right_away(kube: Kube, vivant_release: str):
    release_ns, watched = kube.new_namespace("vns"), kube.new_namespace("watched")
    release = "vivant-ns"  # a name holding "vivant": the chart uses it as is for its objects
    kube.apply(pool_manifest(watched, "early"))  # there before the operator starts: its first object
    try:
        # one standalone replica: the bound below is about the namespaced start (no refused namespace listings);
        # the default two replicas' peering start is the failover test's (test_flows.py)
        kube.helm("install", release, str(CHART), "-n", release_ns, "--skip-crds",
                  "--set", f"operator.watchNamespaces={{{watched}}}", "--set", "api.enabled=false",
                  "--set", "operator.replicas=1", "--set", "operator.peering.enabled=false")
        pods = wait_for(lambda: operator_pods(kube, release_ns, release), "the namespaced operator pods", 60)
        logs = [wait_for(lambda pod=pod: PodLog(kube, release_ns, pod, "operator"), f"the log of {pod}", 60)
                for pod in pods]

        def first_handled():  # by whichever replica works (kopf peering pauses the other)
            times = [(t, log) for log in logs
                     if (t := log.first_time(rf"pool {watched}/early: generation \d+ applied")) is not None]
            return min(times, key=lambda x: x[0]) if times else None

        handled, log = wait_for(first_handled, "the namespaced operator handling pool 'early'", 90)
        took = (handled - log.process_start()).total_seconds()
        text = log.text()
        assert "Not enough permissions to list namespaces" not in text, text[-3000:]
        # A functional bound (the old start waited ~30 s on refused namespace listings), not a benchmark.
        assert took < 15, f"the namespaced operator took {took:.1f}s from its start to its first pool:\n{text[-3000:]}"
    finally:
        kube.helm("uninstall", release, "-n", release_ns, "--wait", check=False)
        kube.kubectl("delete", "namespace", release_ns, watched, "--wait=false", check=False)
