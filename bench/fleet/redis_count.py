"""Count the Redis commands a process sends, by command name, from inside that process.

Why: Redis' own INFO commandstats adds every client together (and counts the calls a Lua script makes
inside Redis as well), so it cannot say how many commands the operator sent and how many the simulated
workers sent. Counting where each command is serialised (redis-py's RESP packers, which every command
and every pipelined command goes through) gives each process's own top-level count. `install()` is
called once, before the first Redis client is made; the counts are the top-level commands the process
sent (an EVALSHA counts once, whatever the script does inside Redis).
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable

import redis.connection

_lock = threading.Lock()
_counts: Counter[str] = Counter()
_listeners: list[Callable[[str], None]] = []
_installed = False


def _name(first: object) -> str:
    if isinstance(first, bytes | bytearray | memoryview):
        first = bytes(first).decode("ascii", "replace")
    return str(first).split(" ", 1)[0].upper()


def _counting(pack: Callable) -> Callable:
    def pack_counted(self, *args):  # noqa: ANN001, ANN202 (redis-py's own signature)
        name = _name(args[0]) if args else "?"
        with _lock:
            _counts[name] += 1
        for listener in _listeners:
            listener(name)
        return pack(self, *args)

    return pack_counted


def install(on_command: Callable[[str], None] | None = None) -> None:
    """Start counting (idempotent). `on_command(name)` is called for every command, e.g. to feed a
    Prometheus counter."""
    global _installed
    if on_command is not None:
        _listeners.append(on_command)
    if _installed:
        return
    for cls in (redis.connection.PythonRespSerializer, redis.connection.HiredisRespSerializer):
        cls.pack = _counting(cls.pack)
    _installed = True


def counts() -> dict[str, int]:
    """Commands sent so far by this process, by name (a copy)."""
    with _lock:
        return dict(_counts)
