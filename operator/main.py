"""`vivant operator`: run the kopf operator for CharacterSession and WorkerPool.

Settings come from the environment the Helm chart sets (VIVANT_REDIS_URL, LIVEKIT_API_KEY,
LIVEKIT_API_SECRET, VIVANT_*_TIMEOUT_S, ...; see `config.py`); flags given here override them.
Watches all namespaces unless `--namespace` is given (repeatable). With `--namespace`, kopf serves
exactly those namespaces without scanning the cluster (`settings.scanning.disabled`): a namespaced
operator may not list namespaces, and kopf would otherwise retry that for about 30 s before it
starts handling anything.

Replicas: `--peering-name NAME` makes kopf peering mandatory in that peering object (what the chart's
two replicas run with: without the peering CRD a replica waits instead of running beside another);
`--standalone` runs one replica without peering. The metrics server (`--metrics-port`) listens on
`--metrics-address`, loopback unless told otherwise.

Logging: kopf logs every run of every handler ("Timer 'session_tick' succeeded.") at INFO; the session
and pool timers run every 1-2 s per object, so those lines are DEBUG here (`RoutineTimerLogs`), and
the handlers log at INFO only when something changed.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import ipaddress
import logging
import os

import kopf
from vivant.operator.config import OperatorConfig


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--redis-url", help="Redis of the session registry (default: $VIVANT_REDIS_URL)")
    parser.add_argument("--namespace", "-n", action="append", default=[], help="watch only these namespaces")
    parser.add_argument("--metrics-port", type=int, help="serve Prometheus metrics on this port")
    parser.add_argument("--metrics-address", type=metrics_address,
                        help="listen address of the metrics server (default: $VIVANT_OPERATOR_METRICS_ADDRESS, "
                             "else 127.0.0.1; 0.0.0.0 where Prometheus scrapes the pod)")
    parser.add_argument("--liveness", default="http://0.0.0.0:8080/healthz", help="kopf liveness endpoint URL")
    peering = parser.add_mutually_exclusive_group()
    peering.add_argument("--standalone", action="store_true", help="no peering (single operator replica)")
    peering.add_argument("--peering-name", help="kopf peering object the replicas meet in (ClusterKopfPeering when "
                         "cluster-wide, else a KopfPeering in each namespace); peering is then mandatory: "
                         "without its CRD the operator waits instead of running beside other replicas")
    parser.add_argument("--verbose", "-v", action="store_true")


def metrics_address(text: str) -> str:
    """An argparse type: an IP address to listen on."""
    try:
        ipaddress.ip_address(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an IP address (127.0.0.1, 0.0.0.0, ::), got {text!r}") from None
    return text


class RoutineTimerLogs(logging.Filter):
    """On kopf's object logger: a timer's "... succeeded." line is DEBUG, not INFO (it would be written
    every second per session). Other lines pass unchanged."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if record.levelno == logging.INFO and message.startswith("Timer ") and message.endswith(" succeeded."):
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"
            return logging.getLogger().isEnabledFor(logging.DEBUG)
        return True


def operator_settings(namespaces: list[str]) -> kopf.OperatorSettings:
    """kopf settings that depend on the command line (the rest are set in handlers.configure)."""
    settings = kopf.OperatorSettings()
    # Exact namespaces need no cluster scan, and a namespaced operator is not allowed to list namespaces.
    settings.scanning.disabled = bool(namespaces)
    return settings


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
    if args.metrics_address:
        config = dataclasses.replace(config, metrics_address=args.metrics_address)
    from vivant.operator import handlers  # noqa: F401  (registers the handlers with kopf)

    kopf.configure(verbose=args.verbose)
    logging.getLogger("kopf.objects").addFilter(RoutineTimerLogs())
    asyncio.run(
        kopf.operator(
            clusterwide=not args.namespace,
            namespaces=args.namespace,  # [] when cluster-wide: kopf iterates it (None crashed at start)
            settings=operator_settings(args.namespace),
            standalone=args.standalone,
            peering_name=args.peering_name,
            liveness_endpoint=args.liveness or None,
            memo=kopf.Memo(config=config),
        )
    )
    return 0
