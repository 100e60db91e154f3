"""The ring's undo log: what the last `depth` chunks overwrote, so a session can rewind to a chunk boundary.

Why: when a speech turn starts, the chunks generated ahead of playback from silence are dropped and generation
restarts at the first chunk not shown (docs/ARCHITECTURE.md, "Rewind at a turn start"). The ring is overwritten in
place, so rewinding needs the contents each undone chunk replaced:

* per chunk c (saved by `save_chunk` when c begins, before its first write): its ring slots' K/V. A chunk's slots
  are one contiguous range (`RingLayout.chunk_slot_range`), so a save is one slice copy per tensor over all layers
  (`copy_words`), no host sync.
* per position reset (saved by `save_reset` before the delta rotation): the whole window's K (one contiguous
  slice; V is never rotated). Resets are `t_limit − W` chunks apart and the generator refuses a depth ≥ that, so
  at most one reset is ever inside the log; a second one inside it raises.

Rewinding to chunk 0 is not done here: the session is reset (`KVCache.clear`), which equals the state before
chunk 0 (chunk 0 also writes the sink, which this log does not save).

Every buffer is allocated once, at the first save, and restored with `copy_` into the ring's own tensors: CUDA
graphs keep the ring's addresses.

Memory, per rank: depth × L × T × H × 2·D·b bytes for the chunk entries plus L × W·T × H × D·b for the reset
snapshot (b: bytes per ring element, 2 for the served bf16 ring); docs/ARCHITECTURE.md gives the 57b figures.
"""

from __future__ import annotations

import torch


def word_views(dst: torch.Tensor, src: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(dst, src) as 8-byte-word (int64) views when both are tensors of one dtype and shape whose rows (last dim) are
    contiguous and whose every row's bytes and every other stride divide by 8; else (dst, src) as they are.
    Why: a slice of the ring over slots is strided (one block per layer), and the device's generic strided copy moves
    elements, so words copy the same bytes in 2–4× fewer elements (bf16: 4, float32: 2)."""
    def words_ok(t: torch.Tensor) -> bool:
        size = t.element_size()
        return t.stride(-1) == 1 and (t.shape[-1] * size) % 8 == 0 and \
            all((st * size) % 8 == 0 for st in t.stride()[:-1]) and (t.storage_offset() * size) % 8 == 0
    if dst.dtype == src.dtype and dst.shape == src.shape and dst.dim() and words_ok(dst) and words_ok(src):
        return dst.view(torch.int64), src.view(torch.int64)
    return dst, src


def copy_words(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst.copy_(src) through `word_views`: bit-exact either way."""
    d, s = word_views(dst, src)
    d.copy_(s)


class RingUndoLog:
    """Undo entries of the last `depth` chunks of one ring (`KVCache` optimized mode), plus one reset snapshot.

    Entry e = chunk mod depth holds what chunk `self.chunk_of[e]` overwrote; −1 marks an empty entry. Shapes per
    entry: K/V `[L, T, H, D]` in the ring's dtype."""

    def __init__(self, depth: int) -> None:
        if depth < 0:
            raise ValueError(f"rewind_chunks = {depth}; expected an integer ≥ 0 (0 turns rewinding off)")
        self.depth = depth
        self.chunk_of = [-1] * depth
        self._buf: dict[str, torch.Tensor] = {}
        self.reset_chunk: int | None = None  # the chunk that began with the position reset held in the snapshot
        # save_chunk's (entry, first slot) → its (dst, src) word views, for the ring tensors named by _save_key (their
        # data pointers): a chunk start then costs one copy call per tensor, no view building or stride checks
        self._save_key: tuple = ()
        self._save_views: dict[tuple[int, int], list[tuple[torch.Tensor, torch.Tensor]]] = {}

    def clear(self) -> None:
        self.chunk_of = [-1] * self.depth
        self.reset_chunk = None

    def _alloc(self, name: str, like: torch.Tensor, rows: int) -> torch.Tensor:
        buf = self._buf.get(name)
        if buf is None:
            shape = (self.depth, like.shape[0], rows, *like.shape[2:]) if not name.startswith("reset_") else \
                (like.shape[0], rows, *like.shape[2:])
            buf = self._buf[name] = torch.empty(shape, dtype=like.dtype, device=like.device)
        return buf

    # ---- saving -------------------------------------------------------------------------------------------
    def save_chunk(self, cache, chunk: int) -> None:
        """Before chunk `chunk`'s first write: keep its slots' current contents (one slice copy per tensor)."""
        if self.depth == 0:
            return
        a, b = cache.layout.chunk_slot_range(chunk)
        e = chunk % self.depth
        tensors = self._tensors(cache)
        key = tuple((name, t.data_ptr(), t.dtype, tuple(t.shape)) for name, t in tensors)
        if key != self._save_key:  # other ring tensors (another ring): views of the old ones go
            self._save_key, self._save_views = key, {}
        views = self._save_views.get((e, a))
        if views is None:
            views = self._save_views[(e, a)] = [word_views(self._alloc(name, t, b - a)[e], t[:, a:b])
                                                for name, t in tensors]
        for dst, src in views:
            dst.copy_(src)
        self.chunk_of[e] = chunk

    def save_reset(self, cache, chunk: int) -> None:
        """Before the position reset that begins chunk `chunk` rotates the window's keys: snapshot them."""
        if self.depth == 0:
            return
        if self.reset_chunk is not None and chunk - self.reset_chunk <= self.depth:
            raise RuntimeError(f"ring undo log: a position reset at chunk {chunk} while the reset at chunk "
                               f"{self.reset_chunk} is still within rewind_chunks = {self.depth}; expected resets "
                               f"more than rewind_chunks apart (t_limit − window_chunks > rewind_chunks)")
        s = cache.layout.sink
        for name, t in self._key_tensors(cache):
            copy_words(self._alloc("reset_" + name, t, t.shape[1] - s), t[:, s:])
        self.reset_chunk = chunk

    # ---- restoring ----------------------------------------------------------------------------------------
    def oldest(self, next_chunk: int) -> int:
        """The oldest chunk this log can rewind to when `next_chunk` is the next chunk to generate (≥ 1: rewinding
        to 0 is a session reset, done by the cache)."""
        lo = next_chunk
        if self.depth == 0:
            return lo
        while lo > max(1, next_chunk - self.depth) and self.chunk_of[(lo - 1) % self.depth] == lo - 1:
            lo -= 1
        return lo

    def restore(self, cache, to_chunk: int, next_chunk: int) -> None:
        """Undo chunks next_chunk − 1 … to_chunk, newest first (and the reset snapshot when its chunk is undone),
        into the ring's own tensors. The caller checked `oldest(next_chunk) ≤ to_chunk`."""
        s = cache.layout.sink
        for c in range(next_chunk - 1, to_chunk - 1, -1):
            e = c % self.depth
            a, b = cache.layout.chunk_slot_range(c)
            for name, t in self._tensors(cache):
                copy_words(t[:, a:b], self._buf[name][e])
            self.chunk_of[e] = -1
            if self.reset_chunk == c:
                for name, t in self._key_tensors(cache):
                    copy_words(t[:, s:], self._buf["reset_" + name])
                self.reset_chunk = None

    # ---- helpers ------------------------------------------------------------------------------------------
    @staticmethod
    def _tensors(cache):
        return [("k", cache.k), ("v", cache.v)]

    @staticmethod
    def _key_tensors(cache):
        return [("k", cache.k)]
