"""`PaddedGenerator` (worker/model/cadence.py): every chunk takes at least the padded time, the chunk itself is the
wrapped generator's, everything else passes through; the worker's `--pad-chunk-ms` is checked by name."""

from __future__ import annotations

import argparse
import time

import pytest
from vivant.worker.model.cadence import PaddedGenerator
from vivant.worker.serving.cli import add_arguments, rank_spec


class Counting:
    cfg = "the model's config"
    rewind_chunks = 4

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def generate_chunk(self, audio, sample_rate):  # noqa: ANN001, ANN201
        self.calls.append((audio, sample_rate))
        return f"chunk {len(self.calls)}"

    def oldest_rewind(self) -> int:
        return 7


def test_each_chunk_takes_at_least_the_step_and_is_the_wrapped_generators():
    inner = Counting()
    gen = PaddedGenerator(inner, step_ms=40)
    start = time.perf_counter()
    assert gen.generate_chunk("pcm", 16000) == "chunk 1"
    assert gen.generate_chunk("pcm2", sample_rate=16000) == "chunk 2"
    assert time.perf_counter() - start >= 0.080
    assert inner.calls == [("pcm", 16000), ("pcm2", 16000)]
    assert gen.cfg == "the model's config" and gen.rewind_chunks == 4 and gen.oldest_rewind() == 7


@pytest.mark.parametrize("bad", [0, -5])
def test_a_step_that_is_not_positive_is_refused(bad):
    with pytest.raises(ValueError, match="step_ms: expected > 0"):
        PaddedGenerator(Counting(), bad)


@pytest.mark.parametrize("bad", ["-1", "10000"])
def test_the_workers_pad_option_is_checked_by_name(bad):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--pool", "p", "--device", "cpu", "--pad-chunk-ms", bad])
    with pytest.raises(ValueError, match="pad-chunk-ms: expected 0"):
        rank_spec(args)
    ok = parser.parse_args(["--pool", "p", "--device", "cpu", "--pad-chunk-ms", "103"])
    assert rank_spec(ok).pad_chunk_ms == 103.0
