"""CharacterSession status writes, off the reconcile path: one waiting patch per session, a few writer threads.

Why: a status write is an API request, and an API server under load answers in hundreds of milliseconds
or throttles (429). If the sweeps waited for their writes, one slow API server would stretch every sweep
and every session's Assigned -> Connecting -> Streaming would cost three writes in a row. Here a sweep or
a handler puts its patch and goes on; a newer patch for a session whose previous one is still waiting is
merged into it (top-level status fields, the newer wins), so under back-pressure those phases become one
write; the API server's pace sets how stale the object may be, not how often the operator reconciles.
A failed write (429, 5xx, a dropped connection) goes back into the queue (a newer patch still wins) and
is tried again after `retry_s`; a session that is gone (404) is dropped. Each patch carries a tag (the
sweep's patch number); after a write, `on_written(uid, resourceVersion, tag)` says which patches the object
now holds (the newest tag merged into that write).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

# write(namespace, name, status patch) -> the object's resourceVersion after the write, None if the object
# is gone; raises on any other failure
WriteFn = Callable[[str, str, dict[str, Any]], str | None]
WrittenFn = Callable[[str, str, int], None]  # (uid, resourceVersion, newest tag in the write)


class StatusWriter:
    def __init__(self, write: WriteFn, threads: int = 8, retry_s: float = 1.0,
                 on_written: WrittenFn | None = None) -> None:
        if threads < 1:
            raise ValueError(f"threads: expected >= 1, got {threads}")
        self._write, self._retry_s, self._on_written = write, retry_s, on_written
        # uid -> (namespace, name, patch, newest tag merged into it)
        self._pending: dict[str, tuple[str, str, dict[str, Any], int]] = {}
        self._order: deque[str] = deque()
        self._cond = threading.Condition()
        self._closed = False
        self._writing: set[str] = set()  # uids being written now: never two writes of one session at once
        self.written = self.failed = 0
        self._threads = [threading.Thread(target=self._run, name=f"status-writer-{i}", daemon=True)
                         for i in range(threads)]
        for t in self._threads:
            t.start()

    def put(self, namespace: str, name: str, uid: str, patch: dict[str, Any], tag: int = 0) -> None:
        """Queue `patch` for the session (merged into its waiting patch, if any); never blocks on the API."""
        with self._cond:
            self._merge(uid, namespace, name, patch, tag)
            self._cond.notify()

    def _merge(self, uid: str, namespace: str, name: str, patch: dict[str, Any], tag: int,
               older: bool = False) -> None:
        waiting = self._pending.get(uid)
        if waiting is None:
            self._pending[uid] = (namespace, name, dict(patch), tag)
            self._order.append(uid)
        elif older:  # a failed write coming back: what was queued since is newer and wins
            self._pending[uid] = (namespace, name, {**patch, **waiting[2]}, max(tag, waiting[3]))
        else:
            self._pending[uid] = (namespace, name, {**waiting[2], **patch}, max(tag, waiting[3]))

    def depth(self) -> int:
        """Sessions with a patch waiting to be written."""
        with self._cond:
            return len(self._pending)

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until nothing is waiting (tests, shutdown). True if the queue emptied in time."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._cond:
                if not self._pending and not self._writing:
                    return True
            time.sleep(0.01)
        return False

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        for t in self._threads:
            t.join(timeout=5)

    def _next(self) -> str | None:
        """The oldest waiting session not being written right now (taken off the order), else None."""
        for uid in self._order:
            if uid not in self._writing:
                self._order.remove(uid)
                return uid
        return None

    def _run(self) -> None:
        while True:
            with self._cond:
                while not (uid := self._next()) and not self._closed:
                    self._cond.wait()
                if not uid:
                    return
                namespace, name, patch, tag = self._pending.pop(uid)
                self._writing.add(uid)
            try:
                version = self._write(namespace, name, patch)
                if version is not None and self._on_written is not None:
                    self._on_written(uid, version, tag)
            except Exception as exc:  # noqa: BLE001 (throttled or unreachable: try again, newest first)
                log.warning("status of %s/%s not written (%s); retrying in %.1fs", namespace, name, exc, self._retry_s)
                with self._cond:
                    self.failed += 1
                    self._writing.discard(uid)
                    self._merge(uid, namespace, name, patch, tag, older=True)
                time.sleep(self._retry_s)
                with self._cond:
                    self._cond.notify()
                continue
            with self._cond:
                self.written += 1
                self._writing.discard(uid)
                self._cond.notify()  # a newer patch of this session may have waited for this write
