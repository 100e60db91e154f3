"""Reading the committed results: the folder, a JSON by file name, and the figures several sections format the same
way. Every section reads its numbers through these, so the page holds no figure that is not in bench/results/."""

from __future__ import annotations

import json
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[1] / "results"
ARCHIVE_TAG = "lab-archive-2026-12-03"  # the git tag that keeps the finished probes and superseded results


def load(name: str) -> dict:
    return json.loads((RESULTS / name).read_text())


def day(doc: dict) -> str:
    """The date a result was measured (its JSON's `date`, an ISO date or timestamp), as YYYY-MM-DD."""
    return doc["date"][:10]


def pct(fraction: float, digits: int = 2) -> str:
    return f"{100 * fraction:.{digits}f} %"
