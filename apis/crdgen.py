"""Generate the CustomResourceDefinitions in `crds/` from the pydantic models in `vivant.apis.resources`.

    python -m vivant.apis.crdgen crds/        # what `make crds` runs

Pydantic emits JSON Schema (draft 2020-12, `$defs`/`$ref`, `anyOf` with null for optionals). The
Kubernetes API server wants a *structural* OpenAPI v3.0 schema: every node typed, no `$ref`, no
`anyOf` over types, no `additionalProperties` next to `properties`, no `title`/`const`. `to_structural`
does that translation; bounds, enums, patterns, defaults, descriptions and CEL rules
(`x-kubernetes-validations`) survive it. A test regenerates the CRDs in memory and fails on drift.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel
from vivant.apis import resources
from vivant.apis.feature_flags import FUSED_GEMM_ALL_REDUCE

_DROP_KEYS = {"title", "$defs"}


def _resolve(node: Any, defs: dict[str, Any]) -> Any:
    if isinstance(node, dict):
        if "$ref" in node:
            target = defs[node["$ref"].rsplit("/", 1)[-1]]
            merged = {**_resolve(target, defs), **{k: v for k, v in node.items() if k != "$ref"}}
            return _resolve(merged, defs)
        return {k: _resolve(v, defs) for k, v in node.items()}
    if isinstance(node, list):
        return [_resolve(v, defs) for v in node]
    return node


def _structural(node: dict[str, Any]) -> dict[str, Any]:
    node = {k: v for k, v in node.items() if k not in _DROP_KEYS}
    # Optional[X] -> X (absence is how Kubernetes spells "unset"; null is not needed on input).
    if "anyOf" in node:
        options = [o for o in node.pop("anyOf") if o.get("type") != "null"]
        if len(options) != 1:
            raise ValueError(f"cannot express anyOf with {len(options)} non-null options structurally: {options}")
        inner = _structural(options[0])
        if node.get("default", "absent") is None:
            node.pop("default")
        node = {**inner, **node}
    if "const" in node:
        node["enum"] = [node.pop("const")]
    if "enum" in node and "type" not in node:
        kinds = {type(v) for v in node["enum"]}
        node["type"] = {str: "string", int: "integer", bool: "boolean"}[kinds.pop()]
    for bound, plain in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
        if isinstance(node.get(bound), int | float) and not isinstance(node.get(bound), bool):
            node[plain] = node[bound]
            node[bound] = True
    if "patternProperties" in node:
        node = _map_with_key_rules(node)
    if "properties" in node:
        node["type"] = "object"
        node["properties"] = {k: _structural(v) for k, v in node["properties"].items()}
        if node.get("additionalProperties") is False:
            # Unknown fields are pruned by the API server and reported by strict field validation.
            node.pop("additionalProperties")
        if not node.get("required"):
            node.pop("required", None)
    elif isinstance(node.get("additionalProperties"), dict):
        node["additionalProperties"] = _structural(node["additionalProperties"])
    if isinstance(node.get("items"), dict):
        node["items"] = _structural(node["items"])
    if node.get("format") == "date-time" and "type" not in node:
        node["type"] = "string"
    if "type" not in node:
        raise ValueError(f"schema node without a type is not structural: {node}")
    return node


def _lower_first(text: str) -> str:
    return text[:1].lower() + text[1:]


def _map_with_key_rules(node: dict[str, Any]) -> dict[str, Any]:
    """A dict with constrained keys (pydantic: `patternProperties` + `propertyNames`) -> a structural map
    (`additionalProperties`) whose key constraints become one CEL rule over its keys; the key type's own
    CEL rules, written over `self`, are rebound to each key."""
    node = dict(node)
    patterns = node.pop("patternProperties")
    if len(patterns) != 1:
        raise ValueError(f"cannot express {len(patterns)} key patterns structurally: {list(patterns)}")
    (pattern, values), = patterns.items()
    names = node.pop("propertyNames", {})
    checks = [f"k.matches({resources.cel_string(pattern)})"]
    if "minLength" in names:
        checks.append(f"k.size() >= {names['minLength']}")
    if "maxLength" in names:
        checks.append(f"k.size() <= {names['maxLength']}")
    rules = [{"rule": f"self.all(k, {' && '.join(checks)})",
              "message": "every key must be " + _lower_first(names.get("description", f"a match of {pattern}"))}]
    for rule in names.get("x-kubernetes-validations", []):
        over_key = re.sub(r"\bself\b", "k", rule["rule"])
        rules.append({**rule, "rule": f"self.all(k, {over_key})"})
    node["additionalProperties"] = values
    node["x-kubernetes-validations"] = node.get("x-kubernetes-validations", []) + rules
    return node


def to_structural(model: type[BaseModel]) -> dict[str, Any]:
    """The structural openAPIV3Schema of one pydantic model (camelCase names, all refs inlined)."""
    schema = model.model_json_schema(by_alias=True, mode="validation")
    defs = schema.get("$defs", {})
    return _structural(_resolve(schema, defs))


def _object_schema(whole: type[BaseModel], spec: type[BaseModel], status: type[BaseModel]) -> dict[str, Any]:
    """The root schema; CEL rules of the whole-object model (`whole`, e.g. on metadata.name) sit at the root."""
    rules = (whole.model_config.get("json_schema_extra") or {}).get("x-kubernetes-validations")
    return {
        "type": "object",
        "required": ["spec"],
        **({"x-kubernetes-validations": rules} if rules else {}),
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            # name declared so that a root CEL rule can point its fieldPath at .metadata.name
            "metadata": {"type": "object", "properties": {"name": {"type": "string"}}},
            "spec": to_structural(spec),
            "status": to_structural(status),
        },
    }


def _crd(
    kind: str,
    plural: str,
    singular: str,
    short_names: tuple[str, ...],
    schema: dict[str, Any],
    columns: list[dict[str, Any]],
    subresources: dict[str, Any],
) -> dict[str, Any]:
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{plural}.{resources.GROUP}"},
        "spec": {
            "group": resources.GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": kind,
                "listKind": f"{kind}List",
                "plural": plural,
                "singular": singular,
                "shortNames": list(short_names),
                "categories": ["vivant"],
            },
            "versions": [
                {
                    "name": resources.VERSION,
                    "served": True,
                    "storage": True,
                    "schema": {"openAPIV3Schema": schema},
                    "subresources": subresources,
                    "additionalPrinterColumns": columns,
                }
            ],
        },
    }


def session_crd() -> dict[str, Any]:
    columns = [
        {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
        {"name": "Worker", "type": "string", "jsonPath": ".status.worker"},
        {"name": "FPS", "type": "number", "jsonPath": ".status.avgFps"},
        {"name": "Pool", "type": "string", "jsonPath": ".spec.pool", "priority": 1},
        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    ]
    return _crd(
        resources.SESSION_KIND,
        resources.SESSION_PLURAL,
        resources.SESSION_SINGULAR,
        resources.SESSION_SHORT_NAMES,
        _object_schema(resources.CharacterSession, resources.CharacterSessionSpec, resources.CharacterSessionStatus),
        columns,
        {"status": {}},
    )


def pool_crd() -> dict[str, Any]:
    columns = [
        {"name": "Ready", "type": "integer", "jsonPath": ".status.ready"},
        {"name": "Idle", "type": "integer", "jsonPath": ".status.idle"},
        {"name": "Busy", "type": "integer", "jsonPath": ".status.busy"},
        {"name": "Max", "type": "integer", "jsonPath": ".spec.maxWorkers"},
        {"name": "Fused", "type": "boolean", "jsonPath": f".status.flags.{FUSED_GEMM_ALL_REDUCE}"},
        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    ]
    scale = {
        "specReplicasPath": ".spec.minIdle",
        "statusReplicasPath": ".status.idle",
        "labelSelectorPath": ".status.selector",
    }
    return _crd(
        resources.POOL_KIND,
        resources.POOL_PLURAL,
        resources.POOL_SINGULAR,
        resources.POOL_SHORT_NAMES,
        _object_schema(resources.WorkerPool, resources.WorkerPoolSpec, resources.WorkerPoolStatus),
        columns,
        {"status": {}, "scale": scale},
    )


KOPF_GROUP = "kopf.dev"


def kopf_peering_crd(kind: str, plural: str, scope: str) -> dict[str, Any]:
    """A CRD of kopf's peering objects (kopf does not install its own): operator replicas write their
    priority and last keep-alive into the object's `status`; the live replica of highest priority works.
    `ClusterKopfPeering` (Cluster) serves cluster-wide operators, `KopfPeering` (Namespaced) namespaced ones."""
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{plural}.{KOPF_GROUP}"},
        "spec": {
            "group": KOPF_GROUP,
            "scope": scope,
            "names": {"kind": kind, "plural": plural, "singular": kind.lower()},
            "versions": [{
                "name": "v1", "served": True, "storage": True,
                "schema": {"openAPIV3Schema": {"type": "object", "properties": {
                    "status": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}}}},
            }],
        },
    }


def render_all() -> dict[str, str]:
    """File name -> YAML text of every CRD (what `crds/` must contain): vivant's two and kopf's peering pair,
    which the chart's highly available operator (two replicas, kopf peering) needs."""
    header = "# Generated by `make crds` (python -m vivant.apis.crdgen crds/) from apis/resources.py and apis/feature_flags.py. Do not edit.\n"
    kopf_header = "# Generated by `make crds` (python -m vivant.apis.crdgen crds/): kopf's peering objects. Do not edit.\n"
    return {
        f"{resources.SESSION_PLURAL}.yaml": header + yaml.safe_dump(session_crd(), sort_keys=False, width=120),
        f"{resources.POOL_PLURAL}.yaml": header + yaml.safe_dump(pool_crd(), sort_keys=False, width=120),
        "clusterkopfpeerings.yaml": kopf_header + yaml.safe_dump(
            kopf_peering_crd("ClusterKopfPeering", "clusterkopfpeerings", "Cluster"), sort_keys=False, width=120),
        "kopfpeerings.yaml": kopf_header + yaml.safe_dump(
            kopf_peering_crd("KopfPeering", "kopfpeerings", "Namespaced"), sort_keys=False, width=120),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vivant.apis.crdgen", description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path, help="folder to write the CRD YAML files into (crds/)")
    args = parser.parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    for name, text in render_all().items():
        (args.out_dir / name).write_text(text)
        print(f"wrote {args.out_dir / name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
