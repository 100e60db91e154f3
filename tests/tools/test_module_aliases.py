"""No module of the project imports a module under a one-letter alias (docs/CONTRIBUTING.md, "Names"): `r.Foo` makes
a reader look up what `r` is; `resources.Foo` does not. Run over every Python file in the repository (product
code, tests, tools, benchmarks). The one exception is `torch.nn.functional as F`, the alias every PyTorch reader
knows.

The finder itself is checked on a few lines of source, so the repository-wide test cannot pass by finding nothing."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SKIP = {".venv", "build", ".git", "node_modules", "out"}
ALLOWED = {("torch.nn.functional", "F")}


def one_letter_aliases(source: str) -> list[tuple[int, str]]:
    """(line, the import as written) for each import that binds a module or a name under a one-letter alias."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import | ast.ImportFrom):
            base = node.module if isinstance(node, ast.ImportFrom) else None
            source_from = f"from {'.' * node.level}{base or ''} " if isinstance(node, ast.ImportFrom) else ""
            for alias in node.names:
                name = f"{base}.{alias.name}" if base else alias.name
                if alias.asname is not None and len(alias.asname) == 1 and (name, alias.asname) not in ALLOWED:
                    found.append((node.lineno, f"{source_from}import {alias.name} as {alias.asname}"))
    return found


def python_files() -> list[Path]:
    return sorted(p for p in ROOT.rglob("*.py") if not SKIP.intersection(p.relative_to(ROOT).parts[:-1]))


def test_the_finder_finds_one_letter_aliases() -> None:
    source = ("import numpy as np\nimport torch.nn.functional as F\nfrom vivant.apis import resources as r\n"
              "def f():\n    import json as j\n    from . import builders as b\n    from .x import y as yy\n")
    assert one_letter_aliases(source) == [(3, "from vivant.apis import resources as r"), (5, "import json as j"),
                                          (6, "from . import builders as b")]


def test_no_module_uses_a_one_letter_alias() -> None:
    files = python_files()
    assert len(files) > 100, f"found only {len(files)} Python files under {ROOT}"
    offenders = [f"{path.relative_to(ROOT)}:{line}: {text}"
                 for path in files for line, text in one_letter_aliases(path.read_text())]
    assert not offenders, f"{len(offenders)} one-letter import aliases:\n" + "\n".join(offenders)
