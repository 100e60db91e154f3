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
EXIT_FAULT = 3  # the worker's exit status after a WorkerFault (its pod restarts; its ranks are formed again)


@dataclass(frozen=True)
class ChunkReport:
    """What one `SessionRunner.step` did: chunk index, compute time (ms), frames made, NaN/Inf seen."""

    index: int
    compute_ms: float
    frames: int
    numerical_fault: bool = False


@dataclass(frozen=True)
class PlayoutAccount:
    """What the viewer got, as the pacer counted it: frames published at the frame rate, and stalls (chunks that
    missed their playout slot because the pacer's buffer ran dry). Returned by `SessionRunner.end` when the runner
    has the pacer's count (the decoder rank's acknowledgement); it replaces the service's own estimate."""

    frames_published: int
    stalls: int


class SessionEnded(Exception):  # noqa: N818 (an outcome, not an error)
    """Raised by `SessionRunner.step` when the session ended on the runner's side (e.g. the agent left
    the room while the step waited). The service ends the session as `Ended` with `reason`."""

    def __init__(self, reason: str) -> None:
        if not reason:
            raise ValueError("SessionEnded: reason must be a non-empty string")
        super().__init__(reason)
        self.reason = reason


class SessionInputError(ValueError):
    """Raised by `SessionRunner.begin`/`step` when the session's input is unusable (e.g. audio with NaN samples).
    Raised before the runner started any work for the chunk, so the session ends cleanly (`Failed`, reason
    "bad input: …") and the worker serves the next one."""


class SessionFailed(RuntimeError):  # noqa: N818 (an outcome)
    """Raised by `SessionRunner.step` when the session cannot go on but the worker can (e.g. the decoder rank's
    sink failed): the session ends as `Failed` with this message as its reason; the worker serves the next one."""


class WorkerFault(RuntimeError):
    """Raised by a runner when the worker itself can no longer serve (a rank died or raised): the service ends the
    session as `Failed` with this reason, releases the lease and stops; the worker then exits non-zero."""


class SessionRunner(Protocol):
    """The generation side of a worker. `apply_flags` is only ever called between two `step`s; `idle` between
    sessions, at least once per inbox poll (a runner with ranks to keep in step ticks them there).

    Optional: a `kernel_path` attribute (`str | None`), the path in effect after `begin` applied the
    session's flags. Optional: an `end_reason` attribute (`str | None`); when it is a non-empty string at a chunk
    boundary the service ends the session with it. `step` may also raise `SessionEnded(reason)`,
    `SessionInputError` or `WorkerFault`."""

    frames_per_chunk: int
    chunk_seconds: float

    def idle(self) -> None: ...

    def begin(self, assignment: Assignment, flags: FlagValues) -> None: ...

    def apply_flags(self, flags: FlagValues) -> str | None:
        """Apply at a chunk boundary; return the kernel path now in effect, or None if unknown."""

    def step(self) -> ChunkReport: ...

    def end(self, reason: str) -> PlayoutAccount | None:
        """End the session on the generation side; the pacer's account of the playout when the runner has one."""
