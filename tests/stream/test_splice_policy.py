"""The splice policy shared by the one-process loop and the served runtime (`worker/stream/splice.py`): when a loop
splices, which answers of the playout it refuses, and how many audio samples the remade chunk keeps."""

from __future__ import annotations

import pytest
from vivant.worker.stream.pacer import PacerConfig
from vivant.worker.stream.splice import Splice, splice_cause


@pytest.mark.parametrize(("next_chunk", "interrupted", "turn_starts", "cause"), [
    (0, True, True, None),  # nothing made yet: nothing to cut
    (0, False, True, None),
    (3, False, False, None),
    (3, False, True, "turn"),
    (3, True, False, "interrupt"),
    (3, True, True, "interrupt"),  # one splice serves both, marked as the interrupt
])
def test_when_a_loop_splices(next_chunk: int, interrupted: bool, turn_starts: bool, cause: str | None) -> None:
    assert splice_cause(next_chunk, interrupted=interrupted, turn_starts=turn_starts) == cause


@pytest.mark.parametrize(("chunk", "frame"), [(1, 0), (6, 0), (7, 0), (8, 0), (7, 1), (4, -1)])
def test_an_answer_the_loop_cannot_rewind_to_is_refused(chunk: int, frame: int) -> None:
    """oldest = 2, next chunk 7: chunks 1 and 8 are out of reach, and chunk 7 (not taken yet) has no frame 1."""
    if (chunk, frame) in {(6, 0), (7, 0)}:
        splice = Splice.checked(7, chunk, frame, oldest=2, cause="turn")
        assert (splice.chunk, splice.frame, splice.moves) == (chunk, frame, chunk < 7)
        return
    with pytest.raises(RuntimeError, match=rf"chunk {chunk}, frame {frame}\); expected 2 ≤ chunk ≤ 7"):
        Splice.checked(7, chunk, frame, oldest=2, cause="turn")


def test_the_remade_chunk_keeps_the_samples_of_the_frames_shown() -> None:
    """24 fps, 16 kHz, 4 frames a chunk: frame f starts at sample floor(f · 16000 / 24). Chunk 5 starts at frame 20
    (sample 13333); frames 20, 21 shown → it keeps samples 13333 … 14665 (floor(22 · 16000 / 24) = 14666): 1333."""
    grid = PacerConfig(fps=24, frames_per_chunk=4, audio_sample_rate=16_000)
    assert Splice(9, 5, 0, "turn").keep_samples(grid) == 0
    assert Splice(9, 5, 2, "turn").keep_samples(grid) == 14666 - 13333
    assert Splice(9, 5, 3, "interrupt").keep_samples(grid) == 15333 - 13333
    # the kept samples of frames < k and the rest of the chunk add up to the chunk, whatever the rounding
    start, stop = grid.chunk_sample_range(5)
    for k in range(4):
        keep = Splice(9, 5, k, "turn").keep_samples(grid)
        assert 0 <= keep < stop - start and keep == grid.frame_sample(20 + k) - start
