"""`vivant flags`: read and change a worker pool's live feature flags in Redis (the emergency path).

  vivant flags get     --pool P [--redis URL] [--json]
  vivant flags set     --pool P [--redis URL] [--actor WHO] [--reason WHY] name=value [name=value ...]
  vivant flags history --pool P [--redis URL] [-n N] [--json]

Rollback of the fused kernel is one command: `vivant flags set --pool P fusedGemmAllReduce=false`.
Every change records who (`--actor`, default `$USER@hostname`), when and why in the pool's history;
running workers pick it up at their next chunk boundary. The WorkerPool spec is re-applied by the
operator on reconcile, so a lasting change belongs in the spec too.
`set` prints the pool's flags as its own write left them (read atomically with the write) and says
"no change" when its values were already in force; `--json` prints one JSON document and nothing else.
Exit codes: 0 ok, 1 Redis unavailable, 2 bad input (bad pool id, unknown flag, bad value, malformed
name=value, an `--actor` or `--reason` holding a newline or another control character): nothing is
written then. The text output is one line per fact; a stored actor or reason that is not plain printable
text (written by another client) is shown escaped, as a JSON string, so it can never forge a line.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
from collections.abc import Callable
from datetime import UTC, datetime

from vivant.apis.feature_flags import KNOWN_FLAGS, FlagError, FlagValues
from vivant.sessions.flags import FlagStore, check_pool
from vivant.sessions.models import FlagSet
from vivant.sessions.registry import RegistryUnavailable


def default_actor() -> str:
    user = os.environ.get("USER") or os.environ.get("LOGNAME") or "unknown"
    return f"{user}@{socket.gethostname()}"


ACTOR_MAX_CHARS = 128
REASON_MAX_CHARS = 512


def _printable(option: str, max_chars: int, allow_empty: bool) -> Callable[[str], str]:
    """An argparse type: text of at most `max_chars` printable characters (no newline, tab or other control)."""
    def check(value: str) -> str:
        if (not value and not allow_empty) or len(value) > max_chars or not value.isprintable():
            least = 0 if allow_empty else 1
            raise argparse.ArgumentTypeError(f"{option}: expected {least} to {max_chars} printable characters "
                                             "(no newline, tab or other control character)")
        return value
    return check


def shown(text: str) -> str:
    """`text` as it is when it is plain printable text, else escaped as a JSON string (one line, quoted)."""
    return text if text.isprintable() else json.dumps(text)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--pool", required=True, help="WorkerPool name")
    common.add_argument("--redis", default=os.environ.get("VIVANT_REDIS_URL", "redis://127.0.0.1:6379/0"),
                        help="Redis URL (env VIVANT_REDIS_URL; default redis://127.0.0.1:6379/0)")
    get = sub.add_parser("get", parents=[common], help="show the pool's flags and their version")
    get.add_argument("--json", action="store_true", help="print the FlagSet as JSON")
    st = sub.add_parser("set", parents=[common], help="change flags: name=value ...",
                        description=f"known flags: {', '.join(f'{n} ({t.__name__})' for n, t in KNOWN_FLAGS.items())}")
    st.add_argument("assignments", nargs="+", metavar="name=value")
    st.add_argument("--actor", default=default_actor(), type=_printable("--actor", ACTOR_MAX_CHARS, False),
                    help=f"who makes the change (default: $USER@hostname; printable, <= {ACTOR_MAX_CHARS} characters)")
    st.add_argument("--reason", default="", type=_printable("--reason", REASON_MAX_CHARS, True),
                    help=f"why (kept in the history; printable, <= {REASON_MAX_CHARS} characters)")
    hist = sub.add_parser("history", parents=[common], help="recent changes, newest first")
    hist.add_argument("-n", type=int, default=20, help="how many entries (default 20)")
    hist.add_argument("--json", action="store_true")


def parse_assignments(items: list[str]) -> dict[str, str]:
    """`["a=1", "b=false"]` -> {"a": "1", "b": "false"}; raises FlagError naming a malformed item."""
    out: dict[str, str] = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name.strip() or not value.strip():
            raise FlagError(f"{item!r}: expected name=value, e.g. fusedGemmAllReduce=false")
        if name.strip() in out:
            raise FlagError(f"flag {name.strip()!r} given twice")
        out[name.strip()] = value.strip()
    return out


def _when(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%dT%H:%M:%SZ") if ts else "never"


def _print_set(fs: FlagSet) -> None:
    by = shown(fs.updated_by) if fs.updated_by else "-"
    print(f"pool {fs.pool}  version {fs.version}  updated {_when(fs.updated_at)} by {by}")
    defaults = FlagValues()
    for name, value in fs.values.model_dump().items():
        mark = "" if value == getattr(defaults, name) else "  (changed from default)"
        print(f"  {name} = {json.dumps(value)}{mark}")


def run(args: argparse.Namespace) -> int:
    try:
        check_pool(args.pool)  # before connecting: a bad pool id never reaches Redis
    except FlagError as exc:
        print(f"vivant flags {args.action}: {exc}", file=sys.stderr)
        return 2
    store = FlagStore(args.redis)
    try:
        if args.action == "get":
            fs = store.get(args.pool)
            print(fs.model_dump_json(indent=2)) if args.json else _print_set(fs)
        elif args.action == "set":
            fs, changed = store.write(args.pool, parse_assignments(args.assignments), actor=args.actor,
                                      reason=args.reason)
            if not changed:
                print(f"pool {args.pool}: no change (already so at version {fs.version})")
            _print_set(fs)
        elif args.action == "history":
            entries = store.history(args.pool, args.n)
            if args.json:
                print(json.dumps([e.model_dump() for e in entries], indent=2))
                return 0
            if not entries:
                print(f"pool {args.pool}: no flag changes recorded")
            for e in entries:
                changes = ", ".join(f"{k}: {json.dumps(o)} -> {json.dumps(n)}" for k, (o, n) in e.changes.items())
                why = f"  ({shown(e.reason)})" if e.reason else ""
                print(f"v{e.version}  {_when(e.at)}  {shown(e.actor)}  {changes}{why}")
    except (FlagError, ValueError) as exc:
        print(f"vivant flags {args.action}: {exc}", file=sys.stderr)
        return 2
    except RegistryUnavailable as exc:
        print(f"vivant flags {args.action}: {exc}", file=sys.stderr)
        return 1
    finally:
        store.redis.close()
    return 0
