"""call: whole LiveKit calls on this machine, measured at each receiving participant (MP4 + JSON + markdown).

    vivant bench call --seconds 60 --out out/livekit                       # `make demo-livekit` runs this
    vivant bench call --device cuda --seconds 600 --interrupt-every 4      # a long call, the worker on the GPU
    vivant bench call --device cuda --step-ms 103 --seconds 120            # at the 57b model's per-rank step time
    vivant bench call --device cuda --calls 4,8,16 --seconds 120           # rounds of N concurrent calls, one GPU

What runs, every part real and on loopback: a Redis (the session registry), a livekit-server
(devcluster/livekit.py), the session API in local mode (`vivant api --local`), `max(--calls)` workers (`vivant
worker --runner livekit`: 1 DiT rank + the decoder rank; on the CPU, or on the one GPU with the decoder beside the
DiT rank, `--decoder-device shared`), the example voice agent (examples/livekit_agent/agent.py: livekit-agents +
the published Runway avatar plugin pointed at the API, espeak-ng TTS; one agent process per 4 calls) registered
with the server, and per call a "user" (bench/call_recorder.py, a process of its own) who joins the call's room,
which dispatches the agent to it. The agent speaks its scripted turns (pauses between them, every n-th turn
interrupted with `--interrupt-every`: the framework's interrupt, `lk.clear_buffer` to the avatar) for `--seconds`,
then ends the call (END_CALL); each user records what arrives. `--calls 4,8` runs a round of 4 concurrent calls,
then one of 8, on the same servers and workers.

`--tts-cache DIR`: the agent's speech is read from DIR (made beforehand with `--prepare-tts`, where espeak-ng
exists), so the call runs on a machine without espeak-ng. `--step-ms X` pads every chunk's diffusion to X ms
(vivant.worker.model.cadence: the room path at a larger model's cadence).

Writes under `--out`: `call.mp4` (what the first user of the first round received), `call.json` (per round and
call: the receiver's figures, per minute too; the worker's memory and the GPU's over time; CPU seconds of each
process; the DiT rank's diffusion time per chunk; the machine and versions) and `call.md` (the same as tables).
Whether a call holds the real-time figures (`TARGETS`) is reported per call; the command exits 0 either way (a
measurement, not a test).

`LocalCall` is also what the tests of the call use (tests/livekit/test_call_ends.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path

import numpy as np
from livekit import api as lkapi
from vivant.devcluster.livekit import LiveKitState, LocalLiveKit
from vivant.ports import free_port
from vivant.sessions.registry import Registry

ROOT = Path(__file__).resolve().parent.parent
AGENT_SCRIPT = ROOT / "examples" / "livekit_agent" / "agent.py"
AGENT_NAME = "vivant-example"
AVATAR_IDENTITY = "runway-avatar-agent"  # the Runway plugin's default avatar participant identity
POOL = "local"
AVATAR_ID = "ada"
CALLS_PER_AGENT = 4  # calls one agent process takes (its jobs run in threads)
# What a call must hold at its receiver (the product's promise, docs/livekit.md): every minute's received fps,
# freezes (gaps > 2 frame intervals), |A/V offset| (ms), turn latency p50 and p99 (s).
TARGETS = {"minute_fps_min": 23.5, "freezes_max": 0, "av_offset_ms_max": 45.0, "turn_latency_p50_s_max": 0.35,
           "turn_latency_p99_s_max": 0.5}


@dataclass(frozen=True)
class CallConfig:
    """One local stack's set-up. `weights`: a directory holding ref_dit/ref_vae safetensors (preset ref).
    `device`: cpu or cuda (every worker on the one GPU, its decoder beside its DiT rank). `workers`: how many
    workers to start. `pad_chunk_ms`: > 0 pads each chunk's diffusion (benchmarks). `tts_cache`: the agent's
    speech made beforehand."""

    folder: Path
    preset: str = "tiny"
    weights: Path | None = None
    nice: int = 0
    cpu_threads: int = 1
    api_key: str = "vivant-local-key"
    device: str = "cpu"
    workers: int = 1
    pad_chunk_ms: float = 0.0
    tts_cache: Path | None = None

    def __post_init__(self) -> None:
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device: expected cpu or cuda, got {self.device!r}")
        if not 1 <= self.workers <= 64:
            raise ValueError(f"workers: expected 1..64, got {self.workers}")


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
               "--redis", self.redis_url, "--runner", "livekit", "--device", self.cfg.device, "--preset",
               self.cfg.preset, "--tensor-parallel", "1", "--cpu-threads", str(self.cfg.cpu_threads),
               "--out", f"worker-out/{worker_id}"]
        if self.cfg.device == "cuda":
            cmd += ["--decoder-device", "shared"]
        if self.cfg.pad_chunk_ms > 0:
            cmd += ["--pad-chunk-ms", f"{self.cfg.pad_chunk_ms:g}"]
        if self.cfg.weights is not None:
            w = self.cfg.weights.resolve()
            cmd += ["--checkpoint", str(w / f"{self.cfg.preset}_dit.safetensors"),
                    "--vae-weights", str(w / f"{self.cfg.preset}_vae.safetensors")]
        return cmd

    def start_worker(self, worker_id: str = "worker-0") -> Child:
        name = "worker" if worker_id == "worker-0" else worker_id
        return self._spawn(name, self.worker_command(worker_id))

    def start_agent(self, index: int = 0) -> Child:
        if not AGENT_SCRIPT.is_file():
            raise SystemExit(f"call: the example agent is missing ({AGENT_SCRIPT}); run from a vivant checkout")
        assert self.lk is not None
        env = {"LIVEKIT_URL": self.lk.url, "LIVEKIT_API_KEY": self.lk.api_key, "LIVEKIT_API_SECRET": self.lk.api_secret,
               "VIVANT_API_URL": self.api_url, "VIVANT_API_KEY": self.cfg.api_key, "VIVANT_AGENT_HTTP_PORT": "0"}
        if self.cfg.tts_cache is not None:
            env["VIVANT_TTS_CACHE"] = str(self.cfg.tts_cache.resolve())
        return self._spawn("agent" if index == 0 else f"agent-{index}", [sys.executable, str(AGENT_SCRIPT), "start"],
                           env=env)

    def watched(self) -> list[Child]:
        """The children whose exit stops the call."""
        return [c for c in self.children.values() if c.name.split("-")[0] in ("api", "worker", "agent", "redis")]

    def wait(self, what: str, cond, timeout: float, every: float = 0.2) -> None:  # noqa: ANN001
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for child in self.watched():
                if not child.alive():
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

    def idle_workers(self) -> int:
        registry = Registry(self.redis_url)
        try:
            return len(registry.idle_workers(POOL))
        finally:
            registry.close()

    def agents(self) -> list[Child]:
        return [c for c in self.children.values() if c.name.split("-")[0] == "agent"]

    def agent_registered(self) -> bool:
        agents = self.agents()
        return bool(agents) and all("registered worker" in c.log() for c in agents)

    def worker_pids(self) -> dict[str, int]:
        return {c.name: c.proc.pid for c in self.children.values() if c.name.split("-")[0] == "worker"}

    def start(self, livekit: LiveKitState | None = None, worker_timeout: float = 300.0) -> LocalCall:
        """Everything: servers, the workers (waits until all are idle) and the agents (waits until registered)."""
        self.start_servers(livekit)
        for i in range(self.cfg.workers):
            self.start_worker(f"worker-{i}")
        for i in range(max(1, math.ceil(self.cfg.workers / CALLS_PER_AGENT))):
            self.start_agent(i)
        self.wait(f"{self.cfg.workers} worker(s) warm and idle", lambda: self.idle_workers() >= self.cfg.workers,
                  worker_timeout)
        self.wait("the agents registered with the LiveKit server", self.agent_registered, 60)
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
        for kind in ("agent", "worker", "api", "redis"):
            for child in [c for c in self.children.values() if c.name.split("-")[0] == kind]:
                # the agent drains a job still in a room (e.g. one whose server restarted) for up to an hour
                child.stop(term_again_after=3.0 if kind == "agent" else None)
        if self.livekit is not None:
            self.livekit.down()


# ------------------------------------------------------------------------------------------- the benchmark


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seconds", type=float, default=20.0, help="how long the agent keeps talking in each call (s)")
    p.add_argument("--preset", default=None, help="ref (weights/ref, the default when present) or tiny (random)")
    p.add_argument("--weights", type=Path, default=ROOT / "weights" / "ref", help="directory of the ref weights")
    p.add_argument("--out", type=Path, default=Path("out/livekit"), help="folder for call.mp4, call.json, call.md")
    p.add_argument("--nice", type=int, default=0, help="run the call's processes at this nice level")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                   help="where the workers generate: cpu, or cuda (every worker on GPU 0, decoder shared)")
    p.add_argument("--calls", default="1",
                   help="concurrent calls per round, comma-separated (e.g. 4,8,16): one round each, same servers")
    p.add_argument("--step-ms", type=float, default=0.0,
                   help="pad every chunk's diffusion to this many ms (the 57b per-rank step; 0 = off)")
    p.add_argument("--interrupt-every", type=int, default=0,
                   help="the agent interrupts every n-th turn 1.2 s in (lk.clear_buffer; 0 = never)")
    p.add_argument("--tts-cache", type=Path, default=None,
                   help="the agent's speech made beforehand (a folder of WAV files; see --prepare-tts)")
    p.add_argument("--prepare-tts", action="store_true",
                   help="only speak the script into --tts-cache with espeak-ng, then exit")
    p.add_argument("--sample-s", type=float, default=5.0, help="seconds between samples of memory and GPU use")


SCRIPT_TURNS = [
    "Hello! I am a vivant character, talking to you through a real LiveKit room.",
    "Everything you see is generated on this machine while I speak.",
    "Let me know if my lips follow my voice.",
    "I can keep talking for as long as you like, and you can cut me off at any moment.",
    "Short answer.",
    "Now a longer one, with a pause in the middle, and then a few more words to finish the thought.",
]
INTERRUPT_AFTER_S = 1.2


def parse_calls(text: str) -> list[int]:
    """`--calls 4,8,16` -> [4, 8, 16]; ValueError naming the option."""
    try:
        rounds = [int(x) for x in text.split(",")]
    except ValueError:
        rounds = []
    if not rounds or min(rounds) < 1 or max(rounds) > 64:
        raise ValueError(f"calls: expected comma-separated counts in 1..64, got {text!r}")
    return rounds


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


def tree_pids_rss(pid: int) -> tuple[set[int], float]:
    """(the pids of a process and its descendants, their summed resident memory in MB)."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return set(), 0.0
    pids, rss = set(), 0.0
    for proc in procs:
        try:
            rss += proc.memory_info().rss / 2**20
            pids.add(proc.pid)
        except psutil.NoSuchProcess:
            pass
    return pids, rss


def gpu_use() -> tuple[dict[int, float], float | None]:
    """({pid: GPU memory in MB} of the compute processes, GPU utilization in %) from nvidia-smi; empty without one."""
    if shutil.which("nvidia-smi") is None:
        return {}, None
    try:
        apps = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                              capture_output=True, text=True, timeout=10).stdout
        util = subprocess.run(["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits"],
                              capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return {}, None
    mem = {}
    for line in apps.splitlines():
        parts = [x.strip() for x in line.split(",")]
        if len(parts) == 2 and parts[0].isdigit():
            try:
                mem[int(parts[0])] = float(parts[1])
            except ValueError:
                pass
    try:
        return mem, float(util.split()[0])
    except (ValueError, IndexError):
        return mem, None


class ResourceSampler:
    """Every `every_s`: each worker's resident memory (its process tree, MB) and GPU memory (MB, nvidia-smi),
    the GPU's utilization and the machine's CPU use (%), on a thread until `stop`."""

    def __init__(self, workers: dict[str, int], every_s: float) -> None:
        self.workers, self.every_s = workers, every_s
        self.samples: list[dict] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="resource-sampler", daemon=True)

    def start(self) -> ResourceSampler:
        import psutil

        psutil.cpu_percent()
        self.t0 = time.time()
        self._thread.start()
        return self

    def _run(self) -> None:
        import psutil

        while not self._stop.wait(self.every_s):
            gpu_mem, util = gpu_use()
            rss, gmem = {}, {}
            for name, pid in self.workers.items():
                pids, rss[name] = tree_pids_rss(pid)
                gmem[name] = sum(mb for p, mb in gpu_mem.items() if p in pids)
            self.samples.append({"t_s": round(time.time() - self.t0, 1), "worker_rss_mb": rss, "worker_gpu_mb": gmem,
                                 "gpu_util_pct": util, "cpu_pct": psutil.cpu_percent()})

    def stop(self) -> list[dict]:
        self._stop.set()
        self._thread.join(30)
        return self.samples


def memory_per_minute(samples: list[dict], workers: list[str]) -> dict:
    """Per minute and worker: mean resident and GPU memory (MB); `drift_from_minute_2`: per worker, the largest
    relative change of each from its minute-2 mean over the later minutes (the long call's flatness figure: the
    first two minutes hold start-up and the first sessions' allocations)."""
    minutes: dict[int, list[dict]] = {}
    for sample in samples:
        minutes.setdefault(int(sample["t_s"] // 60), []).append(sample)
    table = []
    for m in sorted(minutes):
        row = {"minute": m}
        for key in ("worker_rss_mb", "worker_gpu_mb"):
            row[key] = {w: round(float(np.mean([s[key].get(w, 0.0) for s in minutes[m]])), 1) for w in workers}
        utils = [s["gpu_util_pct"] for s in minutes[m] if s["gpu_util_pct"] is not None]
        row["gpu_util_pct"] = round(float(np.mean(utils)), 1) if utils else None
        row["cpu_pct"] = round(float(np.mean([s["cpu_pct"] for s in minutes[m]])), 1)
        table.append(row)
    drift = {}
    base = next((r for r in table if r["minute"] == 2), None)
    later = [r for r in table if r["minute"] > 2]
    if base is not None and later:
        for key in ("worker_rss_mb", "worker_gpu_mb"):
            drift[key] = {w: round(max(abs(r[key][w] - base[key][w]) / base[key][w] for r in later), 4)
                          for w in workers if base[key][w] > 0}
    return {"per_minute": table, "drift_from_minute_2": drift}


def holds(m: dict) -> dict:
    """Which of `TARGETS` one call's measurement holds (each a bool) and `all`."""
    minutes = [x["received_fps"] for x in m["minutes"] if x["seconds"] >= 30] or [m["received_fps"]]
    checks = {
        "minute_fps": min(minutes) >= TARGETS["minute_fps_min"],
        "freezes": m["freezes"] <= TARGETS["freezes_max"],
        "av_offset": m["av_offset_ms"] is not None and abs(m["av_offset_ms"]) <= TARGETS["av_offset_ms_max"],
        "turn_latency_p50": m["turn_latency_p50_s"] is not None
        and m["turn_latency_p50_s"] <= TARGETS["turn_latency_p50_s_max"],
        "turn_latency_p99": m["turn_latency_p99_s"] is not None and m["turns_without_motion"] == 0
        and m["turn_latency_p99_s"] <= TARGETS["turn_latency_p99_s_max"],
    }
    return {**checks, "all": all(checks.values())}


def summary(calls: list[dict]) -> dict:
    """A round's figures over its calls: the worst call's, and turn latency over every turn of every call."""
    ms = [c["measurement"] for c in calls]
    lat = np.asarray([x for m in ms for x in m["turn_latency_s"] if x is not None], np.float64)
    minute_fps = [x["received_fps"] for m in ms for x in m["minutes"] if x["seconds"] >= 30]
    offsets = [m["av_offset_ms"] for m in ms if m["av_offset_ms"] is not None]
    return {"calls": len(calls), "calls_holding": sum(c["holds"]["all"] for c in calls),
            "received_fps_min": min((m["received_fps"] for m in ms), default=None),
            "minute_fps_min": min(minute_fps, default=None), "freezes_total": sum(m["freezes"] for m in ms),
            "longest_gap_ms_max": max((m["longest_gap_ms"] for m in ms), default=None),
            "turns_sent": sum(m["turns_sent"] for m in ms), "turns_measured": int(len(lat)),
            "turns_without_motion": sum(m["turns_without_motion"] for m in ms),
            "turn_latency_p50_s": round(float(np.percentile(lat, 50)), 4) if len(lat) else None,
            "turn_latency_p99_s": round(float(np.percentile(lat, 99)), 4) if len(lat) else None,
            "av_offset_ms_range": [min(offsets), max(offsets)] if offsets else None,
            "av_offset_r_min": min((m["av_offset_r"] for m in ms if m["av_offset_r"] is not None), default=None)}


def script_for(seconds: float, interrupt_every: int) -> dict:
    return {"avatar": AVATAR_ID, "turns": SCRIPT_TURNS, "pause_s": 1.5, "repeat_for_s": seconds, "end": "end_call",
            "interrupt_every": interrupt_every, "interrupt_after_s": INTERRUPT_AFTER_S}


async def run_round(call: LocalCall, n: int, seconds: float, interrupt_every: int, sample_s: float, tag: str,
                    mp4: Path | None) -> dict:
    """`n` concurrent calls: per call a room, the agent dispatched to it and a user process recording it."""
    folder = call.cfg.folder / tag
    folder.mkdir(parents=True, exist_ok=True)
    stamp = int(time.time())
    rooms = [f"{tag}-{i}-{stamp}" for i in range(n)]
    names = [c.name for c in call.children.values()] + ["livekit-server"]
    pids = {c.name: c.proc.pid for c in call.children.values()} | {"livekit-server": call.lk.pid}
    cpu0 = {name: cpu_seconds(pids[name]) for name in names}
    sampler = ResourceSampler(call.worker_pids(), sample_s).start()
    wall0 = time.time()
    users = []
    for i, room in enumerate(rooms):
        await call.dispatch(room, script_for(seconds, interrupt_every))
        out = folder / f"user-{i}.json"
        cmd = [sys.executable, "-m", "vivant.bench.call_recorder", "--url", call.lk.url, "--avatar-identity",
               AVATAR_IDENTITY, "--max-seconds", f"{seconds + 240:g}", "--out", str(out)]
        if i == 0 and mp4 is not None:
            cmd += ["--mp4", str(mp4)]
        log = open(folder / f"user-{i}.log", "wb")  # noqa: SIM115 (closed below)
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env={**os.environ, "VIVANT_USER_TOKEN": call.user_token(room)})
        users.append((proc, out, log))
    user_cpu: dict[int, float] = {}  # the users' CPU seconds, last read while each was alive
    while any(proc.poll() is None for proc, _, _ in users):
        for proc, _, _ in users:
            if proc.poll() is None:
                user_cpu[proc.pid] = cpu_seconds(proc.pid)
        await asyncio.sleep(1.0)
    wall = time.time() - wall0
    samples = sampler.stop()
    cpu = {name: round(cpu_seconds(pids[name]) - cpu0[name], 2) for name in names}
    cpu["users"] = round(sum(user_cpu.values()), 2)
    calls = []
    for i, (proc, out, log) in enumerate(users):
        log.close()
        if proc.returncode != 0 or not out.is_file():
            text = (folder / f"user-{i}.log").read_text(errors="replace")[-2000:]
            raise RuntimeError(f"call: user {i} exited {proc.returncode}; its log ends:\n{text}")
        doc = json.loads(out.read_text())
        doc["room"] = rooms[i]
        doc["holds"] = holds(doc["measurement"])
        calls.append(doc)
    workers = sorted(call.worker_pids())
    return {"concurrent_calls": n, "seconds": seconds, "wall_s": round(wall, 1), "summary": summary(calls),
            "calls": calls, "cpu_s": cpu, "cpu_cores_used": round(sum(cpu.values()) / wall, 2),
            "memory": memory_per_minute(samples, workers), "samples": samples,
            "stages": stage_times(call.cfg.folder, since=wall0)}


def stage_times(folder: Path, since: float = 0.0) -> dict:
    """The DiT rank's diffusion time per chunk over the sessions that started after `since` (unix s): p50/p90/max."""
    ms = []
    for trace in folder.glob("worker-out/*/*/rank0.jsonl"):
        if trace.stat().st_mtime < since:
            continue
        ms += [e["diffuse_ms"] for e in map(json.loads, trace.read_text().splitlines())
               if e.get("event") == "chunk" and "diffuse_ms" in e]
    if not ms:
        return {}
    a = np.asarray(ms)
    return {"chunks": len(ms), "diffuse_ms_p50": round(float(np.median(a)), 1),
            "diffuse_ms_p90": round(float(np.percentile(a, 90)), 1), "diffuse_ms_max": round(float(a.max()), 1),
            "chunk_budget_ms": round(4 / 24 * 1000, 1)}


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


def gpu_name() -> str | None:
    if shutil.which("nvidia-smi") is None:
        return None
    out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                         capture_output=True, text=True).stdout.strip()
    return out or None


def markdown(report: dict) -> str:
    lines = [f"# LiveKit calls, {report['date']}", "", f"`{report['command']}`", "",
             f"machine: {report['machine']['cores']} cores, GPU {report['machine']['gpu']}; "
             f"device {report['device']}, preset {report['preset']}, chunk padded to {report['step_ms']} ms", ""]
    lines += ["| calls | holding | fps min (call / minute) | freezes | longest gap ms | turn latency p50 / p99 s "
              "| A/V offset ms (r min) | CPU cores | DiT ms p50/p90/max |", "|---|---|---|---|---|---|---|---|---|"]
    for rnd in report["rounds"]:
        s, st = rnd["summary"], rnd["stages"]
        lines.append(f"| {s['calls']} | {s['calls_holding']} | {s['received_fps_min']} / {s['minute_fps_min']} | "
                     f"{s['freezes_total']} | {s['longest_gap_ms_max']} | {s['turn_latency_p50_s']} / "
                     f"{s['turn_latency_p99_s']} ({s['turns_sent']} turns, {s['turns_without_motion']} without motion) | "
                     f"{s['av_offset_ms_range']} ({s['av_offset_r_min']}) | {rnd['cpu_cores_used']} | "
                     f"{st.get('diffuse_ms_p50')}/{st.get('diffuse_ms_p90')}/{st.get('diffuse_ms_max')} |")
    first = report["rounds"][0]
    if first["calls"] and first["calls"][0]["measurement"]["minutes"]:
        lines += ["", "Per minute, first call of the first round:", "", "| minute | fps | freezes | longest gap ms |",
                  "|---|---|---|---|"]
        lines += [f"| {x['minute']} | {x['received_fps']} | {x['freezes']} | {x['longest_gap_ms']} |"
                  for x in first["calls"][0]["measurement"]["minutes"]]
    mem = first["memory"]
    if mem["drift_from_minute_2"]:
        lines += ["", f"worker memory drift from minute 2 (largest relative change): {mem['drift_from_minute_2']}"]
    lines += ["", f"versions: {report['versions']}", ""]
    return "\n".join(lines)


def prepare_tts(folder: Path) -> int:
    sys.path.insert(0, str(AGENT_SCRIPT.parent))
    from espeak_tts import EspeakTTS

    paths = EspeakTTS(cache_dir=folder).fill_cache(SCRIPT_TURNS)
    print(f"call: {len(paths)} sentences spoken into {folder}")
    return 0


def run(args: argparse.Namespace) -> int:
    if args.prepare_tts:
        if args.tts_cache is None:
            raise SystemExit("call: --prepare-tts needs --tts-cache DIR")
        return prepare_tts(args.tts_cache)
    if not args.seconds > 0:
        raise SystemExit(f"call: --seconds = {args.seconds}; expected > 0")
    if not 0 <= args.step_ms < 10_000 or args.interrupt_every < 0 or not args.sample_s > 0:
        raise SystemExit(f"call: --step-ms {args.step_ms}, --interrupt-every {args.interrupt_every}, --sample-s "
                         f"{args.sample_s}: expected 0 <= step-ms < 10000, interrupt-every >= 0, sample-s > 0")
    try:
        rounds = parse_calls(args.calls)
    except ValueError as exc:
        raise SystemExit(f"call: {exc}") from None
    weights = args.weights if (args.weights / "ref_dit.safetensors").is_file() else None
    preset = args.preset or ("ref" if weights is not None else "tiny")
    if preset == "ref" and weights is None:
        raise SystemExit(f"call: --preset ref needs {args.weights}/ref_dit.safetensors (vivant train ref)")
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    call = LocalCall(CallConfig(folder=out, preset=preset, weights=weights if preset == "ref" else None,
                                nice=args.nice, device=args.device, workers=max(rounds), pad_chunk_ms=args.step_ms,
                                tts_cache=args.tts_cache))
    argv = [f"--seconds {args.seconds:g}", f"--preset {preset}", f"--device {args.device}", f"--calls {args.calls}"]
    argv += [f"--step-ms {args.step_ms:g}"] if args.step_ms else []
    argv += [f"--interrupt-every {args.interrupt_every}"] if args.interrupt_every else []
    results: list[dict] = []

    def write_report() -> dict:
        """call.json and call.md with the rounds so far (after each round: a run stopped in a later round keeps them)."""
        uptime = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
        report = {"date": datetime.now(UTC).isoformat(timespec="seconds"),
                  "command": "vivant bench call " + " ".join(argv), "preset": preset, "device": args.device,
                  "step_ms": args.step_ms, "targets": TARGETS, "rounds_planned": rounds,
                  "machine": {"cores": os.cpu_count(), "uptime": uptime, "platform": platform.platform(),
                              "gpu": gpu_name()},
                  "versions": versions(), "rounds": results,
                  "mp4": "call.mp4" if (out / "call.mp4").is_file() else None}
        (out / "call.json").write_text(json.dumps(report, indent=1))
        (out / "call.md").write_text(markdown(report))
        return report

    try:
        call.start(worker_timeout=900 if args.device == "cuda" else 300)
        for k, n in enumerate(rounds):
            tag = f"round-{k}-calls-{n}"
            print(f"call: round {k}: {n} concurrent call(s) of {args.seconds:g} s", flush=True)
            results.append(asyncio.run(run_round(call, n, args.seconds, args.interrupt_every, args.sample_s, tag,
                                                 out / "call.mp4" if k == 0 else None)))
            print(f"call: round {k}: {json.dumps(results[-1]['summary'])}", flush=True)
            write_report()
    finally:
        call.stop()
    report = write_report()
    print(markdown(report))
    print(f"wrote {out / 'call.json'}, {out / 'call.md'}" + (f", {out / 'call.mp4'}" if report["mp4"] else ""))
    return 0
