"""The operator's status writer (operator/status_writer.py): queued, merged per session, retried, in order.

The write function here records calls instead of patching an API server (the kopf and cluster tests run
the writer against one); it can be made slow or failing to show what the queue does under back-pressure.
"""

from __future__ import annotations

import threading
import time

import pytest
from vivant.operator.status_writer import StatusWriter


class Api:
    """Records writes; `gate` holds every write until released (an API server answering slowly)."""

    def __init__(self, fail_first: int = 0) -> None:
        self.writes: list[tuple[str, dict]] = []
        self.gate = threading.Event()
        self.gate.set()
        self.fail_first = fail_first
        self.lock = threading.Lock()

    def __call__(self, namespace: str, name: str, patch: dict) -> str:
        """The object's resourceVersion after the write: the count of writes so far, as the API server's."""
        self.gate.wait(10)
        with self.lock:
            if self.fail_first:
                self.fail_first -= 1
                raise ConnectionError("429 Too Many Requests")
            self.writes.append((name, dict(patch)))
            return str(100 + len(self.writes))


def test_a_waiting_patch_absorbs_newer_ones_so_a_slow_api_sees_one_write():
    api = Api()
    api.gate.clear()
    w = StatusWriter(api, threads=1, retry_s=0.01)
    w.put("ns", "blocker", "u0", {"phase": "Assigned"})  # occupies the only thread
    time.sleep(0.05)
    for phase in ("Assigned", "Connecting", "Streaming"):
        w.put("ns", "s-1", "u1", {"phase": phase, "worker": "w1"})
    w.put("ns", "s-1", "u1", {"avgFps": 23.9})
    assert w.depth() == 1
    api.gate.set()
    assert w.flush()
    assert api.writes == [("blocker", {"phase": "Assigned"}),
                          ("s-1", {"phase": "Streaming", "worker": "w1", "avgFps": 23.9})]
    w.close()


def test_a_failed_write_is_retried_and_a_newer_patch_still_wins():
    api = Api(fail_first=1)
    w = StatusWriter(api, threads=1, retry_s=0.2)
    w.put("ns", "s-1", "u1", {"phase": "Connecting", "message": "joining"})
    time.sleep(0.05)  # the first attempt failed; the retry waits
    w.put("ns", "s-1", "u1", {"phase": "Streaming"})
    assert w.flush()
    assert api.writes == [("s-1", {"phase": "Streaming", "message": "joining"})]
    assert w.failed == 1 and w.written == 1
    w.close()


def test_one_session_is_never_written_by_two_threads_at_once():
    api = Api()
    api.gate.clear()
    w = StatusWriter(api, threads=4, retry_s=0.01)
    w.put("ns", "s-1", "u1", {"phase": "Assigned"})
    time.sleep(0.05)  # one thread is writing s-1
    w.put("ns", "s-1", "u1", {"phase": "Streaming"})  # must wait for that write, not race it
    time.sleep(0.05)
    api.gate.set()
    assert w.flush()
    assert [p["phase"] for _, p in api.writes] == ["Assigned", "Streaming"]
    w.close()


def test_after_a_write_it_reports_the_version_and_the_newest_patch_merged_into_it():
    api = Api()
    api.gate.clear()
    written: list[tuple[str, str, int]] = []
    w = StatusWriter(api, threads=1, retry_s=0.01, on_written=lambda *a: written.append(a))
    w.put("ns", "s-1", "u1", {"phase": "Assigned"}, tag=1)  # being written (held at the gate)
    time.sleep(0.05)
    w.put("ns", "s-1", "u1", {"phase": "Connecting"}, tag=2)
    w.put("ns", "s-1", "u1", {"phase": "Streaming"}, tag=3)  # merged with tag 2 into one waiting write
    api.gate.set()
    assert w.flush()
    assert written == [("u1", "101", 1), ("u1", "102", 3)]
    w.close()


def test_a_session_that_is_gone_is_dropped_and_not_reported_written():
    written: list[tuple[str, str, int]] = []
    w = StatusWriter(lambda ns, name, patch: None, threads=1, on_written=lambda *a: written.append(a))
    w.put("ns", "gone", "u1", {"phase": "Streaming"}, tag=1)
    assert w.flush() and w.depth() == 0 and written == [] and w.written == 1
    w.close()


def test_phase_changes_go_before_waiting_stats_refreshes():
    api = Api()
    api.gate.clear()
    w = StatusWriter(api, threads=1, retry_s=0.01)
    w.put("ns", "blocker", "u0", {"phase": "Assigned"})  # occupies the only thread
    time.sleep(0.05)
    for i in range(1, 4):
        w.put("ns", f"s-{i}", f"u{i}", {"avgFps": 23.9}, urgent=False)
    w.put("ns", "s-9", "u9", {"phase": "Assigned", "worker": "w9"})
    w.put("ns", "s-2", "u2", {"phase": "Ended"})  # a waiting refresh that now ends its session moves up
    api.gate.set()
    assert w.flush()
    assert [name for name, _ in api.writes] == ["blocker", "s-9", "s-2", "s-1", "s-3"]
    assert api.writes[2] == ("s-2", {"avgFps": 23.9, "phase": "Ended"})
    w.close()


def test_bad_thread_count_is_refused():
    with pytest.raises(ValueError, match="threads: expected >= 1"):
        StatusWriter(Api(), threads=0)
