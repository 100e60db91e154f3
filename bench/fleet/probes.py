"""Readings the fleet benchmark takes at phase boundaries: one `Sample` of every counter it reports.

A phase's figures are the difference of two samples divided by the phase's length: operator CPU
seconds (/proc), requests the API server dispatched for the operator (its FlowSchema), Redis commands
(INFO commandstats: every client, Lua-internal calls included), the commands the operator process and
the simulated workers sent themselves (counted in each process), operator log lines; CPU seconds of
each process the benchmark started (etcd, kube-apiserver, kwok, the operator replicas, ...) and of the
whole machine, so a phase says which process its cores went to and how much went to other jobs. The
machine's load average is sampled every few seconds in a thread, because the benchmark shares its cores.
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil
import redis


@dataclass(frozen=True)
class Sample:
    at: float
    operator_cpu_s: float
    operator_rss_bytes: int
    operator_requests: float
    operator_rejected: float
    operator_apf_wait_s: float
    apiserver_requests: float
    redis_calls: dict[str, int]
    operator_redis: dict[str, float]
    fleet_redis: dict[str, int]
    fleet_calls: dict[str, int]
    operator_log_lines: int
    fleet: dict[str, Any] = field(default_factory=dict)
    cpu_by_process: dict[str, float] = field(default_factory=dict)  # CPU seconds so far, by process name
    machine_busy_s: float = 0.0  # CPU seconds the whole machine spent busy (all cores, all processes)


def cpu_by_process(names: dict[int, str]) -> dict[str, float]:
    """CPU seconds (user + system) of this process and every descendant, summed by name: `names[pid]`
    where given (the operator replicas, ...), else the executable's name (etcd, kube-apiserver, ...)."""
    me = psutil.Process()
    out: dict[str, float] = {}
    for proc in [me, *me.children(recursive=True)]:
        try:
            t = proc.cpu_times()
            name = names.get(proc.pid) or ("bench-driver" if proc.pid == me.pid else proc.name())
        except psutil.Error:  # ended between the listing and the reading
            continue
        out[name] = out.get(name, 0.0) + t.user + t.system
    return out


def machine_busy_seconds() -> float:
    """CPU seconds all cores spent on anything but idle and I/O wait since boot."""
    t = psutil.cpu_times()
    return sum(t) - t.idle - getattr(t, "iowait", 0.0)


def redis_commandstats(client: redis.Redis) -> dict[str, int]:
    """INFO commandstats as {command: calls}."""
    out: dict[str, int] = {}
    for key, value in client.info("commandstats").items():
        name = key.removeprefix("cmdstat_")
        out[name] = int(value["calls"]) if isinstance(value, dict) else 0
    return out


def read_fleet_status(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def delta(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
    return {k: b.get(k, 0) - a.get(k, 0) for k in sorted(set(a) | set(b)) if b.get(k, 0) - a.get(k, 0)}


def phase_rates(a: Sample, b: Sample, sessions: float) -> dict[str, Any]:
    """Per-second rates and totals between two samples; `sessions` = mean live sessions in the phase."""
    secs = max(1e-9, b.at - a.at)
    cpu = b.operator_cpu_s - a.operator_cpu_s
    redis_all = delta(a.redis_calls, b.redis_calls)
    op_redis = delta(a.operator_redis, b.operator_redis)
    fleet_redis = delta(a.fleet_redis, b.fleet_redis)
    top = sorted(redis_all.items(), key=lambda kv: -kv[1])[:12]
    return {
        "seconds": round(secs, 2),
        "operator_cpu_s": round(cpu, 2),
        "operator_cpu_cores": round(cpu / secs, 3),
        "operator_cpu_s_per_session_minute": round(cpu / (sessions * secs / 60), 5) if sessions else None,
        "operator_api_requests_per_s": round((b.operator_requests - a.operator_requests) / secs, 2),
        "operator_api_rejected_429": int(b.operator_rejected - a.operator_rejected),
        "operator_api_mean_apf_wait_s": round((b.operator_apf_wait_s - a.operator_apf_wait_s)
                                              / max(1.0, b.operator_requests - a.operator_requests), 4),
        "apiserver_requests_per_s_all_clients": round((b.apiserver_requests - a.apiserver_requests) / secs, 2),
        "redis_commands_per_s_all": round(sum(redis_all.values()) / secs, 1),
        "redis_commands_per_s_operator": round(sum(op_redis.values()) / secs, 1),
        "redis_commands_per_s_sim_workers": round(sum(fleet_redis.values()) / secs, 1),
        "redis_top_commands_per_s": {k: round(v / secs, 1) for k, v in top},
        "operator_redis_commands_per_s": {k: round(v / secs, 1) for k, v in
                                          sorted(op_redis.items(), key=lambda kv: -kv[1])},
        "operator_log_lines_per_s": round((b.operator_log_lines - a.operator_log_lines) / secs, 2),
        "mean_live_sessions": round(sessions, 1),
        "machine_busy_cores": round((b.machine_busy_s - a.machine_busy_s) / secs, 2),
        # a process that ended within the phase (a killed replica) is left out: its last reading is gone
        "cores_by_process": {k: round((v - a.cpu_by_process.get(k, 0.0)) / secs, 3)
                             for k, v in sorted(b.cpu_by_process.items(), key=lambda kv: kv[1] - a.cpu_by_process.get(kv[0], 0.0),
                                                reverse=True)},
    }


class LoadSampler:
    """os.getloadavg() every `period_s` in a thread: [(t, 1-min, 5-min, 15-min)]."""

    def __init__(self, period_s: float = 5.0) -> None:
        self.period_s = period_s
        self.samples: list[tuple[float, float, float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="loadavg", daemon=True)

    def _run(self) -> None:
        while True:
            self.samples.append((time.time(), *os.getloadavg()))
            if self._stop.wait(self.period_s):
                return

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self.period_s + 1)

    def between(self, t0: float, t1: float) -> dict[str, float] | None:
        one = [s[1] for s in self.samples if t0 <= s[0] <= t1]
        if not one:
            return None
        return {"min_1m": round(min(one), 2), "mean_1m": round(sum(one) / len(one), 2), "max_1m": round(max(one), 2)}


def as_dict(s: Sample) -> dict[str, Any]:
    return asdict(s)
