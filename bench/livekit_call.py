"""call: the whole LiveKit call on this machine, measured at the receiving participant (MP4 + JSON + markdown).

    vivant bench call --seconds 60 --preset ref --out out/livekit     # `make demo-livekit` runs this

What runs, every part real and on loopback: a Redis (the session registry), a livekit-server
(devcluster/livekit.py), the session API in local mode (`vivant api --local`), one worker (`vivant worker
--runner livekit`: 1 DiT rank + the decoder rank, on the CPU), the example voice agent
(examples/livekit_agent/agent.py: livekit-agents + the published Runway avatar plugin pointed at the API,
espeak-ng TTS) registered with the server, and a "user" (bench/call_recorder.py) who joins the room, which
dispatches the agent to it. The agent speaks its scripted turns for `--seconds`, then ends the call (END_CALL);
the user records what arrives. Writes under `--out`: `call.mp4` (what the user received), `call.json` (the
measurement, the machine, versions, per-stage times) and `call.md` (the same as a short table).

Where the time goes: CPU seconds of each process of the call (psutil, children included) over the call, and
the DiT rank's diffusion time per chunk (its trace, `rank0.jsonl`) against the 166.7 ms a chunk plays.

`LocalCall` is also what the tests of the call use (tests/livekit/test_call_ends.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path

from livekit import api as lkapi
from vivant.bench.call_recorder import CallMeasurement, UserRecorder, write_mp4
from vivant.devcluster.livekit import LiveKitState, LocalLiveKit
from vivant.ports import free_port

ROOT = Path(__file__).resolve().parent.parent
AGENT_SCRIPT = ROOT / "examples" / "livekit_agent" / "agent.py"
AGENT_NAME = "vivant-example"
AVATAR_IDENTITY = "runway-avatar-agent"  # the Runway plugin's default avatar participant identity
POOL = "local"
AVATAR_ID = "ada"


@dataclass(frozen=True)
class CallConfig:
    """One local call's set-up. `weights`: a directory holding ref_dit/ref_vae safetensors (preset ref)."""

    folder: Path
    preset: str = "tiny"
    weights: Path | None = None
    nice: int = 0
    cpu_threads: int = 1
    api_key: str = "vivant-local-key"


@dataclass
class Child:
    """A child process with its log file; stopped with SIGTERM (then SIGKILL) of its process group."""

    name: str
    proc: subprocess.Popen
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout: float = 20.0, term_again_after: float | None = None) -> int | None:
        """SIGTERM; with `term_again_after`, a second SIGTERM once that many seconds passed (livekit-agents drains
        its running jobs on the first signal, up to its drain timeout, and exits at once on the second); SIGKILL
        after `timeout`."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                if term_again_after is not None and term_again_after < timeout:
                    try:
                        self.proc.wait(term_again_after)
                    except subprocess.TimeoutExpired:
                        os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout if term_again_after is None else max(timeout - term_again_after, 1.0))
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        return self.proc.returncode


@dataclass
class LocalCall:
    """Starts and stops the call's servers and processes (module docstring); `children` by name."""

    cfg: CallConfig
    children: dict[str, Child] = field(default_factory=dict)
    livekit: LocalLiveKit | None = None
    lk: LiveKitState | None = None
    redis_url: str = ""
    api_url: str = ""

    def _spawn(self, name: str, cmd: list[str], env: dict[str, str] | None = None) -> Child:
        log_path = self.cfg.folder / f"{name}.log"
        with open(log_path, "ab") as out:
            full = ["nice", "-n", str(self.cfg.nice), *cmd] if self.cfg.nice else cmd
            proc = subprocess.Popen(full, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env={**os.environ, **(env or {})}, start_new_session=True, cwd=self.cfg.folder)
        child = self.children[name] = Child(name, proc, log_path)
        return child

    def start_servers(self, livekit: LiveKitState | None = None) -> LocalCall:
        """Redis, the LiveKit server (or the given running one) and the session API in local mode."""
        self.cfg.folder.mkdir(parents=True, exist_ok=True)
        redis = shutil.which("redis-server")
        if redis is None:
            raise SystemExit("call: redis-server not found (`make sysdeps`, Debian package redis-server)")
        port = free_port()
        self._spawn("redis", [redis, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
        self.redis_url = f"redis://127.0.0.1:{port}/0"
        if livekit is None:
            self.livekit = LocalLiveKit(self.cfg.folder / "livekit", log=lambda m: print(m, file=sys.stderr))
            livekit = self.livekit.up()
        self.lk = livekit
        (self.cfg.folder / "avatars.yaml").write_text(
            f"avatars:\n  {AVATAR_ID}: {{character: {AVATAR_ID}, pool: {POOL}}}\ndefaultMaxDurationS: 600\n")
        api_port = free_port()
        self.api_url = f"http://127.0.0.1:{api_port}"
        self._spawn("api", [sys.executable, "-m", "vivant", "api", "--local", "--avatars", "avatars.yaml",
                            "--redis", self.redis_url, "--port", str(api_port)],
                    env={"VIVANT_API_KEYS": self.cfg.api_key})
        return self

    def worker_command(self, worker_id: str = "worker-0") -> list[str]:
        cmd = [sys.executable, "-m", "vivant", "worker", "--pool", POOL, "--worker-id", worker_id,
               "--redis", self.redis_url, "--runner", "livekit", "--device", "cpu", "--preset", self.cfg.preset,
               "--tensor-parallel", "1", "--cpu-threads", str(self.cfg.cpu_threads), "--out", "worker-out"]
        if self.cfg.weights is not None:
            w = self.cfg.weights.resolve()
            cmd += ["--checkpoint", str(w / f"{self.cfg.preset}_dit.safetensors"),
                    "--vae-weights", str(w / f"{self.cfg.preset}_vae.safetensors")]
        return cmd

    def start_worker(self, worker_id: str = "worker-0") -> Child:
        return self._spawn("worker", self.worker_command(worker_id))

    def start_agent(self) -> Child:
        if not AGENT_SCRIPT.is_file():
            raise SystemExit(f"call: the example agent is missing ({AGENT_SCRIPT}); run from a vivant checkout")
        assert self.lk is not None
        env = {"LIVEKIT_URL": self.lk.url, "LIVEKIT_API_KEY": self.lk.api_key, "LIVEKIT_API_SECRET": self.lk.api_secret,
               "VIVANT_API_URL": self.api_url, "VIVANT_API_KEY": self.cfg.api_key, "VIVANT_AGENT_HTTP_PORT": "0"}
        return self._spawn("agent", [sys.executable, str(AGENT_SCRIPT), "start"], env=env)

    def wait(self, what: str, cond, timeout: float, every: float = 0.2) -> None:  # noqa: ANN001
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for child in self.children.values():
                if not child.alive() and child.name in ("api", "worker", "agent", "redis"):
                    raise RuntimeError(f"call: {child.name} exited ({child.proc.returncode}) while waiting for "
                                       f"{what}; its log ends:\n{child.log()[-3000:]}")
            if cond():
                return
            time.sleep(every)
        raise TimeoutError(f"call: timed out after {timeout:.0f}s waiting for {what}")

    def worker_ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.api_url}/readyz", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def agent_registered(self) -> bool:
        child = self.children.get("agent")
        return child is not None and "registered worker" in child.log()

    def start(self, livekit: LiveKitState | None = None, worker_timeout: float = 300.0) -> LocalCall:
        """Everything: servers, the worker (waits until it is idle) and the agent (waits until registered)."""
        self.start_servers(livekit)
        self.start_worker()
        self.start_agent()
        self.wait("the worker warm and idle (/readyz)", self.worker_ready, worker_timeout)
        self.wait("the agent registered with the LiveKit server", self.agent_registered, 60)
        return self

    def user_token(self, room: str, identity: str = "user") -> str:
        assert self.lk is not None
        grants = lkapi.VideoGrants(room_join=True, room=room, can_publish=True, can_subscribe=True)
        return lkapi.AccessToken(self.lk.api_key, self.lk.api_secret).with_identity(identity).with_grants(
            grants).to_jwt()

    async def dispatch(self, room: str, script: dict) -> None:
        """Ask the server to send the example agent to `room` with `script` (its Script, as JSON metadata)."""
        assert self.lk is not None
        async with lkapi.LiveKitAPI(self.lk.http_url, self.lk.api_key, self.lk.api_secret) as client:
            await client.agent_dispatch.create_dispatch(lkapi.CreateAgentDispatchRequest(
                agent_name=AGENT_NAME, room=room, metadata=json.dumps(script)))

    def stop(self) -> None:
        for name in ("agent", "worker", "api", "redis"):
            if name in self.children:
                # the agent drains a job still in a room (e.g. one whose server restarted) for up to an hour
                self.children[name].stop(term_again_after=3.0 if name == "agent" else None)
        if self.livekit is not None:
            self.livekit.down()


# ------------------------------------------------------------------------------------------- the demo


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seconds", type=float, default=20.0, help="how long the agent keeps talking (s)")
    p.add_argument("--preset", default=None, help="ref (weights/ref, the default when present) or tiny (random)")
    p.add_argument("--weights", type=Path, default=ROOT / "weights" / "ref", help="directory of the ref weights")
    p.add_argument("--out", type=Path, default=Path("out/livekit"), help="folder for call.mp4, call.json, call.md")
    p.add_argument("--nice", type=int, default=0, help="run the call's processes at this nice level")


SCRIPT_TURNS = [
    "Hello! I am a vivant character, talking to you through a real LiveKit room.",
    "Everything you see is generated on this machine while I speak.",
    "Let me know if my lips follow my voice.",
]


def cpu_seconds(pid: int) -> float:
    import psutil

    try:
        proc = psutil.Process(pid)
        total = 0.0
        for p in [proc, *proc.children(recursive=True)]:
            try:
                t = p.cpu_times()
                total += t.user + t.system
            except psutil.NoSuchProcess:
                pass
        return total
    except psutil.NoSuchProcess:
        return 0.0


def own_cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system


async def run_call(call: LocalCall, seconds: float) -> tuple[dict, object]:
    room = f"demo-{int(time.time())}"
    user = UserRecorder(call.lk.url, call.user_token(room), AVATAR_IDENTITY)
    cpu0 = {n: cpu_seconds(c.proc.pid) for n, c in call.children.items()}
    cpu0["livekit-server"] = cpu_seconds(call.lk.pid)
    cpu0["user (this process)"] = own_cpu_seconds()
    wall0 = time.time()
    await call.dispatch(room, {"avatar": AVATAR_ID, "turns": SCRIPT_TURNS, "pause_s": 1.5, "repeat_for_s": seconds,
                               "end": "end_call"})
    await user.start()
    deadline = time.monotonic() + seconds + 300
    seen = False
    while time.monotonic() < deadline:  # until the avatar has come and gone (the agent's END_CALL)
        present = user.avatar_present()
        seen |= present
        if seen and not present:
            break
        await asyncio.sleep(0.5)
    cpu1 = {n: cpu_seconds(c.proc.pid) for n, c in call.children.items()}
    cpu1["livekit-server"] = cpu_seconds(call.lk.pid)
    cpu1["user (this process)"] = own_cpu_seconds()
    wall = time.time() - wall0
    left = seen and not user.avatar_present()
    rec = await user.stop()
    cpu = {n: round(cpu1[n] - cpu0.get(n, 0.0), 2) for n in cpu1}
    return {"wall_s": round(wall, 2), "cpu_s": cpu, "avatar_left": left}, rec


def stage_times(folder: Path) -> dict:
    import numpy as np

    traces = sorted(folder.glob("worker-out/*/rank0.jsonl"))
    if not traces:
        return {}
    ms = [e["diffuse_ms"] for e in map(json.loads, traces[-1].read_text().splitlines())
          if e.get("event") == "chunk" and "diffuse_ms" in e]
    if not ms:
        return {}
    a = np.asarray(ms)
    return {"chunks": len(ms), "diffuse_ms_p50": round(float(np.median(a)), 1),
            "diffuse_ms_p90": round(float(np.percentile(a, 90)), 1), "chunk_budget_ms": round(4 / 24 * 1000, 1)}


def versions() -> dict:
    out = {"python": platform.python_version()}
    for dist in ("livekit", "livekit-agents", "livekit-plugins-runway", "torch", "vivant"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    gomod = ROOT / "tools" / "livekit" / "go.mod"
    if gomod.exists():
        out["livekit-server"] = gomod.read_text().split("github.com/livekit/livekit-server ")[1].split()[0]
    return out


def markdown(report: dict) -> str:
    m = report["measurement"]
    lat = [x for x in m["turn_latency_s"] if x is not None]
    rows = [("frames received", m["frames_received"]), ("received fps", m["received_fps"]),
            ("span (s)", m["span_s"]), ("freezes (gaps > 2 frame intervals)", m["freezes"]),
            ("frozen (s)", m["frozen_s"]), ("longest gap (ms)", m["longest_gap_ms"]),
            ("A/V offset at the receiver (ms, r)", f"{m['av_offset_ms']} (r = {m['av_offset_r']})"),
            ("turn latency per turn (s)", m["turn_latency_s"]),
            ("turn latency median (s)", round(sorted(lat)[len(lat) // 2], 3) if lat else None),
            ("frame size", "x".join(map(str, m["frame_size"]))), ("audio received (s)", m["audio_received_s"])]
    lines = [f"# LiveKit call, {report['date']}", "", f"`{report['command']}`", "", "| figure | value |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in rows]
    lines += ["", f"machine: {report['machine']['cores']} cores, uptime: {report['machine']['uptime']}",
              f"CPU seconds by process over the call: {report['call']['cpu_s']} (wall {report['call']['wall_s']} s)",
              f"DiT rank: {report['stages']}", f"versions: {report['versions']}", ""]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    if not args.seconds > 0:
        raise SystemExit(f"call: --seconds = {args.seconds}; expected > 0")
    weights = args.weights if (args.weights / "ref_dit.safetensors").is_file() else None
    preset = args.preset or ("ref" if weights is not None else "tiny")
    if preset == "ref" and weights is None:
        raise SystemExit(f"call: --preset ref needs {args.weights}/ref_dit.safetensors (vivant train ref)")
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    call = LocalCall(CallConfig(folder=out, preset=preset, weights=weights if preset == "ref" else None,
                                nice=args.nice))
    try:
        call.start()
        info, rec = asyncio.run(run_call(call, args.seconds))
    finally:
        call.stop()
    measurement = CallMeasurement.from_recording(rec)
    mp4 = write_mp4(rec, out / "call.mp4")
    uptime = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    report = {"date": datetime.now(UTC).isoformat(timespec="seconds"),
              "command": f"vivant bench call --seconds {args.seconds:g} --preset {preset}",
              "preset": preset, "seconds": args.seconds,
              "machine": {"cores": os.cpu_count(), "uptime": uptime, "platform": platform.platform()},
              "versions": versions(), "call": info, "stages": stage_times(out),
              "measurement": measurement.to_dict(), "turns": rec.turns,
              "first_video_at": rec.video_t[0] if rec.video_t else None, "mp4": mp4.name if mp4 else None}
    chunks = report["stages"].get("chunks")
    if chunks:  # CPU the worker spent per chunk (all its ranks) against the 166.7 ms a chunk plays
        per_chunk = info["cpu_s"]["worker"] * 1000 / chunks
        report["stages"]["worker_cpu_ms_per_chunk"] = round(per_chunk, 1)
        report["stages"]["cores_for_24fps"] = round(per_chunk / (4 / 24 * 1000), 2)
        report["stages"]["worker_cores_given"] = round(info["cpu_s"]["worker"] / info["wall_s"], 2)
    (out / "call.json").write_text(json.dumps(report, indent=1))
    (out / "call.md").write_text(markdown(report))
    print(markdown(report))
    print(f"wrote {out / 'call.mp4'}, {out / 'call.json'}, {out / 'call.md'}")
    return 0
