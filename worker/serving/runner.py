"""What the worker service drives: the `SessionRunner` protocol and its outcomes.

Both the service (vivant.worker.serving.service) and every runner import this module, and neither imports
the other, so the runners never depend on the service loop.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from vivant.apis.feature_flags import FlagValues
from vivant.sessions.models import Assignment

MAX_DURATION_REASON = "max duration reached"  # SessionStats.end_reason when the assignment's max duration passed


@dataclass(frozen=True)
class ChunkReport:
    """What one `SessionRunner.step` did: chunk index, compute time (ms), frames made, NaN/Inf seen."""

    index: int
    compute_ms: float
    frames: int
    numerical_fault: bool = False


class SessionEnded(Exception):  # noqa: N818 (an outcome, not an error)
    """Raised by `SessionRunner.step` when the session ended on the runner's side (e.g. the agent left
    the room while the step waited). The service ends the session as `Ended` with `reason`."""

    def __init__(self, reason: str) -> None:
        if not reason:
            raise ValueError("SessionEnded: reason must be a non-empty string")
        super().__init__(reason)
        self.reason = reason


class SessionRunner(Protocol):
    """The generation side of a worker. `apply_flags` is only ever called between two `step`s.

    Optional: a `kernel_path` attribute (`str | None`), the path in effect after `begin` applied the
    session's flags. Optional: an `end_reason` attribute (`str | None`); when it is a non-empty string at a chunk
    boundary the service ends the session with it. `step` may also raise `SessionEnded(reason)`."""

    frames_per_chunk: int
    chunk_seconds: float

    def begin(self, assignment: Assignment, flags: FlagValues) -> None: ...

    def apply_flags(self, flags: FlagValues) -> str | None:
        """Apply at a chunk boundary; return the kernel path now in effect, or None if unknown."""

    def step(self) -> ChunkReport: ...

    def end(self, reason: str) -> None: ...
