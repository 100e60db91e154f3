"""`vivant bench <what>`: benchmarks that print JSON and a short table (baseline vs optimized side by side).

  step    the DiT chunk step (bench/step.py)
  decode  the VAE decoder and the two-stage pipeline (bench/decode.py)
  call    the whole LiveKit call on this machine, measured at the receiving participant (bench/livekit_call.py)
  fleet   the control plane with a thousand sessions on simulated GPU nodes (bench/fleet/)
  turn    turn latency through the streaming loop by stage, with rewinds and an interruption (bench/turn.py)

Only the chosen bench's module is imported, when its arguments are parsed (the others pull in torch, the LiveKit
SDK or the Kubernetes client); the list of benches and their one-line help come from the modules' files.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.util

BENCHES = {"step": "vivant.bench.step", "decode": "vivant.bench.decode", "call": "vivant.bench.livekit_call",
           "fleet": "vivant.bench.fleet.run", "turn": "vivant.bench.turn"}


class _BenchParser(argparse.ArgumentParser):
    """One bench's parser: its module is imported and its arguments added the first time it parses."""

    def __init__(self, *args, bench: tuple[str, str] | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._bench = bench  # (name, module) until loaded

    def parse_known_args(self, args=None, namespace=None):
        if self._bench is not None:
            name, module = self._bench
            self._bench = None
            _load(self, name, module)
        return super().parse_known_args(args, namespace)


def _load(p: argparse.ArgumentParser, name: str, module: str) -> None:
    try:
        mod = importlib.import_module(module)
    except ImportError as exc:
        if (exc.name or "").startswith("vivant"):
            raise  # our own code is broken: say so, do not hide it
        # a dependency this machine lacks (e.g. the LiveKit SDK on a GPU machine): the other benches still run
        p.set_defaults(_bench_run=_unavailable(name, exc))
        return
    mod.add_arguments(p)
    p.set_defaults(_bench_run=mod.run)


def _summary(module: str) -> str | None:
    """The first line of the module's docstring, read from its file; None when the module is not installed."""
    try:
        spec = importlib.util.find_spec(module)
    except ModuleNotFoundError:
        return None
    if spec is None or not spec.origin:
        return None
    with open(spec.origin, encoding="utf-8") as f:
        doc = ast.get_docstring(ast.parse(f.read(), spec.origin)) or ""
    return (doc.strip().splitlines() or [""])[0]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="bench", metavar="WHAT", required=True, parser_class=_BenchParser)
    for name, module in BENCHES.items():
        summary = _summary(module)
        if summary is None:
            continue  # not part of this install
        sub.add_parser(name, help=summary, bench=(name, module))


def _unavailable(name: str, exc: ImportError):
    def run(args: argparse.Namespace) -> int:
        raise SystemExit(f"vivant bench {name}: unavailable on this machine: {exc} (install the project's extras)")
    return run


def run(args: argparse.Namespace) -> int:
    return int(args._bench_run(args) or 0)
