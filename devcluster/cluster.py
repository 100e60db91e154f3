"""A real Kubernetes control plane on loopback, with simulated GPU nodes: `vivant dev cluster`.

What runs (all bound to 127.0.0.1, each a child process in its own session so it outlives the
command that started it and `down` stops it):
- etcd 3.6 (built from tools/etcd/go.mod), data in the state folder;
- kube-apiserver with RBAC, TLS and service-account tokens, OwnerReferencesPermissionEnforcement on
  (as on OpenShift) so ownerReferences with blockOwnerDeletion need `update` on `<kind>/finalizers`;
- kube-controller-manager (garbage collector, StatefulSet/Deployment controllers, service-account
  tokens, ...) and kube-scheduler, both under their own client certificates;
- kwok, which keeps the simulated nodes Ready and moves the pods the scheduler binds to them to
  Running (no container runs; `devcluster/pod_runner.py` runs the processes behind vivant's pods);
- optionally a Redis server for the control plane, and Secrets `vivant-redis` / `vivant-livekit` so
  the Helm chart installs with its default values.

Nodes: a GPU node pool (`nvidia.com/gpu` capacity, the labels and taints of `NodePoolSpec`; default an
H100 pool with the `nvidia.com/gpu=present:NoSchedule` taint) and one untainted CPU node, `cpu-0`, for
the control plane's own pods.

State folder layout: `state.json` (ports, pids), `admin.kubeconfig`, `pki/`, `etcd/`, `logs/`.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import ssl
import subprocess
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml
from vivant.devcluster import pki
from vivant.devcluster.binaries import ClusterBinaries, ensure_binaries, tool
from vivant.ports import free_port

KWOK_ANNOTATION = ("kwok.x-k8s.io/node", "fake")
STAGES = Path(__file__).with_name("kwok_stages.yaml")  # how kwok moves nodes and pods (see the file)
RUN_BY_ANNOTATION = "dev.vivant.dev/run-by"  # set on pods the pod runner runs: it, not kwok, removes them
GPU_RESOURCE = "nvidia.com/gpu"
# Credentials of the local cluster only (loopback, throwaway): what its Secrets hold.
DEV_API_KEY = "vivant-dev-api-key"
DEV_LIVEKIT_KEY = "devkey"
DEV_LIVEKIT_SECRET = "vivant-dev-livekit-secret-0123456789"


@dataclass(frozen=True)
class Taint:
    key: str
    value: str
    effect: str  # NoSchedule | PreferNoSchedule | NoExecute

    @classmethod
    def parse(cls, text: str) -> Taint:
        """`key=value:Effect` (the kubectl taint syntax)."""
        try:
            kv, effect = text.rsplit(":", 1)
            key, _, value = kv.partition("=")
        except ValueError:
            raise ValueError(f"taint {text!r}: expected key=value:Effect") from None
        if effect not in ("NoSchedule", "PreferNoSchedule", "NoExecute") or not key:
            raise ValueError(f"taint {text!r}: expected key=value:Effect with Effect NoSchedule|PreferNoSchedule|NoExecute")
        return cls(key=key, value=value, effect=effect)


@dataclass(frozen=True)
class NodePoolSpec:
    """The simulated GPU nodes: count, GPUs each, labels and taints (an H100 pool by default)."""

    nodes: int = 2
    gpus_per_node: int = 8
    name_prefix: str = "h100"
    cpu: str = "96"
    memory: str = "1000Gi"
    labels: tuple[tuple[str, str], ...] = (
        ("nvidia.com/gpu.product", "NVIDIA-H100-80GB-HBM3"),
        ("nvidia.com/gpu.present", "true"),
        ("vivant.dev/node-pool", "h100"),
    )
    taints: tuple[Taint, ...] = (Taint("nvidia.com/gpu", "present", "NoSchedule"),)

    def __post_init__(self) -> None:
        if self.nodes < 0 or self.nodes > 5000:
            raise ValueError(f"nodes: expected 0..5000, got {self.nodes}")
        if self.gpus_per_node < 0 or self.gpus_per_node > 64:
            raise ValueError(f"gpus_per_node: expected 0..64, got {self.gpus_per_node}")

    def node_manifest(self, index: int) -> dict[str, Any]:
        name = f"{self.name_prefix}-{index}"
        capacity = {"cpu": self.cpu, "memory": self.memory, "pods": "110"}
        if self.gpus_per_node:
            capacity[GPU_RESOURCE] = str(self.gpus_per_node)
        return {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {
                "name": name,
                "annotations": {KWOK_ANNOTATION[0]: KWOK_ANNOTATION[1], "node.alpha.kubernetes.io/ttl": "0"},
                "labels": {"kubernetes.io/hostname": name, "kubernetes.io/os": "linux", "kubernetes.io/arch": "amd64",
                           "type": "kwok", **dict(self.labels)},
            },
            "spec": {"taints": [{"key": t.key, "value": t.value, "effect": t.effect} for t in self.taints]},
            "status": {"capacity": capacity, "allocatable": capacity},
        }


# The untainted CPU node(s) where the control plane's own pods (operator, session API) are scheduled,
# as on a real cluster whose GPU nodes carry a taint.
SYSTEM_POOL = NodePoolSpec(nodes=1, gpus_per_node=0, name_prefix="cpu", cpu="16", memory="64Gi",
                           labels=(("vivant.dev/node-pool", "system"),), taints=())


@dataclass(frozen=True)
class ClusterSpec:
    """Everything `up` needs: where state lives, the node pools, and the extras for the chart's defaults."""

    state_dir: Path
    node_pool: NodePoolSpec = field(default_factory=NodePoolSpec)
    system_pool: NodePoolSpec = SYSTEM_POOL
    run_pods: bool = True  # start the pod runner (real processes behind vivant's pods)
    redis: bool = True  # start a Redis and write Secret vivant-redis into `secret_namespaces`
    secret_namespaces: tuple[str, ...] = ("default", "vivant-system")
    livekit_url: str = "ws://127.0.0.1:7880"


@dataclass
class ClusterState:
    """What a running cluster's `state.json` records."""

    server: str
    kubeconfig: str
    ports: dict[str, int]
    pids: dict[str, int]
    redis_url: str | None = None
    # each process's start time (clock ticks since boot, /proc/<pid>/stat): pids are reused (pid_max is
    # often 32768), so a pid from an old state.json may name someone else's process by now
    starts: dict[str, int] = field(default_factory=dict)

    def save(self, folder: Path) -> None:
        (folder / "state.json").write_text(json.dumps(asdict(self), indent=2))

    @classmethod
    def load(cls, folder: Path) -> ClusterState | None:
        path = folder / "state.json"
        return cls(**json.loads(path.read_text())) if path.exists() else None


def _start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (field 22 of /proc/<pid>/stat), None if gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return int(fields[19])


def _alive(pid: int, start: int | None = None) -> bool:
    """`pid` runs and is not a zombie; with `start`, it is also the process that started then (not a
    later process that got the same pid)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    if start is not None and _start_time(pid) != start:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().split(") ", 1)[-1].startswith("Z"))


def _stop_pid(pid: int, timeout: float = 10.0, start: int | None = None) -> None:
    """SIGTERM the process group led by `pid`, then SIGKILL what is left; nothing if `pid` is no longer
    the process that started at `start` (its pid was reused)."""
    if start is not None and not _alive(pid, start):
        return
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + (timeout if sig == signal.SIGTERM else 2.0)
        while time.monotonic() < deadline:
            try:
                if os.waitpid(pid, os.WNOHANG)[0] == pid:
                    return
            except ChildProcessError:
                pass
            if not _alive(pid, start):
                return
            time.sleep(0.05)


class LocalCluster:
    """Start, inspect and stop one local cluster in `spec.state_dir`."""

    def __init__(self, spec: ClusterSpec, binaries: ClusterBinaries | None = None, log=print) -> None:
        self.spec = spec
        self.dir = Path(spec.state_dir).resolve()
        self._binaries = binaries
        self.log = log
        self.state: ClusterState | None = ClusterState.load(self.dir)

    # ------------------------------------------------------------------ paths

    @property
    def kubeconfig(self) -> Path:
        return self.dir / "admin.kubeconfig"

    @property
    def logs(self) -> Path:
        return self.dir / "logs"

    # ------------------------------------------------------------------ lifecycle

    def running(self) -> bool:
        return self.state is not None and all(_alive(p, self.state.starts.get(n)) for n, p in self.state.pids.items())

    def up(self, timeout: float = 120.0) -> ClusterState:
        if self.running():
            assert self.state is not None
            return self.state
        if self.state is not None:  # a dead or half-stopped cluster: clear it first
            self.down()
        bins = self._binaries or ensure_binaries(log=self.log)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.logs.mkdir(exist_ok=True)
        keys = pki.make_pki(self.dir / "pki")
        ports = {name: free_port() for name in ("etcd", "etcd_peer", "apiserver", "controller_manager", "scheduler",
                                                "kwok")}
        server = f"https://127.0.0.1:{ports['apiserver']}"
        self.state = ClusterState(server=server, kubeconfig=str(self.kubeconfig), ports=ports, pids={})
        for user, cert, path in (("admin", keys.admin, self.kubeconfig),
                                 ("controller-manager", keys.controller_manager, self.dir / "controller-manager.kubeconfig"),
                                 ("scheduler", keys.scheduler, self.dir / "scheduler.kubeconfig")):
            path.write_text(yaml.safe_dump(pki.kubeconfig(server, keys.ca_cert, user=user, cert=cert)))
            path.chmod(0o600)
        try:
            self._start("etcd", [
                str(bins.etcd), "--name", "vivant-dev", "--data-dir", str(self.dir / "etcd"),
                "--listen-client-urls", f"http://127.0.0.1:{ports['etcd']}",
                "--advertise-client-urls", f"http://127.0.0.1:{ports['etcd']}",
                "--listen-peer-urls", f"http://127.0.0.1:{ports['etcd_peer']}",
                "--initial-advertise-peer-urls", f"http://127.0.0.1:{ports['etcd_peer']}",
                "--initial-cluster", f"vivant-dev=http://127.0.0.1:{ports['etcd_peer']}",
                "--unsafe-no-fsync", "--log-level", "warn",
            ])
            self._wait(lambda: _http_ok(f"http://127.0.0.1:{ports['etcd']}/health"), "etcd", 30)
            self._start("kube-apiserver", [
                str(bins.kube_apiserver),
                f"--etcd-servers=http://127.0.0.1:{ports['etcd']}",
                "--bind-address=127.0.0.1", "--advertise-address=127.0.0.1", f"--secure-port={ports['apiserver']}",
                f"--tls-cert-file={keys.serving.cert}", f"--tls-private-key-file={keys.serving.key}",
                f"--client-ca-file={keys.ca_cert}",
                f"--service-account-key-file={keys.sa_pub}", f"--service-account-signing-key-file={keys.sa_key}",
                "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
                "--service-cluster-ip-range=10.96.0.0/16",
                "--authorization-mode=Node,RBAC",
                "--enable-admission-plugins=OwnerReferencesPermissionEnforcement",
                "--endpoint-reconciler-type=none",  # the advertise address is loopback: no kubernetes endpoints
                "--profiling=false", "--v=1",
            ])
            self._wait(self._apiserver_ready, "kube-apiserver /readyz", 60)
            common = ["--leader-elect=false", "--bind-address=127.0.0.1", "--profiling=false", "--v=1"]
            cm_kc = str(self.dir / "controller-manager.kubeconfig")
            self._start("kube-controller-manager", [
                str(bins.kube_controller_manager), f"--kubeconfig={cm_kc}",
                f"--authentication-kubeconfig={cm_kc}", f"--authorization-kubeconfig={cm_kc}",
                f"--secure-port={ports['controller_manager']}",
                f"--service-account-private-key-file={keys.sa_key}", f"--root-ca-file={keys.ca_cert}",
                "--use-service-account-credentials=true", "--cluster-name=vivant-dev",
                "--concurrent-gc-syncs=5", *common,
            ])
            sch_kc = str(self.dir / "scheduler.kubeconfig")
            self._start("kube-scheduler", [
                str(bins.kube_scheduler), f"--kubeconfig={sch_kc}",
                f"--authentication-kubeconfig={sch_kc}", f"--authorization-kubeconfig={sch_kc}",
                f"--secure-port={ports['scheduler']}", *common,
            ])
            self._start("kwok", [
                str(bins.kwok), f"--kubeconfig={self.kubeconfig}", "--manage-all-nodes=false",
                f"--manage-nodes-with-annotation-selector={KWOK_ANNOTATION[0]}={KWOK_ANNOTATION[1]}",
                "--cidr=10.0.0.0/16", "--node-ip=127.0.0.1", f"--server-address=127.0.0.1:{ports['kwok']}",
                "--node-lease-duration-seconds=40", f"--config={STAGES}",
            ])
            pools = (self.spec.system_pool, self.spec.node_pool)
            nodes = [pool.node_manifest(i) for pool in pools for i in range(pool.nodes)]
            for start in range(0, len(nodes), 250):  # one kubectl per 250 nodes (a fleet has thousands)
                self.kubectl_apply({"apiVersion": "v1", "kind": "List", "items": nodes[start:start + 250]},
                                   timeout=300)
            total = len(nodes)
            self._wait(lambda: self._nodes_ready(total), f"{total} nodes Ready", max(60, total / 10))
            self._wait(lambda: self.kubectl("get", "serviceaccount", "default", "-n", "default", check=False)
                       .returncode == 0, "the default ServiceAccount", 60)
            if self.spec.redis:
                self._start_redis()
            for ns in self.spec.secret_namespaces:
                self._write_chart_secrets(ns)
            if self.spec.run_pods:
                self._start("pod-runner", [
                    os.environ.get("VIVANT_PYTHON", _python()), "-m", "vivant.devcluster.pod_runner",
                    "--state-dir", str(self.dir),
                ])
        except BaseException:
            self.down()
            raise
        self.state.save(self.dir)
        return self.state

    def down(self) -> None:
        """Stop every process of the cluster (pod runner first, etcd last) and forget its state."""
        state = self.state or ClusterState.load(self.dir)
        if state is not None:
            order = ["pod-runner", "kwok", "kube-scheduler", "kube-controller-manager", "kube-apiserver", "redis", "etcd"]
            for name in sorted(state.pids, key=lambda n: order.index(n) if n in order else -1):
                _stop_pid(state.pids[name], start=state.starts.get(name))
        for sub in ("etcd", "state.json"):
            path = self.dir / sub
            if path.is_dir():
                import shutil

                shutil.rmtree(path, ignore_errors=True)
            elif path.exists():
                path.unlink()
        self.state = None

    def status(self) -> dict[str, Any]:
        state = self.state or ClusterState.load(self.dir)
        if state is None:
            return {"running": False}
        procs = {name: ("running" if _alive(pid, state.starts.get(name)) else "dead") for name, pid in state.pids.items()}
        out: dict[str, Any] = {"running": all(v == "running" for v in procs.values()), "server": state.server,
                               "kubeconfig": state.kubeconfig, "processes": procs, "redis_url": state.redis_url}
        if out["running"]:
            nodes = self.kubectl("get", "nodes", "-o", "json", check=False)
            if nodes.returncode == 0:
                out["nodes"] = [
                    {"name": n["metadata"]["name"],
                     "gpus": n["status"].get("allocatable", {}).get(GPU_RESOURCE),
                     "ready": any(c["type"] == "Ready" and c["status"] == "True" for c in n["status"].get("conditions", []))}
                    for n in json.loads(nodes.stdout)["items"]
                ]
        return out

    # ------------------------------------------------------------------ helpers

    def kubectl(self, *args: str, check: bool = True, input: str | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
        proc = subprocess.run([tool("kubectl"), f"--kubeconfig={self.kubeconfig}", *args], input=input,
                              capture_output=True, text=True, timeout=timeout)
        if check and proc.returncode != 0:
            raise RuntimeError(f"kubectl {' '.join(args)} failed: {proc.stderr.strip()}")
        return proc

    def kubectl_apply(self, manifest: dict[str, Any], timeout: float = 60) -> None:
        self.kubectl("apply", "-f", "-", input=json.dumps(manifest), timeout=timeout)

    def _start(self, name: str, cmd: list[str]) -> None:
        assert self.state is not None
        logf = open(self.logs / f"{name}.log", "ab")
        env = dict(os.environ)
        env["KUBECONFIG"] = str(self.kubeconfig)
        proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, cwd=self.dir, env=env)
        logf.close()
        self.state.pids[name] = proc.pid
        start = _start_time(proc.pid)
        if start is not None:
            self.state.starts[name] = start
        self.state.save(self.dir)

    def _wait(self, ready, what: str, timeout: float) -> None:
        assert self.state is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            dead = [n for n, p in self.state.pids.items() if not _alive(p, self.state.starts.get(n))]
            if dead:
                tail = (self.logs / f"{dead[0]}.log").read_text(errors="replace")[-3000:]
                raise RuntimeError(f"{dead[0]} exited while waiting for {what}; its log ends:\n{tail}")
            try:
                if ready():
                    return
            except Exception:  # not up yet
                pass
            time.sleep(0.2)
        raise RuntimeError(f"timed out after {timeout:.0f}s waiting for {what} (logs in {self.logs})")

    def _apiserver_ready(self) -> bool:
        keys = self.dir / "pki"
        ctx = ssl.create_default_context(cafile=str(keys / "ca.crt"))
        ctx.load_cert_chain(str(keys / "admin.crt"), str(keys / "admin.key"))
        assert self.state is not None
        with urllib.request.urlopen(f"{self.state.server}/readyz", context=ctx, timeout=2) as r:
            return r.status == 200

    def _nodes_ready(self, count: int) -> bool:
        out = self.kubectl("get", "nodes", "-o", "json")
        items = json.loads(out.stdout)["items"]
        ready = [n for n in items if any(c["type"] == "Ready" and c["status"] == "True"
                                         for c in n["status"].get("conditions", []))]
        return len(ready) >= count

    def _start_redis(self) -> None:
        import shutil

        assert self.state is not None
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server not found: install the Debian package redis-server (`make sysdeps`)")
        port = free_port()
        self.state.ports["redis"] = port
        self._start("redis", [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
        self.state.redis_url = f"redis://127.0.0.1:{port}/0"
        self._wait(lambda: _redis_ping(port), "redis", 20)

    def _write_chart_secrets(self, namespace: str) -> None:
        """Namespace + the Secrets the chart's defaults name: `vivant-redis` (url), `vivant-livekit` (dev
        credentials) and `vivant-api-keys` (the session API's key file, holding DEV_API_KEY)."""
        assert self.state is not None
        self.kubectl_apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}})
        if self.state.redis_url:
            self.kubectl_apply({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "vivant-redis", "namespace": namespace},
                                "stringData": {"url": self.state.redis_url}})
        self.kubectl_apply({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "vivant-livekit", "namespace": namespace},
                            "stringData": {"api-key": DEV_LIVEKIT_KEY, "api-secret": DEV_LIVEKIT_SECRET}})
        self.kubectl_apply({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "vivant-api-keys", "namespace": namespace},
                            "stringData": {"keys": f"# session API keys of the local cluster\n{DEV_API_KEY}\n"}})


def _python() -> str:
    import sys

    return sys.executable


def _http_ok(url: str) -> bool:
    with urllib.request.urlopen(url, timeout=2) as r:
        return r.status == 200


def _redis_ping(port: int) -> bool:
    with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
        s.sendall(b"PING\r\n")
        return s.recv(16).startswith(b"+PONG")
