"""The Helm chart (charts/vivant) rendered by the real helm binary (.venv/bin/helm, from `make install`).

Rendered with the default values and each file under charts/vivant/ci/, then:
- `helm lint --strict` passes and every built-in object passes `kubernetes-validate --strict` (k8s 1.31);
- custom resources are checked by schema: the WorkerPool against the CRD's own openAPIV3Schema (and the
  pydantic model the operator parses it with); PodMonitor/ServiceMonitor/PrometheusRule against the
  subset of the Prometheus Operator's schema the chart uses (its CRDs are not vendored here);
- assertions on what an operator of the cluster cares about: RBAC verbs, pod security, pinned images,
  GPU requests and nodeSelector of the worker pool (through the operator's own StatefulSet builder),
  feature flags -> objects present or absent, the CRDs and the rules file carried without a fork;
- bad values fail the render with a message naming the value.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from functools import cache
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "vivant"
CI_VALUES = sorted((CHART / "ci").glob("*.yaml"))
HELM = Path(sys.executable).parent / "helm"
K8S_VERSION = "1.31"
CUSTOM_GROUPS = ("vivant.dev/", "monitoring.coreos.com/", "kopf.dev/")
DEFAULT_RUNBOOK_BASE = "https://github.com/vivant-dev/vivant/blob/main/docs/runbooks"

pytestmark = pytest.mark.skipif(not HELM.exists(), reason=f"{HELM} missing: run `make install` (tools/install_helm.py)")

VALUE_SETS = {"default": None, **{p.stem: p for p in CI_VALUES}}


def helm(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(HELM), *args], cwd=ROOT, capture_output=True, text=True, timeout=120)


@cache
def render(values: str | None = None, *sets: str) -> tuple[dict, ...]:
    """`helm template` (with CRDs) -> the rendered objects."""
    args = ["template", "rel", str(CHART), "--namespace", "vivant-system", "--include-crds"]
    if values:
        args += ["-f", values]
    for s in sets:
        args += ["--set", s]
    out = helm(*args)
    assert out.returncode == 0, f"helm template failed ({values}, {sets}):\n{out.stderr}"
    return tuple(d for d in yaml.safe_load_all(out.stdout) if d)


def objects(name: str) -> tuple[dict, ...]:
    path = VALUE_SETS[name]
    return render(str(path) if path else None)


def find(objs, kind: str, name: str | None = None) -> list[dict]:
    return [o for o in objs if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]


def one(objs, kind: str, name: str | None = None) -> dict:
    found = find(objs, kind, name)
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {[o['metadata']['name'] for o in found]}"
    return found[0]


def rules_of(role: dict) -> dict[tuple[str, str], set[str]]:
    table: dict[tuple[str, str], set[str]] = {}
    for rule in role["rules"]:
        for group in rule["apiGroups"]:
            for res in rule["resources"]:
                table.setdefault((group, res), set()).update(rule["verbs"])
    return table


# ------------------------------------------------------------------------------ lint and validation


@pytest.mark.parametrize("name", VALUE_SETS)
def test_helm_lint_strict(name: str):
    path = VALUE_SETS[name]
    out = helm("lint", "--strict", str(CHART), *(["-f", str(path)] if path else []))
    assert out.returncode == 0, f"helm lint --strict ({name}) failed:\n{out.stdout}\n{out.stderr}"


def test_there_are_several_non_default_value_files():
    assert len(CI_VALUES) >= 3, f"expected >= 3 values files under charts/vivant/ci, found {[p.name for p in CI_VALUES]}"


@pytest.mark.parametrize("name", VALUE_SETS)
def test_builtin_objects_pass_kubernetes_validate_strict(name: str):
    builtin = [o for o in objects(name) if not o["apiVersion"].startswith(CUSTOM_GROUPS)]
    assert builtin, "nothing rendered"
    errors = []
    for o in builtin:
        try:
            kubernetes_validate.validate(o, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            errors.append(f"{o['kind']}/{o['metadata']['name']}: {str(exc).splitlines()[0]}")
    assert not errors, f"{name}: objects rejected by kubernetes-validate --strict {K8S_VERSION}:\n" + "\n".join(errors)


def test_a_broken_object_would_be_caught_by_the_validator():
    deployment = json.loads(json.dumps(one(objects("default"), "Deployment", "rel-vivant-operator")))
    deployment["spec"]["template"]["spec"]["containers"][0]["securityContext"]["runAsNonroot"] = True  # typo
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, K8S_VERSION, strict=True)


# Structure of the Prometheus Operator kinds, limited to the fields the chart writes (strict there).
_ENDPOINT = {
    "type": "object", "additionalProperties": False, "required": ["port"],
    "properties": {"port": {"type": "string"}, "path": {"type": "string", "pattern": "^/"},
                   "interval": {"type": "string", "pattern": "^[0-9]+(ms|s|m|h)$"}},
}
_SELECTOR = {
    "type": "object", "additionalProperties": False,
    "properties": {
        "matchLabels": {"type": "object", "additionalProperties": {"type": "string"}},
        "matchExpressions": {"type": "array", "items": {
            "type": "object", "additionalProperties": False, "required": ["key", "operator"],
            "properties": {"key": {"type": "string"}, "operator": {"enum": ["In", "NotIn", "Exists", "DoesNotExist"]},
                           "values": {"type": "array", "items": {"type": "string"}}}}},
    },
}
_NS_SELECTOR = {
    "type": "object", "additionalProperties": False,
    "properties": {"any": {"type": "boolean"}, "matchNames": {"type": "array", "items": {"type": "string"}}},
}
MONITORING_SCHEMAS = {
    "PodMonitor": {"type": "object", "additionalProperties": False, "required": ["selector", "podMetricsEndpoints"],
                   "properties": {"selector": _SELECTOR, "namespaceSelector": _NS_SELECTOR,
                                  "podMetricsEndpoints": {"type": "array", "minItems": 1, "items": _ENDPOINT}}},
    "ServiceMonitor": {"type": "object", "additionalProperties": False, "required": ["selector", "endpoints"],
                       "properties": {"selector": _SELECTOR, "namespaceSelector": _NS_SELECTOR,
                                      "endpoints": {"type": "array", "minItems": 1, "items": _ENDPOINT}}},
    "PrometheusRule": {"type": "object", "additionalProperties": False, "required": ["groups"], "properties": {
        "groups": {"type": "array", "minItems": 1, "items": {
            "type": "object", "additionalProperties": False, "required": ["name", "rules"],
            "properties": {"name": {"type": "string"}, "interval": {"type": "string"}, "rules": {"type": "array", "items": {
                "type": "object", "additionalProperties": False, "required": ["expr"],
                "oneOf": [{"required": ["record"]}, {"required": ["alert"]}],
                "properties": {"record": {"type": "string"}, "alert": {"type": "string"}, "expr": {"type": "string"},
                               "for": {"type": "string"}, "labels": {"type": "object"},
                               "annotations": {"type": "object"}}}}}}}}},
}


def crd_schemas() -> dict[str, dict]:
    out = {}
    for path in sorted((ROOT / "crds").glob("*.yaml")):
        crd = yaml.safe_load(path.read_text())
        version = next(v for v in crd["spec"]["versions"] if v.get("storage"))
        out[crd["spec"]["names"]["kind"]] = version["schema"]["openAPIV3Schema"]
    return out


@pytest.mark.parametrize("name", VALUE_SETS)
def test_custom_resources_match_their_schemas(name: str):
    schemas = crd_schemas()
    for o in objects(name):
        kind = o["kind"]
        if o["apiVersion"].startswith(("vivant.dev/", "kopf.dev/")):
            assert kind in schemas, f"{kind}: no CRD for it under crds/"
            jsonschema.validate(o, schemas[kind])
        elif o["apiVersion"] == "monitoring.coreos.com/v1":
            jsonschema.validate(o["spec"], MONITORING_SCHEMAS[kind])


# ------------------------------------------------------------------------------ CRDs and rules: no fork


def test_chart_carries_the_repository_crds_unforked():
    link = CHART / "crds"
    assert link.is_symlink() and link.resolve() == (ROOT / "crds").resolve(), (
        "charts/vivant/crds must be a symlink to the generated crds/ (one source)"
    )
    expected = [yaml.safe_load(p.read_text()) for p in sorted((ROOT / "crds").glob("*.yaml"))]
    assert expected, "crds/ holds no CRD yet"
    rendered = find(objects("default"), "CustomResourceDefinition")
    by_name = {c["metadata"]["name"]: c for c in rendered}
    assert sorted(by_name) == sorted(c["metadata"]["name"] for c in expected)
    for crd in expected:
        assert by_name[crd["metadata"]["name"]] == crd, f"{crd['metadata']['name']}: rendered CRD differs from crds/"


def test_packaged_chart_carries_the_crds_and_rules_files(tmp_path: Path):
    """`helm package` resolves the crds/ symlink: the archive holds the same CRDs and rules file."""
    import tarfile

    out = helm("package", str(CHART), "-d", str(tmp_path))
    assert out.returncode == 0, out.stderr
    (archive,) = tmp_path.glob("vivant-*.tgz")
    with tarfile.open(archive) as tar:
        names = set(tar.getnames())
        for crd in sorted((ROOT / "crds").glob("*.yaml")):
            member = f"vivant/crds/{crd.name}"
            assert member in names, f"{member} missing from the packaged chart"
            assert tar.extractfile(member).read() == crd.read_bytes(), f"{member} differs from crds/{crd.name}"
        assert tar.extractfile("vivant/files/rules.yaml").read() == (CHART / "files" / "rules.yaml").read_bytes()
        assert not any(n.startswith("vivant/ci/") for n in names), "ci/ values files should not ship"


def test_prometheus_rule_is_the_rules_file_verbatim():
    rule = one(objects("trial-values"), "PrometheusRule")
    assert rule["spec"] == yaml.safe_load((CHART / "files" / "rules.yaml").read_text())


def test_runbook_base_url_is_swapped_everywhere():
    rule = one(objects("production-values"), "PrometheusRule")
    urls = [r["annotations"]["runbook_url"] for g in rule["spec"]["groups"] for r in g["rules"] if "alert" in r]
    assert urls, "no alerts in the PrometheusRule"
    for url in urls:
        assert re.fullmatch(r"https://runbooks\.example\.com/vivant/Vivant\w+\.md", url), url
    assert DEFAULT_RUNBOOK_BASE not in json.dumps(rule)


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool missing: run `make sysdeps`")
def test_rendered_rules_pass_promtool(tmp_path: Path):
    rule = one(objects("production-values"), "PrometheusRule")
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump(rule["spec"]))
    out = subprocess.run(["promtool", "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def test_dashboard_configmap_is_the_dashboard_file():
    cm = one(objects("trial-values"), "ConfigMap", "rel-vivant-dashboard")
    assert json.loads(cm["data"]["vivant-fleet.json"]) == json.loads((CHART / "files" / "dashboard.json").read_text())
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"


def test_dashboard_shows_fps_latency_stalls_turns_capacity_flags_and_the_control_plane():
    dash = json.loads((CHART / "files" / "dashboard.json").read_text())
    exprs = " ".join(t["expr"] for p in dash["panels"] for t in p.get("targets", []))  # a row has no targets
    for series in ("vivant:sessions_meeting_fps:ratio", "vivant:session_fps:average", "vivant:chunk_step_seconds:p99_rate5m",
                   "vivant_worker_session_stalls_total", "vivant:turn_latency_seconds:p50_rate15m",
                   "vivant_operator_pool_workers", "vivant_worker_kernel_path_info", "vivant_operator_flag_rollbacks_total",
                   "vivant:operator_reconcile_seconds:p99_rate5m", "vivant_operator_queue_depth",
                   "vivant:assignment_latency_seconds:p99_rate10m", "vivant_operator_worker_failures_total"):
        assert series in exprs, f"the dashboard has no panel reading {series}"
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)), "panel ids repeat"
    for p in dash["panels"]:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24, f"panel {p['title']!r} leaves the 24-column grid"


# ------------------------------------------------------------------------------ flags -> objects


OPTIONAL = {"PodMonitor", "ServiceMonitor", "PrometheusRule", "ConfigMap/rel-vivant-dashboard", "WorkerPool",
            "Deployment/rel-vivant-redis"}


def optional_present(objs) -> set[str]:
    keys = {o["kind"] for o in objs} | {f"{o['kind']}/{o['metadata']['name']}" for o in objs}
    return keys & OPTIONAL


@pytest.mark.parametrize(
    ("name", "present"),
    [
        ("default", set()),
        ("namespaced-values", set()),
        ("trial-values", {"PodMonitor", "PrometheusRule", "ConfigMap/rel-vivant-dashboard", "WorkerPool",
                          "Deployment/rel-vivant-redis"}),
        ("production-values", {"PodMonitor", "ServiceMonitor", "PrometheusRule", "ConfigMap/rel-vivant-dashboard",
                               "WorkerPool"}),
    ],
)
def test_optional_objects_follow_their_flags(name: str, present: set[str]):
    got = optional_present(objects(name))
    assert got == present, f"{name}: optional objects {sorted(got)}, expected {sorted(present)}"


@pytest.mark.parametrize(("name", "monitors"), [
    ("trial-values", {"PodMonitor/rel-vivant-workers", "PodMonitor/rel-vivant-control-plane"}),
    ("production-values", {"PodMonitor/rel-vivant-workers", "ServiceMonitor/rel-vivant-control-plane"}),
])
def test_each_target_is_scraped_once(name: str, monitors: set[str]):
    got = {f"{o['kind']}/{o['metadata']['name']}" for o in objects(name) if o["kind"] in ("PodMonitor", "ServiceMonitor")}
    assert got == monitors, f"{name}: monitors {sorted(got)}, expected {sorted(monitors)} (no target scraped twice)"


def test_monitor_labels_reach_every_prometheus_object():
    for o in objects("production-values"):
        if o["apiVersion"].startswith("monitoring.coreos.com/"):
            assert o["metadata"]["labels"].get("release") == "kube-prometheus-stack", f"{o['kind']}/{o['metadata']['name']}"


def test_prometheus_rule_toggles_with_its_flag_alone():
    on = render(None, "prometheusRule.enabled=true")
    off = render(None, "prometheusRule.enabled=false")
    assert len(find(on, "PrometheusRule")) == 1 and not find(off, "PrometheusRule")
    assert {o["kind"] for o in on} - {"PrometheusRule"} == {o["kind"] for o in off}


def test_in_chart_redis_and_its_url_secret():
    objs = objects("trial-values")
    one(objs, "Deployment", "rel-vivant-redis")
    svc = one(objs, "Service", "rel-vivant-redis")
    secret = one(objs, "Secret", "rel-vivant-redis")
    assert secret["stringData"]["url"] == f"redis://{svc['metadata']['name']}.vivant-system.svc:6379/0"
    assert not find(objects("default"), "Deployment", "rel-vivant-redis")


@pytest.mark.parametrize(("name", "secret"), [("default", "vivant-redis"), ("production-values", "rel-vivant-redis"),
                                             ("namespaced-values", "shared-redis"), ("trial-values", "rel-vivant-redis")])
def test_operator_and_workers_read_redis_from_the_same_secret(name: str, secret: str):
    op = one(objects(name), "Deployment", "rel-vivant-operator")
    env = {e["name"]: e for e in op["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["VIVANT_REDIS_URL"]["valueFrom"]["secretKeyRef"] == {"name": secret, "key": "url"}
    assert env["VIVANT_WORKER_REDIS_SECRET"]["value"] == secret


# ------------------------------------------------------------------------------ RBAC

OPERATOR_NAMESPACED = {
    ("vivant.dev", "charactersessions"): {"get", "list", "watch", "patch"},
    ("vivant.dev", "workerpools"): {"get", "list", "watch", "patch"},
    ("vivant.dev", "charactersessions/status"): {"get", "patch"},
    ("vivant.dev", "workerpools/status"): {"get", "patch"},
    ("vivant.dev", "workerpools/scale"): {"get"},
    ("apps", "statefulsets"): {"get", "create", "patch"},
    ("", "services"): {"create", "patch"},
    ("policy", "poddisruptionbudgets"): {"create", "patch"},
    # get: the token Secret a session names in spec.livekit.tokenSecret (the session API's path);
    # delete: a re-created session removes its predecessor's token Secret, then writes its own (operator/kube.py)
    ("", "secrets"): {"get", "create", "delete"},
    # why a session waits (the scheduler's reason), and the roll of idle outdated pods (updateStrategy OnDelete)
    ("", "pods"): {"list", "delete"},
    # ownerReferences with blockOwnerDeletion need update on the owner's finalizers where
    # OwnerReferencesPermissionEnforcement is on (OpenShift, the local cluster)
    ("vivant.dev", "charactersessions/finalizers"): {"update"},
    ("vivant.dev", "workerpools/finalizers"): {"update"},
    ("", "events"): {"create", "patch"},
    ("events.k8s.io", "events"): {"create", "patch"},
}
CRD_READ = {("apiextensions.k8s.io", "customresourcedefinitions"): {"get", "list", "watch"}}


PEERING = {("kopf.dev", "clusterkopfpeerings"): {"get", "list", "watch", "patch"}}


def test_operator_cluster_role_is_exactly_what_it_uses():
    role = one(objects("default"), "ClusterRole", "rel-vivant-operator")
    assert rules_of(role) == {**CRD_READ, **OPERATOR_NAMESPACED, **PEERING}


def test_operator_with_peering_may_use_kopf_peerings_only_then():
    with_peering = rules_of(one(objects("production-values"), "ClusterRole", "rel-vivant-operator"))
    assert with_peering == {**CRD_READ, **OPERATOR_NAMESPACED, **PEERING}
    standalone = render(None, "operator.replicas=1", "operator.peering.enabled=false")
    assert rules_of(one(standalone, "ClusterRole", "rel-vivant-operator")) == {**CRD_READ, **OPERATOR_NAMESPACED}


def test_namespaced_operator_gets_roles_in_its_namespaces_only():
    objs = objects("namespaced-values")
    assert rules_of(one(objs, "ClusterRole", "rel-vivant-operator")) == CRD_READ
    roles = find(objs, "Role")
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["studio-a", "studio-b"]
    for role in roles:  # peering is on by default: a KopfPeering in each namespace
        assert rules_of(role) == {**OPERATOR_NAMESPACED, ("kopf.dev", "kopfpeerings"): {"get", "list", "watch", "patch"}}
    bindings = find(objs, "RoleBinding")
    assert sorted(b["metadata"]["namespace"] for b in bindings) == ["studio-a", "studio-b"]
    for b in bindings:
        assert b["subjects"] == [{"kind": "ServiceAccount", "name": "rel-vivant-operator", "namespace": "vivant-system"}]
    op = one(objs, "Deployment", "rel-vivant-operator")
    args = op["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--namespace=studio-a" in args and "--namespace=studio-b" in args


def test_api_has_a_role_in_its_namespace_only():
    objs = objects("default")
    assert not find(objs, "ClusterRole", "rel-vivant-api")
    role = one(objs, "Role", "rel-vivant-api")
    assert role["metadata"]["namespace"] == "vivant-system"
    assert rules_of(role) == {
        ("vivant.dev", "charactersessions"): {"get", "list", "create", "delete"},
        ("vivant.dev", "workerpools"): {"get"},
        ("", "secrets"): {"create", "patch", "delete"},
        ("coordination.k8s.io", "leases"): {"get", "list", "create", "update", "patch", "delete"},  # capacity slots
    }
    binding = one(objs, "RoleBinding", "rel-vivant-api")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "rel-vivant-api", "namespace": "vivant-system"}]
    assert not find(objects("namespaced-values"), "Role", "rel-vivant-api"), "API disabled but its Role rendered"


def test_api_runs_the_cli_with_its_avatars_and_mounted_keys(tmp_path: Path):
    objs = objects("trial-values")
    pod = one(objs, "Deployment", "rel-vivant-api")["spec"]["template"]["spec"]
    args = pod["containers"][0]["args"]
    assert args[:2] == ["api", "--host=0.0.0.0"] and "--namespace=vivant-system" in args
    mounts = {m["mountPath"]: m["name"] for m in pod["containers"][0]["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    avatars_arg = next(a for a in args if a.startswith("--avatars=")).split("=", 1)[1]
    keys_arg = next(a for a in args if a.startswith("--keys-file=")).split("=", 1)[1]
    assert volumes[mounts[str(Path(avatars_arg).parent)]]["configMap"]["name"] == "rel-vivant-api-avatars"
    assert volumes[mounts[str(Path(keys_arg).parent)]]["secret"]["secretName"] == "vivant-api-keys"
    catalogue = one(objs, "ConfigMap", "rel-vivant-api-avatars")["data"][Path(avatars_arg).name]
    assert yaml.safe_load(catalogue)["avatars"] == {"ada": {"character": "ada", "pool": "trial"}}
    from vivant.gateway.server import ApiConfig
    path = tmp_path / "avatars.yaml"
    path.write_text(catalogue)
    config = ApiConfig.from_file(path, "vivant-system")
    assert config.avatars["ada"].pool == "trial" and config.default_max_duration_s == 1800


def test_api_limits_reach_the_api_and_its_replicas_have_a_pdb(tmp_path: Path):
    from vivant.gateway.config import ApiConfig

    objs = render(None, "api.limits.headerTimeoutS=3", "api.limits.maxQueuedCreates=64")
    catalogue = one(objs, "ConfigMap", "rel-vivant-api-avatars")["data"]["avatars.yaml"]
    path = tmp_path / "avatars.yaml"
    path.write_text(catalogue)
    limits = ApiConfig.from_file(path, "vivant-system").limits
    assert (limits.header_timeout_s, limits.max_queued_creates, limits.body_timeout_s) == (3, 64, 10)
    pdb = one(objects("default"), "PodDisruptionBudget", "rel-vivant-api")
    api = one(objects("default"), "Deployment", "rel-vivant-api")
    assert pdb["spec"]["minAvailable"] == 1
    assert pdb["spec"]["selector"]["matchLabels"] == api["spec"]["selector"]["matchLabels"]
    assert not find(render(None, "api.replicas=1"), "PodDisruptionBudget", "rel-vivant-api")


@pytest.mark.parametrize("name", VALUE_SETS)
def test_no_wildcards_and_only_the_operator_reads_a_secret_by_name(name: str):
    for role in [*find(objects(name), "ClusterRole"), *find(objects(name), "Role")]:
        for rule in role["rules"]:
            for key in ("apiGroups", "resources", "verbs"):
                assert "*" not in rule[key], f"{role['metadata']['name']}: wildcard in {key}"
            if "secrets" in rule["resources"]:  # one Secret by name at most: never list or watch them
                assert not {"list", "watch"} & set(rule["verbs"]), f"{role['metadata']['name']} can list secrets"
                if "get" in rule["verbs"]:
                    assert role["metadata"]["name"].endswith("-operator"), f"{role['metadata']['name']} reads secrets"


# ------------------------------------------------------------------------------ pods


def pod_specs(objs) -> list[tuple[str, dict]]:
    return [(o["metadata"]["name"], o["spec"]["template"]["spec"]) for o in objs if o["kind"] in ("Deployment", "StatefulSet")]


@pytest.mark.parametrize("name", VALUE_SETS)
def test_pods_run_non_root_read_only_without_capabilities(name: str):
    specs = pod_specs(objects(name))
    assert specs
    for obj, spec in specs:
        assert spec["securityContext"]["runAsNonRoot"] is True, obj
        assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}, obj
        for c in spec["containers"]:
            sc = c["securityContext"]
            assert sc["readOnlyRootFilesystem"] is True, f"{obj}/{c['name']}: writable root filesystem"
            assert sc["allowPrivilegeEscalation"] is False, f"{obj}/{c['name']}: privilege escalation allowed"
            assert sc["capabilities"]["drop"] == ["ALL"], f"{obj}/{c['name']}: capabilities {sc['capabilities']}"
            assert sc.get("privileged") is not True, f"{obj}/{c['name']}: privileged"


@pytest.mark.parametrize("name", VALUE_SETS)
def test_images_are_pinned(name: str):
    images = [c["image"] for _, spec in pod_specs(objects(name)) for c in spec["containers"]]
    images += [o["spec"]["image"] for o in find(objects(name), "WorkerPool")]
    for image in images:
        repo, _, tag = image.rpartition(":")
        assert repo and "/" not in tag and tag and tag != "latest", f"image {image!r} is not pinned to a tag"


# ------------------------------------------------------------------------------ availability


def _operator(objs) -> tuple[dict, list[str], dict[str, str]]:
    op = one(objs, "Deployment", "rel-vivant-operator")
    container = op["spec"]["template"]["spec"]["containers"][0]
    return op, container["args"], {e["name"]: e.get("value") for e in container["env"]}


def test_default_operator_is_highly_available():
    """Item 7 of issue 36: the chart ran one operator replica (`--standalone`). The default now: two replicas
    with mandatory kopf peering in an object the chart creates (its CRDs in crds/), a short peering
    lifetime (the failover time after a SIGKILL), a PodDisruptionBudget over the operator's pods, and a
    rolling update (never zero replicas)."""
    objs = objects("default")
    op, args, env = _operator(objs)
    assert op["spec"]["replicas"] == 2 and op["spec"]["strategy"]["type"] == "RollingUpdate"
    assert "--standalone" not in args and "--peering-name=rel-vivant" in args, args
    assert env["VIVANT_PEERING_LIFETIME_S"] == "5", env
    one(objs, "ClusterKopfPeering", "rel-vivant")
    crds = {c["metadata"]["name"] for c in find(objs, "CustomResourceDefinition")}
    assert {"clusterkopfpeerings.kopf.dev", "kopfpeerings.kopf.dev"} <= crds, crds
    pdb = one(objs, "PodDisruptionBudget", "rel-vivant-operator")
    assert pdb["spec"]["minAvailable"] == 1
    pod_labels = op["spec"]["template"]["metadata"]["labels"]
    assert pdb["spec"]["selector"]["matchLabels"].items() <= pod_labels.items(), "the PDB must select the operator"
    assert op["spec"]["selector"]["matchLabels"] == pdb["spec"]["selector"]["matchLabels"]


def test_namespaced_operator_meets_its_peers_in_each_namespace():
    objs = objects("namespaced-values")
    peerings = find(objs, "KopfPeering", "rel-vivant")
    assert sorted(p["metadata"]["namespace"] for p in peerings) == ["studio-a", "studio-b"]
    assert not find(objs, "ClusterKopfPeering")
    for role in find(objs, "Role"):
        assert rules_of(role)[("kopf.dev", "kopfpeerings")] == {"get", "list", "watch", "patch"}


def test_a_single_standalone_operator_has_no_peering_and_no_pdb():
    objs = render(None, "operator.replicas=1", "operator.peering.enabled=false")
    op, args, env = _operator(objs)
    assert op["spec"]["replicas"] == 1 and op["spec"]["strategy"]["type"] == "Recreate"
    assert "--standalone" in args and not any(a.startswith("--peering-name") for a in args)
    assert "VIVANT_PEERING_LIFETIME_S" not in env
    assert not find(objs, "PodDisruptionBudget", "rel-vivant-operator") and not find(objs, "ClusterKopfPeering")


def test_operator_metrics_address_is_set_for_scraping_and_configurable():
    """The operator alone listens on loopback (OperatorConfig.metrics_address); the chart sets 0.0.0.0
    because Prometheus scrapes the pod's IP, and 127.0.0.1 is one value away."""
    assert _operator(objects("default"))[2]["VIVANT_OPERATOR_METRICS_ADDRESS"] == "0.0.0.0"
    local = render(None, "operator.metricsAddress=127.0.0.1")
    assert _operator(local)[2]["VIVANT_OPERATOR_METRICS_ADDRESS"] == "127.0.0.1"


def test_operator_node_selector_comes_from_values():
    spec = one(objects("production-values"), "Deployment", "rel-vivant-operator")["spec"]["template"]["spec"]
    assert spec["nodeSelector"] == {"node-role.vivant.dev/control-plane": "true"}
    assert "nodeSelector" not in one(objects("default"), "Deployment", "rel-vivant-operator")["spec"]["template"]["spec"]


# ------------------------------------------------------------------------------ the worker pool


def test_worker_pool_passes_gpus_node_selector_and_flags_through():
    pool = one(objects("production-values"), "WorkerPool")
    assert pool["metadata"] == {**pool["metadata"], "name": "h200", "namespace": "vivant-system"}
    spec = pool["spec"]
    assert spec["gpusPerWorker"] == 5 and spec["tensorParallel"] == 4
    assert spec["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H200"}
    assert spec["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    assert spec["flags"] == {"fusedGemmAllReduce": True}


def test_operator_builds_five_gpu_workers_on_the_selected_nodes_from_the_chart_pool():
    """The chart's WorkerPool, parsed as the operator parses it, becomes pods requesting 5 GPUs on the H200 nodes."""
    from vivant.apis.resources import WorkerPoolSpec
    from vivant.operator.builders import Owner, WorkerRuntime, build_statefulset

    pool = one(objects("production-values"), "WorkerPool")
    spec = WorkerPoolSpec.model_validate(pool["spec"])
    sts = build_statefulset("h200", "vivant-system", Owner(kind="WorkerPool", name="h200", uid="u-1"), spec, 2,
                            WorkerRuntime(redis_secret="rel-vivant-redis"))
    pod = sts["spec"]["template"]["spec"]
    res = pod["containers"][0]["resources"]
    assert res["requests"]["nvidia.com/gpu"] == "5" and res["limits"]["nvidia.com/gpu"] == "5", res
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H200"}
    kubernetes_validate.validate(sts, K8S_VERSION, strict=True)
    # The chart's worker PodMonitor selects these pods on their metrics port.
    monitor = find(objects("production-values"), "PodMonitor", "rel-vivant-workers")[0]
    labels = sts["spec"]["template"]["metadata"]["labels"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= labels.items()
    ports = {p["name"] for p in pod["containers"][0]["ports"]}
    assert {e["port"] for e in monitor["spec"]["podMetricsEndpoints"]} <= ports
    assert monitor["spec"]["namespaceSelector"] == {"any": True}


def test_trial_pool_is_a_valid_operator_spec():
    from vivant.apis.resources import WorkerPoolSpec

    spec = WorkerPoolSpec.model_validate(one(objects("trial-values"), "WorkerPool")["spec"])
    assert (spec.model.preset, spec.gpus_per_worker, spec.tensor_parallel) == ("tiny", 2, 1)


# ------------------------------------------------------------------------------ bad values


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (["image.tag=latest"], "image.tag"),
        (["workerPool.enabled=true", "workerPool.image.tag=latest"], "workerPool.image.tag"),
        (["redis.internal.enabled=true", "redis.internal.image.tag=latest"], "redis.internal.image.tag"),
        (["workerPool.gpusPerWorker=five"], "workerPool.gpusPerWorker"),
        (["workerPool.model.preset=70b"], "workerPool.model.preset"),
        (["operator.metricsPort=70000"], "operator.metricsPort"),
        (["redis.url=redis://r:6379/0", "redis.internal.enabled=true"], "redis.url"),
        (["redis.url=http://r:6379"], "redis.url"),
        (["redis.existingSecret="], "redis.existingSecret"),
        (["livekit.apiKey=k"], "apiSecret"),
        (["operator.peering.enabled=false"], "operator.peering.enabled"),
        (["operator.metricsAddress=localhost"], "operator.metricsAddress"),
        (["operator.peering.lifetimeSeconds=1"], "operator.peering.lifetimeSeconds"),
        (["operator.podDisruptionBudget.minAvailable=0"], "operator.podDisruptionBudget.minAvailable"),
        (["operator.unknownKnob=1"], "unknownKnob"),
    ],
)
def test_bad_values_fail_with_a_message_naming_them(sets: list[str], message: str):
    args = ["template", "rel", str(CHART)]
    for s in sets:
        args += ["--set", s]
    out = helm(*args)
    assert out.returncode != 0, f"helm template accepted {sets}"
    assert message in out.stderr, f"error for {sets} does not name {message!r}:\n{out.stderr}"


# ------------------------------------------------------------------------------ values documentation


def undocumented_values(text: str) -> list[str]:
    """Keys of values.yaml without a `# --` comment, unless a documented ancestor covers them or all
    their children are documented (helm-docs conventions)."""
    lines = text.splitlines()
    entries = []  # (indent, key, documented)
    pending_doc = False
    for line in lines:
        stripped = line.strip()
        if stripped.startswith("# --"):
            pending_doc = True
            continue
        if not stripped or stripped.startswith("#"):
            continue
        m = re.match(r"^( *)([A-Za-z0-9_.-]+):", line)
        if m and not stripped.startswith("- "):
            entries.append((len(m.group(1)), m.group(2), pending_doc))
        pending_doc = False
    missing = []

    def walk(i: int, covered: bool, path: str) -> tuple[int, bool]:
        indent, key, doc = entries[i]
        full = f"{path}.{key}" if path else key
        j = i + 1
        children_ok = True
        has_children = False
        while j < len(entries) and entries[j][0] > indent:
            has_children = True
            j, ok = walk(j, covered or doc, full)
            children_ok &= ok
        ok = doc or covered or (has_children and children_ok)
        if not ok and not has_children:
            missing.append(full)
        return j, ok

    i = 0
    while i < len(entries):
        i, _ = walk(i, False, "")
    return missing


def test_every_value_is_documented():
    missing = undocumented_values((CHART / "values.yaml").read_text())
    assert not missing, f"values without a `# --` comment: {missing}"


def test_the_documentation_check_finds_an_undocumented_value():
    assert undocumented_values("# -- ok\na: 1\nb:\n  c: 2\n  # -- fine\n  d: 3\n") == ["b.c"]
