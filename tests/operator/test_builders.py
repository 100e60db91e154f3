"""Built-in objects the operator renders pass `kubernetes-validate --strict` (Kubernetes 1.31 schemas).
(The avatar's LiveKit token, which the operator also mints, is tested in tests/livekit/test_avatar_tokens.py.)"""

from __future__ import annotations

import datetime
import re
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from vivant.apis import resources
from vivant.operator import builders

ROOT = Path(__file__).resolve().parents[2]
K8S_VERSION = "1.31"
OWNER = builders.Owner(kind=resources.POOL_KIND, name="h200", uid="0f6c3a52-9a8e-4a37-9c1e-5b1b1f0e2d11")
SPEC = resources.WorkerPool.model_validate(yaml.safe_load((ROOT / "examples/production/workerpool-h200-57b.yaml").read_text())).spec
SPEC_AFFINITY = SPEC.model_copy(update={"affinity": resources.NodeAffinity.model_validate(
    {"required": [{"matchExpressions": [{"key": "gpu", "operator": "In", "values": ["h200"]}]}],
     "preferred": [{"weight": 10, "preference": {"matchExpressions": [{"key": "zone", "operator": "Exists"}]}}]}
)})


def _rendered():
    return {
        "statefulset": builders.build_statefulset("h200", "default", OWNER, SPEC, 3, builders.WorkerRuntime()),
        "statefulset-affinity": builders.build_statefulset("h200", "default", OWNER, SPEC_AFFINITY, 0,
                                                    builders.WorkerRuntime(service_account="vivant-worker")),
        "service": builders.build_headless_service("h200", "default", OWNER),
        "pdb": builders.build_pdb("h200", "default", OWNER),
        "secret": builders.build_token_secret("ada", "default", OWNER, "not-a-real-token"),
    }


@pytest.mark.parametrize("name", list(_rendered()))
def test_rendered_objects_pass_kubernetes_validate_strict(name):
    manifest = _rendered()[name]
    try:
        kubernetes_validate.validate(manifest, K8S_VERSION, strict=True)
    except kubernetes_validate.ValidationError as exc:
        pytest.fail(f"{name}: kubernetes-validate rejected it: {exc.message} at {list(exc.path)}")


def test_strict_validation_catches_a_broken_object():
    """The check above can fail: a typo'd field in a rendered StatefulSet is reported."""
    manifest = _rendered()["statefulset"]
    manifest["spec"]["replica"] = 3
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(manifest, K8S_VERSION, strict=True)


def test_statefulset_shape():
    sts = _rendered()["statefulset"]
    pod = sts["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert sts["spec"]["replicas"] == 3 and sts["spec"]["podManagementPolicy"] == "Parallel"
    assert container["resources"]["limits"] == {"nvidia.com/gpu": "5"}
    env = {e["name"]: e for e in container["env"]}
    assert env["VIVANT_POOL"]["value"] == "default/h200"
    assert "secretKeyRef" in env["VIVANT_REDIS_URL"]["valueFrom"], "Redis URL must come from a Secret"
    assert env["NCCL_NVLS_ENABLE"]["value"] == "0"
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H200"}
    assert sts["metadata"]["ownerReferences"][0]["uid"] == OWNER.uid
    assert set(sts["spec"]["selector"]["matchLabels"].items()) <= set(sts["spec"]["template"]["metadata"]["labels"].items())


def test_replicas_out_of_bounds_is_refused():
    with pytest.raises(ValueError, match="replicas"):
        builders.build_statefulset("h200", "default", OWNER, SPEC, SPEC.max_workers + 1, builders.WorkerRuntime())


def test_token_secret_is_owned_by_the_session():
    owner = builders.Owner(kind=resources.SESSION_KIND, name="ada", uid="u-1")
    secret = builders.build_token_secret("ada", "default", owner, "tok")
    ref = secret["metadata"]["ownerReferences"][0]
    assert (ref["kind"], ref["name"], ref["uid"], ref["controller"]) == ("CharacterSession", "ada", "u-1", True)
    assert secret["stringData"] == {"token": "tok"}


def test_conditions_keep_transition_time_until_status_flips():
    t0 = datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC)
    t1 = t0 + datetime.timedelta(minutes=5)
    c = builders.set_condition([], "Ready", False, "Waiting", now=t0)
    c = builders.set_condition(c, "Ready", False, "StillWaiting", now=t1)
    assert c[0]["lastTransitionTime"] == "2026-01-01T00:00:00Z" and c[0]["reason"] == "StillWaiting"
    c = builders.set_condition(c, "Ready", True, "Streaming", now=t1)
    assert c[0]["lastTransitionTime"] == "2026-01-01T00:05:00Z" and c[0]["status"] == "True"


def test_statefulset_rolls_on_delete_only():
    """The operator rolls idle pods itself; the controller must never replace a streaming worker's pod."""
    assert _rendered()["statefulset"]["spec"]["updateStrategy"] == {"type": "OnDelete"}


def test_token_secret_names_and_labels_fit_any_session_name():
    owner = builders.Owner(kind=resources.SESSION_KIND, name="x", uid="u-1")
    for name in ("ada", "a" * 64, "a.b-c", "s" * 245, "s" * 246, "s" * 252 + "x", ("a." * 126)[:253].rstrip(".")):
        secret = builders.build_token_secret(name, "default", owner, "tok")
        kubernetes_validate.validate(secret, K8S_VERSION, strict=True)
        secret_name = secret["metadata"]["name"]
        assert len(secret_name) <= 253 and secret_name.endswith("-livekit"), secret_name
        assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*", secret_name), secret_name
        assert all(len(v) <= 63 for v in secret["metadata"]["labels"].values())
        assert secret["metadata"]["annotations"][builders.SESSION_ANNOTATION] == name
    long_names = {builders.token_secret_name("s" * 250 + c) for c in "abc"}
    assert len(long_names) == 3, "two long session names share a token Secret"
