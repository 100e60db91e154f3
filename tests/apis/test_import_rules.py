"""`tools/check_imports.py` enforces the apis/ and gateway/ rules (and passes on the repository as it is).

The checker is run on a scratch tree (its ROOT pointed at a temporary folder) holding one allowed and
several forbidden imports, including lazy ones inside functions, and must name each forbidden one.
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
