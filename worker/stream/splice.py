"""The splice policy at a turn start or an interrupt, once for both session loops.

The one-process loop (vivant.worker.stream.pipeline) and the served runtime (vivant.worker.serving.runtime) splice the
same way before they take chunk n (docs/ARCHITECTURE.md, "Turns: rewind and lead"):

* when: `splice_cause` — never before the first chunk (nothing was made to cut); "interrupt" when the speech was
  cleared since the last chunk (one splice serves both when a turn starts too), "turn" when the next chunk begins a
  turn after silence, else None (no splice).
* where: the playout answers (chunk r, frame k), the first frame it can still replace; `Splice.checked` refuses an
  answer outside what the loop can rewind to: `oldest` ≤ r ≤ n (oldest: the earliest chunk the generator's and the
  audio input's undo logs hold), and k = 0 unless chunk r was already taken (r < n).
* what the audio keeps: `Splice.keep_samples` — chunk r is made again and only its frames k.. are shown, so the audio
  input gives chunk r back the samples it took for its frames < k (the viewer saw those) and the new speech starts at
  frame k's first sample.

Pure: integers in, integers out; the callers rewind their generator and audio input with the result.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from vivant.worker.stream.pacer import PacerConfig

SpliceCause = Literal["interrupt", "turn"]


def splice_cause(next_chunk: int, *, interrupted: bool, turn_starts: bool) -> SpliceCause | None:
    """Why the loop splices before taking chunk `next_chunk`, or None: `interrupted` (the speech was cleared since the
    last chunk) wins over `turn_starts` (the next chunk begins a turn after silence); chunk 0 never splices."""
    if next_chunk <= 0:
        return None
    if interrupted:
        return "interrupt"
    return "turn" if turn_starts else None


@dataclass(frozen=True)
class Splice:
    """One splice before chunk `next_chunk` was taken: the loop goes back to chunk `chunk` and shows it from frame
    `frame` (both counted from the session's start; `frame` within the chunk, 0 … frames_per_chunk − 1)."""

    next_chunk: int
    chunk: int
    frame: int
    cause: SpliceCause

    @classmethod
    def checked(cls, next_chunk: int, chunk: int, frame: int, *, oldest: int, cause: SpliceCause) -> Splice:
        """The playout's answer (chunk, frame), refused with RuntimeError when the loop cannot rewind to it: chunk
        outside [oldest, next_chunk], or frame ≠ 0 for the chunk about to be taken (it has no frames yet)."""
        if not oldest <= chunk <= next_chunk or not (frame == 0 or chunk < next_chunk) or frame < 0:
            raise RuntimeError(f"the playout spliced at (chunk {chunk}, frame {frame}); expected {oldest} ≤ chunk ≤ "
                               f"{next_chunk} (the chunk about to be taken), frame 0 unless the chunk was taken")
        return cls(next_chunk, chunk, frame, cause)

    @property
    def moves(self) -> bool:
        """Whether the loop goes back at all (chunk < next_chunk); at chunk = next_chunk nothing is made again."""
        return self.chunk < self.next_chunk

    @property
    def interrupt(self) -> bool:
        return self.cause == "interrupt"

    def keep_samples(self, grid: PacerConfig) -> int:
        """Audio samples chunk `chunk` keeps when it is taken again: those of its frames < `frame` on the slot grid
        (`PacerConfig.frame_sample`, exact integers); 0 for a whole-chunk rewind (frame 0)."""
        first = self.chunk * grid.frames_per_chunk
        return grid.frame_sample(first + self.frame) - grid.frame_sample(first)
