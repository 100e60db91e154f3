"""Device memory of one rank's step, part by part, and its headroom on the cards a fleet runs (issue: the numbers
the fleet needs; docs/BENCHMARKS.md).

Parts, each counted from its tensors and measured by the allocator's delta around building it (torch.cuda
memory_allocated; `measured_deltas`: fp8_weights around the FP8 quantization of the projections, ring_cache around
the cache's allocation, kept_by_chunk0 across chunk 0, which allocates the read image or the whole-window store):
  context      the CUDA context and whatever else holds the GPU before this process allocates: total − free of
               `torch.cuda.mem_get_info` at the start (outside PyTorch's allocator, so not in its counters)
  weights      the served engine's tensors (FP8 projections and their scales, the bf16 rest), counted once each
  ring         the KV ring (FP8 K/V, scales, slot positions), its bf16 read image (none for a bf16 ring: it is
               its own image) and the rewind undo log (worker/model/ring_undo.py), counted
  activations  the peak of an eager chunk (chunk 0) above what was allocated before it, less the read image (or
               whole-window store) and the undo log it allocates
  graphs       the CUDA graphs' private pools: memory reserved after the graph-replayed chunks minus after chunk 0
  peak         max_memory_allocated / max_memory_reserved over the whole run (includes what the benchmark keeps
               besides the served engine: the bf16 shard for the baseline and the other rows)
The served estimate is context + weights + ring (+ image, undo log) + activations + graphs (reserved: what the
allocator holds; the undo log as the run allocated it: its reset snapshot exists only after a position reset);
headroom = the card's bytes − that estimate: an 80 GB H100 (80e9 bytes) and a 141 GB H200 (141e9 bytes), the
nominal capacities (the exact figure of this GPU is `device_total_bytes`).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

CARDS = {"h100_80gb": 80e9, "h200_141gb": 141e9}


def tensor_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of the distinct storages among `tensors` (a view or a shared tensor counts once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is not None and t.numel():
            st = t.untyped_storage()
            seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def engine_weight_bytes(model: torch.nn.Module) -> int:
    """The model's parameters, buffers and the plain-attribute FP8 weights (`Fp8Linear.w8`, `.sw`)."""
    ts: list[torch.Tensor] = [*model.parameters(), *model.buffers()]
    for m in model.modules():
        for name in ("w8", "sw"):
            t = getattr(m, name, None)
            if isinstance(t, torch.Tensor):
                ts.append(t)
    return tensor_bytes(ts)


def cache_bytes(cache) -> dict[str, int]:
    """The ring (K/V, and the slot positions of the ablation's whole-window variant), that variant's window store,
    if any, and the rewind undo log (worker/model/ring_undo.py; allocated at the first chunk). The bf16 ring is
    what attention reads: there is no read image of its own."""
    ring = tensor_bytes([getattr(cache, n, None) for n in ("k", "v", "slot_pos")])
    window = cache.window.nbytes if getattr(cache, "window", None) is not None else 0
    undo = getattr(cache, "undo", None)
    undo_bytes = tensor_bytes(getattr(undo, "_buf", {}).values()) if undo is not None else 0
    return {"ring_bytes": ring, "whole_window_bytes": window, "undo_log_bytes": undo_bytes}


class StepMemory:
    """Snapshots around one engine's run (module docstring). All methods are no-ops off CUDA; `report` is None."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.marks: dict[str, tuple[int, int]] = {}
        self.context_bytes = self.total_bytes = 0
        if self.cuda:
            free, total = torch.cuda.mem_get_info(self.device)
            self.context_bytes, self.total_bytes = total - free - torch.cuda.memory_reserved(self.device), total

    def mark(self, name: str) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)
            self.marks[name] = (torch.cuda.memory_allocated(self.device), torch.cuda.memory_reserved(self.device))

    def reset_peak(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)

    def peak(self) -> tuple[int, int]:
        if not self.cuda:
            return 0, 0
        return torch.cuda.max_memory_allocated(self.device), torch.cuda.max_memory_reserved(self.device)

    def chunk_hook(self):
        """A `time_chunks` hook: marks the peak of chunk 0 and the state after it and after the last chunk."""
        def hook(n: int, last: bool) -> None:
            if n == 0:
                self.marks["chunk0_peak"] = self.peak()
                self.mark("after_chunk0")
            if last:
                self.mark("after_run")
        return hook

    def report(self, model: torch.nn.Module, cache) -> dict | None:
        """The breakdown after a run that called mark("before_chunk0") then ran with `chunk_hook()`."""
        if not self.cuda or not {"before_chunk0", "after_chunk0", "after_run"} <= self.marks.keys():
            return None
        weights = engine_weight_bytes(model)
        c = cache_bytes(cache)
        before, after0, end = self.marks["before_chunk0"], self.marks["after_chunk0"], self.marks["after_run"]
        image_and_window = c["whole_window_bytes"] + c["undo_log_bytes"]
        activations = max(0, self.marks["chunk0_peak"][0] - before[0] - image_and_window)
        alloc = {name: m[0] for name, m in self.marks.items()}
        pairs = {"fp8_weights": ("before_fp8_weights", "after_fp8_weights"),
                 "ring_cache": ("before_cache", "before_chunk0")}
        deltas = {k: alloc[b] - alloc[a] for k, (a, b) in pairs.items() if a in alloc and b in alloc}
        deltas["kept_by_chunk0"] = after0[0] - before[0]  # the whole-window store, the modulation cache
        graphs_reserved = max(0, end[1] - after0[1])
        served = self.context_bytes + weights + c["ring_bytes"] + image_and_window + activations + graphs_reserved
        peak_alloc, peak_res = self.peak()
        return {"context_bytes": self.context_bytes, "weights_bytes": weights, **c,
                "activations_peak_bytes": activations, "graphs_reserved_bytes": graphs_reserved,
                "graphs_allocated_bytes": max(0, end[0] - after0[0]),
                "measured_deltas": deltas, "served_estimate_bytes": served, "process_peak_allocated_bytes": peak_alloc,
                "process_peak_reserved_bytes": peak_res, "device_total_bytes": self.total_bytes,
                "headroom_bytes": {card: cap - served for card, cap in CARDS.items()},
                "note": "served estimate = context + weights + ring + undo log + activations + graph "
                        "pools; "
                        "process peaks include what this benchmark keeps beside the served engine"}
