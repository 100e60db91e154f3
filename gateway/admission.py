"""Load shedding for the session gateway: bounded concurrency, a bounded queue, an answer at once beyond it.

Why: a burst of creates used to queue without bound behind the Kubernetes client's thread pool; every
client waited past its own timeout while the server went on writing sessions for requests already
abandoned, and reads queued behind the writes while `/healthz` still said 200. Here each class of
request (creates, reads) has a gate:

- at most `max_in_flight` requests of the class run at once; up to `max_queue` more wait, each at most
  `queue_timeout_s` (seconds);
- a request beyond the queue, or one that waited too long, is answered `503 overloaded` with
  `Retry-After` at once (`Overloaded`);
- a request whose client went away while it waited is dropped before it does anything (`Abandoned`);
- `saturated` (running and waiting requests fill the gate) is what the readiness endpoint reports, so a
  load balancer sends the next request to another replica instead of into a full queue.

Each gate owns a thread pool of `max_in_flight` threads for its blocking Kubernetes calls, so reads
never wait for threads held by writes. Times are seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from aiohttp import web


class Overloaded(Exception):  # noqa: N818 (an outcome: the answer is 503)
    """The gate's queue is full, or the request waited longer than the queue timeout."""

    def __init__(self, gate: str, why: str) -> None:
        super().__init__(f"{gate}: {why}")
        self.gate, self.why = gate, why


class Abandoned(Exception):  # noqa: N818
    """The client closed its connection before the request was carried out: nothing is done for it."""


def client_gone(request: web.Request) -> bool:
    """True when the client's connection is closed or closing (it gave up waiting)."""
    transport = request.transport
    return transport is None or transport.is_closing()


@dataclass
class Gate:
    """One class of requests: `max_in_flight` at once, `max_queue` waiting, `queue_timeout_s` each."""

    name: str
    max_in_flight: int
    max_queue: int
    queue_timeout_s: float
    in_flight: int = field(default=0, init=False)
    waiting: int = field(default=0, init=False)
    shed: int = field(default=0, init=False)  # requests answered 503 overloaded so far
    abandoned: int = field(default=0, init=False)  # requests dropped because the client left

    def __post_init__(self) -> None:
        if self.max_in_flight < 1 or self.max_queue < 0 or self.queue_timeout_s <= 0:
            raise ValueError(f"gate {self.name}: expected max_in_flight >= 1, max_queue >= 0, queue_timeout_s > 0; "
                             f"got {self.max_in_flight}, {self.max_queue}, {self.queue_timeout_s}")
        self._slots = asyncio.Semaphore(self.max_in_flight)
        self.executor = ThreadPoolExecutor(max_workers=self.max_in_flight, thread_name_prefix=f"gate-{self.name}")

    @property
    def saturated(self) -> bool:
        return self.in_flight + self.waiting >= self.max_in_flight + self.max_queue

    @contextlib.asynccontextmanager
    async def admit(self, request: web.Request) -> AsyncIterator[None]:
        """Hold one of the gate's slots for the body of the `async with`; raise Overloaded or Abandoned.

        The request is counted (`waiting`) before the first await, so the requests of a burst that arrive
        in one turn of the event loop see each other: those beyond `max_in_flight + max_queue` are shed
        at once, not after the queue timeout."""
        if self.saturated:
            self.shed += 1
            raise Overloaded(self.name, f"{self.in_flight} requests running and {self.waiting} waiting")
        self.waiting += 1
        try:
            await asyncio.wait_for(self._slots.acquire(), self.queue_timeout_s)
        except TimeoutError:
            self.shed += 1
            raise Overloaded(self.name, f"waited {self.queue_timeout_s:g}s for a slot") from None
        finally:
            self.waiting -= 1
        self.in_flight += 1
        try:
            if client_gone(request):
                self.abandoned += 1
                raise Abandoned(f"{request.method} {request.path}: the client left while it waited")
            yield
        finally:
            self.in_flight -= 1
            self._slots.release()

    def close(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)
