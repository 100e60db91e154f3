"""`vivant operator`: run the kopf operator for CharacterSession and WorkerPool.

Settings come from the environment the Helm chart sets (VIVANT_REDIS_URL, LIVEKIT_API_KEY,
LIVEKIT_API_SECRET, VIVANT_*_TIMEOUT_S, ...; see `config.py`); flags given here override them.
Watches all namespaces unless `--namespace` is given (repeatable).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os

import kopf
from vivant.operator.config import OperatorConfig


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--redis-url", help="Redis of the session registry (default: $VIVANT_REDIS_URL)")
    parser.add_argument("--namespace", "-n", action="append", default=[], help="watch only these namespaces")
    parser.add_argument("--metrics-port", type=int, help="serve Prometheus metrics on this port")
    parser.add_argument("--liveness", default="http://0.0.0.0:8080/healthz", help="kopf liveness endpoint URL")
    parser.add_argument("--standalone", action="store_true", help="no peering (single operator replica)")
    parser.add_argument("--verbose", "-v", action="store_true")


def run(args: argparse.Namespace) -> int:
    env = dict(os.environ)
    if args.redis_url:
        env["VIVANT_REDIS_URL"] = args.redis_url
    try:
        config = OperatorConfig.from_env(env)
    except ValueError as exc:
        print(f"vivant operator: {exc}")
        return 2
    if args.metrics_port:
        config = dataclasses.replace(config, metrics_port=args.metrics_port)
    from vivant.operator import handlers  # noqa: F401  (registers the handlers with kopf)

    kopf.configure(verbose=args.verbose)
    asyncio.run(
        kopf.operator(
            clusterwide=not args.namespace,
            namespaces=args.namespace,  # [] when cluster-wide: kopf iterates it (None crashed at start)
            standalone=args.standalone,
            liveness_endpoint=args.liveness or None,
            memo=kopf.Memo(config=config),
        )
    )
    return 0
