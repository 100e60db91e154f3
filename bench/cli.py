"""`vivant bench <what>`: benchmarks that print JSON and a short table (baseline vs optimized side by side).

  step    the DiT chunk step (bench/step.py)
  decode  the VAE decoder and the two-stage pipeline (bench/decode.py)
  call    the whole LiveKit call on this machine, measured at the receiving participant (bench/livekit_call.py)
  fleet   the control plane with a thousand sessions on simulated GPU nodes (bench/fleet/)
  turn    turn latency through the streaming loop by stage, with rewinds and an interruption (bench/turn.py)
"""

from __future__ import annotations

import argparse
import importlib

BENCHES = {"step": "vivant.bench.step", "decode": "vivant.bench.decode", "call": "vivant.bench.livekit_call",
           "fleet": "vivant.bench.fleet.run", "turn": "vivant.bench.turn"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="bench", metavar="WHAT", required=True)
    for name, module in BENCHES.items():
        try:
            mod = importlib.import_module(module)
        except ImportError as exc:
            if exc.name == module:
                continue  # not part of this install
            if (exc.name or "").startswith("vivant"):
                raise  # our own code is broken: say so, do not hide it
            # a dependency this machine lacks (e.g. the LiveKit SDK on a GPU machine): the other benches still run
            p = sub.add_parser(name, help=f"(unavailable here: {exc})")
            p.set_defaults(_bench_run=_unavailable(name, exc))
            continue
        p = sub.add_parser(name, help=(mod.__doc__ or "").strip().splitlines()[0])
        mod.add_arguments(p)
        p.set_defaults(_bench_run=mod.run)


def _unavailable(name: str, exc: ImportError):
    def run(args: argparse.Namespace) -> int:
        raise SystemExit(f"vivant bench {name}: unavailable on this machine: {exc} (install the project's extras)")
    return run


def run(args: argparse.Namespace) -> int:
    return int(args._bench_run(args) or 0)
