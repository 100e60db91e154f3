"""Prometheus metrics of the operator: sessions by phase, assignment latency, pool capacity, errors.

Why a class with an explicit registry: the operator process registers once on the default registry
(`OperatorMetrics()`), tests build their own `CollectorRegistry` so they never collide. The chart's
rules file (`charts/vivant/files/rules.yaml`) reads these series; `tests/metrics/test_scrape.py`
checks every name and label the rules use is exported. prometheus-client only (no torch here).

The `pool` label is the pool id `<namespace>/<name>` (`vivant.apis.resources.pool_key`), the same
value the workers put on their series, so rules can join operator and worker series on `pool`.

Series (all prefixed `vivant_operator_`):

| series | type | labels | meaning |
|---|---|---|---|
| sessions | gauge | namespace, pool, phase | CharacterSessions currently in each phase (a snapshot, see `set_session_counts`) |
| assignment_latency_seconds | histogram | pool | CharacterSession created → worker assigned |
| pool_workers | gauge | pool, state | workers of a pool per state: idle, busy, starting (not ready yet), draining |
| pool_desired_workers | gauge | pool | workers the pool should run now (busy + minIdle, capped by maxWorkers) |
| reconcile_errors_total | counter | kind | handler failures per resource kind (CharacterSession, WorkerPool, ...) |
| flag_rollbacks_total | counter | pool, flag, reason | feature-flag rollbacks (a flag turned off after being on) |
| inbox_dead_letters_total | counter | — | inbox messages workers rejected as malformed (the registry's dead-letter list, `observe_dead_letters`): an operator and workers that disagree on the message format |
| worker_failures_total | counter | pool, kind | workers that failed: `fault` (stopped themselves on a fault, exit code 3), `lost` (reaped after their heartbeat stopped); from the registry's per-pool counts (`observe_worker_failures`) |
| build_info | gauge (=1) | version | present while the operator runs (absent-metric alerts key on it) |
| reconcile_duration_seconds | histogram | handler | one run of a handler: `assign` (one session), `session_sweep` (all sessions of one pool), `release` (a delete, until the worker gave the lease back) |
| queue_depth | gauge | queue, pool | work waiting in the control plane: `waiting_for_worker` (sessions Pending with no worker), `awaiting_end` (deleted sessions whose worker has not stopped yet), `status_writes` (sessions with a status patch not yet written; pool `all`) |
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from functools import cache

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from vivant.sessions.registry import WORKER_FAILURE_KINDS

WORKER_STATES = ("idle", "busy", "starting", "draining")
ASSIGNMENT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
RECONCILE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
HANDLERS = ("assign", "session_sweep", "release")
EVENT_HANDLERS = ("session_create", "session_resume")
QUEUES = ("waiting_for_worker", "awaiting_end", "status_writes")


class OperatorMetrics:
    """The operator's metric set on one registry. Inputs are checked; bad ones raise ValueError naming the field."""

    def __init__(self, registry: CollectorRegistry = REGISTRY, version: str = "0.1.0") -> None:
        r = registry
        self.registry = registry
        self._sessions = Gauge(
            "vivant_operator_sessions", "CharacterSessions per phase.", ["namespace", "pool", "phase"], registry=r,
        )
        self._assign = Histogram(
            "vivant_operator_assignment_latency_seconds", "CharacterSession created to worker assigned.",
            ["pool"], buckets=ASSIGNMENT_BUCKETS, registry=r,
        )
        self._workers = Gauge(
            "vivant_operator_pool_workers", "Workers of a pool per state (idle, busy, starting, draining).",
            ["pool", "state"], registry=r,
        )
        self._desired = Gauge(
            "vivant_operator_pool_desired_workers", "Workers the pool should run now (busy + minIdle, capped by maxWorkers).", ["pool"], registry=r,
        )
        self._errors = Counter(
            "vivant_operator_reconcile_errors", "Handler failures per resource kind.", ["kind"], registry=r,
        )
        self._rollbacks = Counter(
            "vivant_operator_flag_rollbacks", "Feature-flag rollbacks per pool and flag.",
            ["pool", "flag", "reason"], registry=r,
        )
        self._reconcile = Histogram(
            "vivant_operator_reconcile_duration_seconds", "One run of a handler (assign, session_sweep, release).",
            ["handler"], buckets=RECONCILE_BUCKETS, registry=r,
        )
        self._queue = Gauge(
            "vivant_operator_queue_depth", "Work waiting in the control plane, per queue and pool.",
            ["queue", "pool"], registry=r,
        )
        self._failures = Counter(
            "vivant_operator_worker_failures", "Workers that failed: fault (stopped on a fault), lost (reaped).",
            ["pool", "kind"], registry=r,
        )
        self._dead_letters = Counter(
            "vivant_operator_inbox_dead_letters", "Inbox messages workers rejected as malformed.", registry=r,
        )
        self._handler_runs = Counter(
            "vivant_operator_handler_runs", "Runs of a kopf event handler (session_create, session_resume).",
            ["handler"], registry=r,
        )
        # a registry count last observed, per counter child: (pool, kind) or "dead_letters" -> n
        self._seen: dict[object, int] = {}
        self._build = Gauge("vivant_operator_build_info", "1 while the operator runs.", ["version"], registry=r)
        self._build.labels(version=version).set(1)

    def set_session_counts(self, counts: Mapping[tuple[str, str, str], int]) -> None:
        """Replace the sessions gauge with a fresh snapshot {(namespace, pool, phase): count}.

        Series absent from the snapshot are removed, so a phase that emptied reads as gone, not stale.
        """
        checked = {}
        for key, n in counts.items():
            if not (isinstance(key, tuple) and len(key) == 3 and all(isinstance(k, str) and k for k in key)):
                raise ValueError(f"counts: expected keys (namespace, pool, phase) of non-empty strings, got {key!r}")
            checked[key] = _count("count", n)
        self._sessions.clear()
        for (namespace, pool, phase), n in checked.items():
            self._sessions.labels(namespace=namespace, pool=pool, phase=phase).set(n)

    def observe_assignment(self, pool: str, seconds: float) -> None:
        v = float(seconds)
        if math.isnan(v) or math.isinf(v) or v < 0:
            raise ValueError(f"seconds: expected a finite non-negative duration, got {seconds!r}")
        self._assign.labels(pool=_name("pool", pool)).observe(v)

    def set_pool_workers(self, pool: str, *, desired: int, **by_state: int) -> None:
        """Set a pool's capacity: `set_pool_workers("ns/main", desired=4, idle=2, busy=1, starting=1, draining=0)`.

        States not given are set to 0 so the idle-capacity alert sees an explicit zero.
        """
        p = _name("pool", pool)
        unknown = set(by_state) - set(WORKER_STATES)
        if unknown:
            raise ValueError(f"state: expected one of {', '.join(WORKER_STATES)}, got {sorted(unknown)}")
        self._desired.labels(pool=p).set(_count("desired", desired))
        for state in WORKER_STATES:
            self._workers.labels(pool=p, state=state).set(_count(state, by_state.get(state, 0)))

    def pool_deleted(self, pool: str) -> None:
        """Drop a deleted pool's series."""
        p = _name("pool", pool)
        for state in WORKER_STATES:
            try:
                self._workers.remove(p, state)
            except KeyError:
                pass
        try:
            self._desired.remove(p)
        except KeyError:
            pass
        for queue in QUEUES:
            try:
                self._queue.remove(queue, p)
            except KeyError:
                pass
        for kind in WORKER_FAILURE_KINDS:
            self._seen.pop((p, kind), None)
            try:
                self._failures.remove(p, kind)
            except KeyError:
                pass

    def observe_reconcile(self, handler: str, seconds: float) -> None:
        if handler not in HANDLERS:
            raise ValueError(f"handler: expected one of {', '.join(HANDLERS)}, got {handler!r}")
        v = float(seconds)
        if math.isnan(v) or math.isinf(v) or v < 0:
            raise ValueError(f"seconds: expected a finite non-negative duration, got {seconds!r}")
        self._reconcile.labels(handler=handler).observe(v)

    def set_queue_depth(self, queue: str, pool: str, depth: int) -> None:
        self._queue.labels(queue=_queue(queue), pool=_name("pool", pool)).set(_count("depth", depth))

    def queue_change(self, queue: str, pool: str, delta: int) -> None:
        """+1 when an item enters the queue, -1 when it leaves (for queues counted where they happen)."""
        if delta not in (-1, 1):
            raise ValueError(f"delta: expected +1 or -1, got {delta!r}")
        self._queue.labels(queue=_queue(queue), pool=_name("pool", pool)).inc(delta)

    def handler_run(self, handler: str) -> None:
        """One run of an event handler (kopf runs a session's create handler once unless it fails)."""
        if handler not in EVENT_HANDLERS:
            raise ValueError(f"handler: expected one of {', '.join(EVENT_HANDLERS)}, got {handler!r}")
        self._handler_runs.labels(handler=handler).inc()

    def reconcile_error(self, kind: str) -> None:
        self._errors.labels(kind=_name("kind", kind)).inc()

    def observe_worker_failures(self, pool: str, counts: Mapping[str, int]) -> None:
        """Advance the failures counter to the registry's per-pool counts {kind: n} (`Registry.worker_failures`).
        The first observation of a pool in this process is the baseline (the series starts at 0, so an operator
        restart does not count the pool's history again); a count that went down (Redis restarted empty) is the
        new baseline."""
        p = _name("pool", pool)
        unknown = set(counts) - set(WORKER_FAILURE_KINDS)
        if unknown:
            raise ValueError(f"kind: expected one of {', '.join(WORKER_FAILURE_KINDS)}, got {sorted(unknown)}")
        checked = {kind: _count(kind, counts.get(kind, 0)) for kind in WORKER_FAILURE_KINDS}  # all, before any change
        for kind, n in checked.items():
            self._advance(self._failures.labels(pool=p, kind=kind), (p, kind), n)

    def observe_dead_letters(self, total: int) -> None:
        """Advance the dead-letters counter to the registry's count (`Registry.dead_letters_total`), from a
        baseline as `observe_worker_failures`."""
        self._advance(self._dead_letters, "dead_letters", _count("total", total))

    def _advance(self, counter, key: object, n: int) -> None:  # noqa: ANN001 (a prometheus_client Counter child)
        """Count a registry's total n into `counter`: its first reading (per process) is the baseline, a reading
        below the last one (Redis restarted empty) a new baseline; the series exists (at 0) from the first."""
        seen = self._seen.get(key)
        counter.inc(n - seen if seen is not None and n > seen else 0)
        self._seen[key] = n

    def flag_rollback(self, pool: str, flag: str, reason: str) -> None:
        self._rollbacks.labels(pool=_name("pool", pool), flag=_name("flag", flag), reason=_name("reason", reason)).inc()


@cache
def default_metrics() -> OperatorMetrics:
    """The process's operator metrics on the default registry (created on first use)."""
    return OperatorMetrics()


def serve(metrics_port: int, addr: str = "127.0.0.1", registry: CollectorRegistry = REGISTRY):
    """Expose `registry` at http://addr:metrics_port/metrics; returns (server, thread)."""
    return start_http_server(metrics_port, addr=addr, registry=registry)


def _name(field: str, value: str) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{field}: expected a non-empty string, got {value!r}")
    return value


def _queue(value: str) -> str:
    if value not in QUEUES:
        raise ValueError(f"queue: expected one of {', '.join(QUEUES)}, got {value!r}")
    return value


def _count(field: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{field}: expected a non-negative integer, got {value!r}")
    return value
