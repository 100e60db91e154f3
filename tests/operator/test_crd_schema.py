"""CRDs: generated from the typed source without drift, structural, and strict about bad input.

Every malformed object below must be rejected twice, with the offending field named both times:
by the CRD schema and by the pydantic models the operator parses with. This is the fast, offline twin of
the real thing (tests/cluster/test_pool_validation.py and test_spec_fuzz.py apply objects to a real
kube-apiserver): the CRD schema is applied the way the API server applies it, in steps: defaults from
the schema, then `jsonschema` against the generated openAPIV3Schema (unknown fields checked as the
server's strict field validation reports them, by adding `additionalProperties: false` under spec), then
the CEL rules (`x-kubernetes-validations`, at every level: objects, list items, map values) evaluated
with cel-python.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import celpy
import jsonschema
import pydantic
import pytest
import yaml
from vivant.apis import crdgen, resources

ROOT = Path(__file__).resolve().parents[2]


def _load(name: str) -> dict[str, Any]:
    return yaml.safe_load((ROOT / "examples" / name).read_text())


SESSION = _load("charactersession.yaml")
POOL = _load("production/workerpool-h200-57b.yaml")
LOCAL_POOL = _load("workerpool.yaml")


def _strict(node: Any) -> Any:
    if isinstance(node, dict):
        out = {k: _strict(v) for k, v in node.items()}
        if "properties" in node and "additionalProperties" not in node:
            out["additionalProperties"] = False
        return out
    if isinstance(node, list):
        return [_strict(v) for v in node]
    return node


def _schema(crd: dict[str, Any]) -> dict[str, Any]:
    schema = copy.deepcopy(crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"])
    schema["properties"]["spec"] = _strict(schema["properties"]["spec"])
    return schema


SCHEMAS = {"CharacterSession": _schema(crdgen.session_crd()), "WorkerPool": _schema(crdgen.pool_crd())}
MODELS = {"CharacterSession": resources.CharacterSession, "WorkerPool": resources.WorkerPool}
CEL = celpy.Environment()


def _set(obj: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    obj = copy.deepcopy(obj)
    *parents, leaf = path.split(".")
    node = obj
    for p in parents:
        node = node[int(p)] if isinstance(node, list) else node.setdefault(p, {})
    if value is _DELETE:
        del node[leaf]
    elif isinstance(node, list):
        node[int(leaf)] = value
    else:
        node[leaf] = value
    return obj


_DELETE = object()

# (id, base object, dotted path, new value or _DELETE, field name the errors must mention)
MALFORMED: list[tuple[str, dict[str, Any], str, Any, str]] = [
    ("cs-no-character", SESSION, "spec.character", _DELETE, "character"),
    ("cs-empty-character", SESSION, "spec.character", "", "character"),
    ("cs-character-spaces", SESSION, "spec.character", "ada lovelace", "character"),
    ("cs-character-number", SESSION, "spec.character", 7, "character"),
    ("cs-no-pool", SESSION, "spec.pool", _DELETE, "pool"),
    ("cs-pool-uppercase", SESSION, "spec.pool", "H200", "pool"),
    ("cs-pool-too-long", SESSION, "spec.pool", "p" * 64, "pool"),
    ("cs-no-livekit", SESSION, "spec.livekit", _DELETE, "livekit"),
    ("cs-livekit-string", SESSION, "spec.livekit", "wss://x", "livekit"),
    ("cs-no-url", SESSION, "spec.livekit.url", _DELETE, "url"),
    ("cs-url-ftp", SESSION, "spec.livekit.url", "ftp://livekit.example.com", "url"),
    ("cs-url-no-scheme", SESSION, "spec.livekit.url", "livekit.example.com", "url"),
    ("cs-no-room", SESSION, "spec.livekit.room", _DELETE, "room"),
    ("cs-room-too-long", SESSION, "spec.livekit.room", "r" * 257, "room"),  # LiveKit: at most 256 bytes
    ("cs-no-agent", SESSION, "spec.livekit.agentIdentity", _DELETE, "agentIdentity"),
    ("cs-agent-empty", SESSION, "spec.livekit.agentIdentity", "", "agentIdentity"),
    ("cs-duration-short", SESSION, "spec.maxDurationSeconds", 5, "maxDurationSeconds"),
    ("cs-duration-long", SESSION, "spec.maxDurationSeconds", 86_401, "maxDurationSeconds"),
    ("cs-duration-text", SESSION, "spec.maxDurationSeconds", "ten minutes", "maxDurationSeconds"),
    ("cs-duration-float", SESSION, "spec.maxDurationSeconds", 60.5, "maxDurationSeconds"),
    ("cs-unknown-field", SESSION, "spec.charcter", "typo", "charcter"),
    ("cs-unknown-livekit-field", SESSION, "spec.livekit.token", "secret", "token"),
    ("cs-flag-unknown", SESSION, "spec.flags", {"turbo": True}, "turbo"),
    ("cs-flag-not-bool", SESSION, "spec.flags", {"fusedGemmAllReduce": "maybe"}, "fusedGemmAllReduce"),
    ("cs-no-spec", SESSION, "spec", _DELETE, "spec"),
    ("wp-no-model", POOL, "spec.model", _DELETE, "model"),
    ("wp-bad-preset", POOL, "spec.model.preset", "70b", "preset"),
    ("wp-no-checkpoint", POOL, "spec.model.checkpoint", _DELETE, "checkpoint"),
    ("wp-relative-checkpoint", POOL, "spec.model.checkpoint", "models/x.safetensors", "checkpoint"),
    ("wp-no-image", POOL, "spec.image", _DELETE, "image"),
    ("wp-image-space", POOL, "spec.image", "vivant worker", "image"),
    ("wp-gpus-one", POOL, "spec.gpusPerWorker", 1, "gpusPerWorker"),
    ("wp-gpus-many", POOL, "spec.gpusPerWorker", 17, "gpusPerWorker"),
    ("wp-tp-three", POOL, "spec.tensorParallel", 3, "tensorParallel"),
    ("wp-min-idle-negative", POOL, "spec.minIdle", -1, "minIdle"),
    ("wp-no-max-workers", POOL, "spec.maxWorkers", _DELETE, "maxWorkers"),
    ("wp-max-workers-zero", POOL, "spec.maxWorkers", 0, "maxWorkers"),
    ("wp-toleration-operator", POOL, "spec.tolerations.0.operator", "Maybe", "operator"),
    ("wp-toleration-effect", POOL, "spec.tolerations.0.effect", "NoWay", "effect"),
    ("wp-node-selector-list", POOL, "spec.nodeSelector", ["gpu"], "nodeSelector"),
    ("wp-node-selector-int", POOL, "spec.nodeSelector", {"gpu": 1}, "gpu"),
    ("wp-affinity-op", POOL, "spec.affinity", {"required": [{"matchExpressions": [{"key": "k", "operator": "Near"}]}]}, "operator"),
    ("wp-affinity-empty-term", POOL, "spec.affinity", {"required": [{"matchExpressions": []}]}, "matchExpressions"),
    ("wp-flag-unknown", POOL, "spec.flags", {"fusedGemmAllReduce": True, "warp": True}, "warp"),
    ("wp-flag-not-bool", POOL, "spec.flags.fusedGemmAllReduce", "yes", "fusedGemmAllReduce"),
    ("wp-unknown-field", POOL, "spec.replicas", 3, "replicas"),
    # What the API server would refuse in the StatefulSet's pod template (issue 14, defect 4).
    ("wp-toleration-exists-value", POOL, "spec.tolerations.0",
     {"key": "nvidia.com/gpu", "operator": "Exists", "value": "present", "effect": "NoSchedule"}, "value"),
    ("wp-toleration-seconds-noschedule", POOL, "spec.tolerations.0",
     {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule", "tolerationSeconds": 30}, "tolerationSeconds"),
    ("wp-toleration-no-key-equal", POOL, "spec.tolerations.0", {"operator": "Equal", "value": "x"}, "operator"),
    ("wp-toleration-key-space", POOL, "spec.tolerations.0.key", "nvidia gpu", "key"),
    ("wp-toleration-value-slash", POOL, "spec.tolerations.0", {"key": "k", "value": "a/b"}, "value"),
    ("wp-toleration-key-name-64", POOL, "spec.tolerations.0.key", "k" * 64, "key"),
    ("wp-toleration-key-prefix-254", POOL, "spec.tolerations.0.key", "p" * 254 + "/k", "key"),
    ("wp-affinity-in-no-values", POOL, "spec.affinity", {"required": [{"matchExpressions": [
        {"key": "k", "operator": "In"}]}]}, "values"),
    ("wp-affinity-exists-values", POOL, "spec.affinity", {"required": [{"matchExpressions": [
        {"key": "k", "operator": "Exists", "values": ["a"]}]}]}, "values"),
    ("wp-affinity-gt-two-values", POOL, "spec.affinity", {"preferred": [{"weight": 5, "preference": {
        "matchExpressions": [{"key": "k", "operator": "Gt", "values": ["1", "2"]}]}}]}, "values"),
    ("wp-affinity-lt-not-integer", POOL, "spec.affinity", {"required": [{"matchExpressions": [
        {"key": "k", "operator": "Lt", "values": ["many"]}]}]}, "values"),
    ("wp-affinity-value-space", POOL, "spec.affinity", {"required": [{"matchExpressions": [
        {"key": "k", "operator": "In", "values": ["a b"]}]}]}, "values"),
    ("wp-node-selector-bad-key", POOL, "spec.nodeSelector", {"gpu type": "h200"}, "nodeSelector"),
    ("wp-node-selector-bad-value", POOL, "spec.nodeSelector", {"gpu": "h200!"}, "gpu"),
    ("wp-node-selector-value-64", POOL, "spec.nodeSelector", {"gpu": "v" * 64}, "gpu"),
    ("wp-name-dots", POOL, "metadata.name", "h200.main", "name"),
    ("wp-name-digit-first", POOL, "metadata.name", "1pool", "name"),
    ("wp-name-53", POOL, "metadata.name", "p" * 53, "name"),
    ("cs-pool-dots", SESSION, "spec.pool", "h200.main", "pool"),
    # Valid field by field; rejected by the CEL rules (and by pydantic's model validator).
    ("wp-min-idle-over-max", POOL, "spec.minIdle", 9, "minIdle"),
    ("wp-tp-does-not-divide", POOL, "spec.tensorParallel", 8, "tensorParallel"),
    ("wp-tp-default-does-not-divide", POOL, "spec.gpusPerWorker", 4, "tensorParallel"),
]


def _with_defaults(schema: dict[str, Any], value: Any) -> Any:
    """Fill absent fields that have a schema default, as the API server does before validation."""
    if isinstance(value, dict) and "properties" in schema:
        out = dict(value)
        for key, sub in schema["properties"].items():
            if key not in out and "default" in sub:
                out[key] = copy.deepcopy(sub["default"])
            if key in out:
                out[key] = _with_defaults(sub, out[key])
        return out
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [_with_defaults(schema["items"], v) for v in value]
    return value


def _cel_errors(schema: dict[str, Any], value: Any, path: str = "$") -> list[str]:
    errors = []
    for rule in schema.get("x-kubernetes-validations", []):
        program = CEL.program(CEL.compile(rule["rule"]))
        if program.evaluate({"self": celpy.json_to_cel(value)}) != celpy.celtypes.BoolType(True):
            errors.append(f"{path}: {rule['message']} (rule: {rule['rule']})")
    if isinstance(value, dict):
        for key, sub in schema.get("properties", {}).items():
            if key in value:
                errors += _cel_errors(sub, value[key], f"{path}.{key}")
        if isinstance(schema.get("additionalProperties"), dict):
            for key, item in value.items():
                errors += _cel_errors(schema["additionalProperties"], item, f"{path}.{key}")
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(value):
            errors += _cel_errors(schema["items"], item, f"{path}[{i}]")
    return errors


def _json_schema_errors(kind: str, obj: dict[str, Any]) -> list[str]:
    """What the API server would say about `obj`: schema errors first, CEL rules if the schema passed."""
    schema = SCHEMAS[kind]
    obj = _with_defaults(schema, obj)
    errors = [f"{e.json_path}: {e.message}" for e in jsonschema.Draft7Validator(schema).iter_errors(obj)]
    return errors or _cel_errors(schema, obj)


class TestGeneratedCrds:
    def test_crds_on_disk_match_the_typed_source(self):
        for name, text in crdgen.render_all().items():
            path = ROOT / "crds" / name
            assert path.exists(), f"{path} is missing: run `make crds`"
            assert path.read_text() == text, f"{path} differs from apis/resources.py + apis/feature_flags.py: run `make crds`"

    def test_names_scope_and_subresources(self):
        cs, wp = crdgen.session_crd(), crdgen.pool_crd()
        assert cs["metadata"]["name"] == "charactersessions.vivant.dev"
        assert cs["spec"]["names"]["shortNames"] == ["chs"] and wp["spec"]["names"]["shortNames"] == ["wp"]
        assert cs["spec"]["scope"] == wp["spec"]["scope"] == "Namespaced"
        assert cs["spec"]["versions"][0]["subresources"] == {"status": {}}
        scale = wp["spec"]["versions"][0]["subresources"]["scale"]
        assert scale["specReplicasPath"] == ".spec.minIdle", scale
        cols = [c["name"] for c in cs["spec"]["versions"][0]["additionalPrinterColumns"]]
        assert cols[:3] == ["Phase", "Worker", "FPS"] and cols[-1] == "Age", cols

    def test_schemas_are_structural(self):
        """Every node typed; no $ref/anyOf/title; no preserve-unknown-fields; no properties+additionalProperties."""

        def walk(node: Any, where: str) -> None:
            if isinstance(node, dict):
                if "properties" in node or "items" in node or "additionalProperties" in node or "enum" in node:
                    assert "type" in node, f"{where}: untyped schema node"
                for bad in ("$ref", "anyOf", "oneOf", "title", "const", "x-kubernetes-preserve-unknown-fields"):
                    assert bad not in node, f"{where}: {bad} is not allowed in a structural schema"
                assert not ("properties" in node and "additionalProperties" in node), f"{where}: both properties and additionalProperties"
                for k, v in node.items():
                    walk(v, f"{where}.{k}")
            elif isinstance(node, list):
                for i, v in enumerate(node):
                    walk(v, f"{where}[{i}]")

        for crd in (crdgen.session_crd(), crdgen.pool_crd()):
            walk(crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"], crd["metadata"]["name"])

    def test_cel_rules_are_in_the_pool_crd(self):
        spec = crdgen.pool_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
        rules = [v["rule"] for v in spec["x-kubernetes-validations"]]
        assert "self.minIdle <= self.maxWorkers" in rules, rules
        assert any("tensorParallel" in rule for rule in rules), rules


class TestExamplesAreValid:
    @pytest.mark.parametrize("kind,obj", [("CharacterSession", SESSION), ("WorkerPool", POOL)])
    def test_example_passes_schema_and_model(self, kind, obj):
        assert _json_schema_errors(kind, obj) == []
        MODELS[kind].model_validate(obj)


class TestMalformedObjectsAreRejected:
    def test_the_limits_themselves_are_accepted(self):
        pool = _set(POOL, "metadata.name", "p" * resources.POOL_NAME_MAX)
        pool = _set(pool, "spec.nodeSelector", {"p" * 253 + "/" + "n" * 63: "v" * 63})
        assert _json_schema_errors("WorkerPool", pool) == []
        resources.WorkerPool.model_validate(pool)

    def test_at_least_thirty_cases(self):
        assert len(MALFORMED) >= 30

    @pytest.mark.parametrize("case_id,base,path,value,field", MALFORMED, ids=[c[0] for c in MALFORMED])
    def test_rejected_by_crd_schema_and_model(self, case_id, base, path, value, field):
        kind = base["kind"]
        obj = _set(base, path, value)
        errors = _json_schema_errors(kind, obj)
        assert errors, f"{case_id}: the CRD schema accepted {path}={value!r}"
        assert any(field in e for e in errors), f"{case_id}: no schema error names {field!r}: {errors}"
        with pytest.raises(pydantic.ValidationError) as exc:
            MODELS[kind].model_validate(obj)
        assert field in str(exc.value), f"{case_id}: pydantic error does not name {field!r}: {exc.value}"

    def test_cel_rules_accept_the_defaults(self):
        spec = {k: v for k, v in POOL["spec"].items() if k not in ("gpusPerWorker", "tensorParallel", "minIdle")}
        assert _json_schema_errors("WorkerPool", {**POOL, "spec": spec}) == []
