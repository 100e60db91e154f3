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
A folder may always import its own package.

No circles: among all of vivant's modules (every folder pyproject.toml maps into the `vivant` namespace), no module
may reach itself through imports, whether the imports sit at module level or inside functions (an import inside a
function only postpones the circle to the first call). Each circle is named with the files and lines of its imports.

Layers inside a folder (`LAYERS`): a folder's modules listed lowest layer first; a module of a layer may import the
modules of its own layer and of the layers below, never one above. A module a folder's layers do not name is free
(the no-circle rule still holds for it); a layer naming a module that does not exist is an error, so the list
follows the code.

Parses every module's AST (so lazy imports inside functions count too), resolves relative imports against the
module's package, and exits non-zero naming each offending file, line and import.
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
# Layers inside a folder, lowest first (module docstring): module stems, each in one layer.
LAYERS: dict[str, tuple[tuple[str, ...], ...]] = {
    "gateway": (
        ("models", "config", "metrics", "admission", "capacity"),  # the API's types, settings, counters, policies
        ("openapi", "agent_plugin"),  # built from the types
    ),
    "worker/model": (
        ("config", "options", "positions", "ring_undo"),  # shapes, engine choices, RoPE positions, the undo log
        ("kv_cache",),  # the ring cache
    ),
    "worker/serving": (
        ("runner", "layout", "metrics", "room_feed", "wire"),  # the runner protocol, rank layout, metrics, words
        ("room_video", "session_state"),  # the room's video queue; the service's per-session state
        ("ranks", "livekit_avatar"),  # a rank's spec, groups and DiT follower; the decoder rank's room
        ("decoder_rank",),
        ("rank_main",),  # a spawned rank's entry point: builds a DiT follower or the decoder rank
        ("supervisor",),  # rank 0's side of the spawned ranks
        ("runtime", "service"),  # rank 0's runtime and the session service
        ("cli",),  # `vivant worker`
    ),
}
# Folders pyproject.toml maps into the `vivant` namespace (`[tool.setuptools] package-dir`).
PACKAGE_DIRS: dict[str, str] = {
    "cli": "vivant", "apis": "vivant.apis", "operator": "vivant.operator", "gateway": "vivant.gateway",
    "worker": "vivant.worker", "kernels": "vivant.kernels", "sessions": "vivant.sessions", "bench": "vivant.bench",
    "devcluster": "vivant.devcluster",
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


def module_names(root: Path, package_dirs: dict[str, str]) -> dict[str, Path]:
    """Every module of the namespace: dotted name -> file (a package's `__init__.py` under the package's name)."""
    modules: dict[str, Path] = {}
    for folder, package in package_dirs.items():
        for path in sorted((root / folder).rglob("*.py")):
            rel = path.relative_to(root / folder).with_suffix("").parts
            parts = [*package.split("."), *rel]
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


# module -> {module it imports -> [(file, line), ...]}
Graph = dict[str, dict[str, list[tuple[Path, int]]]]


def import_graph(root: Path, package_dirs: dict[str, str]) -> Graph:
    """module -> {module it imports -> [(file, line), ...]}, over the namespace's own modules only. `from p import
    x` counts as importing p.x when that is a module, else p; an import of a.b.c counts as importing a.b.c alone
    (its packages' `__init__` modules are not edges: they would close a circle with every submodule they name)."""
    modules = module_names(root, package_dirs)
    graph: Graph = {name: {} for name in modules}
    for name, path in modules.items():
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    head = package[: len(package) - (node.level - 1)]
                    base = ".".join([*head, *([node.module] if node.module else [])])
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            for target in targets:
                while target and target not in modules:  # `import a.b.c` names a.b.c; a symbol's owner module
                    target = target.rpartition(".")[0]
                sites = graph[name].setdefault(target, []) if target and target != name else None
                if sites is not None and (path, node.lineno) not in sites:
                    sites.append((path, node.lineno))
    return graph


def circles(graph: Graph) -> list[list[str]]:
    """The import circles: each strongly connected component of more than one module (Tarjan's algorithm,
    iterative), its modules sorted; components sorted by their first module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return sorted(found)


def circle_problems(root: Path, package_dirs: dict[str, str], graph: Graph | None = None) -> list[str]:
    """One entry per circle: its modules, then each import inside it (file:line: a imports b). `graph`: the
    tree's `import_graph`, when the caller has it already."""
    graph = graph if graph is not None else import_graph(root, package_dirs)
    problems = []
    for component in circles(graph):
        members = set(component)
        edges = [f"  {path.relative_to(root)}:{line}: {a} imports {b}" for a in component
                 for b, sites in sorted(graph[a].items()) if b in members for path, line in sorted(sites)]
        problems.append("\n".join([f"import circle among {', '.join(component)}:", *edges]))
    return problems


def layer_problems(root: Path, package_dirs: dict[str, str], layers: dict[str, tuple[tuple[str, ...], ...]],
                   graph: Graph | None = None) -> list[str]:
    """A module importing a module of a higher layer of its folder, and a layer naming a module that is missing."""
    graph = graph if graph is not None else import_graph(root, package_dirs)
    problems = []
    for folder, stacked in layers.items():
        top, _, rest = folder.partition("/")
        package = ".".join([package_dirs[top], *rest.split("/")]) if rest else package_dirs[top]
        level = {f"{package}.{stem}": i for i, layer in enumerate(stacked) for stem in layer}
        for module in sorted(level):
            if module not in graph:
                problems.append(f"{folder}: layer {level[module]} names {module.rpartition('.')[2]!r}, "
                                "which is not a module of the folder")
                continue
            for target, sites in sorted(graph[module].items()):
                if target in level and level[target] > level[module]:
                    for path, line in sites:
                        problems.append(f"{path.relative_to(root)}:{line}: imports {target!r}, of layer "
                                        f"{level[target]} of {folder}/ (above its own, {level[module]})")
    return problems


def main() -> int:
    problems = [v for folder, banned in FORBIDDEN.items() for v in violations(folder, banned)]
    graph = import_graph(ROOT, PACKAGE_DIRS)
    problems += circle_problems(ROOT, PACKAGE_DIRS, graph)
    problems += layer_problems(ROOT, PACKAGE_DIRS, LAYERS, graph)
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
        print("import direction, circles and layers: ok")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
