"""What both trainers share: clip windows, the time-budgeted schedule, a progress log, checkpoint writing.

Training runs for a wall-clock budget (seconds), not a step count, so one command fits the GPU call it
is given; the learning rate warms up (over its step count or the first 5 % of the budget, whichever
ends first) and decays with the fraction of the budget spent (cosine). Checkpoints are safetensors; on
a machine without the `safetensors` package (the GPU machine has only torch/numpy/av) the same file
format is written by hand (8-byte little-endian header length, JSON header with dtype/shape/offsets,
raw little-endian tensor bytes).
"""

from __future__ import annotations

import json
import math
import struct
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from vivant.worker.model.weights import CHECKSUM_KEY, tensors_digest


@dataclass
class Budget:
    seconds: float
    warmup_steps: int = 100
    start: float = field(default_factory=time.perf_counter)

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def done(self) -> bool:
        return self.elapsed() >= self.seconds

    def lr_factor(self, step: int) -> float:
        frac = min(1.0, self.elapsed() / max(self.seconds, 1e-9))
        # warm up over `warmup_steps` or the first 5 % of the budget, whichever ends first (slow CPU runs)
        warm = min(1.0, max((step + 1) / self.warmup_steps, self.elapsed() / max(0.05 * self.seconds, 1e-9)))
        return warm * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * frac)))


class Log:
    """Prints progress lines (flushed) and keeps the records for the JSON log."""

    def __init__(self, stream=None) -> None:
        self.stream = stream or sys.stdout
        self.records: list[dict] = []
        self.t0 = time.perf_counter()

    def __call__(self, msg: str, **record) -> None:
        t = time.perf_counter() - self.t0
        print(f"[{t:7.1f} s] {msg}", file=self.stream, flush=True)
        if record:
            self.records.append({"t_s": round(t, 2), **record})


def clip_starts(clip_chunks: np.ndarray) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(clip_chunks)[:-1]]).astype(np.int64)


def sample_windows(rng: np.random.Generator, clip_chunks: np.ndarray, length: int, batch: int) -> np.ndarray:
    """[batch] first global chunk index of windows of `length` chunks lying inside one clip each."""
    ok = np.nonzero(clip_chunks >= length)[0]
    if not ok.size:
        raise ValueError(f"no clip has ≥ {length} chunks (longest: {int(clip_chunks.max())})")
    starts = clip_starts(clip_chunks)
    clips = rng.choice(ok, size=batch)
    offs = (rng.random(batch) * (clip_chunks[clips] - length + 1)).astype(np.int64)
    return starts[clips] + offs


_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.int64: "I64", torch.int32: "I32"}


def save_tensors(tensors: dict[str, torch.Tensor], path: str | Path, metadata: dict[str, str] | None = None) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    metadata = {**(metadata or {}), CHECKSUM_KEY: tensors_digest(tensors)}  # checked when a worker loads it
    try:
        from safetensors.torch import save_file
    except ImportError:
        _write_safetensors(tensors, path, metadata)
    else:
        save_file(tensors, str(path), metadata=metadata)
    return path


def _write_safetensors(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str] | None) -> None:
    header: dict = {"__metadata__": metadata} if metadata else {}
    blobs, offset = [], 0
    for name in sorted(tensors):
        t = tensors[name]
        raw = t.view(torch.uint8).numpy().tobytes() if t.numel() else b""
        header[name] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(head)))
        f.write(head)
        for raw in blobs:
            f.write(raw)


def pick_device(name: str) -> torch.device:
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: CUDA is not available on this machine; expected --device cpu")
    if name not in ("cpu", "cuda"):
        raise ValueError(f"--device = {name!r}; expected cpu or cuda")
    return torch.device(name)
