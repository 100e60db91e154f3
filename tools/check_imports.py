"""Import-direction check (docs/ARCHITECTURE.md, packages and import direction), run by `make test`.

Rules:
  apis/      imports nothing of vivant but vivant.apis itself, and no torch, triton, kopf or kubernetes
             (the API types are plain data every component and every image can import);
  kernels/   imports nothing of vivant but vivant.kernels itself (it is reusable on its own);
  operator/  never imports torch, triton or vivant.worker / vivant.kernels (the operator image has no torch);
  gateway/   never imports torch, triton or vivant.worker / vivant.kernels / vivant.operator;
  sessions/  never imports torch or vivant.worker / vivant.kernels / vivant.operator / vivant.gateway;
  worker/    may import vivant.kernels and vivant.sessions, never vivant.operator;
  devcluster/ imports none of vivant's components (it runs their processes) and no torch or triton.
Parses every module's AST (so lazy imports inside functions count too) and exits non-zero naming
each offending file, line and import.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

FORBIDDEN: dict[str, tuple[str, ...]] = {
    "apis": ("vivant", "torch", "triton", "kopf", "kubernetes"),
    "kernels": ("vivant",),
    "operator": ("torch", "triton", "vivant.worker", "vivant.kernels"),
    "gateway": ("torch", "triton", "vivant.worker", "vivant.kernels", "vivant.operator"),
    "sessions": ("torch", "triton", "vivant.worker", "vivant.kernels", "vivant.operator", "vivant.gateway"),
    "worker": ("vivant.operator",),
    # the local cluster is tooling around the product: it runs vivant's processes, never imports them
    "devcluster": ("torch", "triton", "vivant.worker", "vivant.kernels", "vivant.operator", "vivant.gateway",
                   "vivant.sessions"),
}


def imported_names(tree: ast.AST) -> list[tuple[int, str]]:
    names: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.extend((node.lineno, a.name) for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append((node.lineno, node.module))
    return names


def violations(folder: str, banned: tuple[str, ...]) -> list[str]:
    found = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for lineno, name in imported_names(tree):
            own = f"vivant.{folder}"
            if name == own or name.startswith(own + "."):  # a folder may always import itself
                continue
            for ban in banned:
                if name == ban or name.startswith(ban + "."):
                    found.append(f"{path.relative_to(ROOT)}:{lineno}: imports {name!r} ({folder}/ must not import {ban})")
    return found


def main() -> int:
    problems = [v for folder, banned in FORBIDDEN.items() for v in violations(folder, banned)]
    for p in problems:
        print(p)
    for folder in FORBIDDEN:
        if (ROOT / folder / "__init__.py").exists():
            problems.append(f"{folder}/__init__.py exists: top-level folders must not be regular packages")
            print(problems[-1])
    if not problems:
        print("import direction: ok")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
