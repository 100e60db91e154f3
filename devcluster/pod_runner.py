"""The local cluster's stand-in for a kubelet's container runtime: real processes behind vivant's pods.

kwok marks the pods the scheduler binds to the simulated nodes Running, but no container starts
(there is no container engine here). This runner does the part vivant needs: for every pod bound to a
kwok node whose image has a host program in `HOST_PROGRAMS`, it starts the container's real command
(`vivant worker`, `vivant operator`, `vivant api`, `redis-server`) as a host process with the pod's
environment, and stops it when the pod is deleted. A stand-in, because no real kubelet can run here;
it is deliberately small and does what a kubelet does for these pods:

- env: `value`, `valueFrom` (fieldRef, secretKeyRef, configMapKeyRef), `envFrom`, and `$(VAR)` expansion;
- volumes: secret, configMap, emptyDir and downwardAPI files written into the pod's folder; a
  container's mountPath prefix in its args and env values is rewritten to that folder;
- the pod's ServiceAccount: a bound token from the TokenRequest API in a kubeconfig ($KUBECONFIG), so
  the process has exactly the RBAC rights the chart gave it (and no token with
  `automountServiceAccountToken: false`);
- ports: the pods share the host's network, so every containerPort gets a free loopback port,
  substituted where the env or args name that port number (and 0.0.0.0 becomes 127.0.0.1); the
  mapping is published on the pod as annotation `dev.vivant.dev/host-ports` ({"<port name>": port});
- restartPolicy Always: a process that exits is started again (1 s, 2 s, ... 10 s back-off); the
  count is published as annotation `dev.vivant.dev/restarts`;
- deletion: SIGTERM, then SIGKILL after the pod's grace period (at most 10 s here), and only then the
  pod object is removed (annotation `dev.vivant.dev/run-by` tells kwok to leave that to the runner), so a
  StatefulSet's replacement pod never runs beside the process it replaces.

Logs: `<state>/pods/<namespace>_<pod>/<container>.log`.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import kubernetes
import yaml
from kubernetes.client.rest import ApiException
from vivant.devcluster.cluster import KWOK_ANNOTATION, RUN_BY_ANNOTATION, ClusterState
from vivant.ports import free_port

HOST_PORTS_ANNOTATION = "dev.vivant.dev/host-ports"
RESTARTS_ANNOTATION = "dev.vivant.dev/restarts"
MAX_GRACE_S = 10.0


def host_program(image: str) -> str | None:
    """The host program that stands in for an image's entry point, None if this runner cannot run it."""
    repo = image.rsplit("@", 1)[0].rsplit(":", 1)[0] if "/" in image or ":" in image else image
    name = repo.rsplit("/", 1)[-1]
    if name.startswith("vivant"):
        return str(Path(sys.executable).parent / "vivant")
    if name == "redis":
        return shutil.which("redis-server")
    return None


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes `$(VAR)` expansion: defined names are replaced, `$$(X)` escapes, unknown names stay."""
    def sub(m: re.Match) -> str:
        if m.group(0).startswith("$$"):
            return m.group(0)[1:]
        return env.get(m.group(1), m.group(0))

    return re.sub(r"\$\$?\(([A-Za-z_][A-Za-z0-9_.-]*)\)", sub, text)


def field_value(pod: dict[str, Any], path: str) -> str:
    meta, spec = pod["metadata"], pod["spec"]
    m = re.fullmatch(r"metadata\.(labels|annotations)\['(.+)'\]", path)
    if m:
        return (meta.get(m.group(1)) or {}).get(m.group(2), "")
    table = {
        "metadata.name": meta.get("name"), "metadata.namespace": meta.get("namespace"), "metadata.uid": meta.get("uid"),
        "spec.nodeName": spec.get("nodeName"), "spec.serviceAccountName": spec.get("serviceAccountName"),
        "status.podIP": "127.0.0.1", "status.hostIP": "127.0.0.1",
    }
    if path not in table:
        raise ValueError(f"fieldRef {path!r} is not supported by the local pod runner")
    return table[path] or ""


@dataclass
class Container:
    """One running host process of a pod's container."""

    name: str
    cmd: list[str]
    env: dict[str, str]
    cwd: Path
    log: Path
    proc: subprocess.Popen | None = None
    restarts: int = 0
    next_start: float = 0.0

    def start(self) -> None:
        with open(self.log, "ab") as out:
            out.write(f"--- start {time.strftime('%H:%M:%S')}: {' '.join(self.cmd)}\n".encode())
            self.proc = subprocess.Popen(self.cmd, env=self.env, cwd=self.cwd, stdout=out, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)

    def stop(self, grace: float) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=grace)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(timeout=5)


@dataclass
class RunningPod:
    uid: str
    namespace: str
    name: str
    folder: Path
    containers: list[Container] = field(default_factory=list)
    grace: float = MAX_GRACE_S


class PodRunner:
    def __init__(self, state_dir: Path) -> None:
        self.dir = state_dir
        state = ClusterState.load(state_dir)
        if state is None:
            raise RuntimeError(f"no cluster state in {state_dir}")
        self.state = state
        self.ca = state_dir / "pki" / "ca.crt"
        kubernetes.config.load_kube_config(config_file=state.kubeconfig)
        self.core = kubernetes.client.CoreV1Api()
        self.pods: dict[str, RunningPod] = {}
        self.waiting: dict[str, str] = {}  # uid -> why it cannot start yet (logged once)

    # ------------------------------------------------------------------ the loop

    def run_forever(self, period: float = 0.5) -> None:
        stop = False

        def on_term(*_: Any) -> None:
            nonlocal stop
            stop = True

        signal.signal(signal.SIGTERM, on_term)
        signal.signal(signal.SIGINT, on_term)
        while not stop:
            try:
                self.sync()
            except Exception as exc:  # the apiserver may be restarting: keep the processes, try again
                print(f"pod runner: sync failed: {type(exc).__name__}: {exc}", flush=True)
            time.sleep(period)
        for pod in list(self.pods.values()):
            self._stop(pod)

    def sync(self) -> None:
        kwok_nodes = {n.metadata.name for n in self.core.list_node().items
                      if (n.metadata.annotations or {}).get(KWOK_ANNOTATION[0]) == KWOK_ANNOTATION[1]}
        wanted: dict[str, dict[str, Any]] = {}
        for pod in self.core.list_pod_for_all_namespaces().items:
            d = self.core.api_client.sanitize_for_serialization(pod)
            meta = d["metadata"]
            if d["spec"].get("nodeName") not in kwok_nodes:
                continue
            if meta.get("deletionTimestamp"):
                if RUN_BY_ANNOTATION in (meta.get("annotations") or {}):
                    self._finish_deletion(d)
                continue
            wanted[meta["uid"]] = d
        for uid in list(self.pods):
            if uid not in wanted:
                self._stop(self.pods.pop(uid))
        for uid, pod in wanted.items():
            if uid in self.pods:
                self._supervise(self.pods[uid])
            else:
                self._try_start(pod)

    def _finish_deletion(self, pod: dict[str, Any]) -> None:
        """A deleted pod of ours: stop its processes (SIGTERM, grace, SIGKILL), then remove the pod object."""
        meta = pod["metadata"]
        running = self.pods.pop(meta["uid"], None)
        if running is not None:
            self._stop(running)
        try:
            self.core.delete_namespaced_pod(meta["name"], meta["namespace"], grace_period_seconds=0,
                                            body=kubernetes.client.V1DeleteOptions(
                                                grace_period_seconds=0,
                                                preconditions=kubernetes.client.V1Preconditions(uid=meta["uid"])))
        except ApiException as exc:
            if exc.status not in (404, 409):
                raise

    # ------------------------------------------------------------------ one pod

    def _try_start(self, pod: dict[str, Any]) -> None:
        meta = pod["metadata"]
        uid = meta["uid"]
        try:
            running = self._prepare(pod)
        except _NotReady as exc:
            if self.waiting.get(uid) != str(exc):
                print(f"pod runner: {meta['namespace']}/{meta['name']}: waiting: {exc}", flush=True)
                self.waiting[uid] = str(exc)
            return
        self.waiting.pop(uid, None)
        if running is None:
            return
        for c in running.containers:
            c.start()
        self.pods[uid] = running
        print(f"pod runner: started {running.namespace}/{running.name} "
              f"({', '.join(c.name for c in running.containers)})", flush=True)

    def _supervise(self, pod: RunningPod) -> None:
        now = time.monotonic()
        for c in pod.containers:
            if c.proc is not None and c.proc.poll() is not None:
                code = c.proc.returncode
                c.proc = None
                c.restarts += 1
                c.next_start = now + min(10.0, 2.0 ** (c.restarts - 1))
                print(f"pod runner: {pod.namespace}/{pod.name}/{c.name} exited with {code}; restart #{c.restarts}",
                      flush=True)
                self._annotate(pod, {RESTARTS_ANNOTATION: str(sum(x.restarts for x in pod.containers))})
            if c.proc is None and now >= c.next_start:
                c.start()

    def _stop(self, pod: RunningPod) -> None:
        for c in pod.containers:
            c.stop(pod.grace)
        print(f"pod runner: stopped {pod.namespace}/{pod.name}", flush=True)

    def _annotate(self, pod: RunningPod, annotations: dict[str, str]) -> None:
        try:
            self.core.patch_namespaced_pod(pod.name, pod.namespace, {"metadata": {"annotations": annotations}})
        except ApiException as exc:
            if exc.status != 404:
                raise

    def _prepare(self, pod: dict[str, Any]) -> RunningPod | None:
        meta, spec = pod["metadata"], pod["spec"]
        ns, name = meta["namespace"], meta["name"]
        programs = {c["name"]: host_program(c["image"]) for c in spec["containers"]}
        if not all(programs.values()):
            missing = [c["image"] for c in spec["containers"] if not programs[c["name"]]]
            if self.waiting.get(meta["uid"]) is None:
                print(f"pod runner: {ns}/{name}: no host program for image(s) {missing}; not run", flush=True)
                self.waiting[meta["uid"]] = "no host program"
            return None
        folder = self.dir / "pods" / f"{ns}_{name}_{meta['uid'][:8]}"
        folder.mkdir(parents=True, exist_ok=True)
        volumes = self._volumes(pod, folder)
        base_env = {"PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '/usr/bin:/bin')}",
                    "HOME": str(folder), "LANG": "C.UTF-8", "PYTHONUNBUFFERED": "1",
                    # what a container runtime sets: the operator's replicas take their peering priority from it
                    "HOSTNAME": spec.get("hostname") or name}
        if spec.get("automountServiceAccountToken", True) is not False:
            base_env["KUBECONFIG"] = str(self._service_account_kubeconfig(pod, folder))
        ports: dict[str, int] = {}
        running = RunningPod(uid=meta["uid"], namespace=ns, name=name, folder=folder,
                             grace=min(MAX_GRACE_S, float(spec.get("terminationGracePeriodSeconds", 30))))
        for c in spec["containers"]:
            port_map = {}
            for p in c.get("ports") or []:
                host = free_port()
                port_map[int(p["containerPort"])] = host
                ports[p.get("name") or str(p["containerPort"])] = host
            mounts = {m["mountPath"].rstrip("/"): str(volumes[m["name"]])
                      for m in c.get("volumeMounts") or [] if m["name"] in volumes}
            localize = _localizer(mounts, port_map)
            env = dict(base_env)
            env.update({k: localize(v) for k, v in self._container_env(pod, c).items()})
            argv = [expand(x, env) for x in (c.get("command") or []) + (c.get("args") or [])]
            if not argv:
                raise _NotReady(f"container {c['name']} has no command (the runner cannot read image entry points)")
            argv = [programs[c["name"]]] + [localize(a) for a in argv[1:]]
            running.containers.append(Container(name=c["name"], cmd=argv, env=env, cwd=folder,
                                                log=folder / f"{c['name']}.log"))
        # From here on the runner, not kwok, finishes the pod's deletion (after stopping its processes).
        self.core.patch_namespaced_pod(name, ns, {"metadata": {"annotations": {
            RUN_BY_ANNOTATION: "pod-runner", HOST_PORTS_ANNOTATION: json.dumps(ports)}}})
        return running

    def _container_env(self, pod: dict[str, Any], c: dict[str, Any]) -> dict[str, str]:
        ns = pod["metadata"]["namespace"]
        env: dict[str, str] = {}
        for src in c.get("envFrom") or []:
            prefix = src.get("prefix", "")
            if src.get("secretRef"):
                data = self._secret(ns, src["secretRef"]["name"], optional=src["secretRef"].get("optional", False))
            else:
                data = self._config_map(ns, src["configMapRef"]["name"], optional=src["configMapRef"].get("optional", False))
            env.update({prefix + k: v for k, v in data.items()})
        for e in c.get("env") or []:
            if "value" in e:
                env[e["name"]] = expand(e["value"] or "", env)
                continue
            ref = e.get("valueFrom") or {}
            if "fieldRef" in ref:
                env[e["name"]] = field_value(pod, ref["fieldRef"]["fieldPath"])
            elif "secretKeyRef" in ref:
                r = ref["secretKeyRef"]
                data = self._secret(ns, r["name"], optional=r.get("optional", False))
                if r["key"] in data:
                    env[e["name"]] = data[r["key"]]
                elif not r.get("optional"):
                    raise _NotReady(f"Secret {ns}/{r['name']} has no key {r['key']!r}")
            elif "configMapKeyRef" in ref:
                r = ref["configMapKeyRef"]
                data = self._config_map(ns, r["name"], optional=r.get("optional", False))
                if r["key"] in data:
                    env[e["name"]] = data[r["key"]]
                elif not r.get("optional"):
                    raise _NotReady(f"ConfigMap {ns}/{r['name']} has no key {r['key']!r}")
            else:
                env[e["name"]] = ""
        return env

    def _secret(self, ns: str, name: str, optional: bool = False) -> dict[str, str]:
        try:
            s = self.core.read_namespaced_secret(name, ns)
        except ApiException as exc:
            if exc.status == 404:
                if optional:
                    return {}
                raise _NotReady(f"Secret {ns}/{name} not found") from None
            raise
        return {k: base64.b64decode(v).decode() for k, v in (s.data or {}).items()}

    def _config_map(self, ns: str, name: str, optional: bool = False) -> dict[str, str]:
        try:
            cm = self.core.read_namespaced_config_map(name, ns)
        except ApiException as exc:
            if exc.status == 404:
                if optional:
                    return {}
                raise _NotReady(f"ConfigMap {ns}/{name} not found") from None
            raise
        return dict(cm.data or {})

    def _volumes(self, pod: dict[str, Any], folder: Path) -> dict[str, Path]:
        ns = pod["metadata"]["namespace"]
        out: dict[str, Path] = {}
        for v in pod["spec"].get("volumes") or []:
            path = folder / "volumes" / v["name"]
            path.mkdir(parents=True, exist_ok=True)
            files: dict[str, str] = {}
            if "secret" in v:
                src = v["secret"]
                data = self._secret(ns, src["secretName"], optional=src.get("optional", False))
                files = {i["path"]: data[i["key"]] for i in src.get("items") or []} if src.get("items") else data
            elif "configMap" in v:
                src = v["configMap"]
                data = self._config_map(ns, src["name"], optional=src.get("optional", False))
                files = {i["path"]: data[i["key"]] for i in src.get("items") or []} if src.get("items") else data
            elif "downwardAPI" in v:
                files = {i["path"]: field_value(pod, i["fieldRef"]["fieldPath"]) for i in v["downwardAPI"].get("items") or []
                         if "fieldRef" in i}
            for rel, content in files.items():
                target = path / rel
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_text(content)
            out[v["name"]] = path
        return out

    def _service_account_kubeconfig(self, pod: dict[str, Any], folder: Path) -> Path:
        meta, spec = pod["metadata"], pod["spec"]
        sa = spec.get("serviceAccountName") or "default"
        body = {"spec": {"audiences": ["https://kubernetes.default.svc.cluster.local"], "expirationSeconds": 86400,
                         "boundObjectRef": {"kind": "Pod", "apiVersion": "v1", "name": meta["name"], "uid": meta["uid"]}}}
        try:
            tr = self.core.create_namespaced_service_account_token(sa, meta["namespace"], body)
        except ApiException as exc:
            if exc.status == 404:
                raise _NotReady(f"ServiceAccount {meta['namespace']}/{sa} not found") from None
            raise
        from vivant.devcluster.pki import kubeconfig

        path = folder / "serviceaccount.kubeconfig"
        cfg = kubeconfig(self.state.server, self.ca, user=f"system:serviceaccount:{meta['namespace']}:{sa}",
                         token=tr.status.token)
        cfg["contexts"][0]["context"]["namespace"] = meta["namespace"]
        path.write_text(yaml.safe_dump(cfg))
        path.chmod(0o600)
        return path


def _localizer(mounts: dict[str, str], ports: dict[int, int]):
    """A function rewriting one arg/env value for the host: mount paths -> the pod's volume folders,
    container ports -> host ports, 0.0.0.0 -> 127.0.0.1. One pass each, so a rewritten path is never
    rewritten again (a mount at /tmp must not match the host folder it produced)."""
    path_re = None
    if mounts:
        alternatives = "|".join(re.escape(p) for p in sorted(mounts, key=len, reverse=True))
        path_re = re.compile(rf"(^|[=\s,:])({alternatives})(?=/|$|\s|,)")
    port_re = re.compile(rf"(^|[:=])({'|'.join(str(p) for p in ports)})(?=\D|$)") if ports else None

    def localize(text: str) -> str:
        if path_re is not None:
            text = path_re.sub(lambda m: m.group(1) + mounts[m.group(2)], text)
        if port_re is not None:
            text = port_re.sub(lambda m: m.group(1) + str(ports[int(m.group(2))]), text)
        return text.replace("0.0.0.0", "127.0.0.1")

    return localize


class _NotReady(Exception):
    """Something the pod needs (a Secret, its ServiceAccount) does not exist yet: try again next sync."""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m vivant.devcluster.pod_runner")
    p.add_argument("--state-dir", type=Path, required=True)
    args = p.parse_args(argv)
    PodRunner(args.state_dir.resolve()).run_forever()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
