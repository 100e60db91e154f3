"""A real `vivant worker` process for the runtime tests, driven as the operator drives one: through Redis.

`WorkerProcess` starts `python -m vivant worker --pool … --device cpu --preset tiny …` (its N + 1 ranks are its
own children), waits until it is registered warm and idle, claims it for a session and sends the assignment
(`Registry.claim_idle_worker` + `send_assignment`, what operator/reconcile.py does), ends sessions with the
operator's EndRequest, and reads the ranks' pids from the worker's log (`rank r (role, cpu) started: pid N`).
Everything is real: Redis (tests/conftest.py), the worker, its spawned ranks, gloo on loopback.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
from polling import wait_for
from vivant.sessions.models import Assignment, SessionStats
from vivant.sessions.registry import Registry

POOL = "ns/gpu-pool"


def overflowing_checkpoint(folder: Path) -> Path:
    """A tiny checkpoint that loads (finite values, checksum recorded) but whose output projection overflows float32:
    every chunk's latents are Inf/NaN, the numerical fault a diverged or badly quantized model shows."""
    import torch
    from vivant.worker.model.config import ModelConfig
    from vivant.worker.model.model import VideoDiT, init_random_
    from vivant.worker.model.weights import save_weights

    model = init_random_(VideoDiT(ModelConfig.from_name("tiny")), seed=0)
    with torch.no_grad():
        model.out.weight.fill_(3e38)
    path = folder / "overflowing-tiny.safetensors"
    save_weights(model, path)
    return path


def assignment(session_id: str, **over: object) -> Assignment:
    """What the operator sends a worker (sessions/models.py); `over` replaces fields (validated)."""
    body: dict = dict(session_id=session_id, namespace="ns", pool=POOL, character="ada", room="room-1",
                      livekit_url="wss://lk.example", agent_identity="agent-1", token="tok-secret", seed=3,
                      max_duration_s=120.0)
    return Assignment(**{**body, **over})


class WorkerProcess:
    def __init__(self, redis_url: str, out: Path, *args: str, worker_id: str = "worker-0", tp: int = 1) -> None:
        self.redis_url, self.out, self.worker_id, self.tp = redis_url, out, worker_id, tp
        self.registry = Registry(redis_url)
        self.log_path = out / f"{worker_id}.log"
        out.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "w")  # noqa: SIM115 (closed in stop)
        cmd = [sys.executable, "-m", "vivant", "worker", "--pool", POOL, "--worker-id", worker_id,
               "--redis", redis_url, "--tensor-parallel", str(tp), "--device", "cpu", "--preset", "tiny",
               "--out", str(out), *args]
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env={**os.environ})

    # ---- the worker's life ------------------------------------------------------------------------------
    def log(self) -> str:
        return self.log_path.read_text()

    def wait_idle(self, timeout: float = 150.0) -> WorkerProcess:
        def idle():
            if self.proc.poll() is not None:
                raise AssertionError(f"the worker exited ({self.proc.returncode}) before it was idle:\n{self.log()}")
            return self.registry.idle_workers(POOL) == [self.worker_id]

        wait_for(f"{self.worker_id} warm and idle", idle, timeout, every=0.2)
        return self

    def idle_again(self, timeout: float = 15.0) -> list[str]:
        """The pool's idle workers once this one is idle again (after a session), or what they are at the timeout."""
        try:
            wait_for("idle again", lambda: self.registry.idle_workers(POOL) == [self.worker_id], timeout, every=0.1)
        except AssertionError:
            pass
        return self.registry.idle_workers(POOL)

    def rank_pids(self) -> dict[int, int]:
        return {int(r): int(p) for r, p in re.findall(r"rank (\d+) \(\w+, cpu\) started: pid (\d+)", self.log())}

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
            raise AssertionError(f"the worker did not stop within {timeout}s:\n{self.log()}") from None
        finally:
            self._log.close()
        return self.proc.returncode

    # ---- sessions, as the operator runs them ------------------------------------------------------------
    def assign(self, session_id: str, **kw) -> Assignment:
        a = assignment(session_id, **kw)
        assert self.registry.claim_idle_worker(POOL, session_id) == self.worker_id, "the worker was not claimable"
        self.registry.send_assignment(self.worker_id, a)
        return a

    def stats(self, session_id: str) -> SessionStats | None:
        return self.registry.session_stats(session_id)

    def streaming(self, session_id: str, chunks: int, timeout: float = 90.0) -> SessionStats:
        """Wait until the session reported at least `chunks` chunks (stats are reported once a second)."""
        return wait_for(f"{session_id}: {chunks} chunks",
                        lambda: (s := self.stats(session_id)) and s.phase == "Streaming" and s.chunks >= chunks and s,
                        timeout, every=0.1)

    def ended(self, session_id: str, timeout: float = 60.0) -> SessionStats:
        return wait_for(f"{session_id} ended", lambda: (s := self.stats(session_id)) and s.phase in ("Ended", "Failed")
                        and s, timeout, every=0.05)

    def end(self, session_id: str, reason: str = "Deleted") -> SessionStats:
        self.registry.send_end(self.worker_id, session_id, reason)
        return self.ended(session_id)

    def assert_released(self, session_id: str) -> None:
        wait_for(f"{session_id}'s lease released", lambda: self.registry.worker_of(session_id) is None, 10)
        assert self.registry.session_of(POOL, self.worker_id) is None, "the worker still holds a lease"

    # ---- what the ranks kept under --out ----------------------------------------------------------------
    def folder(self, session_id: str) -> Path:
        return self.out / session_id.replace("/", "_")

    def trace(self, session_id: str, rank: int) -> list[dict]:
        path = self.folder(session_id) / f"rank{rank}.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()]

    def latents(self, session_id: str) -> np.ndarray:
        files = sorted((self.folder(session_id) / "latents").glob("chunk_*.npy"))
        return np.stack([np.load(f) for f in files])
