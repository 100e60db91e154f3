"""`tools/check_commits.py` on a throwaway git repository: commits after the base with a subject over 72 characters,
or a body glued to the subject, are named; the base's own history (here a long subject) is left alone."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "check_commits.py"


@pytest.fixture
def check_commits():
    spec = importlib.util.spec_from_file_location("check_commits", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _git(repo: Path, *args: str) -> str:
    env = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.org", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@example.org", "HOME": str(repo), "PATH": "/usr/bin:/bin"}
    return subprocess.run(["git", *args], cwd=repo, env=env, capture_output=True, text=True, check=True).stdout.strip()


def _commit(repo: Path, message: str) -> str:
    (repo / "f").write_text(message)
    _git(repo, "add", "f")
    _git(repo, "commit", "-q", "--cleanup=verbatim", "-m", message)
    return _git(repo, "rev-parse", "HEAD")


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    _git(tmp_path, "init", "-q", "-b", "main")
    _commit(tmp_path, "x" * 200)  # history before the base: not checked
    _git(tmp_path, "tag", "base")
    return tmp_path


def test_good_subjects_pass(repo: Path, check_commits) -> None:
    _commit(repo, "Splice policy once, in worker/stream/splice.py\n\nWhy: the loop and the runtime had two copies.\n")
    _commit(repo, "y" * 72)  # exactly the limit
    assert check_commits.check("base", cwd=repo) == []


def test_long_subjects_and_glued_bodies_are_named(repo: Path, check_commits) -> None:
    long = _commit(repo, "z" * 73 + "\n\nbody\n")
    glued = _commit(repo, "A short subject\nthe body right under it\n")
    empty = _commit(repo, "\n\nonly a body\n")
    assert check_commits.check("base", cwd=repo) == [
        f"{long[:10]}: subject is 73 characters; expected at most 72 (the why goes in the body): "
        f"'{'z' * 57}...'",
        f"{glued[:10]}: no blank line between the subject and the body: 'A short subject'",
        f"{empty[:10]}: empty subject: ''",
    ]


def test_the_command_exits_1_on_a_bad_subject_and_2_on_an_unknown_base(repo: Path) -> None:
    run = lambda *args: subprocess.run([sys.executable, str(TOOL), *args], cwd=repo,  # noqa: E731
                                       capture_output=True, text=True)
    assert run("base").returncode == 0
    _commit(repo, "w" * 80)
    done = run("base")
    assert done.returncode == 1 and "subject is 80 characters" in done.stdout, done.stdout
    done = run("no-such-ref")
    assert done.returncode == 2 and "git cannot list no-such-ref..HEAD" in done.stderr, done.stderr
