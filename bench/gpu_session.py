"""One long session through the served runtime, as a deployment runs it: Redis, `vivant worker`, the operator's
claim → assign → release, the decoder rank's pacer, an MP4 on the content timeline.

    python bench/gpu_session.py --seconds 60 --out OUT/session_ref_tp1.json
        [--device cuda] [--tp 1] [--decoder-device shared] [--preset ref] [--redis-server PATH] [--speak FILE]

It starts a redis-server on a free loopback port (`--redis-server`, else the one on PATH), starts
`vivant worker --runner pipeline --device DEVICE --tensor-parallel TP --decoder-device ...` with the preset's
weights (`ref`: weights/ref), waits until it is warm, assigns one session of `--seconds`, waits for its end,
stops the worker, and writes JSON: the session's SessionStats (fps as the worker counted chunks, end reason),
the decoder rank's playout report (frames published at 24 fps, stalls, repeated frames, per-stage p50/p99 ms:
decode, pacer push wait, buffer residency, publish, end to end) and rank 0's per-chunk diffusion times
(p50/p99/max). The target of the reference system (docs/ARCHITECTURE.md): ≥ 23.5 fps delivered with 0 stalls;
the script reports whether the session met it and exits 0 either way (a figure, not a test).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from vivant.ports import free_port

TARGET_FPS = 23.5


def _wait(what: str, cond, timeout: float, every: float = 0.2):  # noqa: ANN001, ANN202
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = cond()
        if value:
            return value
        time.sleep(every)
    raise SystemExit(f"gpu_session: timed out after {timeout:.0f}s waiting for {what}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--out", required=True, help="the JSON result")
    p.add_argument("--device", default="cuda")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--decoder-device", default="shared")
    p.add_argument("--preset", default="ref")
    p.add_argument("--engine", default="auto")
    p.add_argument("--redis-server", default=shutil.which("redis-server"))
    p.add_argument("--speak", default=None, help="a speech file for the session (default: silence)")
    p.add_argument("--startup-s", type=float, default=900.0, help="how long forming the ranks may take")
    args = p.parse_args(argv)
    if not args.redis_server:
        raise SystemExit("gpu_session: no redis-server on PATH; pass --redis-server (docs/BENCHMARKS.md says how)")
    from vivant.sessions.models import Assignment
    from vivant.sessions.registry import Registry

    work = Path(tempfile.mkdtemp(prefix="vivant-session-"))
    port = free_port()
    redis_proc = subprocess.Popen([args.redis_server, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                   "--appendonly", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    pool, wid, sid = "bench/gpu", "bench-worker-0", "bench/session"
    cmd = [sys.executable, "-m", "vivant", "worker", "--pool", pool, "--worker-id", wid, "--redis", url,
           "--runner", "pipeline", "--device", args.device, "--tensor-parallel", str(args.tp),
           "--decoder-device", args.decoder_device, "--preset", args.preset, "--engine", args.engine,
           "--out", str(work / "out")]
    if args.preset == "ref":
        weights = Path(__file__).resolve().parents[1] / "weights" / "ref"
        cmd += ["--checkpoint", str(weights / "ref_dit.safetensors"), "--vae-weights", str(weights / "ref_vae.safetensors")]
    if args.speak:
        cmd += ["--speak", str(Path(args.speak).resolve())]
    log_path = work / "worker.log"
    with open(log_path, "w") as log:
        worker = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ})
        try:
            time.sleep(0.5)
            reg = Registry(url)
            _wait("the worker warm and idle", lambda: worker.poll() is not None or reg.idle_workers(pool) == [wid],
                  args.startup_s)
            if worker.poll() is not None:
                raise SystemExit(f"gpu_session: the worker exited ({worker.returncode}):\n{log_path.read_text()[-4000:]}")
            assert reg.claim_idle_worker(pool, sid) == wid
            reg.send_assignment(wid, Assignment(session_id=sid, namespace="bench", pool=pool, character="ref",
                                                room="bench", livekit_url="wss://unused", agent_identity="agent",
                                                token="unused", max_duration_s=args.seconds))
            t0 = time.monotonic()
            stats = _wait("the session's end", lambda: (s := reg.session_stats(sid)) and s.phase in ("Ended", "Failed")
                          and s, args.seconds + 600)
            wall = time.monotonic() - t0
        finally:
            worker.send_signal(signal.SIGTERM)
            try:
                worker.wait(120)
            except subprocess.TimeoutExpired:
                worker.kill()
            redis_proc.terminate()
    folder = work / "out" / sid.replace("/", "_")
    playout = json.loads((folder / "playout.json").read_text()) if (folder / "playout.json").exists() else None
    rank0 = [json.loads(line) for line in (folder / "rank0.jsonl").read_text().splitlines()]
    diffuse = [e["diffuse_ms"] for e in rank0 if e["event"] == "chunk"]
    import torch

    result = {
        "bench": "session", "preset": args.preset, "device": args.device, "tp": args.tp,
        "decoder_device": args.decoder_device, "engine": args.engine, "seconds": args.seconds,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None, "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"), "wall_s": wall, "session": stats.model_dump(mode="json"),
        "diffuse_ms": {"n": len(diffuse), "p50": float(np.percentile(diffuse, 50)) if diffuse else None,
                       "p99": float(np.percentile(diffuse, 99)) if diffuse else None,
                       "max": max(diffuse) if diffuse else None},
        "playout": playout, "worker_exit": worker.returncode,
    }
    delivered = playout["delivered_fps"] if playout else 0.0
    stalls = playout["stalls"] if playout else None
    result["target"] = {"fps": TARGET_FPS, "stalls": 0,
                        "met": bool(playout) and delivered >= TARGET_FPS and stalls == 0}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"session {stats.phase} ({stats.end_reason}): {stats.chunks} chunks in {wall:.1f}s; delivered "
          f"{delivered:.2f} fps, {stalls} stalls; diffusion p50 {result['diffuse_ms']['p50']} ms; "
          f"target met: {result['target']['met']}")
    shutil.copy(log_path, Path(args.out).with_suffix(".worker.log"))  # the worker's own account, kept with the JSON
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
