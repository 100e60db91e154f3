"""`python -m vivant.bench.fleet.operator_host operator ...`: `vivant operator` with its Redis commands counted.

The fleet benchmark runs the operator exactly as `vivant operator` runs it (same entry point, same
arguments), plus one probe: every Redis command the process sends is counted by name
(`redis_count`) into `vivant_bench_operator_redis_commands_total{command}` on the default Prometheus
registry, which the operator serves on its metrics port. Nothing else differs.
"""

from __future__ import annotations

import sys

from prometheus_client import Counter
from vivant.bench.fleet import redis_count

REDIS_COMMANDS = Counter("vivant_bench_operator_redis_commands", "Redis commands the operator process sent.",
                         ["command"])


def main(argv: list[str] | None = None) -> int:
    redis_count.install(lambda name: REDIS_COMMANDS.labels(command=name).inc())
    from vivant.cli import main as vivant_main

    return vivant_main(list(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    raise SystemExit(main())
