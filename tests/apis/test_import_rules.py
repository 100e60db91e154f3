"""`tools/check_imports.py` enforces the rules between folders, no import circles, and the layers inside folders.

The checker is run on scratch trees (its ROOT pointed at a temporary folder): one holding one allowed and several
forbidden imports, including lazy ones inside functions, where it must name each forbidden one; and a small package
that passes as it is and fails once an import (at module level, or inside a function) closes a circle or reaches
above its layer. `test_repository_passes` runs it on the repository itself.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def check_imports():
    spec = importlib.util.spec_from_file_location("check_imports", ROOT / "tools" / "check_imports.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_repository_passes() -> None:
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "check_imports.py")], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_forbidden_imports_are_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, check_imports) -> None:
    files = {
        "apis/ok.py": "from vivant.apis import resources\nimport pydantic\n",
        "apis/bad.py": "import kubernetes\n\ndef f():\n    from vivant.sessions import models\n    import torch\n",
        "gateway/ok.py": "from vivant.apis import resources\nfrom aiohttp import web\n",
        "gateway/bad.py": "def g():\n    from vivant.operator import reconcile\n    import triton\n",
        "sessions/bad.py": "from vivant.gateway import server\n",
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    monkeypatch.setattr(check_imports, "ROOT", tmp_path)
    found = sorted(v for folder, banned in check_imports.FORBIDDEN.items() if (tmp_path / folder).exists()
                   for v in check_imports.violations(folder, banned))
    assert found == sorted([
        "apis/bad.py:1: imports 'kubernetes' (apis/ must not import kubernetes)",
        "apis/bad.py:4: imports 'vivant.sessions' (apis/ must not import vivant)",
        "apis/bad.py:5: imports 'torch' (apis/ must not import torch)",
        "gateway/bad.py:2: imports 'vivant.operator' (gateway/ must not import vivant.operator)",
        "gateway/bad.py:3: imports 'triton' (gateway/ must not import triton)",
        "sessions/bad.py:1: imports 'vivant.gateway' (sessions/ must not import vivant.gateway)",
    ]), found


def test_a_top_level_init_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, check_imports) -> None:
    for folder in check_imports.FORBIDDEN:
        (tmp_path / folder).mkdir()
    (tmp_path / "gateway" / "__init__.py").write_text("")
    monkeypatch.setattr(check_imports, "ROOT", tmp_path)
    assert check_imports.main() == 1


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)


# A small package, `vivant.pkg` in folder pkg/: base <- middle <- top, and `lazy` imported inside a function.
PACKAGE = {
    "pkg/__init__.py": "",
    "pkg/base.py": "X = 1\n",
    "pkg/middle.py": "from vivant.pkg.base import X\n",
    "pkg/top.py": "from vivant.pkg import middle\nfrom . import base\n\n\ndef f():\n    from .lazy import Y\n    return Y\n",
    "pkg/lazy.py": "Y = 2\n",
}


@pytest.mark.parametrize(("extra", "circle"), [
    # module level, both ways
    ({"pkg/base.py": "from vivant.pkg.top import f\n"},
     ["import circle among vivant.pkg.base, vivant.pkg.middle, vivant.pkg.top:",
      "  pkg/base.py:1: vivant.pkg.base imports vivant.pkg.top",
      "  pkg/middle.py:1: vivant.pkg.middle imports vivant.pkg.base",
      "  pkg/top.py:2: vivant.pkg.top imports vivant.pkg.base",
      "  pkg/top.py:1: vivant.pkg.top imports vivant.pkg.middle"]),
    # closed by an import inside a function, relative: a circle all the same
    ({"pkg/lazy.py": "Y = 2\n\n\ndef g():\n    from . import top\n    return top\n"},
     ["import circle among vivant.pkg.lazy, vivant.pkg.top:",
      "  pkg/lazy.py:5: vivant.pkg.lazy imports vivant.pkg.top",
      "  pkg/top.py:6: vivant.pkg.top imports vivant.pkg.lazy"]),
])
def test_a_circle_inside_a_folder_fails_the_check(tmp_path: Path, check_imports, extra: dict[str, str],
                                                 circle: list[str]) -> None:
    """The same package passes without the closing import and fails with it, naming the circle's imports."""
    _write(tmp_path, PACKAGE)
    dirs = {"pkg": "vivant.pkg"}
    assert check_imports.circle_problems(tmp_path, dirs) == []
    _write(tmp_path, extra)
    assert check_imports.circle_problems(tmp_path, dirs) == ["\n".join(circle)]


def test_main_fails_on_a_circle(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, check_imports, capsys) -> None:
    """`main` (what `make test` runs) exits 1 on a circle in a tree that breaks no other rule, and 0 without it."""
    _write(tmp_path, PACKAGE)
    monkeypatch.setattr(check_imports, "ROOT", tmp_path)
    monkeypatch.setattr(check_imports, "FORBIDDEN", {})
    monkeypatch.setattr(check_imports, "LAYERS", {})
    monkeypatch.setattr(check_imports, "PACKAGE_DIRS", {"pkg": "vivant.pkg"})
    (tmp_path / "worker").mkdir()
    assert check_imports.main() == 0
    _write(tmp_path, {"pkg/base.py": "def h():\n    import vivant.pkg.top\n"})
    assert check_imports.main() == 1
    assert "import circle among vivant.pkg.base, vivant.pkg.middle, vivant.pkg.top:" in capsys.readouterr().out


def test_layers_inside_a_folder(tmp_path: Path, check_imports) -> None:
    """A module may import its own layer and those below; an import of a higher layer (here inside a function) is
    named, and so is a layer naming a module the folder lacks."""
    _write(tmp_path, PACKAGE)
    dirs = {"pkg": "vivant.pkg"}
    layers = {"pkg": (("base", "lazy"), ("middle",), ("top",))}
    assert check_imports.layer_problems(tmp_path, dirs, layers) == []
    _write(tmp_path, {"pkg/lazy.py": "def g():\n    from vivant.pkg.middle import X\n    return X\n"})
    assert check_imports.layer_problems(tmp_path, dirs, layers) == [
        "pkg/lazy.py:2: imports 'vivant.pkg.middle', of layer 1 of pkg/ (above its own, 0)"]
    assert check_imports.layer_problems(tmp_path, dirs, {"pkg": (("base", "gone"),)}) == [
        "pkg: layer 0 names 'gone', which is not a module of the folder"]


def test_the_declared_layers_hold_in_the_repository(check_imports) -> None:
    """Every layer names existing modules and no module imports above its layer (the circle check is separate:
    `test_repository_passes`)."""
    assert check_imports.layer_problems(ROOT, check_imports.PACKAGE_DIRS, check_imports.LAYERS) == []
