"""Objects and readings shared by the cluster tests of issue 14's defects and the spec fuzzing.

Manifests start from the README's examples (`examples/workerpool.yaml`, `examples/charactersession.yaml`)
so the tests exercise what a user applies. `FUZZ_IMAGE` does not start with `vivant`: the local pod
runner starts no process for such pods, so a pool of it costs the 2-core machine nothing but objects.
"""

from __future__ import annotations

import copy
import re
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import yaml
from conftest import RELEASE_NS, REPO, Kube
from vivant.operator.config import name_priority

EXAMPLES = REPO / "examples"
FUZZ_IMAGE = "registry.example/fuzz-worker:1"
WORKER_IMAGE = "ghcr.io/vivant-dev/vivant-worker:0.1.0"  # a vivant image: the pod runner runs `vivant worker`
POOLS, SESSIONS = "workerpools.vivant.dev", "charactersessions.vivant.dev"


def example(name: str) -> dict[str, Any]:
    return yaml.safe_load((EXAMPLES / name).read_text())


def pool_manifest(namespace: str, name: str, image: str = FUZZ_IMAGE, **spec: Any) -> dict[str, Any]:
    """examples/workerpool.yaml in `namespace` as `name`, with `spec` fields (camelCase) replaced."""
    obj = example("workerpool.yaml")
    obj["metadata"] = {"name": name, "namespace": namespace}
    obj["spec"]["image"] = image
    obj["spec"].update(copy.deepcopy(spec))
    return obj


def session_manifest(namespace: str, name: str, pool: str, **spec: Any) -> dict[str, Any]:
    """examples/charactersession.yaml in `namespace` as `name` for `pool`, with `spec` fields replaced."""
    obj = example("charactersession.yaml")
    obj["metadata"] = {"name": name, "namespace": namespace}
    obj["spec"]["pool"] = pool
    obj["spec"].update(copy.deepcopy(spec))
    return obj


def status(kube: Kube, kind: str, name: str, namespace: str) -> dict[str, Any]:
    return ((kube.get(kind, name, namespace) or {}).get("status")) or {}


def condition(obj_status: dict[str, Any], type_: str) -> dict[str, Any] | None:
    return next((c for c in obj_status.get("conditions") or [] if c.get("type") == type_), None)


def events(kube: Kube, namespace: str, name: str, reason: str | None = None) -> list[dict[str, Any]]:
    """Core Events about the object `name` in `namespace` (optionally of one reason)."""
    out = [e for e in kube.items("events", namespace) if e.get("involvedObject", {}).get("name") == name]
    return [e for e in out if reason is None or e.get("reason") == reason]


def operator_pods(kube: Kube, namespace: str = RELEASE_NS, release: str = "vivant") -> list[str]:
    """The names of the release's live operator pods (the chart runs two replicas by default)."""
    pods = [p for p in kube.items("pods", namespace, f"app.kubernetes.io/component=operator,app.kubernetes.io/instance={release}")
            if not p["metadata"].get("deletionTimestamp")]
    return [p["metadata"]["name"] for p in pods]


def operator_pod(kube: Kube, namespace: str = RELEASE_NS, release: str = "vivant") -> str:
    """The release's active operator pod: of its live replicas, the one kopf peering lets work — the highest
    priority, which each replica derives from its pod name (vivant.operator.config.name_priority)."""
    names = operator_pods(kube, namespace, release)
    assert names, f"no operator pod of release {release} in {namespace}"
    return max(names, key=name_priority)


class PodLog:
    """The whole log of one pod's container as the local pod runner writes it (Kube.pod_log keeps a tail)."""

    def __init__(self, kube: Kube, namespace: str, pod: str, container: str) -> None:
        files = sorted((kube.cluster.dir / "pods").glob(f"{namespace}_{pod}_*/{container}.log"))
        assert files, f"no log of {namespace}/{pod} ({container}) yet"
        self.path: Path = files[-1]

    def text(self) -> str:
        return self.path.read_text(errors="replace")

    def mark(self) -> int:
        return self.path.stat().st_size

    def since(self, mark: int) -> str:
        with open(self.path, "rb") as f:
            f.seek(mark)
            return f.read().decode(errors="replace")

    def process_start(self) -> datetime:
        """When the pod runner started the process (its `--- start HH:MM:SS` line), on the first log line's date."""
        text = self.text()
        start = re.search(r"^--- start (\d\d:\d\d:\d\d)", text, re.M)
        first = re.search(r"^\[(\d{4}-\d\d-\d\d) ", text, re.M)
        assert start and first, f"{self.path}: no start line or no timestamped line yet"
        return datetime.strptime(f"{first.group(1)} {start.group(1)}", "%Y-%m-%d %H:%M:%S")

    def first_time(self, pattern: str) -> datetime | None:
        """Timestamp of the first line matching `pattern` (kopf's `[YYYY-mm-dd HH:MM:SS,mmm]` format)."""
        for line in self.text().splitlines():
            m = re.match(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3})\]", line)
            if m and re.search(pattern, line):
                return datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S") + timedelta(milliseconds=int(m.group(2)))
        return None
