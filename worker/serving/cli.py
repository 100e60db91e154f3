"""`vivant worker`: one worker for 1 to N GPUs (or CPU ranks) — parse the command line, form the ranks, serve.

    vivant worker --pool POOL [--tensor-parallel N] [--decoder-device own|shared] [--device auto|cpu|cuda]
                  [--runner generator|pipeline|livekit] [--preset tiny] [--out DIR] ...

The process is rank 0: it registers in Redis (as loading), forms its N + 1 ranks (vivant.worker.serving.runtime:
N tensor-parallel DiT ranks and one decoder rank, spawned with torch.multiprocessing and joined with
torch.distributed — NCCL on GPUs, gloo on CPU), becomes warm, and serves sessions from its inbox
(vivant.worker.serving.service). SIGTERM/SIGINT stop it after the current chunk; it exits 0. When a rank dies
or raises, the session ends with that reason, the lease is released, and the worker exits with status 3 so its
pod restarts and forms its ranks again. Input errors on the command line exit with status 2 and name the
option.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
from pathlib import Path

from vivant.apis.feature_flags import FlagValues
from vivant.ports import free_port
from vivant.sessions.flags import FlagStore
from vivant.sessions.models import WorkerInfo
from vivant.sessions.registry import Registry, redis_client
from vivant.worker.model.config import ConfigError
from vivant.worker.model.options import CacheMode, EngineName
from vivant.worker.serving.layout import DecoderDevice, RankLayout
from vivant.worker.serving.metrics import WorkerMetrics
from vivant.worker.serving.metrics import serve as serve_metrics
from vivant.worker.serving.ranks import RankSpec, RunnerKind
from vivant.worker.serving.runner import EXIT_FAULT, WorkerFault
from vivant.worker.serving.service import WorkerService
from vivant.worker.stream.vae import VAEConfig

log = logging.getLogger(__name__)


def checkpoint_path(checkpoint: str) -> Path | None:
    """`--checkpoint` -> a local safetensors path, or None for random weights. Weights are never fetched
    at run time: a remote URI must be mounted as a volume first."""
    if not checkpoint or checkpoint.startswith("random://"):  # e.g. random://tiny in a WorkerPool spec
        return None
    if checkpoint.startswith("/"):
        return Path(checkpoint)
    raise ValueError(f"checkpoint: expected an absolute path (a mounted volume) or random://, got {checkpoint!r}; "
                     "weights are not fetched at run time")


def _choices(enum) -> list[str]:  # noqa: ANN001
    return [m.value for m in enum]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    env = os.environ
    parser.add_argument("--pool", default=env.get("VIVANT_POOL"), help="WorkerPool name (env VIVANT_POOL)")
    parser.add_argument("--worker-id", default=env.get("VIVANT_WORKER_ID") or env.get("POD_NAME") or socket.gethostname(),
                        help="worker id, the pod name (env VIVANT_WORKER_ID or POD_NAME; default: hostname)")
    parser.add_argument("--node", default=env.get("VIVANT_NODE") or env.get("NODE_NAME", ""),
                        help="node name (env VIVANT_NODE or NODE_NAME)")
    parser.add_argument("--redis", default=env.get("VIVANT_REDIS_URL", "redis://127.0.0.1:6379/0"),
                        help="Redis URL (env VIVANT_REDIS_URL)")
    parser.add_argument("--tensor-parallel", default=env.get("VIVANT_TENSOR_PARALLEL", "1"),
                        help="DiT ranks; the worker runs this many + 1 decoder rank (env VIVANT_TENSOR_PARALLEL)")
    parser.add_argument("--decoder-device", default=env.get("VIVANT_DECODER_DEVICE", DecoderDevice.OWN.value),
                        help="own = the decoder rank on its own GPU (N + 1 GPUs); shared = beside DiT rank 0 on "
                             "its GPU (N GPUs) (env VIVANT_DECODER_DEVICE)")
    parser.add_argument("--device", default=env.get("VIVANT_DEVICE", "auto"),
                        help="cpu, cuda, or auto (cuda when this host has a GPU): every rank on the CPU (gloo), or "
                             "DiT rank r on cuda:r (NCCL) (env VIVANT_DEVICE)")
    parser.add_argument("--runner", default=env.get("VIVANT_RUNNER", RunnerKind.GENERATOR.value),
                        help="a session's output (env VIVANT_RUNNER): generator = latents only (kept under --out); "
                             "pipeline = decoder + pacer, an MP4 per session under --out (else nothing kept); "
                             "livekit = decoder + the assignment's LiveKit room (the agent's speech in)")
    parser.add_argument("--preset", default=env.get("VIVANT_MODEL_PRESET", "tiny"), help="model preset")
    parser.add_argument("--checkpoint", default=env.get("VIVANT_CHECKPOINT", ""),
                        help="safetensors checkpoint: an absolute path (mounted volume), or random:// for random "
                             "weights of the preset's shapes (benchmarks); env VIVANT_CHECKPOINT")
    parser.add_argument("--vae-weights", default=env.get("VIVANT_VAE_WEIGHTS") or None,
                        help="decoder safetensors (absolute path) for --runner pipeline|livekit; default: random "
                             "weights of the preset's shapes (env VIVANT_VAE_WEIGHTS)")
    parser.add_argument("--vae-widths", default=None,
                        help="the decoder's channel widths, comma-separated (e.g. 16,8,8: a decoder of other widths "
                             "over the preset's latent grid, frames of 2^(n−1) × the latent size); default the preset's")
    parser.add_argument("--mode", default=CacheMode.OPTIMIZED.value, help=f"KV cache: {', '.join(_choices(CacheMode))}")
    parser.add_argument("--engine", default=env.get("VIVANT_ENGINE", EngineName.AUTO.value),
                        help="what runs the denoising passes (env VIVANT_ENGINE): auto = fast on a CUDA device with "
                             "--mode optimized, else model; fast = the FP8 parts (FP8 GEMMs, fused kernels, read-image "
                             "attention, CUDA graphs; needs --mode optimized); model = the float parts")
    parser.add_argument("--out", default=None,
                        help="keep each session under this folder: <session>/latents/chunk_NNNNN.npy, video.mp4 "
                             "(--runner pipeline), rank<r>.jsonl (every rank's chunk-by-chunk record)")
    parser.add_argument("--speak", default=None,
                        help="an audio file the character says at the start of every session (default: silence; "
                             "--runner livekit takes the agent's speech from the room)")
    parser.add_argument("--rank-timeout", type=float, default=120.0,
                        help="seconds a rank waits on another in one collective before the worker gives up")
    parser.add_argument("--cpu-threads", type=int, default=1, help="torch threads per rank on --device cpu")
    parser.add_argument("--pad-chunk-ms", type=float, default=0.0,
                        help="benchmarks only: every chunk's diffusion takes at least this many ms (a sleep after the "
                             "real chunk), to run the call at a larger model's cadence (0 = off)")
    parser.add_argument("--metrics-port", type=int, default=int(env.get("VIVANT_METRICS_PORT", "0")),
                        help="serve Prometheus metrics on this port (env VIVANT_METRICS_PORT; 0 = off)")
    parser.add_argument("--metrics-addr", default="0.0.0.0", help="address the metrics server binds")
    parser.add_argument("--heartbeat-ttl", type=float, default=10.0, help="seconds without heartbeat = dead")
    parser.add_argument("--realtime", action=argparse.BooleanOptionalAction, default=True,
                        help="--runner generator: pace chunks at the video frame rate, as a viewer receives them "
                             "(default: on; --no-realtime runs as fast as the model goes). The pipeline and livekit "
                             "runners are paced by their playout")
    parser.add_argument("--log-level", default="INFO")


def _choice(enum, value: str, option: str, env_name: str | None = None):  # noqa: ANN001, ANN202
    try:
        return enum(value)
    except ValueError:
        where = f"{option} or {env_name}" if env_name else option
        raise ValueError(f"{option.lstrip('-')}: expected one of {', '.join(_choices(enum))} ({where}), "
                         f"got {value!r}") from None


def _vae_widths(text: str, preset: str) -> VAEConfig:
    """`--vae-widths 16,8,8` → the decoder's sizes over the preset's latent grid; ValueError naming the option."""
    from vivant.worker.model.config import ModelConfig

    try:
        widths = tuple(int(w) for w in text.split(","))
    except ValueError:
        widths = ()
    if len(widths) < 2 or min(widths) < 1:
        raise ValueError(f"vae-widths: expected at least two positive integers, comma-separated, got {text!r}")
    cfg = ModelConfig.from_name(preset)
    return VAEConfig(name=f"{cfg.name}-widths-{'-'.join(map(str, widths))}", latent_h=cfg.latent_h,
                     latent_w=cfg.latent_w, widths=widths, latent_channels=cfg.latent_channels)


def rank_spec(args: argparse.Namespace) -> RankSpec:
    """The ranks' configuration from the command line; a ValueError names the option that is wrong."""
    runner = _choice(RunnerKind, args.runner, "--runner", "VIVANT_RUNNER")
    engine = _choice(EngineName, args.engine, "--engine", "VIVANT_ENGINE")
    mode = _choice(CacheMode, args.mode, "--mode")
    decoder = _choice(DecoderDevice, args.decoder_device, "--decoder-device", "VIVANT_DECODER_DEVICE")
    try:
        tp = int(args.tensor_parallel)
    except ValueError:
        raise ValueError(f"tensor-parallel: expected a positive integer (--tensor-parallel or VIVANT_TENSOR_PARALLEL), "
                         f"got {args.tensor_parallel!r}") from None
    if engine is EngineName.FAST and mode is not CacheMode.OPTIMIZED:
        raise ValueError(f"engine: 'fast' needs --mode optimized (an FP8 ring cache), got mode {mode.value!r}")
    device = args.device
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device: expected cpu, cuda or auto (each rank picks its own index), got {args.device!r}")
    weights = checkpoint_path(args.checkpoint)
    if args.vae_weights and not args.vae_weights.startswith("/"):
        raise ValueError(f"vae-weights: expected an absolute path (a mounted volume), got {args.vae_weights!r}")
    vae = _vae_widths(args.vae_widths, args.preset) if args.vae_widths else None
    if args.speak and not Path(args.speak).is_file():
        raise ValueError(f"speak: {args.speak!r} is not a file")
    if args.cpu_threads < 1 or args.rank_timeout <= 0:
        raise ValueError("cpu-threads and rank-timeout: expected positive values, got "
                         f"{args.cpu_threads} and {args.rank_timeout}")
    if not 0 <= args.pad_chunk_ms < 10_000:
        raise ValueError(f"pad-chunk-ms: expected 0 (off) or a chunk time in ms below 10000, got {args.pad_chunk_ms}")
    layout = RankLayout(tp=tp, device=device, decoder_device=decoder)  # ConfigError (a ValueError) on bad tp
    return RankSpec(layout=layout, init_method=f"tcp://127.0.0.1:{free_port()}", preset=args.preset, mode=mode,
                    engine=engine, runner=runner, weights=str(weights) if weights else None,
                    vae_weights=args.vae_weights, vae=vae, out_dir=args.out, speak=args.speak, timeout_s=args.rank_timeout,
                    cpu_threads=args.cpu_threads, log_level=args.log_level, pad_chunk_ms=args.pad_chunk_ms)


def run(args: argparse.Namespace) -> int:
    from vivant.worker.serving.runtime import RankRuntime

    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s rank0 %(name)s: %(message)s")
    if not args.pool:
        print("vivant worker: --pool is required (or set VIVANT_POOL)")
        return 2
    try:
        spec = rank_spec(args)
        runtime = RankRuntime(spec)  # checks tp against the model and the GPUs before anything starts
    except (ValueError, ConfigError) as exc:
        print(f"vivant worker: {exc}")
        return 2
    registry = Registry(redis_client(args.redis), heartbeat_ttl_s=args.heartbeat_ttl)
    metrics = None
    if args.metrics_port:
        metrics = WorkerMetrics(pool=args.pool)
        serve_metrics(args.metrics_port, addr=args.metrics_addr)
    info = WorkerInfo(worker_id=args.worker_id, pool=args.pool, node=args.node, model_preset=args.preset,
                      tp_size=spec.layout.tp, capabilities=tuple(FlagValues.model_fields), warm=False)
    # The pipeline and livekit runners are paced by their playout; pacing them again here would leave them no
    # jitter buffer.
    service = WorkerService(registry, FlagStore(registry.redis), info, runtime.start,
                            realtime=args.realtime and spec.runner is RunnerKind.GENERATOR, metrics=metrics)
    runtime.supervisor.on_failure = service.fail
    runtime.supervisor.on_stuck = service.abort

    def on_signal(signum: int, _frame: object) -> None:
        log.info("worker %s: signal %d, stopping after the current chunk", info.worker_id, signum)
        service.stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    log.info("worker %s (pool %s, runner %s) forming %d DiT rank(s) + 1 decoder rank on %s", info.worker_id,
             info.pool, spec.runner.value, spec.layout.tp, spec.layout.device)
    try:
        service.run()
    except WorkerFault as exc:  # a rank failed while the ranks were being formed
        log.error("worker %s: %s", info.worker_id, exc)
        return EXIT_FAULT
    finally:
        runtime.supervisor.released.set()
        runtime.shutdown()
    log.info("worker %s: stopped (exit status %d)", info.worker_id, service.exit_code)
    return service.exit_code
