"""Simulated GPU workers for the fleet benchmark: one asyncio worker per worker pod, no model.

`python -m vivant.bench.fleet.sim_workers --kubeconfig K --namespace NS --redis-url URL --status-file F`

Every pod of a WorkerPool's StatefulSet (label `app.kubernetes.io/name=vivant-worker`) that kwok reports
Running gets a simulated worker whose id is the pod's name and whose pool is the pod's `VIVANT_POOL`,
as the real `vivant worker` (worker/serving/service.py) reads them. It speaks the registry's real protocol
through `vivant.sessions.registry.Registry`, in the real worker's order:
- start: `register` (loading) → `recover_unacked` → after `warmup_s`, `set_warm`;
- every ttl/3: `heartbeat` with {"session", "chunks"}; `register` again (keeping its session) when
  the registry forgot it;
- inbox, in order: an Assignment is checked against the lease (`session_of`; a stale one is acked and
  dropped), reported Connecting, and after `connect_s` (joining the room) acked and reported Streaming
  (frames over time, ~24 fps), then reported every `stats_interval_s`; an Assignment that arrives while the worker is
  busy is acked and dropped, as the real chunk loop does (counted: it means the lease was handed out
  while the worker still streamed), or, when the registry gave the worker to that session, ends the
  current one Failed ("lease lost") and is served next; a repeated Assignment of the session it streams is acked and the
  session goes on, as in the real chunk loop (counted: the operator must send a session's assignment
  once); an EndRequest for its session ends it after `end_s` (the chunk
  boundary + leaving the room): final SessionStats (Ended, the reason), then `finish` (lease freed);
- pod deleted: the session (if any) is reported Failed ("worker shutting down") and `deregister`.

What differs from a real worker, and why: a real worker waits in BLMOVE on its inbox (one blocked
connection per worker) and pops once per chunk while streaming; a thousand of those in one process
would need a thousand connections or threads. Here Redis keyspace notifications of the inbox lists
(`notify-keyspace-events Kl`, one subscriber connection) wake the worker, which then pops with the
same `next_message`; a slow safety poll (`poll_s`) covers a missed notification. Flags are not polled
per chunk (the operator is what is measured, and it does not see those reads).

The status file (JSON, rewritten every second and at exit) holds counters: workers by state,
assignments, double assignments (a session streaming on two workers at once), assignments dropped
because the worker was busy, stale ones, registry calls by method, Redis commands by name; at exit
also the wall-clock time each session was reported Streaming.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from vivant.bench.fleet import redis_count
from vivant.sessions.models import EndRequest, SessionStats, WorkerInfo

log = logging.getLogger("vivant.bench.fleet.sim_workers")
T = TypeVar("T")
WORKER_SELECTOR = "app.kubernetes.io/name=vivant-worker"


@dataclass(frozen=True)
class SimTiming:
    """How long the simulated steps take (seconds)."""

    warmup_s: float = 2.0  # model load + graph capture (minutes on a GPU; short here, outside what is measured)
    connect_s: float = 0.5  # joining the LiveKit room
    end_s: float = 0.2  # next chunk boundary + leaving the room
    stats_interval_s: float = 1.0  # as worker/serving/service.py's default
    poll_s: float = 10.0  # safety poll of the inbox (notifications do the waking)
    fps: float = 24.0

    def __post_init__(self) -> None:
        for name in ("warmup_s", "connect_s", "end_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: expected >= 0 seconds, got {getattr(self, name)}")
        for name in ("stats_interval_s", "poll_s", "fps"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: expected > 0, got {getattr(self, name)}")


class Fleet:
    """All simulated workers of one benchmark, on one event loop; registry calls run in a thread pool."""

    def __init__(self, registry: Any, timing: SimTiming, threads: int = 8) -> None:
        self.registry = registry
        self.timing = timing
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="registry")
        self.loop: asyncio.AbstractEventLoop | None = None
        self.workers: dict[str, SimWorker] = {}
        self.active: dict[str, str] = {}  # session id -> worker streaming it
        self.counters: Counter[str] = Counter()
        self.calls: Counter[str] = Counter()
        self.streaming_at: dict[str, float] = {}  # session id -> wall time it was first reported Streaming
        self.double: list[dict[str, Any]] = []

    async def call(self, name: str, fn: Callable[[], T]) -> T:
        self.calls[name] += 1
        assert self.loop is not None
        return await self.loop.run_in_executor(self.pool, fn)

    # -- pods -> workers -------------------------------------------------------------------------
    def pod_event(self, kind: str, pod: dict[str, Any]) -> None:
        meta, spec, status = pod["metadata"], pod.get("spec") or {}, pod.get("status") or {}
        name = meta["name"]
        gone = kind == "DELETED" or meta.get("deletionTimestamp")
        if gone:
            w = self.workers.pop(name, None)
            if w is not None:
                w.stop()
            return
        if name in self.workers or status.get("phase") != "Running" or not spec.get("nodeName"):
            return
        env = {e["name"]: e.get("value") for c in spec.get("containers", []) for e in c.get("env", [])}
        pool = env.get("VIVANT_POOL")
        if not pool:
            return
        w = SimWorker(self, name, pool, spec["nodeName"])
        self.workers[name] = w
        w.start()

    def wake(self, worker_id: str) -> None:
        w = self.workers.get(worker_id)
        if w is not None:
            w.wake.set()

    def snapshot(self, final: bool = False) -> dict[str, Any]:
        states = Counter(w.state for w in self.workers.values())
        out: dict[str, Any] = {
            "at": time.time(), "workers": len(self.workers), "states": dict(states),
            "active_sessions": len(self.active), "counters": dict(self.counters),
            "registry_calls": dict(self.calls), "redis_commands": redis_count.counts(),
            "double_assignments": self.double,
        }
        if final:
            out["streaming_at"] = dict(self.streaming_at)
        return out


class SimWorker:
    def __init__(self, fleet: Fleet, worker_id: str, pool: str, node: str) -> None:
        self.fleet, self.worker_id, self.pool, self.node = fleet, worker_id, pool, node
        self.wake = asyncio.Event()
        self.state = "starting"
        self.current: str | None = None
        self.chunks = 0
        self.session_task: asyncio.Task | None = None
        self.end_requested: asyncio.Event | None = None
        self.end_reason = ""
        self.end_failed = False  # the session ends Failed (lease lost), not Ended
        self.tasks: list[asyncio.Task] = []

    def info(self, warm: bool) -> WorkerInfo:
        return WorkerInfo(worker_id=self.worker_id, pool=self.pool, node=self.node, model_preset="57b", warm=warm)

    def start(self) -> None:
        self.tasks = [asyncio.ensure_future(self.run())]

    def stop(self) -> None:
        asyncio.ensure_future(self.shutdown())

    async def shutdown(self) -> None:
        reg, f = self.fleet.registry, self.fleet
        for t in [*self.tasks, self.session_task]:
            if t is not None:
                t.cancel()
        if self.current is not None:
            sid = self.current
            await self._final(sid, "Failed", "worker shutting down")
        self.state = "gone"
        try:
            await f.call("deregister", lambda: reg.deregister(self.worker_id, self.pool, reason="worker shut down"))
        except Exception as exc:  # noqa: BLE001 (the reaper will)
            log.warning("worker %s: deregister failed: %s", self.worker_id, exc)

    async def run(self) -> None:
        reg, f, t = self.fleet.registry, self.fleet, self.fleet.timing
        try:
            await f.call("register", lambda: reg.register(self.info(False)))
            hb = asyncio.ensure_future(self.heartbeat())
            self.tasks.append(hb)
            await asyncio.sleep(t.warmup_s)
            await f.call("recover_unacked", lambda: reg.recover_unacked(self.worker_id))
            await f.call("set_warm", lambda: reg.set_warm(self.worker_id, self.pool))
            self.state = "idle"
            f.counters["warm"] += 1
            await self.serve()
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("worker %s crashed", self.worker_id)
            f.counters["crashed"] += 1

    async def heartbeat(self) -> None:
        reg, f = self.fleet.registry, self.fleet
        interval = reg.heartbeat_ttl_s / 3
        while True:
            await asyncio.sleep(interval)
            stats = {"session": self.current, "chunks": self.chunks}
            try:
                known = await f.call("heartbeat", lambda s=stats: reg.heartbeat(self.worker_id, self.pool, s))
                if not known:
                    f.counters["reregistered"] += 1
                    kept = await f.call("register", lambda: reg.register(self.info(self.state != "starting"),
                                                                         session_id=self.current))
                    if self.current and not kept:
                        f.counters["lease_lost"] += 1
                        self._request_end("lease lost", failed=True)
            except Exception as exc:  # noqa: BLE001 (keep beating, as the real worker does)
                log.warning("worker %s: heartbeat failed: %s", self.worker_id, exc)

    async def serve(self) -> None:
        reg, f = self.fleet.registry, self.fleet
        while True:
            try:
                await asyncio.wait_for(self.wake.wait(), timeout=f.timing.poll_s)
            except TimeoutError:
                pass
            self.wake.clear()
            while True:
                msg = await f.call("next_message", lambda: reg.next_message(self.worker_id, 0))
                if msg is None:
                    break
                await self.handle(msg)

    async def handle(self, msg: Any) -> None:
        reg, f = self.fleet.registry, self.fleet
        if isinstance(msg, EndRequest):
            await f.call("ack", lambda: reg.ack(self.worker_id, msg))
            if msg.session_id == self.current:
                f.counters["end_requests"] += 1
                self._request_end(msg.reason)
                if self.session_task is not None:
                    await asyncio.shield(self.session_task)
            else:
                f.counters["end_requests_not_running"] += 1
            return
        f.counters["assignments"] += 1
        if msg.pool != self.pool:
            f.counters["wrong_pool"] += 1
            await f.call("ack", lambda: reg.ack(self.worker_id, msg))
            return
        if self.current == msg.session_id:
            # the session it streams, assigned again: the real chunk loop acknowledges it and streams on
            # (worker/serving/service.py). Counted: the operator must never send it (a create handler run twice)
            f.counters["repeated_assignments"] += 1
            f.double.append({"worker": self.worker_id, "session": msg.session_id, "at": time.time(),
                             "kind": "assignment-repeated"})
            await f.call("ack", lambda: reg.ack(self.worker_id, msg))
            return
        if self.current is not None:
            holder = await f.call("session_of", lambda: reg.session_of(self.pool, self.worker_id))
            if holder == msg.session_id:
                # the registry gave this worker to another session: as the real chunk loop, the current one
                # ends Failed (lease lost) and the new one is put back and served next
                f.counters["lease_lost"] += 1
                await f.call("recover_unacked", lambda: reg.recover_unacked(self.worker_id))
                self._request_end(f"lease lost: the worker was assigned session {msg.session_id}", failed=True)
                if self.session_task is not None:
                    await asyncio.shield(self.session_task)
                return
            # the real chunk loop pops it, logs "busy with session X; dropped" and acks it: that session is lost
            f.counters["assignments_while_busy"] += 1
            f.double.append({"worker": self.worker_id, "busy_with": self.current, "assigned": msg.session_id,
                             "at": time.time(), "kind": "assigned-while-busy"})
            await f.call("ack", lambda: reg.ack(self.worker_id, msg))
            return
        holder = await f.call("session_of", lambda: reg.session_of(self.pool, self.worker_id))
        if holder != msg.session_id:
            f.counters["stale_assignments"] += 1
            await f.call("ack", lambda: reg.ack(self.worker_id, msg))
            return
        other = f.active.get(msg.session_id)
        if other is not None and other != self.worker_id:
            f.counters["double_assignments"] += 1
            f.double.append({"session": msg.session_id, "workers": [other, self.worker_id], "at": time.time(),
                             "kind": "session-on-two-workers"})
        f.active[msg.session_id] = self.worker_id
        self.current, self.chunks, self.state = msg.session_id, 0, "busy"
        self.end_requested, self.end_reason, self.end_failed = asyncio.Event(), "", False
        self.session_task = asyncio.ensure_future(self.stream(msg))

    def _request_end(self, reason: str, failed: bool = False) -> None:
        self.end_reason, self.end_failed = reason, failed
        if self.end_requested is not None:
            self.end_requested.set()

    def _stats(self, sid: str, phase: str, t0: float, reason: str | None = None) -> SessionStats:
        # as worker/serving/service.py computes them: frames delivered (4 per chunk) over the wall time since the
        # start, so the average moves a little with every report, as a real one does
        t = self.fleet.timing
        elapsed = max(0.0, time.monotonic() - t0) if t0 else 0.0
        self.chunks = int(elapsed * t.fps / 4)
        fps = self.chunks * 4 / elapsed if elapsed > 0 else 0.0
        return SessionStats(session_id=sid, worker_id=self.worker_id, phase=phase, fps=fps, chunks=self.chunks,
                            streamed_s=self.chunks * 4 / t.fps, chunk_p99_ms=110.0, end_reason=reason)

    async def stream(self, a: Any) -> None:
        reg, f, t = self.fleet.registry, self.fleet, self.fleet.timing
        sid = a.session_id
        assert self.end_requested is not None
        try:
            await f.call("report_session", lambda: reg.report_session(sid, self._stats(sid, "Connecting", 0.0)))
            try:
                await asyncio.wait_for(self.end_requested.wait(), timeout=t.connect_s)
            except TimeoutError:
                pass
            await f.call("ack", lambda: reg.ack(self.worker_id, a))
            t0 = time.monotonic()
            while True:  # the first Streaming report comes one interval after the start, as in the real loop
                try:
                    await asyncio.wait_for(self.end_requested.wait(), timeout=t.stats_interval_s)
                    break
                except TimeoutError:
                    pass
                st = self._stats(sid, "Streaming", t0)
                await f.call("report_session", lambda st=st: reg.report_session(sid, st))
                f.streaming_at.setdefault(sid, time.time())
            await asyncio.sleep(t.end_s)
            await self._final(sid, "Failed" if self.end_failed else "Ended", self.end_reason or "ended", t0)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("worker %s: session %s crashed", self.worker_id, sid)
            f.counters["session_crashed"] += 1
            self._clear(sid)

    async def _final(self, sid: str, phase: str, reason: str, t0: float = 0.0) -> None:
        reg, f = self.fleet.registry, self.fleet
        final = self._stats(sid, phase, t0, reason)
        try:
            await f.call("report_session", lambda: reg.report_session(sid, final))
            await f.call("finish", lambda: reg.finish(self.pool, self.worker_id, sid, reason))
            f.counters["sessions_" + phase.lower()] += 1
        finally:
            self._clear(sid)

    def _clear(self, sid: str) -> None:
        if self.fleet.active.get(sid) == self.worker_id:
            del self.fleet.active[sid]
        if self.current == sid:
            self.current, self.state = None, "idle"


# ------------------------------------------------------------------------------------------ process


def _watch_pods(kubeconfig: str, namespace: str, loop: asyncio.AbstractEventLoop, fleet: Fleet,
                stop: threading.Event) -> None:
    """List + watch the worker pods (a thread: the `kubernetes` client is synchronous)."""
    import kubernetes

    api = kubernetes.client.CoreV1Api(kubernetes.config.new_client_from_config(config_file=kubeconfig))
    rv: str | None = None
    while not stop.is_set():
        try:
            if rv is None:  # list only at the start and after 410 Gone, not after every watch timeout
                listing = api.list_namespaced_pod(namespace, label_selector=WORKER_SELECTOR, _preload_content=False)
                body = json.loads(listing.data)
                for pod in body.get("items", []):
                    loop.call_soon_threadsafe(fleet.pod_event, "ADDED", pod)
                rv = body["metadata"]["resourceVersion"]
            w = kubernetes.watch.Watch()
            for ev in w.stream(api.list_namespaced_pod, namespace, label_selector=WORKER_SELECTOR,
                               resource_version=rv, timeout_seconds=300, allow_watch_bookmarks=True):
                if stop.is_set():
                    w.stop()
                    break
                obj = ev["raw_object"]
                rv = (obj.get("metadata") or {}).get("resourceVersion") or rv
                if ev["type"] in ("ADDED", "MODIFIED", "DELETED"):
                    loop.call_soon_threadsafe(fleet.pod_event, ev["type"], obj)
        except kubernetes.client.ApiException as exc:
            if exc.status == 410:
                rv = None
            log.warning("pod watch: %s %s; watching again", exc.status, exc.reason)
            stop.wait(1.0)
        except Exception as exc:  # noqa: BLE001 (a dropped connection: watch again from rv)
            log.warning("pod watch: %s; watching again", exc)
            stop.wait(1.0)


def _listen_inboxes(registry: Any, loop: asyncio.AbstractEventLoop, fleet: Fleet, stop: threading.Event) -> None:
    """Wake a worker when something is pushed to its inbox (keyspace notifications; a thread)."""
    r = registry.redis
    flags = r.config_get("notify-keyspace-events").get("notify-keyspace-events", "")
    wanted = "".join(sorted(set(flags) | set("Kl")))
    r.config_set("notify-keyspace-events", wanted)
    db = r.connection_pool.connection_kwargs.get("db", 0)
    prefix = f"__keyspace@{db}__:{registry.prefix}worker:"
    ps = r.pubsub(ignore_subscribe_messages=True)
    ps.psubscribe(prefix + "*:inbox")
    while not stop.is_set():
        msg = ps.get_message(timeout=1.0)
        if not msg:
            continue
        event = msg["data"].decode() if isinstance(msg["data"], bytes) else msg["data"]
        if event not in ("rpush", "lpush"):
            continue
        channel = msg["channel"].decode() if isinstance(msg["channel"], bytes) else msg["channel"]
        worker_id = channel[len(prefix):-len(":inbox")]
        loop.call_soon_threadsafe(fleet.wake, worker_id)
    ps.close()


def _write(path: Path, body: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(body))
    os.replace(tmp, path)


async def _main(args: argparse.Namespace) -> None:
    from vivant.sessions.registry import Registry

    redis_count.install()
    registry = Registry(args.redis_url, heartbeat_ttl_s=args.heartbeat_ttl_s)
    timing = SimTiming(warmup_s=args.warmup_s, connect_s=args.connect_s, end_s=args.end_s,
                       stats_interval_s=args.stats_interval_s)
    loop = asyncio.get_running_loop()
    stop = threading.Event()
    done = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, done.set)
    fleet: Any
    if args.real_workers:
        from vivant.bench.fleet.real_workers import RealFleet

        fleet = RealFleet(args.redis_url, timing, args.heartbeat_ttl_s)
        threads = []
    else:
        fleet = Fleet(registry, timing, threads=args.threads)
        fleet.loop = loop
        threads = [threading.Thread(target=_listen_inboxes, args=(registry, loop, fleet, stop), daemon=True)]
    threads.append(threading.Thread(target=_watch_pods, args=(args.kubeconfig, args.namespace, loop, fleet, stop),
                                    daemon=True))
    for th in threads:
        th.start()
    status = Path(args.status_file)
    while not done.is_set():
        _write(status, fleet.snapshot())
        try:
            await asyncio.wait_for(done.wait(), timeout=1.0)
        except TimeoutError:
            pass
    stop.set()
    if args.real_workers:
        fleet.stop_all()
    _write(status, fleet.snapshot(final=True))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m vivant.bench.fleet.sim_workers", description=__doc__.splitlines()[0])
    p.add_argument("--kubeconfig", required=True)
    p.add_argument("--namespace", required=True)
    p.add_argument("--redis-url", required=True)
    p.add_argument("--status-file", required=True)
    p.add_argument("--heartbeat-ttl-s", type=float, default=10.0)
    p.add_argument("--warmup-s", type=float, default=SimTiming.warmup_s)
    p.add_argument("--connect-s", type=float, default=SimTiming.connect_s)
    p.add_argument("--end-s", type=float, default=SimTiming.end_s)
    p.add_argument("--stats-interval-s", type=float, default=SimTiming.stats_interval_s)
    p.add_argument("--threads", type=int, default=8)
    p.add_argument("--real-workers", action="store_true",
                   help="run the real WorkerService per pod, with a null engine (real_workers.py; a few hundred)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    asyncio.run(_main(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
