"""CharacterSession status writes, off the reconcile path: one waiting patch per session, a few writer threads.

Why: a status write is an API request, and an API server under load answers in hundreds of milliseconds
or throttles (429). If the sweeps waited for their writes, one slow API server would stretch every sweep
and every session's Assigned -> Connecting -> Streaming would cost three writes in a row. Here a sweep or
a handler puts its patch and goes on; a newer patch for a session whose previous one is still waiting is
merged into it (top-level status fields, the newer wins), so under back-pressure those phases become one
write; the API server's pace sets how stale the object may be, not how often the operator reconciles.
A failed write (429, 5xx, a dropped connection) goes back into the queue (a newer patch still wins) and
is tried again after `retry_s`; a session that is gone (404) is dropped. A patch that changes what a user
acts on (phase, worker, message) is urgent and goes before every waiting stats refresh (avgFps, stalls,
chunkP99Ms), which at a thousand sessions alone can ask for more writes than a loaded API server serves: in
one queue a new session's Assigned waited minutes behind them. Each patch carries a tag (the
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
        # uid -> (namespace, name, patch, newest tag merged into it, urgent)
        self._pending: dict[str, tuple[str, str, dict[str, Any], int, bool]] = {}
        self._urgent: deque[str] = deque()  # uids in the order their first urgent patch came
        self._background: deque[str] = deque()  # uids whose waiting patch only refreshes stats
        self._cond = threading.Condition()
        self._closed = False
        self._writing: set[str] = set()  # uids being written now: never two writes of one session at once
        self.written = self.failed = 0
        self._threads = [threading.Thread(target=self._run, name=f"status-writer-{i}", daemon=True)
                         for i in range(threads)]
        for t in self._threads:
            t.start()

    def put(self, namespace: str, name: str, uid: str, patch: dict[str, Any], tag: int = 0,
            urgent: bool = True) -> None:
        """Queue `patch` for the session (merged into its waiting patch, if any); never blocks on the API.
        `urgent=False` for a patch that only refreshes stats: it waits behind every urgent one."""
        with self._cond:
            self._merge(uid, namespace, name, patch, tag, urgent)
            self._cond.notify()

    def _merge(self, uid: str, namespace: str, name: str, patch: dict[str, Any], tag: int, urgent: bool,
               older: bool = False) -> None:
        waiting = self._pending.get(uid)
        if waiting is None:
            self._pending[uid] = (namespace, name, dict(patch), tag, urgent)
            (self._urgent if urgent else self._background).append(uid)
            return
        merged = {**patch, **waiting[2]} if older else {**waiting[2], **patch}  # a failed write is the older
        self._pending[uid] = (namespace, name, merged, max(tag, waiting[3]), urgent or waiting[4])
        if urgent and not waiting[4]:  # a stats refresh that now carries a phase change: it moves up
            self._background.remove(uid)
            self._urgent.append(uid)

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
        """The oldest waiting session not being written right now, urgent ones first (taken off its
        queue), else None."""
        for queue in (self._urgent, self._background):
            for uid in queue:
                if uid not in self._writing:
                    queue.remove(uid)
                    return uid
        return None

    def _run(self) -> None:
        while True:
            with self._cond:
                while not (uid := self._next()) and not self._closed:
                    self._cond.wait()
                if not uid:
                    return
                namespace, name, patch, tag, urgent = self._pending.pop(uid)
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
                    self._merge(uid, namespace, name, patch, tag, urgent, older=True)
                time.sleep(self._retry_s)
                with self._cond:
                    self._cond.notify()
                continue
            with self._cond:
                self.written += 1
                self._writing.discard(uid)
                self._cond.notify()  # a newer patch of this session may have waited for this write
