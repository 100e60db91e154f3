"""`vivant flags` end to end against a real redis-server: through `vivant.cli.main` and one real subprocess."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from vivant.cli import main
from vivant.sessions.flags import FlagStore

POOL = "gpu-pool"


def cli(*argv: str) -> int:
    return main(["flags", *argv])


def test_set_get_history_and_rollback(redis_url: str, capsys: pytest.CaptureFixture):
    assert cli("set", "--pool", POOL, "--redis", redis_url, "--actor", "alice@ops", "--reason", "canary",
               "fusedGemmAllReduce=true") == 0
    out = capsys.readouterr().out
    assert "version 1" in out and "fusedGemmAllReduce = true" in out, out

    assert cli("set", "--pool", POOL, "--redis", redis_url, "--actor", "bob@ops", "fusedGemmAllReduce=false") == 0
    capsys.readouterr()

    assert cli("get", "--pool", POOL, "--redis", redis_url, "--json") == 0
    got = json.loads(capsys.readouterr().out)
    assert (got["version"], got["values"]["fusedGemmAllReduce"], got["updated_by"]) == (2, False, "bob@ops"), got

    assert cli("history", "--pool", POOL, "--redis", redis_url) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 2, lines
    assert lines[0].startswith("v2") and "bob@ops" in lines[0] and "true -> false" in lines[0], lines[0]
    assert lines[1].startswith("v1") and "alice@ops" in lines[1] and "(canary)" in lines[1], lines[1]


def test_default_actor_is_user_at_host(redis_url: str, capsys: pytest.CaptureFixture,
                                       monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("USER", "carol")
    monkeypatch.setattr("socket.gethostname", lambda: "ops-box")
    assert cli("set", "--pool", POOL, "--redis", redis_url, "fusedGemmAllReduce=1") == 0
    assert FlagStore(redis_url).history(POOL)[0].actor == "carol@ops-box"


def test_no_op_set_says_so(redis_url: str, capsys: pytest.CaptureFixture):
    assert cli("set", "--pool", POOL, "--redis", redis_url, "fusedGemmAllReduce=false") == 0
    assert "no change" in capsys.readouterr().out


@pytest.mark.parametrize("item, expected", [
    ("warpDrive=on", "unknown flag(s) 'warpDrive'"),
    ("fusedGemmAllReduce=perhaps", "flag 'fusedGemmAllReduce': expected bool, got 'perhaps'"),
    ("fusedGemmAllReduce", "'fusedGemmAllReduce': expected name=value"),
    ("=true", "expected name=value"),
])
def test_bad_input_exits_2_names_the_problem_and_writes_nothing(redis_url: str, capsys: pytest.CaptureFixture,
                                                                 item: str, expected: str):
    assert cli("set", "--pool", POOL, "--redis", redis_url, item) == 2
    err = capsys.readouterr().err
    assert expected in err, err
    assert FlagStore(redis_url).get(POOL).version == 0, "a rejected set wrote something"


def test_unreachable_redis_exits_1(capsys: pytest.CaptureFixture):
    from vivant.ports import free_port

    assert cli("get", "--pool", POOL, "--redis", f"redis://127.0.0.1:{free_port()}/0") == 1
    assert "redis unavailable" in capsys.readouterr().err


def test_real_subprocess_rollback_is_one_command(redis_url: str):
    FlagStore(redis_url).set(POOL, {"fusedGemmAllReduce": True}, actor="deploy")
    proc = subprocess.run([sys.executable, "-m", "vivant", "flags", "set", "--pool", POOL, "--redis", redis_url,
                           "fusedGemmAllReduce=false"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert FlagStore(redis_url).get(POOL).values.fusedGemmAllReduce is False


@pytest.mark.parametrize(("option", "value"), [("--actor", "mallory\n  fusedGemmAllReduce = false (spec)"),
                                               ("--actor", "tab\there"), ("--actor", ""), ("--actor", "a" * 129),
                                               ("--reason", "ok\nv9  forged line")])
def test_actor_and_reason_that_could_forge_output_are_refused(redis_url: str, capsys: pytest.CaptureFixture,
                                                              option: str, value: str):
    """Item 9 of issue 36: an --actor holding a newline printed a fake "= false (spec)" line above the real
    value. Control characters are refused now, naming the option, and nothing is written."""
    with pytest.raises(SystemExit) as exit_:
        cli("set", "--pool", POOL, "--redis", redis_url, option, value, "fusedGemmAllReduce=true")
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert option in err and "printable" in err, err
    assert FlagStore(redis_url).get(POOL).version == 0, "a refused set wrote something"


def test_a_stored_actor_with_a_newline_is_shown_escaped(redis_url: str, capsys: pytest.CaptureFixture):
    """What another client wrote into Redis cannot forge a line of the text output either."""
    FlagStore(redis_url).set(POOL, {"fusedGemmAllReduce": True}, actor="eve\n  fusedGemmAllReduce = false (spec)",
                             reason="x\ny")
    assert cli("get", "--pool", POOL, "--redis", redis_url) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and lines[1].strip() == "fusedGemmAllReduce = true  (changed from default)", lines
    assert '"eve\\n  fusedGemmAllReduce = false (spec)"' in lines[0], lines[0]
    assert cli("history", "--pool", POOL, "--redis", redis_url) == 0
    [line] = capsys.readouterr().out.splitlines()
    assert '"eve\\n' in line and '("x\\ny")' in line, line
