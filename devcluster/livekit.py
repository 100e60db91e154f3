"""A real LiveKit server on loopback: `vivant dev livekit up|down|status` and the tests' `livekit_server`.

The server is `livekit-server` built from `tools/livekit/go.mod` (devcluster/binaries.py). It listens
on 127.0.0.1 only: signalling/API on `port`, ICE over TCP on `tcp_port` and over one UDP mux port, with
loopback ICE candidates on, no STUN servers (no external IP discovery), no TURN. API key and secret
are generated per server unless given (the local cluster passes the credentials of its Secret
`vivant-livekit`, so the operator's tokens are accepted).
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

import yaml
from vivant.devcluster.binaries import ensure_livekit_server
from vivant.ports import free_port


@dataclass
class LiveKitState:
    """What a running server's `livekit.json` records."""

    url: str  # ws://127.0.0.1:<port>
    http_url: str
    api_key: str
    api_secret: str
    pid: int
    ports: dict[str, int]

    def save(self, folder: Path) -> None:
        (folder / "livekit.json").write_text(json.dumps(asdict(self), indent=2))

    @classmethod
    def load(cls, folder: Path) -> LiveKitState | None:
        path = folder / "livekit.json"
        return cls(**json.loads(path.read_text())) if path.exists() else None


def config(port: int, tcp_port: int, udp_port: int, api_key: str, api_secret: str) -> dict:
    """livekit-server's YAML configuration for a loopback-only server."""
    return {
        "port": port,
        "bind_addresses": ["127.0.0.1"],
        "rtc": {
            "tcp_port": tcp_port,
            "udp_port": udp_port,
            "use_external_ip": False,
            "node_ip": "127.0.0.1",
            "enable_loopback_candidate": True,
            "stun_servers": [],
            "interfaces": {"includes": ["lo"]},
        },
        "turn": {"enabled": False},
        "keys": {api_key: api_secret},
        "room": {"auto_create": True, "empty_timeout": 30},
        "logging": {"level": "info", "json": False},
    }


class LocalLiveKit:
    """Start, inspect and stop one livekit-server whose state lives in `folder`."""

    def __init__(self, folder: Path, *, api_key: str | None = None, api_secret: str | None = None, log=print) -> None:
        self.dir = Path(folder).resolve()
        self.api_key = api_key or "vivant-" + secrets.token_hex(4)
        self.api_secret = api_secret or secrets.token_urlsafe(32)
        self.log = log
        self.state = LiveKitState.load(self.dir)

    def running(self) -> bool:
        if self.state is None:
            return False
        try:
            os.kill(self.state.pid, 0)
        except ProcessLookupError:
            return False
        return _ready(self.state.http_url)

    def up(self, timeout: float = 30.0) -> LiveKitState:
        if self.running():
            assert self.state is not None
            return self.state
        self.dir.mkdir(parents=True, exist_ok=True)
        ports = {"http": free_port(), "tcp": free_port(), "udp": free_port(socket.SOCK_DGRAM)}
        return self._start(ports, timeout)

    def restart(self, timeout: float = 30.0) -> LiveKitState:
        """Kill the running server (SIGKILL: every room and connection is lost, as in a crash) and start a new
        one on the same ports with the same keys, so clients can reconnect to the same URL."""
        if self.state is None:
            raise RuntimeError("livekit-server: restart of a server that is not running")
        ports = dict(self.state.ports)
        try:
            os.killpg(self.state.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        _reap(self.state.pid, 5.0)
        return self._start(ports, timeout)

    def _start(self, ports: dict[str, int], timeout: float) -> LiveKitState:
        binary = ensure_livekit_server(log=self.log)
        cfg = self.dir / "livekit.yaml"
        cfg.write_text(yaml.safe_dump(config(ports["http"], ports["tcp"], ports["udp"], self.api_key, self.api_secret)))
        cfg.chmod(0o600)
        with open(self.dir / "livekit-server.log", "ab") as out:
            proc = subprocess.Popen([str(binary), "--config", str(cfg)], stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True, cwd=self.dir)
        http = f"http://127.0.0.1:{ports['http']}"
        self.state = LiveKitState(url=f"ws://127.0.0.1:{ports['http']}", http_url=http, api_key=self.api_key,
                                  api_secret=self.api_secret, pid=proc.pid, ports=ports)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                tail = (self.dir / "livekit-server.log").read_text(errors="replace")[-3000:]
                raise RuntimeError(f"livekit-server exited with {proc.returncode}; its log ends:\n{tail}")
            if _ready(http):
                self.state.save(self.dir)
                return self.state
            time.sleep(0.1)
        self.down()
        raise RuntimeError(f"livekit-server did not answer on {http} within {timeout:.0f}s")

    def down(self) -> None:
        state = self.state or LiveKitState.load(self.dir)
        if state is not None:
            for sig, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 2.0)):
                try:
                    os.killpg(state.pid, sig)
                except ProcessLookupError:
                    break
                deadline = time.monotonic() + wait
                while time.monotonic() < deadline:
                    try:
                        if os.waitpid(state.pid, os.WNOHANG)[0] == state.pid:
                            break
                    except ChildProcessError:
                        pass
                    try:
                        os.kill(state.pid, 0)
                    except ProcessLookupError:
                        break
                    time.sleep(0.05)
                else:
                    continue
                break
        (self.dir / "livekit.json").unlink(missing_ok=True)
        self.state = None


def _reap(pid: int, wait: float) -> None:
    """Wait up to `wait` s for `pid` (our child or not) to be gone."""
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        try:
            if os.waitpid(pid, os.WNOHANG)[0] == pid:
                return
        except ChildProcessError:
            pass
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)


def _ready(http_url: str) -> bool:
    try:
        with urllib.request.urlopen(http_url, timeout=1) as r:
            return r.status == 200
    except OSError:
        return False
