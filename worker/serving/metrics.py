"""Prometheus metrics of a GPU worker: what the fleet SLO rules and the dashboard read.

Why one class: the pipeline, the pacer and the service all report through the methods below, so the
metric names, label sets and units live in one place; the chart's rules file
(`charts/vivant/files/rules.yaml`) reads exactly these series and `tests/metrics/test_scrape.py`
checks that every series name and label the rules use is exported here.

Units are seconds and frames (Prometheus base units). Labels: `pool` (the pool id `<namespace>/<name>`,
as `vivant.sessions.resources.pool_key` makes it and the operator labels its series; fixed per process) on every series; `session` (the CharacterSession name) on per-session series, which
`session_ended` removes so a long-lived worker does not accumulate series of finished sessions.

Series (all prefixed `vivant_worker_`):

| series | type | labels | meaning |
|---|---|---|---|
| chunk_step_seconds | histogram | pool, stage | time of one 4-frame chunk per stage (diffuse, decode, publish, total); real-time budget 166.7 ms |
| session_delivered_fps | gauge | pool, session | frames per second delivered to LiveKit over the pacer's recent window |
| session_frames_total | counter | pool, session | frames published for the session |
| session_streamed_seconds | gauge | pool, session | wall seconds the session has been streaming |
| session_stalls_total | counter | pool, session | times the pacer ran dry (a frame was due, none ready) |
| session_buffer_chunks | gauge | pool, session | chunks waiting in the pacer's buffer |
| sessions_finished_total | counter | pool, result | finished sessions by SLO result: met, missed, short (streamed < 1 s, not counted) |
| numerical_faults_total | counter | pool | chunks whose latents were not finite (NaN/Inf): the model restarted after each |
| decoder_seconds | histogram | pool | VAE decode of one chunk on the decoder GPU |
| turn_latency_seconds | histogram | pool | video pipeline's share of a conversational turn (audio in → first frame out) |
| kernel_path_info | info | pool, path, flag_version | which kernel path is live and the flag version it came from |
| build_info | gauge (=1) | pool, version | present while the worker process runs (absent-metric alerts key on it) |
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram, Info, start_http_server
from vivant.apis.resources import SLO_MIN_FPS, SLO_MIN_STREAMED_SECONDS

# A chunk is 4 frames at 24 fps: 4 / 24 s = 166.7 ms. Buckets are dense around that budget so the
# p99-over-budget alert interpolates inside a narrow bucket.
CHUNK_BUDGET_SECONDS = 4 / 24
CHUNK_STEP_BUCKETS = (
    0.025, 0.05, 0.075, 0.1, 0.125, 0.14, 0.15, 0.16, 0.1667, 0.175, 0.2, 0.25, 0.3, 0.5, 1.0, 2.5,
)
DECODER_BUCKETS = (0.005, 0.01, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.125, 0.1667, 0.25, 0.5, 1.0)
# The reference pipeline takes 0.49 s of a 2.1 s median turn.
TURN_LATENCY_BUCKETS = (0.1, 0.2, 0.3, 0.4, 0.45, 0.49, 0.55, 0.6, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0)

STAGES = ("diffuse", "decode", "publish", "total")
RESULTS = ("met", "missed", "short")


@dataclass(frozen=True)
class SessionFpsObjective:
    """The fleet SLO on a single session: average fps ≥ `min_fps` over a stream of ≥ `min_streamed_seconds`.

    The defaults are the typed source's (`vivant.sessions.resources`, also used by the operator's
    auto-rollback); the rules file repeats them in PromQL and `tests/alerts` checks the two agree.
    """

    min_fps: float = SLO_MIN_FPS
    min_streamed_seconds: float = SLO_MIN_STREAMED_SECONDS
    objective: float = 0.995  # fraction of qualifying sessions that must meet `min_fps`

    def result(self, frames: float, streamed_seconds: float) -> str:
        """'short' if the session did not qualify, else 'met' or 'missed'."""
        if streamed_seconds < self.min_streamed_seconds:
            return "short"
        return "met" if frames / streamed_seconds >= self.min_fps else "missed"


REFERENCE_OBJECTIVE = SessionFpsObjective()


@dataclass
class _SessionTally:
    frames: float = 0.0
    streamed_seconds: float = 0.0


@dataclass
class WorkerMetrics:
    """The worker's metric set, registered on `registry` (a fresh `CollectorRegistry` in tests).

    One instance per process: registering the same names twice on one registry raises.
    Methods validate their inputs (a negative duration or an unknown stage is a bug in the caller,
    reported with a ValueError naming the argument) and are safe to call from several threads.
    """

    pool: str
    registry: CollectorRegistry = field(default=REGISTRY)
    version: str = "0.1.0"
    objective: SessionFpsObjective = REFERENCE_OBJECTIVE

    def __post_init__(self) -> None:
        if not self.pool:
            raise ValueError("pool: expected a non-empty WorkerPool name")
        r = self.registry
        self._lock = threading.Lock()
        self._tallies: dict[str, _SessionTally] = {}
        self._chunk = Histogram(
            "vivant_worker_chunk_step_seconds", "Time of one 4-frame chunk, per pipeline stage.",
            ["pool", "stage"], buckets=CHUNK_STEP_BUCKETS, registry=r,
        )
        self._fps = Gauge(
            "vivant_worker_session_delivered_fps", "Frames per second delivered over the pacer's recent window.",
            ["pool", "session"], registry=r,
        )
        self._frames = Counter(
            "vivant_worker_session_frames", "Frames published to the session's video track.",
            ["pool", "session"], registry=r,
        )
        self._streamed = Gauge(
            "vivant_worker_session_streamed_seconds", "Wall seconds the session has been streaming.",
            ["pool", "session"], registry=r,
        )
        self._stalls = Counter(
            "vivant_worker_session_stalls", "Times a frame was due and none was ready.",
            ["pool", "session"], registry=r,
        )
        self._buffer = Gauge(
            "vivant_worker_session_buffer_chunks", "Chunks waiting in the pacer's buffer.",
            ["pool", "session"], registry=r,
        )
        self._finished = Counter(
            "vivant_worker_sessions_finished",
            "Finished sessions by SLO result (met/missed; short = streamed < 1 s, not counted).",
            ["pool", "result"], registry=r,
        )
        self._faults = Counter(
            "vivant_worker_numerical_faults",
            "Chunks whose latents were not finite (NaN/Inf); the model's state restarted after each.",
            ["pool"], registry=r,
        )
        self._decoder = Histogram(
            "vivant_worker_decoder_seconds", "VAE decode of one chunk on the decoder GPU.",
            ["pool"], buckets=DECODER_BUCKETS, registry=r,
        )
        self._turn = Histogram(
            "vivant_worker_turn_latency_seconds", "Video pipeline's share of a turn: audio in to first frame out.",
            ["pool"], buckets=TURN_LATENCY_BUCKETS, registry=r,
        )
        self._kernel = Info(
            "vivant_worker_kernel_path", "Live kernel path and the flag version it came from.",
            ["pool"], registry=r,
        )
        self._build = Gauge(
            "vivant_worker_build_info", "1 while the worker process runs.", ["pool", "version"], registry=r,
        )
        self._build.labels(pool=self.pool, version=self.version).set(1)
        # Pre-create the finished-session counters so rate() sees a 0 before the first session ends.
        for result in RESULTS:
            self._finished.labels(pool=self.pool, result=result)
        for stage in STAGES:
            self._chunk.labels(pool=self.pool, stage=stage)
        self._faults.labels(pool=self.pool)  # a 0 before the first fault, so increase() counts the first one

    # -- per-chunk timings -------------------------------------------------------------------
    def observe_chunk(self, stage: str, seconds: float) -> None:
        if stage not in STAGES:
            raise ValueError(f"stage: expected one of {', '.join(STAGES)}, got {stage!r}")
        self._chunk.labels(pool=self.pool, stage=stage).observe(_duration("seconds", seconds))

    def numerical_fault(self) -> None:
        """One chunk with non-finite latents (the generator restarted its model state after it)."""
        self._faults.labels(pool=self.pool).inc()

    def decoder_seconds(self, seconds: float) -> None:
        self._decoder.labels(pool=self.pool).observe(_duration("seconds", seconds))

    def turn_latency(self, seconds: float) -> None:
        self._turn.labels(pool=self.pool).observe(_duration("seconds", seconds))

    # -- per-session series ------------------------------------------------------------------
    def session_fps(self, session: str, fps: float) -> None:
        self._fps.labels(pool=self.pool, session=_session(session)).set(_nonnegative("fps", fps))

    def frames_published(self, session: str, n: int = 1) -> None:
        if not isinstance(n, int) or n < 0:
            raise ValueError(f"n: expected a non-negative frame count, got {n!r}")
        s = _session(session)
        with self._lock:
            self._tallies.setdefault(s, _SessionTally()).frames += n
        self._frames.labels(pool=self.pool, session=s).inc(n)

    def streamed_seconds(self, session: str, seconds: float) -> None:
        s = _session(session)
        value = _nonnegative("seconds", seconds)
        with self._lock:
            self._tallies.setdefault(s, _SessionTally()).streamed_seconds = value
        self._streamed.labels(pool=self.pool, session=s).set(value)

    def stall(self, session: str) -> None:
        self._stalls.labels(pool=self.pool, session=_session(session)).inc()

    def buffer_depth(self, session: str, chunks: int) -> None:
        if not isinstance(chunks, int) or chunks < 0:
            raise ValueError(f"chunks: expected a non-negative chunk count, got {chunks!r}")
        self._buffer.labels(pool=self.pool, session=_session(session)).set(chunks)

    def session_ended(self, session: str) -> str:
        """Count the session's SLO result and drop its per-session series. Returns the result.

        Ending a session that never reported anything counts nothing and returns 'short'.
        """
        s = _session(session)
        with self._lock:
            tally = self._tallies.pop(s, None)
        result = "short" if tally is None else self.objective.result(tally.frames, tally.streamed_seconds)
        if tally is not None:
            self._finished.labels(pool=self.pool, result=result).inc()
        for metric in (self._fps, self._frames, self._streamed, self._stalls, self._buffer):
            try:
                metric.remove(self.pool, s)
            except KeyError:
                pass  # that series was never reported for this session
        return result

    # -- kernel path ---------------------------------------------------------------------------
    def kernel_info(self, path: str, flag_version: int | str) -> None:
        if not path:
            raise ValueError("path: expected the name of the live kernel path, got an empty string")
        self._kernel.labels(pool=self.pool).info({"path": path, "flag_version": str(flag_version)})


def serve(metrics_port: int, addr: str = "0.0.0.0", registry: CollectorRegistry = REGISTRY):
    """Expose `registry` at http://addr:metrics_port/metrics; returns (server, thread)."""
    return start_http_server(metrics_port, addr=addr, registry=registry)


def _session(session: str) -> str:
    if not isinstance(session, str) or not session:
        raise ValueError(f"session: expected a non-empty CharacterSession name, got {session!r}")
    return session


def _nonnegative(name: str, value: float) -> float:
    v = float(value)
    if math.isnan(v) or v < 0:
        raise ValueError(f"{name}: expected a non-negative number, got {value!r}")
    return v


def _duration(name: str, value: float) -> float:
    v = _nonnegative(name, value)
    if math.isinf(v):
        raise ValueError(f"{name}: expected a finite duration, got {value!r}")
    return v
