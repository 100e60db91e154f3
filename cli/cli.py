"""The `vivant` command line (the `vivant` package itself is a namespace: its subpackages map to
the top-level folders, see pyproject.toml).

Each subcommand lives with the component it drives and is imported only when chosen, so
`vivant flags ...` on an operator image never imports torch. A subcommand module exposes
`add_arguments(parser)` and `run(args) -> int`.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

# name -> (module, one-line help). Modules are imported lazily.
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("vivant.worker.stream.demo", "render a talking-character video on this machine (MP4) and print a report"),
    "bench": ("vivant.bench.cli", "benchmarks: step, decode, call, fleet, turn; JSON + table"),
    "worker": ("vivant.worker.serving.cli", "run a warm worker: register in Redis, wait for sessions, stream them"),
    "flags": ("vivant.sessions.flags_cli", "get/set a worker pool's live feature flags in Redis"),
    "operator": ("vivant.operator.main", "run the kopf operator (CharacterSession / WorkerPool)"),
    "api": ("vivant.gateway.server", "serve the session gateway, the REST API of /v1/realtime_sessions"),
    "eval": ("vivant.worker.quality.eval_cli", "quality gate: reference vs optimized path (lip-sync proxy, PSNR)"),
    "dev": ("vivant.devcluster.cli", "local development: `dev cluster up|down|status|build` (real Kubernetes, simulated GPU nodes)"),
    "train": ("vivant.worker.train.cli", "train the reference character (procedural data, VAE, DiT): `train ref`"),
}


def _top_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="vivant", description="vivant: real-time conversational video characters")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_) in COMMANDS.items():
        sub.add_parser(name, help=help_, add_help=False)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in COMMANDS:
        parser = _top_parser()
        if argv and not argv[0].startswith("-"):
            parser.error(f"unknown command {argv[0]!r}; expected one of: {', '.join(COMMANDS)}")
        parser.print_help()
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    name, rest = argv[0], argv[1:]
    module_name, help_ = COMMANDS[name]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and module_name.startswith(exc.name):
            print(f"vivant {name}: not available in this build ({module_name} is missing)", file=sys.stderr)
            return 2
        raise
    parser = argparse.ArgumentParser(prog=f"vivant {name}", description=help_)
    module.add_arguments(parser)
    args = parser.parse_args(rest)
    try:
        return int(module.run(args) or 0)
    except ValueError as exc:  # our input errors (ConfigError, AudioError, CheckpointError, ...) are ValueErrors
        if os.environ.get("VIVANT_TRACEBACK"):
            raise
        print(f"vivant {name}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
