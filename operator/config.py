"""The operator's own settings (not from any custom resource): Redis, LiveKit credentials, timeouts.

Read once at start-up, from the command line (`vivant operator`) or from the environment the chart
sets (`OperatorConfig.from_env`), and handed to the handlers through kopf's memo. Immutable; there is
no global config. A bad value raises ValueError naming the variable and what was expected.
"""

from __future__ import annotations

import ipaddress
import os
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta

from vivant.apis.livekit_token import LiveKitCredentials
from vivant.operator.builders import WorkerRuntime
from vivant.operator.reconcile import Timeouts


@dataclass(frozen=True)
class OperatorConfig:
    redis_url: str
    livekit: LiveKitCredentials = field(repr=True)
    timeouts: Timeouts = Timeouts()
    runtime: WorkerRuntime = WorkerRuntime()
    heartbeat_ttl_s: float = 10.0
    # a worker silent this long while Redis was reachable is reaped (docs/reliability.md); >= heartbeat_ttl_s
    reap_grace_s: float = 30.0
    token_ttl: timedelta = timedelta(minutes=10)
    metrics_port: int | None = None
    # where the metrics server listens: loopback unless told otherwise (the chart sets the pod's address
    # Prometheus scrapes); VIVANT_OPERATOR_METRICS_ADDRESS or --metrics-address
    metrics_address: str = "127.0.0.1"
    # kopf peering (several replicas): the live replica of highest priority works, the others wait; two of
    # equal priority would BOTH pause. So each replica gets its own: VIVANT_OPERATOR_PRIORITY, else one
    # derived from the pod name ($HOSTNAME). A replica that died is replaced after `peering_lifetime_s`.
    peering_priority: int = 0
    peering_lifetime_s: int = 15

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> OperatorConfig:
        env = os.environ if env is None else env

        def need(name: str) -> str:
            value = env.get(name, "")
            if not value:
                raise ValueError(f"{name}: expected a non-empty value in the operator's environment")
            return value

        def seconds(name: str, default: float) -> float:
            raw = env.get(name)
            if raw is None or raw == "":
                return default
            try:
                value = float(raw)
            except ValueError:
                raise ValueError(f"{name}: expected a number of seconds, got {raw!r}") from None
            if value <= 0:
                raise ValueError(f"{name}: expected a positive number of seconds, got {raw!r}")
            return value

        def integer(name: str, default: int, low: int, high: int) -> int:
            raw = env.get(name)
            if raw is None or raw == "":
                return default
            try:
                value = int(raw)
            except ValueError:
                raise ValueError(f"{name}: expected an integer, got {raw!r}") from None
            if not low <= value <= high:
                raise ValueError(f"{name}: expected {low}..{high}, got {value}")
            return value

        address = env.get("VIVANT_OPERATOR_METRICS_ADDRESS") or "127.0.0.1"
        try:
            ipaddress.ip_address(address)
        except ValueError:
            raise ValueError(f"VIVANT_OPERATOR_METRICS_ADDRESS: expected an IP address to listen on (127.0.0.1, "
                             f"0.0.0.0, ::), got {address!r}") from None
        port = env.get("VIVANT_OPERATOR_METRICS_PORT")
        if port not in (None, "") and not port.isdigit():
            raise ValueError(f"VIVANT_OPERATOR_METRICS_PORT: expected a port number, got {port!r}")
        return cls(
            redis_url=need("VIVANT_REDIS_URL"),
            livekit=LiveKitCredentials(need("LIVEKIT_API_KEY"), need("LIVEKIT_API_SECRET")),
            timeouts=Timeouts(
                pending_s=seconds("VIVANT_PENDING_TIMEOUT_S", Timeouts.pending_s),
                connect_s=seconds("VIVANT_CONNECT_TIMEOUT_S", Timeouts.connect_s),
            ),
            runtime=WorkerRuntime(redis_secret=env.get("VIVANT_WORKER_REDIS_SECRET") or WorkerRuntime.redis_secret),
            heartbeat_ttl_s=seconds("VIVANT_HEARTBEAT_TTL_S", 10.0),
            reap_grace_s=seconds("VIVANT_REAP_GRACE_S", 30.0),
            token_ttl=timedelta(seconds=seconds("VIVANT_TOKEN_TTL_S", 600.0)),
            metrics_port=int(port) if port else None,
            metrics_address=address,
            peering_priority=integer("VIVANT_OPERATOR_PRIORITY", name_priority(env.get("HOSTNAME", "")), 0, 2**31 - 1),
            peering_lifetime_s=integer("VIVANT_PEERING_LIFETIME_S", 15, 2, 600),
        )


def name_priority(name: str) -> int:
    """A kopf peering priority from a replica's pod name: stable per pod, distinct between pods (crc32)."""
    return zlib.crc32(name.encode()) & 0x7FFFFFFF
