"""Every WorkerPool and CharacterSession the CRDs accept works; everything else is refused naming the field.

The pool spec of `examples/workerpool.yaml` is mutated field by field, the mutations derived from the CRD's
own schema (`vivant.apis.crdgen`): strings at and over their length limits, empty, with odd characters;
numbers at, below and above their bounds and of the wrong type; every other enum value and one that is
not; each required field removed, an unknown field added; label maps with keys and values at and over
the label limits; the toleration and node-affinity variants the API server has rules for; pool names at
and over 52 characters and with characters a Service name cannot hold. Each mutated pool is applied with
`kubectl apply` and must either be refused with an error naming the mutated field, or work: the operator
applies its StatefulSet (pool `Ready=True`), the StatefulSet controller creates its pod (no FailedCreate
Event), so no pool can be accepted and then never run.

CharacterSession names and specs get the same treatment against one real worker (`vivant worker`, tiny
preset): refused naming the field, or handled by the operator (a worker assigned, or a clear reason on the
status) and, once deleted, no lease left in Redis.

Fuzz pools use an image the local pod runner does not run (no processes on the 2-core machine); the
mutations run in batches in one namespace and each batch is deleted before the next.
"""

from __future__ import annotations

import copy
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from conftest import Kube, wait_for
from kube_objects import (
    FUZZ_IMAGE,
    POOLS,
    SESSIONS,
    WORKER_IMAGE,
    condition,
    example,
    pool_manifest,
    session_manifest,
)
from vivant.apis import crdgen, resources
from vivant.sessions.registry import Registry

DELETE = object()
LABEL_KEY_AT_LIMIT = "p" * 253 + "/" + "n" * 63


@dataclass
class Case:
    id: str
    path: tuple[Any, ...]  # into the manifest, e.g. ("spec", "tolerations", 0, "key")
    value: Any  # DELETE removes the field

    @property
    def field(self) -> str:
        """The path as kubectl prints it: spec.tolerations[0].key"""
        out = ""
        for p in self.path:
            out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else p)
        return out

    def apply_to(self, manifest: dict[str, Any]) -> dict[str, Any]:
        obj = copy.deepcopy(manifest)
        node = obj
        for p in self.path[:-1]:
            node = node[p]
        last = self.path[-1]
        if self.value is DELETE:
            del node[last]
        elif isinstance(node, list) and last == len(node):
            node.append(copy.deepcopy(self.value))  # one more list item
        else:
            node[last] = copy.deepcopy(self.value)
        return obj


def _string_cases(path: tuple, node: dict, value: str) -> Iterator[tuple[str, Any]]:
    if "enum" in node:
        yield from ((f"enum-{e}", e) for e in node["enum"] if e != value)
        yield "not-in-enum", "Other"
        return
    limit = node.get("maxLength")
    if limit:
        at = (value + "a" * limit)[:limit]
        yield "at-max-length", at
        yield "over-max-length", at + "a"
    yield "empty", ""
    yield "with-space", value + " x"
    yield "non-ascii", value + "\u00e9"


def _integer_cases(node: dict, value: int) -> Iterator[tuple[str, Any]]:
    if "enum" in node:
        yield from ((f"enum-{e}", e) for e in node["enum"] if e != value)
        yield "not-in-enum", 3
    else:
        for bound, step in (("minimum", -1), ("maximum", 1)):
            if bound in node:
                yield f"at-{bound}", node[bound]
                yield f"past-{bound}", node[bound] + step
    yield "as-string", str(value)
    yield "as-float", value + 0.5


def _map_cases(value: dict[str, str]) -> Iterator[tuple[str, Any]]:
    key = next(iter(value))
    yield "empty", {}
    yield "key-at-label-limits", {**value, LABEL_KEY_AT_LIMIT: "v" * 63}
    yield "key-prefix-over-253", {**value, "p" * 254 + "/n": "v"}
    yield "key-name-over-63", {**value, "n" * 64: "v"}
    yield "key-with-space", {**value, "gpu kind": "h100"}
    yield "value-over-63", {key: "v" * 64}
    yield "value-with-space", {key: "a b"}


def schema_cases(obj: dict[str, Any], schema: dict[str, Any], path: tuple = ()) -> Iterator[Case]:
    """Field by field: each field of the example `obj` mutated by its schema type and bounds."""
    for name in schema.get("required", []):
        if name in obj:
            yield Case(f"{'.'.join(map(str, path + (name,)))}:missing", path + (name,), DELETE)
    yield Case(f"{'.'.join(map(str, path)) or 'root'}:unknown-field", path + ("bogusField",), 1)
    for name, value in obj.items():
        node, where = schema["properties"][name], path + (name,)
        label = ".".join(map(str, where))
        if isinstance(value, bool):
            yield Case(f"{label}:not-a-bool", where, "yes")
            yield Case(f"{label}:flipped", where, not value)
        elif isinstance(value, int):
            yield from (Case(f"{label}:{k}", where, v) for k, v in _integer_cases(node, value))
        elif isinstance(value, str):
            yield from (Case(f"{label}:{k}", where, v) for k, v in _string_cases(where, node, value))
        elif isinstance(value, dict) and "additionalProperties" in node:
            yield from (Case(f"{label}:{k}", where, v) for k, v in _map_cases(value))
        elif isinstance(value, dict):
            yield from schema_cases(value, node, where)
        elif isinstance(value, list) and value and isinstance(value[0], dict):
            yield Case(f"{label}:empty-list", where, [])
            yield from schema_cases(value[0], node["items"], where + (0,))


def _expr(key: str, operator: str, values: list[str] | None = None) -> dict[str, Any]:
    return {"key": key, "operator": operator, **({"values": values} if values is not None else {})}


# Variants of the fields the example leaves out, each with a rule of the API server behind it.
VARIANT_CASES = [
    Case("toleration:exists-no-key", ("spec", "tolerations"), [{"operator": "Exists"}]),
    Case("toleration:exists-with-value", ("spec", "tolerations", 0, "value"), "present"),
    Case("toleration:equal-with-value", ("spec", "tolerations", 0),
         {"key": "nvidia.com/gpu", "operator": "Equal", "value": "present", "effect": "NoSchedule"}),
    Case("toleration:equal-value-over-63", ("spec", "tolerations", 0),
         {"key": "nvidia.com/gpu", "operator": "Equal", "value": "v" * 64, "effect": "NoSchedule"}),
    Case("toleration:noexecute-seconds", ("spec", "tolerations", 1),
         {"key": "node.kubernetes.io/unreachable", "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 300}),
    Case("toleration:seconds-without-noexecute", ("spec", "tolerations", 0, "tolerationSeconds"), 300),
    Case("toleration:seconds-negative", ("spec", "tolerations", 1),
         {"key": "k", "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": -1}),
    Case("toleration:key-at-label-limits", ("spec", "tolerations", 0, "key"), LABEL_KEY_AT_LIMIT),
    Case("affinity:in", ("spec", "affinity"), {"required": [{"matchExpressions": [_expr("vivant.dev/node-pool", "In", ["h100"])]}]}),
    Case("affinity:in-no-values", ("spec", "affinity"), {"required": [{"matchExpressions": [_expr("zone", "In")]}]}),
    Case("affinity:notin-empty-values", ("spec", "affinity"), {"required": [{"matchExpressions": [_expr("zone", "NotIn", [])]}]}),
    Case("affinity:exists", ("spec", "affinity"), {"preferred": [{"weight": 1, "preference": {"matchExpressions": [_expr("zone", "Exists")]}}]}),
    Case("affinity:doesnotexist-with-values", ("spec", "affinity"), {"required": [{"matchExpressions": [_expr("zone", "DoesNotExist", ["a"])]}]}),
    Case("affinity:gt-one-integer", ("spec", "affinity"), {"required": [{"matchExpressions": [_expr("gpu.count", "Gt", ["4"])]}]}),
    Case("affinity:lt-two-values", ("spec", "affinity"), {"required": [{"matchExpressions": [_expr("gpu.count", "Lt", ["4", "8"])]}]}),
    Case("affinity:gt-not-integer", ("spec", "affinity"), {"required": [{"matchExpressions": [_expr("gpu.count", "Gt", ["four"])]}]}),
    Case("affinity:value-over-63", ("spec", "affinity"), {"required": [{"matchExpressions": [_expr("zone", "In", ["z" * 64])]}]}),
    Case("affinity:key-with-space", ("spec", "affinity"), {"required": [{"matchExpressions": [_expr("gpu zone", "Exists")]}]}),
    Case("affinity:weight-0", ("spec", "affinity"), {"preferred": [{"weight": 0, "preference": {"matchExpressions": [_expr("zone", "Exists")]}}]}),
    Case("affinity:empty-term", ("spec", "affinity"), {"required": [{"matchExpressions": []}]}),
]
NAME_CASES = [Case(f"name:{label}", ("metadata", "name"), name) for label, name in [
    ("one-letter", "f"), ("52-chars", "f" * 52), ("53-chars", "f" * 53), ("dots", "fz.pool"), ("upper", "Fz"),
    ("digit-first", "1fz"), ("dash-last", "fz-"), ("underscore", "fz_pool"), ("254-chars", "f" * 254)]]


def pool_cases() -> list[Case]:
    base = pool_manifest("x", "fz", minIdle=1, maxWorkers=1)
    spec_schema = crdgen.pool_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    cases = list(schema_cases(base["spec"], spec_schema, ("spec",))) + VARIANT_CASES + NAME_CASES
    ids = [c.id for c in cases]
    assert len(ids) == len(set(ids)), "duplicate case ids"
    return cases


@pytest.fixture(scope="module")
def fuzz_ns(kube: Kube, vivant_release: str) -> Iterator[str]:
    ns = kube.new_namespace("fuzz")
    yield ns
    kube.kubectl("delete", "namespace", ns, "--wait=false", check=False)


def _verdicts(kube: Kube, ns: str, accepted: dict[str, Case]) -> dict[str, str]:
    """For the accepted pools: name -> '' when it works, else what is wrong (once everything settled)."""
    def look() -> dict[str, str]:
        pools = {p["metadata"]["name"]: p for p in kube.items(POOLS, ns)}
        stss = {s["metadata"]["name"]: s for s in kube.items("statefulsets", ns)}
        pods = {p["metadata"]["name"] for p in kube.items("pods", ns)}
        failed = {e["involvedObject"]["name"]: e["message"] for e in kube.items("events", ns) if e["reason"] == "FailedCreate"}
        out = {}
        for name in accepted:
            ready = condition((pools.get(name) or {}).get("status") or {}, "Ready") or {}
            sts = stss.get(name)
            if name in failed:
                out[name] = f"FailedCreate: {failed[name]}"
            elif ready.get("status") == "False":
                out[name] = f"pool Ready=False {ready.get('reason')}: {ready.get('message')}"
            elif sts is None or ready.get("status") != "True":
                out[name] = "waiting: no StatefulSet or pool not Ready yet"
            elif sts["spec"]["replicas"] and f"{name}-0" not in pods:
                out[name] = "waiting: the StatefulSet created no pod yet"
            else:
                out[name] = ""
        return out

    deadline = time.monotonic() + 60
    while True:
        seen = look()
        if all(not v.startswith("waiting") for v in seen.values()) or time.monotonic() > deadline:
            return seen
        time.sleep(1)


@pytest.mark.timeout(600)
def test_every_accepted_pool_runs_and_every_refusal_names_the_field(kube: Kube, fuzz_ns: str):
    cases = pool_cases()
    assert len(cases) >= 60, len(cases)
    base = pool_manifest(fuzz_ns, "fz", minIdle=1, maxWorkers=1)
    problems, outcome = [], {"refused": 0, "works": 0}
    batch = 16
    for start in range(0, len(cases), batch):
        accepted: dict[str, Case] = {}
        for i, case in enumerate(cases[start:start + batch], start):
            obj = case.apply_to(base)
            if case.path != ("metadata", "name"):
                obj["metadata"]["name"] = f"fz-{i}"  # a fresh pool per case
            out = kube.apply(obj, check=False)
            if out.returncode != 0:
                outcome["refused"] += 1
                if case.field not in out.stderr:
                    problems.append(f"{case.id}: refused without naming {case.field}: {out.stderr.strip()[:300]}")
            else:
                accepted[obj["metadata"]["name"]] = case
        for name, verdict in _verdicts(kube, fuzz_ns, accepted).items():
            if verdict:
                problems.append(f"{accepted[name].id}: accepted as {name!r} but {verdict}")
            else:
                outcome["works"] += 1
        for name in accepted:
            kube.kubectl("delete", POOLS, name, "-n", fuzz_ns, "--wait=false", check=False)
    print(json.dumps({"cases": len(cases), **outcome}))
    assert not problems, f"{len(problems)} of {len(cases)} cases:\n" + "\n".join(problems)
    assert outcome["refused"] >= 20 and outcome["works"] >= 20, outcome  # the mutations reach both sides


SERVED = {"Assigned", "Connecting", "Streaming"}
SESSION_CASES = [Case(f"name:{label}", ("metadata", "name"), name) for label, name in [
    ("63-chars", "s" * 63), ("64-chars", "s" * 64), ("253-chars", ("sess." * 51)[:252] + "n"), ("254-chars", "s" * 254),
    ("dots", "ada.v2"), ("upper", "Ada"), ("underscore", "ada_v2")]] + [
    Case("character:128", ("spec", "character"), "c" * 128), Case("character:129", ("spec", "character"), "c" * 129),
    Case("character:space", ("spec", "character"), "ada v1"),
    Case("room:128", ("spec", "livekit", "room"), "r" * 128), Case("room:slash", ("spec", "livekit", "room"), "a/b"),
    Case("agent:129", ("spec", "livekit", "agentIdentity"), "a" * 129),
    Case("url:ftp", ("spec", "livekit", "url"), "ftp://livekit.example.com"),
    Case("url:https-path", ("spec", "livekit", "url"), "https://livekit.example.com/rtc"),
    Case("duration:9", ("spec", "maxDurationSeconds"), 9), Case("duration:86401", ("spec", "maxDurationSeconds"), 86401),
    Case("pool:53", ("spec", "pool"), "p" * 53), Case("pool:upper", ("spec", "pool"), "W"),
    Case("pool:absent", ("spec", "pool"), "absent-pool"),
    Case("flags:unknown", ("spec", "flags"), {"warpDrive": True}),
    Case("flags:fused", ("spec", "flags"), {"fusedGemmAllReduce": False}),
    Case("token-secret:bad-name", ("spec", "livekit", "tokenSecret"), "Not_A_Name"),
]


@pytest.mark.timeout(600)
def test_every_accepted_session_is_handled_and_every_refusal_names_the_field(kube: Kube, fuzz_ns: str):
    registry = Registry(kube.state.redis_url)
    pool = resources.pool_key(fuzz_ns, "w")
    kube.apply(pool_manifest(fuzz_ns, "w", image=WORKER_IMAGE, minIdle=1, maxWorkers=1))
    wait_for(lambda: registry.idle_workers(pool) == ["w-0"], "the session pool's worker idle", 120)
    base = session_manifest(fuzz_ns, "s", "w", maxDurationSeconds=600)
    assert example("charactersession.yaml")["spec"]["pool"] != "w"  # the example is only the starting point
    problems, outcome = [], {"refused": 0, "served": 0, "explained": 0}
    for i, case in enumerate(SESSION_CASES):
        obj = case.apply_to(base)
        if case.path != ("metadata", "name"):
            obj["metadata"]["name"] = f"s-{i}"
        name = obj["metadata"]["name"]
        out = kube.apply(obj, check=False)
        if out.returncode != 0:
            outcome["refused"] += 1
            if case.field not in out.stderr:
                problems.append(f"{case.id}: refused without naming {case.field}: {out.stderr.strip()[:300]}")
            continue

        def handled(name: str = name) -> dict | None:
            st = ((kube.get(SESSIONS, name, fuzz_ns) or {}).get("status")) or {}
            reason = (condition(st, "Ready") or {}).get("reason")
            if st.get("phase") in SERVED or (reason and reason not in ("WaitingForWorker",) and st.get("message")):
                return st
            return None

        try:
            st = wait_for(handled, f"{case.id} handled", 45)
            outcome["served" if st["phase"] in SERVED else "explained"] += 1
        except AssertionError as exc:
            problems.append(f"{case.id}: accepted, not handled: {exc}")
        kube.kubectl("delete", SESSIONS, name, "-n", fuzz_ns, "--wait=true", "--timeout=60s", check=False)
        if registry.worker_of(f"{fuzz_ns}/{name}") is not None:
            problems.append(f"{case.id}: the deleted session still holds a worker")
        try:
            wait_for(lambda: registry.idle_workers(pool) == ["w-0"], "the worker idle again", 30)
        except AssertionError as exc:
            problems.append(f"{case.id}: {exc}")
    kube.kubectl("delete", POOLS, "w", "-n", fuzz_ns, "--wait=false", check=False)
    registry.close()
    print(json.dumps({"cases": len(SESSION_CASES), **outcome}))
    assert not problems, "\n".join(problems)
    assert outcome["refused"] >= 8 and outcome["served"] >= 5 and outcome["explained"] >= 1, outcome


def test_the_fuzz_image_runs_no_process():
    """Fuzz pools must cost the machine no worker processes: the pod runner only runs vivant images."""
    from vivant.devcluster.pod_runner import host_program
    assert host_program(FUZZ_IMAGE) is None and host_program(WORKER_IMAGE) is not None
