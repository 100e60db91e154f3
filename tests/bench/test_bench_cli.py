"""`vivant bench`: only the chosen bench's module is imported; a bench whose third-party dependency this machine lacks (the LiveKit SDK is not on the GPU
machine) must not take the other benches down with it, and must say what is missing when asked to run; a broken
import of our own code must still fail loudly."""

from __future__ import annotations

import argparse
import importlib

import pytest
from vivant.bench import cli


def _parser_with(monkeypatch, failing: str, exc: ImportError) -> argparse.ArgumentParser:
    real = importlib.import_module

    def fake(name, *a, **kw):
        if name == failing:
            raise exc
        return real(name, *a, **kw)

    monkeypatch.setattr(cli.importlib, "import_module", fake)
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return parser


def test_a_missing_dependency_leaves_the_other_benches_and_names_itself(monkeypatch):
    parser = _parser_with(monkeypatch, "vivant.bench.livekit_call",
                          ImportError("cannot import name 'api' from 'livekit'", name="livekit"))
    args = parser.parse_args(["step", "--preset", "tiny"])
    assert args._bench_run.__module__ == "vivant.bench.step", "the step bench must still be the step bench"
    call = parser.parse_args(["call"])
    with pytest.raises(SystemExit, match="vivant bench call: unavailable on this machine: cannot import name 'api'"):
        cli.run(call)


def test_a_broken_import_of_our_own_code_is_raised(monkeypatch):
    """A bench's module is imported when that bench is chosen (parsing its arguments), so that is where it raises."""
    with pytest.raises(ImportError, match="vivant.worker.nothing"):
        parser = _parser_with(monkeypatch, "vivant.bench.step", ImportError("no module vivant.worker.nothing",
                                                                             name="vivant.worker.nothing"))
        parser.parse_args(["step", "--preset", "tiny"])


def test_only_the_chosen_bench_is_imported(monkeypatch):
    imported = []
    real = importlib.import_module
    monkeypatch.setattr(cli.importlib, "import_module", lambda name, *a, **kw: imported.append(name) or real(name, *a, **kw))
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    assert imported == [], "listing the benches imports none of them"
    assert parser.parse_args(["turn", "--preset", "tiny"])._bench_run.__module__ == "vivant.bench.turn"
    assert imported == ["vivant.bench.turn"]


def test_step_refuses_an_ablation_option_without_the_ablation():
    """`vivant bench step` times the served engine; `--ablation-rows` chooses ablation rows only, so it is refused,
    by name, before anything is built."""
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    args = parser.parse_args(["step", "--preset", "tiny", "--ablation-rows", "bf16_gemms"])
    with pytest.raises(SystemExit, match="--ablation-rows applies to --ablation only"):
        cli.run(args)
