"""Reading the committed results: the folder, a JSON by file name, the 2026-11-29 TP = 4 step and tuning files by
their tag, and two figures several sections take from a step JSON's profile. Every section reads its numbers
through these, so the page never holds a figure that is not in bench/results/."""

from __future__ import annotations

import json
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[1] / "results"


def load(name: str) -> dict:
    return json.loads((RESULTS / name).read_text())


def tp4(tag: str = "") -> dict:
    return load(f"step_57b_tp4_rank0_h200_2026-11-29{'_' + tag if tag else ''}.json")


def tune(tag: str) -> dict:
    return load(f"tune_57b_tp4_rank0_h200_2026-11-29_{tag}.json")


def per_call(st: dict, kernel: str) -> float:
    """A kernel's µs per call in a step JSON's optimized profile."""
    k = st["optimized_profile"]["top_kernels_ms_per_chunk"][kernel]
    return k["ms"] / k["calls_per_chunk"] * 1e3


def boundary_gap(d: dict) -> float:
    """The chunk boundary's device idle (µs): the gap after the finite flag's device-to-host copy."""
    return next(g["us"] for g in d["optimized_profile"]["gaps"]["largest"] if g["after"].startswith("Memcpy DtoH"))
