"""`vivant flags` under bad input and concurrent writers, against a real redis-server.

Fact 10 of issue 15: a bad `--pool` wrote Redis keys before it was refused; `history --json` printed JSON
followed by human-readable lines; concurrent `flags set` printed another writer's version and author, and
some no-op writers did not say "no change".
"""

from __future__ import annotations

import contextlib
import io
import json
import multiprocessing
import re

import pytest
import redis
from vivant.cli import main
from vivant.sessions.flags import FlagStore

POOL = "team-a/gpu-pool"
WRITERS = 24


@pytest.mark.parametrize("pool", ["bad pool!", "", "Team/Pool", "a/b/c", "pool\n", "x" * 200])
def test_bad_pool_is_refused_before_anything_is_written(redis_url: str, pool: str,
                                                         capsys: pytest.CaptureFixture) -> None:
    for argv in (["set", "--pool", pool, "fusedGemmAllReduce=true"], ["get", "--pool", pool],
                 ["history", "--pool", pool, "--json"]):
        assert main(["flags", *argv[:1], "--redis", redis_url, *argv[1:]]) == 2, argv
        err = capsys.readouterr().err
        assert "pool: expected <namespace>/<name>" in err, err
    assert redis.Redis.from_url(redis_url).dbsize() == 0, "a refused command wrote to Redis"


def test_history_json_is_one_json_document(redis_url: str, capsys: pytest.CaptureFixture) -> None:
    for value in ("true", "false", "true"):
        assert main(["flags", "set", "--pool", POOL, "--redis", redis_url, "--actor", "ops@x",
                     f"fusedGemmAllReduce={value}"]) == 0
    capsys.readouterr()
    assert main(["flags", "history", "--pool", POOL, "--redis", redis_url, "--json"]) == 0
    out = capsys.readouterr().out
    entries = json.loads(out)  # the whole output, nothing after it
    assert [e["version"] for e in entries] == [3, 2, 1], entries


def _writer(url: str, actor: str, value: str, barrier: multiprocessing.synchronize.Barrier, out) -> None:  # noqa: ANN001
    buf = io.StringIO()
    barrier.wait()
    with contextlib.redirect_stdout(buf):
        code = main(["flags", "set", "--pool", POOL, "--redis", url, "--actor", actor, f"fusedGemmAllReduce={value}"])
    out.put((actor, value, code, buf.getvalue()))


def test_concurrent_writers_each_report_their_own_write(redis_url: str) -> None:
    """WRITERS processes set the flag at once (alternating values). Each one that changed something prints
    its own version and itself as author (and the history says the same); each that changed nothing says so."""
    ctx = multiprocessing.get_context("fork")
    barrier, out = ctx.Barrier(WRITERS), ctx.Queue()
    procs = [ctx.Process(target=_writer, args=(redis_url, f"w{i}@test", "true" if i % 3 else "false", barrier, out))
             for i in range(WRITERS)]
    for p in procs:
        p.start()
    results = [out.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=30)
    history = {e.version: e for e in FlagStore(redis_url).history(POOL, 1000)}
    changed = set()
    for actor, value, code, text in results:
        assert code == 0, (actor, text)
        header = re.search(r"^pool \S+  version (\d+)  updated \S+ by (\S+)$", text, re.M)
        assert header, text
        version, author = int(header.group(1)), header.group(2)
        assert f"fusedGemmAllReduce = {value}" in text, (actor, text)  # the value its own write left
        if "no change" in text:
            assert actor not in {e.actor for e in history.values()}, (actor, text)
        else:
            assert author == actor and history[version].actor == actor, (actor, version, author, text)
            changed.add(actor)
    assert len(changed) == len(history), (sorted(changed), sorted(e.actor for e in history.values()))
    assert len(results) - len(changed) > 0, "positive control: some writers found their value in force"
