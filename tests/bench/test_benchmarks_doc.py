"""docs/BENCHMARKS.md is what bench/benchmarks_md.py writes from the committed JSON under bench/results/: a change to
the generator (bench/benchmarks_doc/) or to a result file that is not regenerated into the page fails here, naming
the first line that differs and the command that regenerates it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
REGENERATE = "python bench/benchmarks_md.py > docs/BENCHMARKS.md"


def _line(lines: list[str], i: int) -> str:
    return repr(lines[i]) if i < len(lines) else "(end of file)"


def test_generated_page_matches_the_committed_one() -> None:
    run = subprocess.run([sys.executable, "bench/benchmarks_md.py"], cwd=ROOT, capture_output=True, timeout=60)
    assert run.returncode == 0, f"bench/benchmarks_md.py failed:\n{run.stderr.decode()}"
    generated = run.stdout.decode()
    committed = (ROOT / "docs" / "BENCHMARKS.md").read_text()
    if generated == committed:
        return
    new, old = generated.splitlines(keepends=True), committed.splitlines(keepends=True)
    i = next((i for i, (a, b) in enumerate(zip(new, old, strict=False)) if a != b), min(len(new), len(old)))
    raise AssertionError(
        f"docs/BENCHMARKS.md is not what bench/benchmarks_md.py generates; regenerate it with `{REGENERATE}`.\n"
        f"First difference at line {i + 1}:\n  generated: {_line(new, i)}\n  committed: {_line(old, i)}")
