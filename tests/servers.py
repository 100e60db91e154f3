"""Real servers the tests start on loopback, importable by any test module (`from servers import ...`).

They live here rather than in conftest.py: several folders have a conftest.py of their own, and
`from conftest import X` inside a test resolves to whichever conftest pytest imported last.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

from vivant.ports import free_port


class RedisServer:
    """A redis-server child process on 127.0.0.1:port. No persistence by default; with `data_dir` it
    keeps an append-only file there (fsync'd on every write), so `stop()` + `start()` is an outage that
    loses nothing, and `start(empty=True)` a restart that lost everything."""

    def __init__(self, data_dir: Path | None = None) -> None:
        if shutil.which("redis-server") is None:
            raise RuntimeError("redis-server not found: run `make sysdeps` (Debian package redis-server)")
        self.port = free_port()
        self.data_dir = data_dir
        self.proc = self._spawn()
        self._wait_ready()

    def _spawn(self) -> subprocess.Popen:
        args = [shutil.which("redis-server"), "--port", str(self.port), "--bind", "127.0.0.1", "--save", ""]
        if self.data_dir is None:
            args += ["--appendonly", "no"]
        else:
            self.data_dir.mkdir(parents=True, exist_ok=True)
            args += ["--appendonly", "yes", "--appendfsync", "always", "--dir", str(self.data_dir)]
        return subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def _wait_ready(self, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"redis-server on port {self.port} did not answer PING within {timeout}s")

    def stop(self, *, kill: bool = False) -> None:
        """Stop the server: SIGTERM (it shuts down cleanly), or with `kill` SIGKILL (a crash: nothing is
        written after the signal, so only what it fsync'd survives)."""
        if self.proc.poll() is None and kill:
            self.proc.kill()
            self.proc.wait(timeout=5)
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()

    def start(self, *, empty: bool = False) -> None:
        """Start again on the same port after `stop()` (a Redis outage, for resilience tests); `empty`
        drops the persisted data first (a Redis that came back with nothing)."""
        if self.proc.poll() is None:
            return
        if empty and self.data_dir is not None:
            shutil.rmtree(self.data_dir)
        self.proc = self._spawn()
        self._wait_ready()
