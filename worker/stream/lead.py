"""The lead: how many chunks the generator may run ahead of playout, fitted to the measured jitter.

Why: every chunk generated ahead of playout is a chunk a new turn waits behind (or, with a rewind, a chunk of
compute thrown away), so the lead should be the fewest chunks that still keep stalls at 0. When chunk n is taken,
chunk n − lead has just started playing, so chunk n is due on screen `lead` chunk periods later; it is ready in
time when that exceeds its generation + decode time. The controller therefore chooses

    lead = ceil((p99(diffuse) + p99(decode) + margin_s) / chunk_period_s), bounded to [min_chunks, max_chunks]

over the last `window` chunks (the sum of the two p99s bounds the p99 of their sum from above: conservative).
The first `warmup_chunks` measurements of each kind are not used (one-time allocation and compilation, which a
warm worker pays before it takes a session). Until `min_samples` chunks of both kinds are measured after those it
keeps `initial_chunks`. The same estimate gives the
rewind's `min_lead_s` (chunks due sooner than that are kept at a rewind: the rewound chunk must be ready before
its slot, with the margin), at least one frame period. Pure logic: it is fed seconds and never reads a clock. Design: see
docs/ARCHITECTURE.md (Turns: rewind and lead).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class LeadConfig:
    """`chunk_period_s`, `frame_period_s`: the model's chunk and frame durations (s); `margin_s`: added to the
    p99 before dividing (s); `window`: chunks of history; bounds and the start value in chunks."""

    chunk_period_s: float
    frame_period_s: float
    initial_chunks: int = 3
    min_chunks: int = 1
    max_chunks: int = 6
    margin_s: float = 0.02
    window: int = 48
    min_samples: int = 6
    quantile: float = 99.0
    warmup_chunks: int = 2

    def __post_init__(self) -> None:
        for name in ("chunk_period_s", "frame_period_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"LeadConfig.{name} = {getattr(self, name)!r}; expected > 0 seconds")
        if not self.margin_s >= 0:
            raise ValueError(f"LeadConfig.margin_s = {self.margin_s!r}; expected ≥ 0 seconds")
        for name in ("min_chunks", "window", "min_samples"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"LeadConfig.{name} = {getattr(self, name)!r}; expected a positive integer")
        if self.max_chunks < self.min_chunks:
            raise ValueError(f"LeadConfig.max_chunks = {self.max_chunks}; expected ≥ min_chunks = {self.min_chunks}")
        if not self.min_chunks <= self.initial_chunks <= self.max_chunks:
            raise ValueError(f"LeadConfig.initial_chunks = {self.initial_chunks}; expected within "
                             f"[min_chunks, max_chunks] = [{self.min_chunks}, {self.max_chunks}]")
        if self.warmup_chunks < 0:
            raise ValueError(f"LeadConfig.warmup_chunks = {self.warmup_chunks!r}; expected an integer ≥ 0")
        if self.min_samples > self.window:
            raise ValueError(f"LeadConfig.min_samples = {self.min_samples}; expected ≤ window = {self.window}")
        if not 0 < self.quantile <= 100:
            raise ValueError(f"LeadConfig.quantile = {self.quantile!r}; expected a percentile in (0, 100]")

    @classmethod
    def for_model(cls, cfg, **overrides) -> LeadConfig:
        """Periods from a ModelConfig (fps, frames_per_chunk)."""
        return cls(chunk_period_s=cfg.frames_per_chunk / cfg.fps, frame_period_s=1 / cfg.fps, **overrides)


class LeadController:
    """Thread-safe enough for one writer per kind: `observe_diffuse` from the generator, `observe_decode` from the
    decoder thread (deque appends are atomic); `update(chunk)` is called by the producer before taking a chunk."""

    def __init__(self, config: LeadConfig) -> None:
        self.config = config
        self._diffuse: deque[float] = deque(maxlen=config.window)
        self._decode: deque[float] = deque(maxlen=config.window)
        self._skip = {"diffuse": config.warmup_chunks, "decode": config.warmup_chunks}
        self.lead = config.initial_chunks
        self.changes: list[tuple[int, int]] = [(0, config.initial_chunks)]  # (chunk index, lead from then on)

    def observe_diffuse(self, seconds: float) -> None:
        self._observe("diffuse", self._diffuse, seconds)

    def observe_decode(self, seconds: float) -> None:
        self._observe("decode", self._decode, seconds)

    def _observe(self, kind: str, window: deque[float], seconds: float) -> None:
        s = float(seconds)
        if not (s >= 0 and math.isfinite(s)):
            raise ValueError(f"{kind} time: expected finite seconds ≥ 0, got {seconds!r}")
        if self._skip[kind] > 0:
            self._skip[kind] -= 1
            return
        window.append(s)

    def measured(self) -> bool:
        return min(len(self._diffuse), len(self._decode)) >= self.config.min_samples

    def work_p99_s(self) -> float | None:
        """p99(diffuse) + p99(decode) over the window (s), or None before `min_samples` of each."""
        if not self.measured():
            return None
        q = self.config.quantile
        return float(np.percentile(list(self._diffuse), q) + np.percentile(list(self._decode), q))

    def diffuse_p99_s(self) -> float:
        """p99 of the diffuse time over the window (s), 0 before `min_samples`: what one more chunk costs the
        producer after a remade one (a splice's `next_chunk_s`; the remade chunk's decode overlaps it). Before it is
        measured the keep-horizon is the configured lead's whole span, which already leaves that time."""
        if not self.measured():
            return 0.0
        return float(np.percentile(list(self._diffuse), self.config.quantile))

    def target(self) -> int:
        """The lead the measurements call for now (chunks), or the current one before they suffice."""
        work = self.work_p99_s()
        if work is None:
            return self.lead
        c = self.config
        need = math.ceil((work + c.margin_s) / c.chunk_period_s - 1e-9)
        return max(c.min_chunks, min(c.max_chunks, need))

    def update(self, chunk: int) -> int:
        """Re-fit the lead before taking `chunk`; records a change in `changes`. Returns the lead."""
        lead = self.target()
        if lead != self.lead:
            self.lead = lead
            self.changes.append((chunk, lead))
        return self.lead

    def min_lead_s(self) -> float:
        """Keep-horizon for a rewind (s): chunks due within it stay; the measured p99 of diffuse + decode plus the
        margin (the configured lead's span before it is measured), at least one frame period. Without the margin
        the rewound chunk is ready just at its slot, and any jitter (the hand-over to the decoder and the pacer)
        makes it late."""
        work = self.work_p99_s()
        if work is None:
            return max(self.config.frame_period_s, self.config.initial_chunks * self.config.chunk_period_s)
        return max(self.config.frame_period_s, work + self.config.margin_s)
