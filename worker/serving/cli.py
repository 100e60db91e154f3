"""`vivant worker`: parse the command line, build the registry and the runner, serve until a signal."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket

from vivant.apis.feature_flags import FlagValues
from vivant.sessions.flags import FlagStore
from vivant.sessions.models import WorkerInfo
from vivant.sessions.registry import Registry, redis_client
from vivant.worker.model.options import CacheMode, EngineName
from vivant.worker.serving.metrics import WorkerMetrics
from vivant.worker.serving.metrics import serve as serve_metrics
from vivant.worker.serving.runner import SessionRunner
from vivant.worker.serving.runners import RUNNERS, build_runner, checkpoint_path
from vivant.worker.serving.service import WorkerService

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    env = os.environ
    parser.add_argument("--runner", default=env.get("VIVANT_RUNNER", "generator"), choices=RUNNERS,
                        help="what serves a session (env VIVANT_RUNNER): generator = chunk generator fed silence, "
                             "latents to a null/file sink; pipeline = generator + decoder + pacer, frames to a "
                             "null/MP4 sink; livekit = join the assignment's LiveKit room as the avatar (needs a "
                             "reachable LiveKit server)")
    parser.add_argument("--vae-weights", default=env.get("VIVANT_VAE_WEIGHTS") or None,
                        help="decoder safetensors (absolute path) for --runner pipeline|livekit; default: random "
                             "weights of the preset's shapes (env VIVANT_VAE_WEIGHTS)")
    parser.add_argument("--pool", default=env.get("VIVANT_POOL"), help="WorkerPool name (env VIVANT_POOL)")
    parser.add_argument("--worker-id", default=env.get("VIVANT_WORKER_ID") or env.get("POD_NAME") or socket.gethostname(),
                        help="worker id, the pod name (env VIVANT_WORKER_ID or POD_NAME; default: hostname)")
    parser.add_argument("--node", default=env.get("VIVANT_NODE") or env.get("NODE_NAME", ""),
                        help="node name (env VIVANT_NODE or NODE_NAME)")
    parser.add_argument("--checkpoint", default=env.get("VIVANT_CHECKPOINT", ""),
                        help="safetensors checkpoint: an absolute path (mounted volume), or random:// for random "
                             "weights of the preset's shapes (benchmarks); env VIVANT_CHECKPOINT")
    parser.add_argument("--tensor-parallel", type=int, default=int(env.get("VIVANT_TENSOR_PARALLEL", "4")),
                        help="tensor-parallel size this worker reports (env VIVANT_TENSOR_PARALLEL)")
    parser.add_argument("--metrics-port", type=int, default=int(env.get("VIVANT_METRICS_PORT", "0")),
                        help="serve Prometheus metrics on this port (env VIVANT_METRICS_PORT; 0 = off)")
    parser.add_argument("--metrics-addr", default="0.0.0.0", help="address the metrics server binds")
    parser.add_argument("--redis", default=env.get("VIVANT_REDIS_URL", "redis://127.0.0.1:6379/0"),
                        help="Redis URL (env VIVANT_REDIS_URL)")
    parser.add_argument("--preset", default=env.get("VIVANT_MODEL_PRESET", "tiny"), help="model preset")
    parser.add_argument("--mode", default="optimized", choices=[m.value for m in CacheMode])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--engine", default=env.get("VIVANT_ENGINE", "auto"), choices=[e.value for e in EngineName],
                        help="what runs the denoising passes (env VIVANT_ENGINE): auto = fast on a CUDA device "
                             "with --mode optimized, else model; fast = FastDiT (FP8 GEMMs, fused kernels, "
                             "ring read-image attention, CUDA graphs; needs --mode optimized); model = the "
                             "float VideoDiT")
    parser.add_argument("--out", default=None, help="file sink: write each chunk's latents (--runner generator) "
                                                     "or an MP4 per session (--runner pipeline) under this folder")
    parser.add_argument("--heartbeat-ttl", type=float, default=10.0, help="seconds without heartbeat = dead")
    parser.add_argument("--realtime", action=argparse.BooleanOptionalAction, default=True,
                        help="--runner generator: pace chunks at the video frame rate, as a viewer receives them "
                             "(default: on; --no-realtime runs as fast as the model goes, for throughput tests). "
                             "The pipeline and livekit runners are paced by their own playout")
    parser.add_argument("--log-level", default="INFO")


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not args.pool:
        print("vivant worker: --pool is required (or set VIVANT_POOL)")
        return 2
    if args.runner not in RUNNERS:  # argparse does not check a default taken from VIVANT_RUNNER
        print(f"vivant worker: runner: expected one of {', '.join(RUNNERS)} (--runner or VIVANT_RUNNER), "
              f"got {args.runner!r}")
        return 2
    engine = getattr(args, "engine", "auto")
    if engine not in EngineName._value2member_map_:  # nor one taken from VIVANT_ENGINE
        print(f"vivant worker: engine: expected one of {', '.join(EngineName)} (--engine or VIVANT_ENGINE), "
              f"got {engine!r}")
        return 2
    if engine == "fast" and args.mode != "optimized":
        print(f"vivant worker: engine: 'fast' needs --mode optimized (an FP8 ring cache), got mode {args.mode!r}")
        return 2
    try:
        weights = checkpoint_path(args.checkpoint)
    except ValueError as exc:
        print(f"vivant worker: {exc}")
        return 2
    if args.vae_weights and not args.vae_weights.startswith("/"):
        print(f"vivant worker: vae-weights: expected an absolute path (a mounted volume), got {args.vae_weights!r}")
        return 2
    registry = Registry(redis_client(args.redis), heartbeat_ttl_s=args.heartbeat_ttl)
    metrics = None
    if args.metrics_port:
        metrics = WorkerMetrics(pool=args.pool)
        serve_metrics(args.metrics_port, addr=args.metrics_addr)

    def load() -> SessionRunner:
        return build_runner(args, weights)

    info = WorkerInfo(worker_id=args.worker_id, pool=args.pool, node=args.node, model_preset=args.preset,
                      tp_size=args.tensor_parallel, capabilities=tuple(FlagValues.model_fields), warm=False)
    # The pipeline (pacer lead limit) and LiveKit (AVSynchronizer) runners pace themselves; pacing them
    # again here would leave them no jitter buffer.
    service = WorkerService(registry, FlagStore(registry.redis), info, load,
                            realtime=args.realtime and args.runner == "generator", metrics=metrics)

    def on_signal(signum: int, _frame: object) -> None:
        log.info("worker %s: signal %d, stopping after the current chunk", info.worker_id, signum)
        service.stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    log.info("worker %s (pool %s, runner %s) starting", info.worker_id, info.pool, args.runner)
    service.run()
    return 0
