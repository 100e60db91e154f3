"""Import-direction check (docs/ARCHITECTURE.md "Packages and import direction"), run by `make test`.

Rules between top-level folders:
  apis/      imports nothing of vivant but vivant.apis itself, and no torch, triton, kopf or kubernetes
             (the API types are plain data every component and every image can import);
  kernels/   imports nothing of vivant but vivant.kernels itself (it is reusable on its own);
  operator/  never imports torch, triton or vivant.worker / vivant.kernels (the operator image has no torch);
  gateway/   never imports torch, triton or vivant.worker / vivant.kernels / vivant.operator;
  sessions/  never imports torch or vivant.worker / vivant.kernels / vivant.operator / vivant.gateway;
  worker/    may import vivant.kernels and vivant.sessions, never vivant.operator;
  devcluster/ imports none of vivant's components (it runs their processes) and no torch or triton.
Rules inside worker/ (its capabilities, lowest first):
  worker/model/    the model and its cache: never the stream, the serving runtime, quality or training;
  worker/stream/   decoder, pacer, audio, sinks: may import the model; never serving, quality or training;
  worker/train/    may import the model and the stream; never serving or quality;
  worker/quality/  may import the model, the stream and training; never serving;
  worker/serving/  may import the model and the stream; never quality or training;
and worker/ holds no module of its own at its top level (every module lives in one capability).
A folder may always import its own package. Parses every module's AST (so lazy imports inside functions count
too), resolves relative imports against the module's package, and exits non-zero naming each offending file,
line and import.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# folder (relative to the repo root) -> import prefixes its modules must not use
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
    "worker/model": ("vivant.worker.stream", "vivant.worker.serving", "vivant.worker.quality", "vivant.worker.train"),
    "worker/stream": ("vivant.worker.serving", "vivant.worker.quality", "vivant.worker.train"),
    "worker/train": ("vivant.worker.serving", "vivant.worker.quality"),
    "worker/quality": ("vivant.worker.serving",),
    "worker/serving": ("vivant.worker.quality", "vivant.worker.train"),
}
TOP_LEVEL = ("apis", "kernels", "operator", "gateway", "sessions", "worker", "devcluster")
WORKER_CAPABILITIES = ("model", "stream", "serving", "quality", "train")


def package_of(folder: str) -> str:
    """The import name of a folder: apis → vivant.apis, worker/model → vivant.worker.model (pyproject's package-dir)."""
    return "vivant." + folder.replace("/", ".")


def module_package(path: Path) -> list[str]:
    """The dotted package of a module file, e.g. worker/model/kv_cache.py -> ['vivant', 'worker', 'model']."""
    rel = path.relative_to(ROOT).parts
    return ["vivant", *rel[:-1]]


def imported_names(tree: ast.AST, package: list[str]) -> list[tuple[int, str]]:
    names: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.extend((node.lineno, a.name) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                if node.module:
                    names.append((node.lineno, node.module))
                continue
            base = package[: len(package) - (node.level - 1)]
            if node.module:
                names.append((node.lineno, ".".join([*base, node.module])))
            else:  # `from . import x`: each name is a module of the package
                names.extend((node.lineno, ".".join([*base, a.name])) for a in node.names)
    return names


def violations(folder: str, banned: tuple[str, ...]) -> list[str]:
    found = []
    own = package_of(folder)
    for path in sorted((ROOT / folder).rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for lineno, name in imported_names(tree, module_package(path)):
            if name == own or name.startswith(own + "."):  # a folder may always import itself
                continue
            for ban in banned:
                if name == ban or name.startswith(ban + "."):
                    found.append(f"{path.relative_to(ROOT)}:{lineno}: imports {name!r} ({folder}/ must not import {ban})")
    return found


def main() -> int:
    problems = [v for folder, banned in FORBIDDEN.items() for v in violations(folder, banned)]
    for folder in TOP_LEVEL:
        if (ROOT / folder / "__init__.py").exists():
            problems.append(f"{folder}/__init__.py exists: top-level folders must not be regular packages")
    stray = sorted(p.name for p in (ROOT / "worker").glob("*.py"))
    if stray:
        problems.append(f"worker/ has modules at its top level ({', '.join(stray)}): each belongs in one of "
                        + ", ".join(f"worker/{c}" for c in WORKER_CAPABILITIES))
    for sub in sorted(p for p in (ROOT / "worker").iterdir() if p.is_dir() and not p.name.startswith("__")):
        if any(sub.rglob("*.py")) and not (sub / "__init__.py").exists():
            problems.append(f"worker/{sub.name}/ has no __init__.py: worker's capability folders are regular packages "
                            "(listed in pyproject.toml's packages)")
    for p in problems:
        print(p)
    if not problems:
        print("import direction: ok")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
