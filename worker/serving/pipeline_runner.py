"""A worker-service session served by the full stream pipeline (generator → decoder stage → pacer → sinks).

Why a runner of its own: `StreamPipeline.run` owns its loop (generator, decoder and playout threads)
for a whole stream, while the worker service drives a session chunk by chunk (it checks its inbox,
applies flag changes and reports stats between chunks). `PipelineRunner` runs the pipeline in a thread
and gates it: the pipeline's `before_chunk(n)` hook waits until the service's `step()` lets chunk n go,
and `step()` returns once chunk n has been diffused and handed to the decoder (the pipeline is back
at the gate). So `apply_flags` lands between two chunks, as the service promises, and `end` stops the
stream early with `StreamPipeline.run(stop=...)`: chunks already taken are decoded and played out
before `end` returns, and `report` holds that session's `StreamReport`.

The pipeline's own lead limit (a chunk's audio is taken at most `max_lead_chunks` chunks before it
plays) paces `step` at real time once the jitter buffer is full.

Per session: `ceil(max_duration_s / chunk_seconds)` chunks at most (all made -> `SessionEnded` with the
service's max-duration reason); sinks: a `NullSink`, or with `out_dir` an MP4 file
`<out_dir>/<session id with / as _>.mp4` on the content timeline. The generator is fed from the
pipeline's `AudioInput` (silence: no audio source is wired to this runner yet).
Units: `ChunkReport.compute_ms` is that chunk's diffusion time in ms.
"""

from __future__ import annotations

import logging
import math
import threading
from pathlib import Path
from typing import Any

from vivant.apis.feature_flags import FlagValues
from vivant.sessions.models import Assignment
from vivant.worker.serving.runner import MAX_DURATION_REASON, ChunkReport, SessionEnded
from vivant.worker.stream.pipeline import StreamPipeline, StreamReport
from vivant.worker.stream.sinks import FrameSink, Mp4Sink, NullSink

log = logging.getLogger(__name__)


class PipelineRunner:
    """`SessionRunner` over `StreamPipeline` (see module doc). `generator`: a `ChunkGenerator` (with `cfg`,
    `reset_session(seed)`, `generate_chunk`); `vae`: the causal VAE decoder."""

    def __init__(self, generator: Any, vae: Any, *, out_dir: str | Path | None = None,
                 step_timeout_s: float = 60.0) -> None:
        self.generator, self.vae = generator, vae
        self.cfg = generator.cfg
        self.frames_per_chunk = self.cfg.frames_per_chunk
        self.chunk_seconds = self.cfg.chunk_seconds
        self.out_dir = Path(out_dir) if out_dir else None
        self.step_timeout_s = step_timeout_s
        self.flags = FlagValues()
        self.report: StreamReport | None = None  # the latest session's, once it has ended
        self.sinks: list[FrameSink] = []
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._pipe: StreamPipeline | None = None
        self._thread: threading.Thread | None = None
        self._allowed = self._reached = 0  # chunks let through by step / index the pipeline waits at
        self._finished = False
        self._error: BaseException | None = None

    # -- SessionRunner -------------------------------------------------------------------------
    def begin(self, assignment: Assignment, flags: FlagValues) -> None:
        self.generator.reset_session(assignment.seed)
        self.apply_flags(flags)  # sets kernel_path, which the service reports after begin
        if self.out_dir is not None:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            path = self.out_dir / f"{assignment.session_id.replace('/', '_')}.mp4"
            self.sinks = [Mp4Sink(path, self.cfg.width, self.cfg.height, self.cfg.fps, self.cfg.audio_sample_rate,
                                  timeline="content")]
        else:
            self.sinks = [NullSink()]
        self._pipe = StreamPipeline(self.generator, self.vae, self.sinks, session=assignment.session_id)
        chunks = max(1, math.ceil(assignment.max_duration_s / self.chunk_seconds))
        self._stop.clear()
        self._allowed = self._reached = 0
        self._finished, self._error, self.report = False, None, None
        self._thread = threading.Thread(target=self._run, args=(self._pipe, chunks), daemon=True,
                                        name=f"pipeline-{assignment.session_id}")
        self._thread.start()

    def apply_flags(self, flags: FlagValues) -> str | None:
        """Returns the kernel path in effect (what the service reports), None when the generator has no hook."""
        self.flags = flags
        self.kernel_path = self.generator.apply_flags(flags)
        return self.kernel_path

    def step(self) -> ChunkReport:
        if self._pipe is None:
            raise RuntimeError("PipelineRunner.step before begin")
        n = self._allowed
        with self._cond:
            self._allowed += 1
            self._cond.notify_all()
            made = self._cond.wait_for(lambda: self._reached > n or self._finished, self.step_timeout_s)
        if self._error is not None:
            raise RuntimeError(f"stream pipeline failed: {self._error!r}") from self._error
        if not made:
            raise RuntimeError(f"stream pipeline: chunk {n} not made within {self.step_timeout_s:.0f}s")
        if self._reached <= n and len(self._pipe.diffuse_ms) <= n:  # every chunk of max duration is out
            raise SessionEnded(MAX_DURATION_REASON)
        return ChunkReport(index=n, compute_ms=self._pipe.diffuse_ms[n], frames=self.frames_per_chunk)

    def end(self, reason: str) -> None:
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=30)
            if self._thread.is_alive():
                log.error("stream pipeline did not stop within 30 s after %s", reason)
        if self.report is not None:
            log.info("session ended (%s): %s", reason, self.report.format_text())
        self._pipe, self._thread = None, None

    # -- the pipeline's thread ------------------------------------------------------------------
    def _run(self, pipe: StreamPipeline, chunks: int) -> None:
        try:
            self.report = pipe.run(chunks, self._before_chunk, stop=self._stop)
        except BaseException as exc:  # noqa: BLE001 (handed to the service's thread by step)
            self._error = exc
        finally:
            with self._cond:
                self._finished = True
                self._cond.notify_all()

    def _before_chunk(self, n: int, _pipe: StreamPipeline) -> None:
        with self._cond:
            self._reached = n
            self._cond.notify_all()
            self._cond.wait_for(lambda: self._allowed > n or self._stop.is_set())
