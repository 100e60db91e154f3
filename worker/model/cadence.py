"""`PaddedGenerator`: a chunk generator whose every chunk takes at least a given wall time.

Why: the turn latency and the room path's real-time margin depend on how long a chunk takes to make, not on the
weights. One GPU serving the small `ref` model makes a chunk in a few ms; padding each chunk's diffusion with a
sleep to the measured 57b per-rank step time (docs/BENCHMARKS.md) shows the whole call — the worker's ranks, the
decoder, the room, the receiver — at the big model's cadence. A benchmark option (`vivant worker --pad-chunk-ms`,
`vivant bench call|turn --step-ms`), never a deployment's.
"""

from __future__ import annotations

import time
from typing import Any


class PaddedGenerator:
    """Wraps a `ChunkGenerator`: `generate_chunk` runs the real chunk, then sleeps for the rest of `step_ms`
    (milliseconds of wall time per chunk); every other attribute is the wrapped generator's."""

    def __init__(self, inner: Any, step_ms: float) -> None:
        if not step_ms > 0:
            raise ValueError(f"step_ms: expected > 0 ms per chunk, got {step_ms!r}")
        self.inner, self.step_ms = inner, float(step_ms)

    def generate_chunk(self, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        out = self.inner.generate_chunk(*args, **kwargs)
        rest = self.step_ms / 1e3 - (time.perf_counter() - start)
        if rest > 0:
            time.sleep(rest)
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)
