"""The fleet benchmark's control plane: a local cluster without the pod runner, the Helm chart's RBAC,
and the chart's operator and session API run as host processes under their ServiceAccounts.

Why host processes (not the pod runner): the benchmark needs the operator's process id (CPU seconds
and peak RSS from /proc, a kill in the failover phase) and counts the Redis commands it sends
(`operator_host`); the pod runner would also start a process for every worker pod, which here are
simulated (`sim_workers`). So the chart is installed with `operator.replicas=0` and `api.replicas=0`:
it creates the ServiceAccounts, RBAC and Secrets, and the operator's container (its arguments and
environment, as the chart renders them) is run on the host with a token of the operator's
ServiceAccount, so every API request it makes goes through the chart's RBAC.

Requests per client are counted by the API server itself: a FlowSchema (API Priority and Fairness)
that matches only the operator's ServiceAccount, read back as
`apiserver_flowcontrol_dispatched_requests_total{flow_schema="vivant-bench-operator"}`.
"""

from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import yaml
from prometheus_client.parser import text_string_to_metric_families
from vivant.devcluster import pki
from vivant.devcluster.binaries import tool
from vivant.devcluster.cluster import LocalCluster
from vivant.ports import free_port

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "vivant"
RELEASE, RELEASE_NS = "vivant", "vivant-system"
OPERATOR_SA = f"{RELEASE}-operator"
API_SA = f"{RELEASE}-api"
FLOW_SCHEMA = "vivant-bench-operator"
PEERING_CRDS = REPO / "bench" / "fleet" / "kopf_peering_crds.yaml"


def helm(cluster: LocalCluster, *args: str) -> str:
    proc = subprocess.run([tool("helm"), f"--kubeconfig={cluster.kubeconfig}", *args], capture_output=True,
                          text=True, timeout=300)
    if proc.returncode != 0:
        raise RuntimeError(f"helm {' '.join(args)} failed: {proc.stderr.strip()}")
    return proc.stdout


def install_chart(cluster: LocalCluster, api_namespace: str, peering: bool) -> list[dict[str, Any]]:
    """`helm install` with no operator or API pods; returns the rendered manifests (for the operator's
    container). With `peering`, kopf's peering CRDs are applied first and the chart's peering is on."""
    if peering:
        apply_peering(cluster)
    sets = ["operator.replicas=0", "api.replicas=0", f"api.namespace={api_namespace}",
            f"operator.peering.enabled={'true' if peering else 'false'}"]
    args = ["install", RELEASE, str(CHART), "-n", RELEASE_NS]
    for s in sets:
        args += ["--set", s]
    helm(cluster, *args)
    manifest = helm(cluster, "get", "manifest", RELEASE, "-n", RELEASE_NS)
    return [d for d in yaml.safe_load_all(manifest) if d]


def service_account_kubeconfig(cluster: LocalCluster, namespace: str, sa: str, path: Path) -> Path:
    """A kubeconfig holding a 24 h token of ServiceAccount `namespace/sa` (TokenRequest API)."""
    token = cluster.kubectl("create", "token", sa, "-n", namespace, "--duration=24h").stdout.strip()
    cfg = pki.kubeconfig(cluster.state.server, cluster.dir / "pki" / "ca.crt",
                         user=f"system:serviceaccount:{namespace}:{sa}", token=token)
    path.write_text(yaml.safe_dump(cfg))
    path.chmod(0o600)
    return path


def apply_flow_schema(cluster: LocalCluster) -> None:
    """Route the operator's requests through a FlowSchema of their own, so the API server counts them."""
    cluster.kubectl_apply({
        "apiVersion": "flowcontrol.apiserver.k8s.io/v1", "kind": "FlowSchema",
        "metadata": {"name": FLOW_SCHEMA},
        "spec": {"matchingPrecedence": 500, "priorityLevelConfiguration": {"name": "workload-high"},
                 "distinguisherMethod": {"type": "ByUser"},
                 "rules": [{"subjects": [{"kind": "ServiceAccount",
                                          "serviceAccount": {"name": OPERATOR_SA, "namespace": RELEASE_NS}}],
                            "resourceRules": [{"verbs": ["*"], "apiGroups": ["*"], "resources": ["*"],
                                               "clusterScope": True, "namespaces": ["*"]}],
                            "nonResourceRules": [{"verbs": ["*"], "nonResourceURLs": ["*"]}]}]},
    })


@dataclass(frozen=True)
class ApiserverSample:
    at: float
    operator_requests: float  # dispatched through the operator's FlowSchema, all verbs
    all_requests: float  # apiserver_request_total, every client
    operator_rejected: float = 0.0  # refused by API Priority and Fairness (429) in the operator's FlowSchema
    operator_wait_s: float = 0.0  # seconds the operator's requests queued in APF before running (sum)


def apiserver_sample(cluster: LocalCluster) -> ApiserverSample:
    text = cluster.kubectl("get", "--raw", "/metrics", timeout=60).stdout
    op = total = rejected = wait = 0.0

    def ours(s) -> bool:  # noqa: ANN001
        return s.labels.get("flow_schema") == FLOW_SCHEMA

    for fam in text_string_to_metric_families(text):
        if fam.name == "apiserver_flowcontrol_dispatched_requests":
            op += sum(s.value for s in fam.samples if s.name.endswith("_total") and ours(s))
        elif fam.name == "apiserver_flowcontrol_rejected_requests":
            rejected += sum(s.value for s in fam.samples if s.name.endswith("_total") and ours(s))
        elif fam.name == "apiserver_flowcontrol_request_wait_duration_seconds":
            wait += sum(s.value for s in fam.samples if s.name.endswith("_sum") and ours(s))
        elif fam.name == "apiserver_request":
            total += sum(s.value for s in fam.samples if s.name.endswith("_total"))
    return ApiserverSample(at=time.time(), operator_requests=op, all_requests=total, operator_rejected=rejected,
                           operator_wait_s=wait)


# ------------------------------------------------------------------------------------------ processes


def _container(manifests: list[dict[str, Any]], kind: str, name_suffix: str) -> dict[str, Any]:
    for m in manifests:
        if m.get("kind") == kind and m["metadata"]["name"].endswith(name_suffix):
            return m["spec"]["template"]["spec"]["containers"][0]
    raise RuntimeError(f"the chart rendered no {kind} named *{name_suffix}")


def _resolve_env(cluster: LocalCluster, namespace: str, env: list[dict[str, Any]]) -> dict[str, str]:
    """The container's environment with secretKeyRef values read from the cluster."""
    out: dict[str, str] = {}
    for e in env:
        if "value" in e:
            out[e["name"]] = str(e["value"])
            continue
        ref = (e.get("valueFrom") or {}).get("secretKeyRef")
        if ref:
            secret = json.loads(cluster.kubectl("get", "secret", ref["name"], "-n", namespace, "-o", "json").stdout)
            out[e["name"]] = base64.b64decode(secret["data"][ref["key"]]).decode()
    return out


@dataclass
class HostProcess:
    """One control-plane process on the host, with its log and its /proc readings."""

    name: str
    popen: subprocess.Popen
    log_path: Path

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def cpu_seconds(self) -> float:
        t = psutil.Process(self.pid).cpu_times()
        return t.user + t.system

    def peak_rss_bytes(self) -> int:
        """VmHWM: the most resident memory the process ever had."""
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
        return 0

    def rss_bytes(self) -> int:
        return psutil.Process(self.pid).memory_info().rss

    def log_lines(self) -> int:
        with self.log_path.open("rb") as f:
            return sum(chunk.count(b"\n") for chunk in iter(lambda: f.read(1 << 20), b""))

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20.0) -> None:
        if not self.alive():
            return
        self.popen.send_signal(sig)
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait(5)


def _spawn(name: str, cmd: list[str], env: dict[str, str], log_dir: Path) -> HostProcess:
    log_path = log_dir / f"{name}.log"
    logf = log_path.open("ab")
    proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                            start_new_session=True)
    logf.close()
    return HostProcess(name=name, popen=proc, log_path=log_path)


def start_operator(cluster: LocalCluster, manifests: list[dict[str, Any]], kubeconfig: Path, log_dir: Path,
                   name: str = "operator", extra_env: dict[str, str] | None = None) -> tuple[HostProcess, int]:
    """The chart's operator container as a host process; returns it and its metrics port."""
    c = _container(manifests, "Deployment", "-operator")
    env = {**os.environ, **_resolve_env(cluster, RELEASE_NS, c.get("env") or []), "KUBECONFIG": str(kubeconfig),
           "HOSTNAME": name, **(extra_env or {})}
    port = free_port()
    env["VIVANT_OPERATOR_METRICS_PORT"] = str(port)
    args = [a if not a.startswith("--liveness=") else f"--liveness=http://127.0.0.1:{free_port()}/healthz"
            for a in c.get("args") or []]
    cmd = [sys.executable, "-m", "vivant.bench.fleet.operator_host", *args]
    return _spawn(name, cmd, env, log_dir), port


def start_gateway(cluster: LocalCluster, kubeconfig: Path, namespace: str, avatars: dict[str, dict[str, str]],
                  api_key: str, log_dir: Path) -> tuple[HostProcess, str]:
    """`vivant api` (the session API) serving `namespace` under the chart's API ServiceAccount."""
    avatars_file = log_dir / "avatars.yaml"
    avatars_file.write_text(yaml.safe_dump({"avatars": avatars, "defaultMaxDurationS": 86_400}))
    env = {**os.environ, "KUBECONFIG": str(kubeconfig), "VIVANT_API_KEYS": api_key}
    for _attempt in range(3):  # a free port may be taken by another process before the server binds it
        port = free_port()
        cmd = [sys.executable, "-m", "vivant.cli", "api", "--host", "127.0.0.1", "--port", str(port),
               "--namespace", namespace, "--avatars", str(avatars_file)]
        proc, url = _spawn("gateway", cmd, env, log_dir), f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while proc.alive() and time.monotonic() < deadline:
            if _healthy(url):
                return proc, url
            time.sleep(0.5)
        proc.stop()
    raise RuntimeError(f"the session API did not start; see {log_dir / 'gateway.log'}")


def _healthy(url: str) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(f"{url}/healthz", timeout=2) as resp:
            return resp.status == 200
    except OSError:
        return False


def start_sim_workers(cluster: LocalCluster, namespace: str, status_file: Path, log_dir: Path,
                      heartbeat_ttl_s: float, warmup_s: float, real_workers: bool = False) -> HostProcess:
    assert cluster.state is not None and cluster.state.redis_url
    cmd = [sys.executable, "-m", "vivant.bench.fleet.sim_workers", "--kubeconfig", str(cluster.kubeconfig),
           "--namespace", namespace, "--redis-url", cluster.state.redis_url, "--status-file", str(status_file),
           "--heartbeat-ttl-s", str(heartbeat_ttl_s), "--warmup-s", str(warmup_s)]
    if real_workers:
        cmd.append("--real-workers")
    return _spawn("sim-workers", cmd, dict(os.environ), log_dir)


@dataclass
class OperatorSet:
    """The operator replicas of a run (one, or several with kopf peering). Readings of a replica are kept
    when it dies, so a phase's totals include what a killed replica did before it went."""

    procs: list[HostProcess]
    ports: list[int]
    cpu: dict[str, float] = field(default_factory=dict)
    hwm: dict[str, int] = field(default_factory=dict)
    redis: dict[str, dict[str, float]] = field(default_factory=dict)
    handlers: dict[str, dict[str, float]] = field(default_factory=dict)  # replica -> handler_{sum,count}
    runs: dict[str, dict[str, float]] = field(default_factory=dict)  # replica -> event handler -> runs

    def read(self) -> None:
        for p, port in zip(self.procs, self.ports, strict=True):
            if not p.alive():
                continue
            try:
                self.cpu[p.name] = p.cpu_seconds()
                self.hwm[p.name] = p.peak_rss_bytes()
                metrics = operator_metrics(port)
                self.redis[p.name] = {k.split("command=", 1)[1].rstrip("}"): v for k, v in metrics.items()
                                      if k.startswith("vivant_bench_operator_redis_commands_total")}
                self.handlers[p.name] = {
                    f"{k.split('handler=', 1)[1].rstrip('}')}_{k.split('{')[0].rsplit('_', 1)[1]}": v
                    for k, v in metrics.items()
                    if k.startswith(("vivant_operator_reconcile_duration_seconds_sum",
                                     "vivant_operator_reconcile_duration_seconds_count"))}
                self.runs[p.name] = {k.split("handler=", 1)[1].rstrip("}"): v for k, v in metrics.items()
                                     if k.startswith("vivant_operator_handler_runs_total")}
            except (OSError, psutil.Error):
                pass  # it died between the check and the reading: its last reading stands

    def cpu_seconds(self) -> float:
        return sum(self.cpu.values())

    def peak_rss_bytes(self) -> int:
        return max(self.hwm.values(), default=0)

    def redis_commands(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for counts in self.redis.values():
            for k, v in counts.items():
                out[k] = out.get(k, 0.0) + v
        return out

    def log_lines(self) -> int:
        return sum(p.log_lines() for p in self.procs)

    def handler_means(self) -> dict[str, dict[str, float]]:
        """Per handler (the operator's own reconcile_duration histogram, all replicas): runs and mean seconds.
        Empty for an operator that does not export it."""
        total: dict[str, float] = {}
        for h in self.handlers.values():
            for k, v in h.items():
                total[k] = total.get(k, 0.0) + v
        names = {k.rsplit("_", 1)[0] for k in total}
        return {n: {"runs": int(total.get(f"{n}_count", 0)),
                    "mean_s": round(total.get(f"{n}_sum", 0) / max(1, total.get(f"{n}_count", 0)), 4)}
                for n in sorted(names)}

    def handler_runs(self) -> dict[str, int]:
        """Runs per event handler (session_create, session_resume), all replicas."""
        out: dict[str, int] = {}
        for runs in self.runs.values():
            for k, v in runs.items():
                out[k] = out.get(k, 0) + int(v)
        return out

    def stop(self) -> None:
        for p in self.procs:
            p.stop()


def apply_peering(cluster: LocalCluster) -> None:
    """kopf's peering CRDs and the cluster-wide peering object the replicas meet in ("default")."""
    cluster.kubectl("apply", "-f", str(PEERING_CRDS))
    cluster.kubectl("wait", "--for=condition=established", "--timeout=60s", "crd/clusterkopfpeerings.kopf.dev")
    cluster.kubectl_apply({"apiVersion": "kopf.dev/v1", "kind": "ClusterKopfPeering", "metadata": {"name": "default"}})


def operator_metrics(port: int) -> dict[str, float]:
    """The operator's /metrics as {series name with labels: value} (only the series the report uses)."""
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name.startswith(("vivant_bench_operator_redis_commands_total", "vivant_operator_")):
                label = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
                out[f"{s.name}{{{label}}}"] = s.value
    return out
