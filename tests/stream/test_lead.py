"""The adaptive lead (vivant.worker.stream.lead): fed measured seconds, it picks the fewest chunks that cover the
p99 of diffuse + decode, within bounds, and records its changes. The times come from a FakeClock stepping through
scripted stage durations, as the pipeline's measurements would (no wall time)."""

from __future__ import annotations

import math

import pytest
from vivant.worker.model.config import ModelConfig
from vivant.worker.stream.lead import LeadConfig, LeadController
from vivant.worker.stream.pacer import FakeClock

CFG = ModelConfig.from_name("tiny")
PERIOD = CFG.frames_per_chunk / CFG.fps  # 0.1667 s


def feed(ctl: LeadController, clock: FakeClock, diffuse_s: list[float], decode_s: list[float], first: int = 0) -> None:
    """Chunk k: diffuse runs on the clock for diffuse_s[k], then decode for decode_s[k]; the controller sees the
    durations the clock measured, and is updated before each chunk is taken."""
    for k, (d, c) in enumerate(zip(diffuse_s, decode_s, strict=True)):
        ctl.update(first + k)
        t = clock.now()
        clock.advance(d)
        ctl.observe_diffuse(clock.now() - t)
        t = clock.now()
        clock.advance(c)
        ctl.observe_decode(clock.now() - t)


def test_keeps_the_configured_lead_until_enough_chunks_are_measured():
    ctl = LeadController(LeadConfig.for_model(CFG, initial_chunks=3, min_samples=6, warmup_chunks=2))
    feed(ctl, FakeClock(), [0.01] * 7, [0.01] * 7)  # 2 warm-up chunks + 5 measured
    assert ctl.work_p99_s() is None and ctl.target() == 3 and ctl.lead == 3
    assert ctl.changes == [(0, 3)]
    assert ctl.min_lead_s() == pytest.approx(3 * PERIOD), "before measurements the rewind keeps the configured span"
    assert ctl.diffuse_p99_s() == 0.0, "no next-chunk time before measurements (the configured span covers it)"


def test_fast_steady_chunks_shrink_the_lead_to_one():
    ctl = LeadController(LeadConfig.for_model(CFG, initial_chunks=3, margin_s=0.02, warmup_chunks=0))
    feed(ctl, FakeClock(), [0.03] * 10, [0.02] * 10)
    assert ctl.update(10) == 1
    assert ctl.changes == [(0, 3), (6, 1)], "one change, at the first chunk after min_samples were measured"


def test_warm_up_chunks_do_not_count():
    ctl = LeadController(LeadConfig.for_model(CFG, initial_chunks=3, warmup_chunks=2, min_samples=4, window=8))
    feed(ctl, FakeClock(), [5.0, 2.0] + [0.03] * 6, [1.0, 0.5] + [0.02] * 6)  # two slow first chunks (compile)
    assert ctl.work_p99_s() == pytest.approx(0.05) and ctl.update(8) == 1
    assert ctl.min_lead_s() == pytest.approx(0.05 + ctl.config.margin_s), "the rewind keeps the work plus the margin"
    assert ctl.diffuse_p99_s() == pytest.approx(0.03), "a splice's next-chunk time: the diffuse alone"


def test_the_lead_covers_the_p99_of_jittery_chunks_not_their_mean():
    cfg = LeadConfig.for_model(CFG, initial_chunks=2, window=40, min_samples=10, margin_s=0.02, warmup_chunks=0)
    ctl = LeadController(cfg)
    diffuse = [0.05] * 38 + [0.30, 0.30]  # two slow chunks in forty: the mean would call for one chunk of lead
    feed(ctl, FakeClock(), diffuse, [0.04] * 40)
    work = ctl.work_p99_s()
    assert work > 0.3, "the p99 must see the slow chunks"
    assert ctl.update(40) == math.ceil((work + 0.02) / PERIOD) >= 3


def test_the_lead_is_bounded_and_follows_the_window():
    cfg = LeadConfig.for_model(CFG, initial_chunks=2, max_chunks=4, window=8, min_samples=4, warmup_chunks=0)
    ctl = LeadController(cfg)
    clock = FakeClock()
    feed(ctl, clock, [2.0] * 8, [0.5] * 8)  # far slower than real time
    assert ctl.update(8) == 4, "never above max_chunks"
    feed(ctl, clock, [0.01] * 8, [0.01] * 8, first=9)  # the slow chunks leave the window
    assert ctl.update(17) == 1
    assert [lead for _, lead in ctl.changes] == [2, 4, 1]
    assert ctl.min_lead_s() == pytest.approx(1 / CFG.fps), "at least one frame period"


@pytest.mark.parametrize("overrides, match", [
    ({"initial_chunks": 9, "max_chunks": 6}, "initial_chunks = 9; expected within"),
    ({"min_chunks": 0}, "min_chunks = 0; expected a positive integer"),
    ({"max_chunks": 2, "min_chunks": 3, "initial_chunks": 3}, "max_chunks = 2; expected ≥ min_chunks = 3"),
    ({"margin_s": -0.1}, "margin_s = -0.1; expected ≥ 0 seconds"),
    ({"min_samples": 60, "window": 48}, "min_samples = 60; expected ≤ window = 48"),
    ({"quantile": 0}, "quantile = 0; expected a percentile"),
    ({"warmup_chunks": -1}, "warmup_chunks = -1; expected an integer ≥ 0"),
])
def test_bad_config_is_rejected_naming_the_field(overrides, match):
    with pytest.raises(ValueError, match=match):
        LeadConfig.for_model(CFG, **overrides)


def test_bad_measurements_are_rejected_and_not_kept():
    ctl = LeadController(LeadConfig.for_model(CFG, min_samples=1, warmup_chunks=0))
    for bad in (-0.01, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="diffuse time: expected finite seconds ≥ 0"):
            ctl.observe_diffuse(bad)
    ctl.observe_decode(0.01)
    assert not ctl.measured(), "rejected values must not count as measurements"
