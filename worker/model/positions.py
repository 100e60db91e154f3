"""Ring-slot arithmetic and token positions: pure integer logic, no tensors of the model.

The KV cache has `S = sink + W·T` slots (T = tokens per chunk, W = window chunks, the chunk being
generated included). Chunk c's T tokens live in window slot block `c mod W`, i.e. slots
`[sink + (c mod W)·T, sink + (c mod W + 1)·T)`, and overwrite chunk c−W there. The sink keeps the first
`sink` tokens of chunk 0 for the whole session; it becomes attendable once chunk 0 has left the window
(c ≥ W), so no key is ever seen twice.

Positions are (t, h, w) per token: t is the chunk's temporal index in the current position frame,
(h, w) the patch's grid cell; the chunk's audio tokens sit on an extra row h = grid_h, w = 0..A−1.
Sink tokens are anchored at t = 0 of the current frame (they keep their h, w). A session runs for
hours, so t cannot grow without bound: when chunk c would get t ≥ t_limit, the frame shifts by
Δ = t_limit − W (chunk c then gets t = W) and the cached window keys are rotated by −Δ once (delta
rotation); the sink, anchored at 0, is never rotated, so FP8 re-quantization never accumulates on it,
and a window chunk is re-rotated at most ⌈W / Δ⌉ times before it is evicted.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RingLayout:
    sink: int  # sink slots (first tokens of chunk 0)
    tokens_per_chunk: int  # T
    window_chunks: int  # W, including the chunk being generated

    def __post_init__(self) -> None:
        if self.tokens_per_chunk <= 0 or self.window_chunks <= 0 or self.sink < 0:
            raise ValueError(f"RingLayout: need tokens_per_chunk > 0, window_chunks > 0, sink ≥ 0; got {self}")
        if self.sink > self.tokens_per_chunk:
            raise ValueError(f"RingLayout: sink = {self.sink} must be ≤ tokens_per_chunk = {self.tokens_per_chunk}")

    @property
    def slots(self) -> int:
        return self.sink + self.window_chunks * self.tokens_per_chunk

    def block_of(self, chunk: int) -> int:
        if chunk < 0:
            raise ValueError(f"chunk index must be ≥ 0, got {chunk}")
        return chunk % self.window_chunks

    def chunk_slot_range(self, chunk: int) -> tuple[int, int]:
        start = self.sink + self.block_of(chunk) * self.tokens_per_chunk
        return start, start + self.tokens_per_chunk

    def chunk_slots(self, chunk: int) -> torch.Tensor:
        return torch.arange(*self.chunk_slot_range(chunk), dtype=torch.int64)

    def sink_slots(self) -> torch.Tensor:
        return torch.arange(self.sink, dtype=torch.int64)

    def sink_valid(self, chunk: int) -> bool:
        """The sink is attended once chunk 0 has been overwritten in the window."""
        return self.sink > 0 and chunk >= self.window_chunks

    def resident_chunks(self, chunk: int) -> list[int]:
        """Chunks whose K/V sit in the window while generating `chunk` (oldest first, `chunk` last)."""
        return list(range(max(0, chunk - self.window_chunks + 1), chunk + 1))

    def valid_mask(self, chunk: int) -> torch.Tensor:
        """Bool[S]: slots a query of `chunk` may attend (sink when valid, resident chunks incl. itself)."""
        mask = torch.zeros(self.slots, dtype=torch.bool)
        if self.sink_valid(chunk):
            mask[: self.sink] = True
        for c in self.resident_chunks(chunk):
            a, b = self.chunk_slot_range(c)
            mask[a:b] = True
        return mask

    def slot_owner(self, chunk: int) -> torch.Tensor:
        """Int64[S]: for each window slot the chunk whose token it holds while generating `chunk`, −1 if
        empty; sink slots report 0 (they hold chunk 0's first tokens) when valid, −1 otherwise."""
        owner = torch.full((self.slots,), -1, dtype=torch.int64)
        if self.sink_valid(chunk):
            owner[: self.sink] = 0
        for c in self.resident_chunks(chunk):
            a, b = self.chunk_slot_range(c)
            owner[a:b] = c
        return owner


@dataclass
class PositionFrame:
    """The temporal position frame: t(chunk) = chunk − offset; shifts by Δ at t_limit."""

    t_limit: int
    window_chunks: int
    offset: int = 0
    resets: int = 0

    @property
    def delta(self) -> int:
        return self.t_limit - self.window_chunks

    def t_of(self, chunk: int) -> int:
        return chunk - self.offset

    def needs_reset(self, chunk: int) -> bool:
        return self.t_of(chunk) >= self.t_limit

    def reset(self) -> int:
        """Shift the frame; returns Δ (cached window keys must be rotated by −Δ)."""
        d = self.delta
        self.offset += d
        self.resets += 1
        return d


def chunk_positions(chunk_t: int, grid_h: int, grid_w: int, audio_tokens: int) -> torch.Tensor:
    """Int64[T, 3] positions (t, h, w) of one chunk's tokens: video in raster order, then audio."""
    hh, ww = torch.meshgrid(torch.arange(grid_h), torch.arange(grid_w), indexing="ij")
    video = torch.stack([torch.full_like(hh, chunk_t), hh, ww], dim=-1).reshape(-1, 3)
    audio = torch.stack(
        [torch.full((audio_tokens,), chunk_t), torch.full((audio_tokens,), grid_h), torch.arange(audio_tokens)], dim=-1
    )
    return torch.cat([video, audio], dim=0).to(torch.int64)


def sink_positions(first_chunk_positions: torch.Tensor, sink: int) -> torch.Tensor:
    """Sink tokens keep (h, w) of chunk 0's first tokens and sit at t = 0 of every frame."""
    pos = first_chunk_positions[:sink].clone()
    pos[:, 0] = 0
    return pos
