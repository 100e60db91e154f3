"""What the worker service's chunk loop knows about one session between two chunks (vivant.worker.serving.service).

Frozen records, each advanced by one method per chunk, so the loop's state is named and testable alone:

* `PlayoutEstimate`: frames made and stalls, for a runner whose playout no pacer counts (the generator runner, a
  LiveKit room) and for the reports while the session streams. The playout clock starts one chunk period before the
  first chunk is done (playback cannot begin before a chunk exists, so a slow first chunk, e.g. CUDA graph capture,
  delays the start instead of making every later chunk late); chunk n (0-based) is due `n + buffer_chunks` chunk
  periods after that start, and one done later is a stall (the viewer's buffer ran dry).
* `FaultRun`: chunks with NaN/Inf latents in a row, chunks with finite latents, and whether any chunk faulted.
* `SessionOutcome`: the phase and reason a session ends with.
* `SessionState`: the session's flags in effect, its chunks' compute times, the two records above, and when it
  started and last reported (monotonic seconds).

The stall figure a session ends with has one source: `SessionState.final_account` takes the pacer's count when the
runner has one (`SessionRunner.end`'s `PlayoutAccount`, the decoder rank's acknowledgement) and the estimate only
when it has none.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal, NamedTuple

from vivant.apis.feature_flags import FlagValues
from vivant.sessions.models import Assignment
from vivant.worker.serving.runner import PlayoutAccount


class SessionOutcome(NamedTuple):
    """How a session ended: its final phase and `SessionStats.end_reason` (the chunk loop returns one to stop)."""

    phase: Literal["Ended", "Failed"]
    reason: str


@dataclass(frozen=True)
class PlayoutEstimate:
    """The playout as the service estimates it (module docstring). `chunk_s`: seconds of video per chunk;
    `buffer_chunks`: chunks the viewer's buffer holds; `start`: the playout clock's start (monotonic s; the session's
    start until the first chunk is done); `chunks`, `frames`, `stalls`: counted so far."""

    chunk_s: float
    buffer_chunks: int
    start: float
    chunks: int = 0
    frames: int = 0
    stalls: int = 0

    def after_chunk(self, frames: int, done: float) -> PlayoutEstimate:
        """The estimate once the next chunk, of `frames` frames, was done at monotonic time `done`."""
        start = done - self.chunk_s if self.chunks == 0 else self.start
        late = done - start > (self.chunks + self.buffer_chunks) * self.chunk_s
        return replace(self, start=start, chunks=self.chunks + 1, frames=self.frames + frames,
                       stalls=self.stalls + late)

    def stalled(self, before: PlayoutEstimate) -> bool:
        """Whether the chunk that led from `before` to this estimate missed its slot."""
        return self.stalls > before.stalls

    def ahead_s(self, now: float) -> float:
        """Seconds until the video made so far has played out at `now` (≤ 0: playback has caught up): how long a
        real-time runner waits before its next chunk."""
        return self.chunks * self.chunk_s - (now - self.start)

    def account(self) -> PlayoutAccount:
        return PlayoutAccount(frames_published=self.frames, stalls=self.stalls)


@dataclass(frozen=True)
class FaultRun:
    """The session's numerical faults: `in_a_row` chunks with NaN/Inf latents up to the last one, `finite` chunks with
    finite latents in all, and `seen`: any chunk faulted."""

    in_a_row: int = 0
    finite: int = 0
    seen: bool = False

    def after_chunk(self, faulted: bool) -> FaultRun:
        return FaultRun(in_a_row=self.in_a_row + 1 if faulted else 0, finite=self.finite + (not faulted),
                        seen=self.seen or faulted)

    def faulted_s(self, chunk_s: float) -> float:
        """Seconds of video made of the faulted chunks in a row."""
        return self.in_a_row * chunk_s

    def over_limit(self, chunk_s: float, max_faulted_s: float) -> bool:
        """The faulted chunks in a row make `max_faulted_s` seconds of video or more (1e-9 s of rounding allowed)."""
        return self.in_a_row > 0 and self.faulted_s(chunk_s) >= max_faulted_s - 1e-9


@dataclass
class SessionState:
    """One streaming session (module docstring). Replaced field by field as chunks come (`flag_version`/`flags` at a
    flag change, `playout` and `faults` per chunk); `compute_ms` grows by one entry per chunk (ms)."""

    assignment: Assignment
    started: float
    flag_version: int
    flags: FlagValues
    playout: PlayoutEstimate
    last_report: float
    faults: FaultRun = FaultRun()
    compute_ms: list[float] = field(default_factory=list)

    @classmethod
    def begin(cls, assignment: Assignment, flag_version: int, flags: FlagValues, *, chunk_s: float,
              buffer_chunks: int, now: float) -> SessionState:
        return cls(assignment, started=now, flag_version=flag_version, flags=flags,
                   playout=PlayoutEstimate(chunk_s, buffer_chunks, start=now), last_report=now)

    @property
    def chunks(self) -> int:
        return len(self.compute_ms)

    def final_account(self, pacer: PlayoutAccount | None) -> PlayoutAccount:
        """Frames and stalls the session ends with: the pacer's count when the runner has one, else the estimate."""
        return pacer if pacer is not None else self.playout.account()
