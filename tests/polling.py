"""Polling for the tests that watch other threads and processes: one `wait_for` (the modules that wait differently,
say for a Redis that is down while they poll, pass what they retry on)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


def wait_for(what: str, cond: Callable[[], T], timeout: float = 60.0, every: float = 0.05,
             retry_on: tuple[type[BaseException], ...] = ()) -> T:
    """`cond()`'s first truthy value, polled every `every` s; an exception of a type in `retry_on` counts as not
    yet. AssertionError naming `what` and the last value (or error) after `timeout` s."""
    end = time.monotonic() + timeout
    last: Any = None
    while True:
        try:
            last = cond()
            if last:
                return last
        except retry_on as exc:
            last = f"{type(exc).__name__}: {exc}"
        if time.monotonic() >= end:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}; last: {last!r}")
        time.sleep(every)
