"""WorkerPools the API server would refuse to run are refused at `kubectl apply`, naming the field
(issue 14, defects 4 and 5); what the API server still refuses is reported on the pool, once.

Before: the CRD accepted tolerations with `operator: Exists` and a value, `tolerationSeconds` without
`NoExecute`, affinity expressions with the wrong number of values, nodeSelector keys and values that are
not labels, pool names with dots and pool names over 52 characters (whose pods can never be created: the
StatefulSet's controller-revision-hash label would exceed 63 characters); the operator then retried the
StatefulSet for ever and wrote nothing on the pool.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from conftest import RELEASE_NS, Kube, wait_for
from kube_objects import POOLS, PodLog, condition, events, operator_pod, pool_manifest, status

EXISTS_WITH_VALUE = {"key": "nvidia.com/gpu", "operator": "Exists", "value": "present", "effect": "NoSchedule"}
SECONDS_WITHOUT_NOEXECUTE = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule",
                             "tolerationSeconds": 30}


def _required(*expressions: dict[str, Any]) -> dict[str, Any]:
    return {"required": [{"matchExpressions": list(expressions)}]}


# (case id, pool name, spec fields to set, the field path kubectl's error must name)
REFUSED = [
    ("toleration-exists-with-value", "t1", {"tolerations": [EXISTS_WITH_VALUE]}, "spec.tolerations[0].value"),
    ("toleration-seconds-without-noexecute", "t2", {"tolerations": [SECONDS_WITHOUT_NOEXECUTE]},
     "spec.tolerations[0].tolerationSeconds"),
    ("toleration-equal-without-key", "t3", {"tolerations": [{"operator": "Equal", "value": "x"}]},
     "spec.tolerations[0].operator"),
    ("toleration-key-not-a-label", "t4", {"tolerations": [{"key": "nvidia gpu", "operator": "Exists"}]},
     "spec.tolerations[0].key"),
    ("affinity-in-without-values", "a1", {"affinity": _required({"key": "zone", "operator": "In"})},
     "spec.affinity.required[0].matchExpressions[0].values"),
    ("affinity-exists-with-values", "a2", {"affinity": _required({"key": "zone", "operator": "Exists", "values": ["a"]})},
     "spec.affinity.required[0].matchExpressions[0].values"),
    ("affinity-gt-two-values", "a3", {"affinity": _required({"key": "gen", "operator": "Gt", "values": ["1", "2"]})},
     "spec.affinity.required[0].matchExpressions[0].values"),
    ("affinity-lt-not-an-integer", "a4", {"affinity": _required({"key": "gen", "operator": "Lt", "values": ["new"]})},
     "spec.affinity.required[0].matchExpressions[0].values"),
    ("affinity-value-not-a-label", "a5", {"affinity": _required({"key": "zone", "operator": "In", "values": ["a b"]})},
     "spec.affinity.required[0].matchExpressions[0].values[0]"),
    ("node-selector-key-not-a-label", "n1", {"nodeSelector": {"gpu product": "H100"}}, "spec.nodeSelector"),
    ("node-selector-value-not-a-label", "n2", {"nodeSelector": {"nvidia.com/gpu.product": "H100 80GB"}},
     "spec.nodeSelector.nvidia.com/gpu.product"),
    ("name-with-dots", "h100.main", {}, "metadata.name"),
    ("name-of-53-characters", "p" * 53, {}, "metadata.name"),
]


@pytest.fixture(scope="module")
def pool_ns(kube: Kube, vivant_release: str) -> Iterator[str]:
    ns = kube.new_namespace("pools")
    yield ns
    kube.kubectl("delete", "namespace", ns, "--wait=false", check=False)


@pytest.mark.parametrize("case,name,spec,field", REFUSED, ids=[c[0] for c in REFUSED])
def test_the_crd_refuses_what_the_api_server_would_not_run(kube: Kube, pool_ns: str, case, name, spec, field):
    out = kube.apply(pool_manifest(pool_ns, name, **spec), check=False)
    assert out.returncode != 0, f"{case}: the CRD accepted it: {out.stdout}"
    assert field in out.stderr, f"{case}: the error does not name {field}: {out.stderr}"
    assert kube.get(POOLS, name, pool_ns) is None


@pytest.mark.timeout(120)
def test_a_pool_name_at_the_limit_gets_its_pods(kube: Kube, pool_ns: str):
    name = "p" * 52
    kube.apply(pool_manifest(pool_ns, name))
    pod = wait_for(lambda: kube.get("pod", f"{name}-0", pool_ns), f"pod {name}-0 created", 60)
    revision = pod["metadata"]["labels"]["controller-revision-hash"]
    assert revision.startswith(f"{name}-") and len(revision) <= 63, revision
    assert not events(kube, pool_ns, name, "FailedCreate")
    kube.kubectl("delete", POOLS, name, "-n", pool_ns, "--wait=false")


POLICY = "vivant-test-no-forbidden-images"


@pytest.mark.timeout(180)
def test_a_statefulset_the_api_server_refuses_is_reported_once_and_retried_on_the_next_edit(kube: Kube, pool_ns: str):
    """An admission policy (as a cluster's policy engine would) refuses the StatefulSet: the pool says so
    (Ready=False StatefulSetRejected with the server's message, a Warning Event), the operator stops trying,
    and an edit of the spec is tried again."""
    kube.apply({"apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingAdmissionPolicy",
                "metadata": {"name": POLICY}, "spec": {
                    "failurePolicy": "Fail",
                    "matchConstraints": {"resourceRules": [{"apiGroups": ["apps"], "apiVersions": ["v1"],
                                                            "operations": ["CREATE", "UPDATE"],
                                                            "resources": ["statefulsets"]}]},
                    "validations": [{"expression": "object.spec.template.spec.containers.all(c, "
                                                   "!c.image.startsWith('registry.example/forbidden'))",
                                     "message": "images from registry.example/forbidden are not allowed"}]}})
    kube.apply({"apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingAdmissionPolicyBinding",
                "metadata": {"name": POLICY}, "spec": {
                    "policyName": POLICY, "validationActions": ["Deny"],
                    "matchResources": {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": pool_ns}}}}})
    log = PodLog(kube, RELEASE_NS, operator_pod(kube), "operator")
    mark = log.mark()
    try:
        # the policy takes a moment to be in force: until then the pool could be served, so use a fresh name per try
        def refused_pool() -> str | None:
            name = f"refused-{refused_pool.n}"
            refused_pool.n += 1
            kube.apply(pool_manifest(pool_ns, name, image="registry.example/forbidden/worker:1"))
            ready = wait_for(lambda: condition(status(kube, POOLS, name, pool_ns), "Ready"), "a Ready condition", 30)
            return name if ready["reason"] == "StatefulSetRejected" else None
        refused_pool.n = 0
        name = wait_for(refused_pool, "a pool whose StatefulSet the policy refuses", 60, period=1)
        ready = condition(status(kube, POOLS, name, pool_ns), "Ready")
        assert ready["status"] == "False" and "not allowed" in ready["message"], ready
        warnings = events(kube, pool_ns, name, "StatefulSetRejected")
        assert warnings and warnings[0]["type"] == "Warning" and "not allowed" in warnings[0]["message"], warnings
        wait_for(lambda: True, "a few operator ticks", 6)
        tries = log.since(mark).count(f"statefulsets.apps \"{name}\" is forbidden")
        assert tries == 1, f"the operator tried {tries} times (once, then only on a spec change)"
        assert kube.get("statefulset", name, pool_ns) is None

        kube.kubectl("patch", POOLS, name, "-n", pool_ns, "--type=merge", "-p",
                     '{"spec": {"image": "registry.example/fuzz-worker:1"}}')
        wait_for(lambda: (condition(status(kube, POOLS, name, pool_ns), "Ready") or {}).get("status") == "True",
                 "the edited pool Ready", 30)
        assert kube.get("statefulset", name, pool_ns) is not None
    finally:
        kube.kubectl("delete", "validatingadmissionpolicybinding", POLICY, "--wait=false", check=False)
        kube.kubectl("delete", "validatingadmissionpolicy", POLICY, "--wait=false", check=False)
