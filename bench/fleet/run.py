"""`vivant bench fleet`: the control plane at fleet scale, on a local cluster with simulated GPU workers.

Starts a local cluster (devcluster: real etcd, kube-apiserver, controller-manager, scheduler; kwok
H200 nodes; no pod runner), installs the Helm chart's RBAC and runs its operator and session API as
host processes (control_plane.py), starts a simulated worker per worker pod (sim_workers.py), and
then, as users would (driver.py):
  burst  create `--sessions` CharacterSessions in bursts of `--burst` (a share through the session API)
         and wait until all stream;
  hold   keep them for `--hold-s` seconds, ending and replacing `--churn` of them a minute;
  delete end them all and wait until every object is gone; then look for leases left in Redis.
Reports apply → Assigned / Streaming latencies (p50/p99/max), delete → gone, worker report →
visible on the object; operator CPU per session-minute, cores and peak RSS; API requests/s the
operator caused (the API server's own count, by FlowSchema); Redis commands/s (all, the operator's,
the simulated workers'); operator log lines/s; double assignments and leaked leases (both must be 0);
the machine's load average during each phase (the machine may be shared). JSON under bench/results/.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import kubernetes
import redis
from vivant.apis import resources
from vivant.apis.livekit_token import LiveKitCredentials
from vivant.bench.fleet import control_plane as cp
from vivant.bench.fleet import report
from vivant.bench.fleet.driver import Driver
from vivant.bench.fleet.probes import (
    LoadSampler,
    Sample,
    cpu_by_process,
    machine_busy_seconds,
    phase_rates,
    read_fleet_status,
    redis_commandstats,
)
from vivant.devcluster.cluster import (
    DEV_API_KEY,
    DEV_LIVEKIT_KEY,
    DEV_LIVEKIT_SECRET,
    ClusterSpec,
    LocalCluster,
    NodePoolSpec,
    Taint,
)

NAMESPACE = "fleet"
RESULTS = Path(__file__).resolve().parents[1] / "results"
H200_LABELS = (("nvidia.com/gpu.product", "NVIDIA-H200"), ("nvidia.com/gpu.present", "true"),
               ("vivant.dev/node-pool", "h200"))


@dataclass(frozen=True)
class FleetBenchConfig:
    """One benchmark run. Times in seconds; `churn` is the share of sessions ended and replaced per minute."""

    sessions: int = 1000
    pools: int = 5
    headroom: float = 0.1  # spare warm workers per pool, as a share of its sessions
    gpus_per_node: int = 8
    gpus_per_worker: int = 5
    burst: int = 100
    burst_gap_s: float = 1.0
    hold_s: float = 120.0
    churn: float = 0.10
    churn_tick_s: float = 6.0
    api_share: float = 0.05
    warmup_s: float = 2.0
    heartbeat_ttl_s: float = 10.0
    converge_timeout_s: float = 600.0
    delete_timeout_s: float = 300.0
    operators: int = 1  # operator replicas; more than one run with kopf peering
    kill_active_at_s: float | None = None  # SIGKILL the active replica this far into the hold (failover)
    peering_lifetime_s: int = 15  # how long a dead replica's peering record holds the others back
    label: str = "run"
    real_workers: bool = False  # the real WorkerService per pod, null engine (sim_workers --real-workers)

    def __post_init__(self) -> None:
        checks = [
            ("sessions", self.sessions >= 1, "an integer >= 1"),
            ("pools", 1 <= self.pools <= 64, "1..64"),
            ("headroom", 0 <= self.headroom <= 1, "0..1"),
            ("gpus_per_worker", 2 <= self.gpus_per_worker <= 16, "2..16 (WorkerPool gpusPerWorker)"),
            ("gpus_per_node", self.gpus_per_node >= self.gpus_per_worker, ">= gpus_per_worker"),
            ("burst", self.burst >= 1, ">= 1"),
            ("burst_gap_s", self.burst_gap_s >= 0, ">= 0"),
            ("hold_s", self.hold_s >= 0, ">= 0"),
            ("churn", 0 <= self.churn <= 1, "0..1 (share per minute)"),
            ("churn_tick_s", self.churn_tick_s > 0, "> 0"),
            ("api_share", 0 <= self.api_share <= 1, "0..1"),
            ("operators", 1 <= self.operators <= 5, "1..5 (the chart's operator.replicas bound)"),
            ("peering_lifetime_s", 5 <= self.peering_lifetime_s <= 600, "5..600 (VIVANT_PEERING_LIFETIME_S)"),
            ("kill_active_at_s", self.kill_active_at_s is None or (self.operators > 1 and 0 <= self.kill_active_at_s
                                                                   <= self.hold_s),
             "a time within the hold, and operators >= 2 (someone must take over)"),
            ("label", bool(self.label) and all(c.isalnum() or c in "-_." for c in self.label),
             "letters, digits, - _ ."),
        ]
        for name, ok, expected in checks:
            if not ok:
                raise ValueError(f"{name}: expected {expected}, got {getattr(self, name)!r}")
        if self.workers_per_pool > 256:
            raise ValueError(f"pools: {self.pools} pools need {self.workers_per_pool} workers each for "
                             f"{self.sessions} sessions, over WorkerPool maxWorkers' bound of 256; use more pools")

    @property
    def workers_per_pool(self) -> int:
        return math.ceil(self.sessions * (1 + self.headroom) / self.pools)

    @property
    def workers(self) -> int:
        return self.workers_per_pool * self.pools

    @property
    def nodes(self) -> int:
        return math.ceil(self.workers / (self.gpus_per_node // self.gpus_per_worker))


def pool_manifest(name: str, cfg: FleetBenchConfig) -> dict[str, Any]:
    return {
        "apiVersion": resources.API_VERSION, "kind": resources.POOL_KIND, "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": {"model": {"preset": "57b", "checkpoint": "/models/vivant-57b"},
                 "image": "ghcr.io/vivant-dev/vivant-worker:0.1.0", "gpusPerWorker": cfg.gpus_per_worker,
                 "tensorParallel": 4 if (cfg.gpus_per_worker - 1) % 4 == 0 else 1,
                 "minIdle": cfg.workers_per_pool, "maxWorkers": cfg.workers_per_pool,
                 "nodeSelector": {"vivant.dev/node-pool": "h200"},
                 # the GPU taint, as a real pool; and no eviction when a kwok node misses its lease on a
                 # loaded machine (the benchmark measures the control plane, not simulated node failures)
                 "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
                                 {"key": "node.kubernetes.io/unreachable", "operator": "Exists",
                                  "effect": "NoExecute"},
                                 {"key": "node.kubernetes.io/not-ready", "operator": "Exists",
                                  "effect": "NoExecute"}]},
    }


def _wait(check, what: str, timeout: float, period: float = 1.0, log=print) -> float:  # noqa: ANN001
    t0 = time.monotonic()
    last = None
    while time.monotonic() - t0 < timeout:
        last = check()
        if last is True:
            return time.monotonic() - t0
        time.sleep(period)
    log(f"  timed out after {timeout:.0f}s waiting for {what} (last: {last})")
    return float("nan")


class Bench:
    def __init__(self, cfg: FleetBenchConfig, state_dir: Path, log=print) -> None:  # noqa: ANN001
        self.cfg, self.state_dir, self.log = cfg, state_dir, log
        self.procs: list[cp.HostProcess] = []
        self.samples: dict[str, Sample] = {}
        self.killed_at: float | None = None
        self.load = LoadSampler()

    # -- setup -------------------------------------------------------------------------------------
    def setup(self) -> None:
        cfg = self.cfg
        self.log(f"cluster: {cfg.nodes} kwok H200 nodes x {cfg.gpus_per_node} GPUs, {cfg.pools} pools x "
                 f"{cfg.workers_per_pool} workers")
        spec = ClusterSpec(state_dir=self.state_dir / "cluster",
                           node_pool=NodePoolSpec(nodes=cfg.nodes, gpus_per_node=cfg.gpus_per_node,
                                                  name_prefix="h200", labels=H200_LABELS,
                                                  taints=(Taint("nvidia.com/gpu", "present", "NoSchedule"),)),
                           run_pods=False, redis=True, secret_namespaces=("default", cp.RELEASE_NS, NAMESPACE))
        self.cluster = LocalCluster(spec, log=self.log)
        t0 = time.monotonic()
        self.cluster.up(timeout=600)
        self.cluster_up_s = time.monotonic() - t0
        assert self.cluster.state is not None and self.cluster.state.redis_url
        self.redis = redis.Redis.from_url(self.cluster.state.redis_url)
        self.logs = self.state_dir / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.manifests = cp.install_chart(self.cluster, NAMESPACE, peering=cfg.operators > 1)
        cp.apply_flow_schema(self.cluster)
        op_kc = cp.service_account_kubeconfig(self.cluster, cp.RELEASE_NS, cp.OPERATOR_SA, self.logs / "operator.kubeconfig")
        api_kc = cp.service_account_kubeconfig(self.cluster, cp.RELEASE_NS, cp.API_SA, self.logs / "api.kubeconfig")
        self.fleet_status = self.logs / "sim-workers.json"
        self.fleet = cp.start_sim_workers(self.cluster, NAMESPACE, self.fleet_status, self.logs, cfg.heartbeat_ttl_s,
                                          cfg.warmup_s, real_workers=cfg.real_workers)
        self.procs.append(self.fleet)
        # replica i has priority 1000 - i: the first is the active one, the others wait (kopf peering)
        started = [cp.start_operator(self.cluster, self.manifests, op_kc, self.logs, name=f"operator-{i}",
                                     extra_env={"VIVANT_OPERATOR_PRIORITY": str(1000 - i),
                                                "VIVANT_PEERING_LIFETIME_S": str(cfg.peering_lifetime_s)})
                   for i in range(cfg.operators)]
        self.operators = cp.OperatorSet(procs=[p for p, _ in started], ports=[port for _, port in started])
        self.procs.extend(self.operators.procs)
        pools = [f"pool-{i}" for i in range(cfg.pools)]
        self.gateway, gw_url = cp.start_gateway(self.cluster, api_kc, NAMESPACE,
                                                {f"ada-{p}": {"character": "ada", "pool": p} for p in pools},
                                                DEV_API_KEY, self.logs)
        self.procs.append(self.gateway)
        admin = kubernetes.config.new_client_from_config(config_file=str(self.cluster.kubeconfig))
        admin.configuration.connection_pool_maxsize = 32
        self.driver = Driver(admin, NAMESPACE, pools, gw_url, DEV_API_KEY,
                             LiveKitCredentials(DEV_LIVEKIT_KEY, DEV_LIVEKIT_SECRET))
        self.driver.watch.start()
        self.load.start()
        for p in pools:
            self.cluster.kubectl_apply(pool_manifest(p, cfg))
        self.warm_s = _wait(lambda: self._fleet_idle() >= cfg.workers or f"{self._fleet_idle()} warm",
                            "all workers warm", 900, 2.0, self.log)
        self.log(f"  {self._fleet_idle()} simulated workers warm after {self.warm_s:.0f}s")

    def _fleet_idle(self) -> int:
        return int(read_fleet_status(self.fleet_status).get("states", {}).get("idle", 0))

    # -- readings ----------------------------------------------------------------------------------
    def sample(self, name: str) -> Sample:
        api = cp.apiserver_sample(self.cluster)
        fleet = read_fleet_status(self.fleet_status)
        ops = self.operators
        ops.read()
        s = Sample(
            at=time.time(), operator_cpu_s=ops.cpu_seconds(), operator_rss_bytes=ops.peak_rss_bytes(),
            operator_requests=api.operator_requests, operator_rejected=api.operator_rejected,
            operator_apf_wait_s=api.operator_wait_s, apiserver_requests=api.all_requests,
            redis_calls=redis_commandstats(self.redis), operator_redis=ops.redis_commands(),
            fleet_redis=fleet.get("redis_commands", {}), fleet_calls=fleet.get("registry_calls", {}),
            operator_log_lines=ops.log_lines(),
            fleet={k: fleet.get(k) for k in ("workers", "states", "active_sessions", "counters")},
            cpu_by_process=cpu_by_process({p.pid: p.name for p in self.procs}),
            machine_busy_s=machine_busy_seconds(),
        )
        self.samples[name] = s
        return s

    # -- phases ------------------------------------------------------------------------------------
    def burst(self) -> None:
        cfg, d = self.cfg, self.driver
        self.log(f"burst: {cfg.sessions} sessions in bursts of {cfg.burst} every {cfg.burst_gap_s}s "
                 f"({cfg.api_share:.0%} through the session API)")
        left = cfg.sessions
        while left > 0:
            n = min(cfg.burst, left)
            d.create(n, "burst", cfg.api_share)
            left -= n
            if left:
                time.sleep(cfg.burst_gap_s)
        settled = ("Streaming", "Failed", "Ended")
        self.converge_s = _wait(lambda: d.count(lambda x: any(p in x.phases for p in settled)) >= len(d.records)
                                or f"{d.count(lambda x: 'Streaming' in x.phases)}/{len(d.records)} streaming",
                                "every session streaming", cfg.converge_timeout_s, 1.0, self.log)
        self.log(f"  {d.count(lambda x: 'Streaming' in x.phases)}/{len(d.records)} streaming")

    def hold(self) -> None:
        cfg, d = self.cfg, self.driver
        per_tick = cfg.churn * cfg.sessions * cfg.churn_tick_s / 60
        self.log(f"hold: {cfg.hold_s:.0f}s, churn {cfg.churn:.0%}/min ({per_tick:.1f} sessions every "
                 f"{cfg.churn_tick_s:.0f}s)")
        t0 = time.monotonic()
        t_end = t0 + cfg.hold_s
        owed = 0.0
        while time.monotonic() < t_end:
            tick = time.monotonic()
            if cfg.kill_active_at_s is not None and self.killed_at is None and tick - t0 >= cfg.kill_active_at_s:
                active = self.operators.procs[0]
                self.operators.read()  # its last readings count
                active.popen.send_signal(signal.SIGKILL)
                active.popen.wait(10)
                self.killed_at = time.time()
                self.log(f"  killed the active operator ({active.name}, pid {active.pid}) "
                         f"{tick - t0:.0f}s into the hold")
            owed += per_tick
            k = int(owed)
            owed -= k
            if k:
                d.end(d.live()[:k])
                d.create(k, "churn", cfg.api_share)
            time.sleep(max(0.0, min(t_end, tick + cfg.churn_tick_s) - time.monotonic()))

    def delete(self) -> None:
        d = self.driver
        live = d.live()
        self.log(f"delete: {len(live)} sessions")
        d.end(live)
        self.delete_s = _wait(lambda: d.count(lambda x: x.gone_at is None) == 0
                              or f"{d.count(lambda x: x.gone_at is None)} left", "every session gone",
                              self.cfg.delete_timeout_s, 1.0, self.log)

    def leaks(self) -> dict[str, Any]:
        """Leases Redis still holds once every session object is gone (must be none)."""
        busy = {}
        for i in range(self.cfg.pools):
            key = f"vivant:pool:{NAMESPACE}/pool-{i}:busy"
            held = {k.decode(): v.decode() for k, v in self.redis.hgetall(key).items()}
            if held:
                busy[f"{NAMESPACE}/pool-{i}"] = held
        sw = {k.decode(): v.decode() for k, v in self.redis.hgetall("vivant:session_worker").items()}
        return {"busy_leases": sum(len(v) for v in busy.values()), "busy": busy,
                "session_worker_entries": len(sw), "session_worker": dict(list(sw.items())[:20])}

    def teardown(self, keep: bool) -> None:
        if getattr(self, "driver", None) is not None:
            self.driver.watch.stop.set()
        for p in reversed(self.procs):
            p.stop()
        self.load.stop()
        if not keep and getattr(self, "cluster", None) is not None:
            self.cluster.down()


def log_levels(paths: list[Path]) -> dict[str, int]:
    """Lines of kopf logs by level ([INFO ], [ERROR ], ...)."""
    out: dict[str, int] = {}
    for path in paths:
        with path.open(errors="replace") as f:
            for line in f:
                for level in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
                    if f"[{level}" in line:
                        out[level] = out.get(level, 0) + 1
                        break
    return out


def handler_outcomes(paths: list[Path], handler: str) -> dict[str, int]:
    """kopf's log lines of one handler's runs by outcome ("Handler 'x' succeeded.", "... failed temporarily: ..."),
    a count that does not depend on the operator's own metrics (an older operator's run has none)."""
    out: dict[str, int] = {}
    mark = f"Handler '{handler}' "
    for path in paths:
        with path.open(errors="replace") as f:
            for line in f:
                if mark in line:
                    outcome = line.split(mark, 1)[1].split(":", 1)[0].strip().rstrip(".")
                    outcome = " ".join("N" if w.replace(".", "").isdigit() else w for w in outcome.split())
                    out[outcome] = out.get(outcome, 0) + 1
    return out


def peering_changes(path: Path) -> dict[str, Any]:
    """When a replica paused for a peer of higher priority and when it resumed (kopf's peering log lines,
    their timestamps as logged): a standby that resumes while the active replica lives is a peering flap."""
    out: dict[str, list[str]] = {"paused": [], "resumed": []}
    with path.open(errors="replace") as f:
        for line in f:
            if "Pausing operations in favour of" in line:
                out["paused"].append(line[1:24])
            elif "Resuming operations after the pause" in line:
                out["resumed"].append(line[1:24])
    return {"pauses": len(out["paused"]), "resumes": len(out["resumed"]), "resumed_at": out["resumed"][:20]}


def source_digest(folders: tuple[str, ...]) -> str:
    """sha256 (12 hex) of the operator's source as this checkout has it: which operator a result measured."""
    import hashlib

    h = hashlib.sha256()
    for folder in folders:
        for path in sorted((cp.REPO / folder).glob("*.py")):
            h.update(path.name.encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:12]


def versions(cluster: LocalCluster, client: redis.Redis) -> dict[str, Any]:
    import importlib.metadata as md

    kv = json.loads(cluster.kubectl("version", "-o", "json").stdout)
    commit = subprocess.run(["git", "-C", str(cp.REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    dirty = bool(subprocess.run(["git", "-C", str(cp.REPO), "status", "--porcelain", "--", "operator", "sessions",
                                 "bench", "apis", "gateway"], capture_output=True, text=True).stdout.strip())
    return {"operator_source_sha256": source_digest(("operator", "sessions")),
            "kube_apiserver": kv.get("serverVersion", {}).get("gitVersion"),
            "redis": client.info("server").get("redis_version"),
            "python": platform.python_version(), "kopf": md.version("kopf"), "kubernetes_client": md.version("kubernetes"),
            "redis_py": md.version("redis"), "git_commit": commit, "git_dirty": dirty}


def run_bench(cfg: FleetBenchConfig, state_dir: Path, keep: bool = False, log=print) -> dict[str, Any]:  # noqa: ANN001
    bench = Bench(cfg, state_dir, log)
    started = datetime.now(tz=UTC)
    try:
        bench.setup()
        ver = versions(bench.cluster, bench.redis)  # the checkout the processes started from, not the one at the end
        s0 = bench.sample("start")
        bench.burst()
        s1 = bench.sample("burst_end")
        bench.hold()
        s2 = bench.sample("hold_end")
        bench.delete()
        time.sleep(3.0)
        s3 = bench.sample("delete_end")
        leaks = bench.leaks()
        bench.operators.read()
        peak_rss = bench.operators.peak_rss_bytes()
        runs = bench.operators.handler_runs()
        bench.operators.stop()
        bench.gateway.stop()
        bench.fleet.stop(signal.SIGTERM)
        fleet = read_fleet_status(bench.fleet_status)
        live_burst = cfg.sessions  # at most; the hold keeps exactly cfg.sessions live
        phases = {
            "burst": {**phase_rates(s0, s1, live_burst / 2), "load": bench.load.between(s0.at, s1.at)},
            "hold": {**phase_rates(s1, s2, cfg.sessions), "load": bench.load.between(s1.at, s2.at)},
            "delete": {**phase_rates(s2, s3, cfg.sessions / 2), "load": bench.load.between(s2.at, s3.at)},
        }
        result = report.build(cfg=asdict(cfg), records=list(bench.driver.records.values()), fleet=fleet,
                              phases=phases, leaks=leaks, errors=bench.driver.errors, namespace=NAMESPACE)
        result.update({
            "bench": "fleet", "label": cfg.label, "date": started.isoformat(timespec="seconds"),
            "command": " ".join(["vivant", "bench", "fleet", *sys.argv[3:]]) if sys.argv[1:3] == ["bench", "fleet"]
            else " ".join(sys.argv),
            "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "node": platform.node(),
                        "niceness": os.nice(0),
                        "load_during_run": bench.load.between(s0.at, s3.at),
                        "load_samples": bench.load.samples,
                        "note": "shared development machine: other jobs ran beside the benchmark; see load"},
            "versions": ver,
            "setup": {"nodes": cfg.nodes, "workers": cfg.workers, "cluster_up_s": round(bench.cluster_up_s, 1),
                      "workers_warm_s": round(bench.warm_s, 1)},
            "operator": {"mode": "vivant operator (the chart's container args and env) as a host process, "
                                 "under the chart's operator ServiceAccount token",
                         "replicas": cfg.operators,
                         "handlers": bench.operators.handler_means(),
                         "event_handler_runs": runs,
                         # goal 1.0: kopf runs a session's create handler again only after a failure
                         "create_handler_runs_per_session": round(runs.get("session_create", 0)
                                                                  / max(1, len(bench.driver.records)), 3),
                         "peak_rss_mib": round(peak_rss / 2**20, 1),
                         "log_lines_by_level": log_levels([p.log_path for p in bench.operators.procs]),
                         "session_assign_runs_in_log": handler_outcomes([p.log_path for p in bench.operators.procs],
                                                                        "session_assign"),
                         "peering": {p.name: peering_changes(p.log_path) for p in bench.operators.procs}},
        })
        if bench.killed_at is not None:
            result["failover"] = report.failover(list(bench.driver.records.values()), bench.killed_at)
        return result
    finally:
        bench.teardown(keep)


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = FleetBenchConfig()
    p.add_argument("--sessions", type=int, default=d.sessions, help="concurrent CharacterSessions (default 1000)")
    p.add_argument("--pools", type=int, default=d.pools, help="WorkerPools the sessions spread over")
    p.add_argument("--headroom", type=float, default=d.headroom, help="spare warm workers per pool (share)")
    p.add_argument("--gpus-per-node", type=int, default=d.gpus_per_node)
    p.add_argument("--burst", type=int, default=d.burst, help="sessions created at once")
    p.add_argument("--burst-gap-s", type=float, default=d.burst_gap_s)
    p.add_argument("--hold-s", type=float, default=d.hold_s, help="seconds to hold them (with churn)")
    p.add_argument("--churn", type=float, default=d.churn, help="share ended and replaced per minute (0.1)")
    p.add_argument("--api-share", type=float, default=d.api_share, help="share created through the session API")
    p.add_argument("--warmup-s", type=float, default=d.warmup_s, help="simulated model load per worker")
    p.add_argument("--operators", type=int, default=d.operators, help="operator replicas (>1: kopf peering)")
    p.add_argument("--kill-active-at-s", type=float, default=None,
                   help="SIGKILL the active operator replica this many seconds into the hold")
    p.add_argument("--peering-lifetime-s", type=int, default=d.peering_lifetime_s,
                   help="kopf peering lifetime of the replicas (how long a dead one holds the others back)")
    p.add_argument("--label", default="run", help="names the result file, e.g. before / after")
    p.add_argument("--real-workers", action="store_true",
                   help="run the real WorkerService per worker pod with a null engine (a few hundred workers at "
                        "most on a small machine) instead of the asyncio simulation")
    p.add_argument("--state-dir", type=Path, default=None, help="cluster state (default: a temporary folder)")
    p.add_argument("--out", type=Path, default=None, help="JSON path (default bench/results/fleet_<label>_<n>.json)")
    p.add_argument("--keep", action="store_true", help="leave the cluster running")


def run(args: argparse.Namespace) -> int:
    import tempfile

    try:
        cfg = FleetBenchConfig(sessions=args.sessions, pools=args.pools, headroom=args.headroom,
                               gpus_per_node=args.gpus_per_node, burst=args.burst, burst_gap_s=args.burst_gap_s,
                               hold_s=args.hold_s, churn=args.churn, api_share=args.api_share,
                               warmup_s=args.warmup_s, operators=args.operators,
                               kill_active_at_s=args.kill_active_at_s, peering_lifetime_s=args.peering_lifetime_s,
                               label=args.label, real_workers=args.real_workers)
    except ValueError as exc:
        print(f"vivant bench fleet: {exc}")
        return 2
    state = args.state_dir or Path(tempfile.mkdtemp(prefix="vivant-fleet-"))
    # SIGTERM (and SIGINT, which a background job ignores) stop the run with its clean-up: processes, cluster
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    result = run_bench(cfg, state, keep=args.keep, log=lambda m: print(m, flush=True))
    out = args.out or RESULTS / f"fleet_{cfg.label}_{cfg.sessions}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(report.table(result))
    print(f"wrote {out}")
    return 0

