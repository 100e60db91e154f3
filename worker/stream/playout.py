"""The back half of the stream: latents → the decoder stage → the 24 fps pacer → sinks, with its measurements.

Why its own module: the same playout runs inside `StreamPipeline` (one process: generator, decoder and playout
threads; `vivant demo`) and on the worker's decoder rank, where the latents arrive from DiT rank 0 over
torch.distributed (vivant.worker.serving.ranks). `Playout` owns two threads: the `DecoderStage` (decode(n)
overlaps whatever produces n + 1) pushes decoded chunks into the `Pacer` (waiting only while the jitter buffer
is full, i.e. everything is ahead of real time), and the playout thread releases frames at exact 1/fps steps on
the clock and writes them to every `FrameSink`.

Measured per chunk (ms, p50/p99): submit wait, decode, pacer push wait, buffer residency (decoded → first frame
published), publish (sink writes per frame), end to end (audio taken → first frame published); the pacer's
record (stalls, repeated frames, buffer depth, A/V offset); and per speech turn the clock times of its first
sample pushed, the chunk carrying it diffused, decoded and its frame published (`TurnTrace`), observed into
`WorkerMetrics.turn_latency` when a metrics object is given. Times are seconds on the playout's clock.

Rewind (`rewind`, at a speech turn's start): the chunks not begun and not due within a lead are dropped from the
pacer and the decoder stage, the decoder's causal state returns to after the last chunk kept, and the producer
generates again from the returned chunk r (docs/ARCHITECTURE.md, "Rewind at a turn start"); each rewind is kept in
`rewinds`. `splice` is the same at a frame (m, k): the chunk on screen is cut at its frame k instead of playing to
its end, the decoder's state returns to after m − 1 and the producer makes chunk m again, of which only frames k.. are
shown (`Pacer.splice_unshown`).

Lead limit: `wait_lead(n)` blocks the producer until chunk n may be taken (chunk n − lead has started playing),
which bounds the latency the buffers add to a turn. The lead is fitted to the measured diffuse + decode times
by a `LeadController` (vivant.worker.stream.lead), starting from `max_lead_chunks`; the report gives the lead
chosen and its changes. A rewind at a turn start is traced in the turn it was made for: the first turn pushed before it
whose first sample lands at or after its cut (at the cut, unless speech the cut gave back comes first), and the A/V
offset of every generated frame from the cut on is kept (its max |offset| is reported).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field

import numpy as np
from vivant.worker.stream.audio_in import TurnStart
from vivant.worker.stream.decoder_stage import DecoderStage, LatentChunk
from vivant.worker.stream.lead import LeadConfig, LeadController
from vivant.worker.stream.pacer import (
    Clock,
    DecodedChunk,
    MonotonicClock,
    Pacer,
    PacerConfig,
    PacerFull,
    PublishedFrame,
    Rewind,
)
from vivant.worker.stream.sinks import FrameSink
from vivant.worker.stream.vae import VAEDecoder

TURN_STAGES = ("rewound", "diffused", "decoded", "published")  # after "audio in" (the first sample pushed)


@dataclass
class TurnTrace:
    """One speech turn's way to the screen, as clock times (s): its first sample pushed (audio in) → the rewind
    done (None when the turn did not rewind) → the chunk carrying that sample diffused → decoded → its frame
    published. `av_offset_ms`: that frame's A/V offset (audio position of its first sample minus its pts)."""

    turn: int
    pushed_s: float
    chunk_index: int | None = None
    first_frame: int | None = None  # generated frame index whose audio holds the turn's first sample
    rewound_to: int | None = None  # chunk the generator was rewound to for this turn (None: no rewind)
    rewound_s: float | None = None
    diffused_s: float | None = None
    decoded_s: float | None = None
    published_s: float | None = None
    av_offset_ms: float | None = None

    @property
    def latency_s(self) -> float | None:
        return None if self.published_s is None else self.published_s - self.pushed_s

    def stage_ms(self) -> dict[str, float | None]:
        """ms from audio in to each stage of TURN_STAGES (None where the stage did not happen)."""
        ms = lambda t: None if t is None else round((t - self.pushed_s) * 1e3, 2)  # noqa: E731
        return {f"{name}_ms": ms(getattr(self, f"{name}_s")) for name in TURN_STAGES}

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(self.stage_ms())
        return d

    def format_text(self) -> str:
        d = self.stage_ms()
        rewind = (f"→ rewound to chunk {self.rewound_to} {d['rewound_ms']} ms " if self.rewound_to is not None
                  else "(no rewind) ")
        head = f"turn {self.turn}: first sample in {rewind}→ diffused {d['diffused_ms']} ms"
        if self.published_s is None:
            return (f"{head}; never published (its chunk {self.chunk_index} was discarded by an interrupt "
                    f"or the stream ended)")
        return (f"{head} → decoded {d['decoded_ms']} ms → first frame published {d['published_ms']} ms "
                f"(chunk {self.chunk_index}, frame {self.first_frame}, A/V offset {self.av_offset_ms} ms)")


def turn_stage_percentiles(turns: list[dict]) -> dict[str, dict]:
    """p50/p99/max over turns of each stage's ms from audio in (turns where the stage happened)."""
    return {name: percentiles([t[f"{name}_ms"] for t in turns if t.get(f"{name}_ms") is not None])
            for name in TURN_STAGES}


def percentiles(values: list[float]) -> dict[str, float | int | None]:
    if not values:
        return {"n": 0, "p50": None, "p99": None, "max": None}
    a = np.asarray(values, dtype=np.float64)
    return {"n": int(a.size), "p50": round(float(np.percentile(a, 50)), 3),
            "p99": round(float(np.percentile(a, 99)), 3), "max": round(float(a.max()), 3)}


@dataclass
class StreamReport:
    session: str
    chunks: int
    content_seconds: float
    production_seconds: float  # first chunk's audio taken → last chunk decoded
    playout_seconds: float  # t0 → last frame published
    frames_published: int  # live slots, repeats included
    generated_frames_published: int
    repeated_frames: int
    stalls: int
    stall_frames: list[int]
    stall_causes: list[str]  # "late" (generation behind) or "interrupt" (gap after discarded speech)
    discarded_chunks: list[int]  # chunks whose decoded frames an interruption dropped (all or those from its cut)
    delivered_fps: float  # generated frames per second of live playout
    real_time_factor: float  # busiest stage's compute seconds per content second (≤ 1 keeps up)
    production_real_time_factor: float  # wall production s per content s (lead-limited when ahead)
    max_abs_av_offset_ms: float
    stages_ms: dict[str, dict]
    buffer_depth: list[tuple[float, int]]  # (s since t0, chunks buffered)
    turns: list[dict]
    speech_samples_in: int
    cleared_samples: int
    chunks_generated: int = 0  # chunks diffused, those dropped by rewinds included
    rewinds: list[dict] = field(default_factory=list)  # per rewind: from_chunk, to_chunk, to_frame, dropped, at_s (s since
    # t0), cause ("turn" or "interrupt")
    lead_chunks: int = 0  # the lead at the end of the stream
    lead_changes: list[tuple[int, int]] = field(default_factory=list)  # (chunk index, lead from then on)
    max_abs_av_offset_after_rewind_ms: float | None = None  # over generated frames of rewound chunks
    turn_stages_ms: dict[str, dict] = field(default_factory=dict)  # TURN_STAGES: ms from audio in, over turns
    discarded_frames: int = 0  # frames decoded and never published (cut by a rewind or an interrupt: Pacer's count)

    def to_dict(self) -> dict:
        return asdict(self)

    def format_text(self) -> str:
        lines = [
            f"session {self.session}: {self.chunks} chunks, {self.content_seconds:.2f} s of video",
            f"  live playout: {self.generated_frames_published} generated frames in {self.playout_seconds:.2f} s "
            f"= {self.delivered_fps:.2f} fps delivered; {self.stalls} stalls "
            f"({self.stall_causes.count('late')} late, {self.stall_causes.count('interrupt')} after an interrupt), "
            f"{self.repeated_frames} repeated frames; {self.discarded_frames} decoded frames never shown "
            f"({len(self.discarded_chunks)} chunks cut by interrupts)",
            f"  real-time factor {self.real_time_factor:.2f} (busiest stage's compute s per s of video; ≤ 1 keeps "
            f"up); wall production {self.production_seconds:.2f} s for {self.content_seconds:.2f} s of video",
            f"  A/V offset: max |offset| {self.max_abs_av_offset_ms:.3f} ms (one frame = {1000 / 24:.1f} ms); after "
            f"rewinds: {'n/a' if self.max_abs_av_offset_after_rewind_ms is None else f'{self.max_abs_av_offset_after_rewind_ms:.3f} ms'}",
            f"  lead: {self.lead_chunks} chunks at the end; changes (chunk: lead) "
            + ", ".join(f"{c}: {lead}" for c, lead in self.lead_changes)
            + f"; {len(self.rewinds)} rewinds, {self.chunks_generated} chunks generated for {self.chunks}",
            "  stage              n      p50 ms    p99 ms    max ms",
        ]
        for name, s in self.stages_ms.items():
            if s["n"]:
                lines.append(f"  {name:<16}{s['n']:>5}  {s['p50']:>9.2f} {s['p99']:>9.2f} {s['max']:>9.2f}")
        depths = [d for _, d in self.buffer_depth]
        if depths:
            step = max(1, len(self.buffer_depth) // 12)
            trace = " ".join(f"{t:.1f}s:{d}" for t, d in self.buffer_depth[::step])
            lines.append(f"  buffer depth (chunks) min {min(depths)} max {max(depths)}; over time: {trace}")
        for t in self.turns:
            fields = {k: t[k] for k in TurnTrace.__dataclass_fields__}
            lines.append("  " + TurnTrace(**fields).format_text())
        if self.turns:
            lines.append("  turn stage (ms from audio in)  n      p50       p99")
            for name, s in self.turn_stages_ms.items():
                if s["n"]:
                    lines.append(f"  {name:<29}{s['n']:>3} {s['p50']:>9.2f} {s['p99']:>9.2f}")
        return "\n".join(lines)


class Playout:
    """Decoder stage → pacer → sinks for one session (module docstring). `grid`: the ModelConfig (fps,
    frames_per_chunk, audio_sample_rate, chunk_sample_range); `metrics`: a WorkerMetrics or None."""

    def __init__(self, grid, vae: VAEDecoder, sinks: list[FrameSink], *, pacer_config: PacerConfig | None = None,
                 clock: Clock | None = None, decoder_queue_chunks: int = 2, metrics=None, session: str = "local",
                 max_lead_chunks: int = 3, lead_config: LeadConfig | None = None) -> None:
        self.clock = clock or MonotonicClock()
        self.pacer = Pacer(pacer_config or PacerConfig.for_model(grid), self.clock)
        if self.pacer.config.fps != grid.fps or self.pacer.config.frames_per_chunk != grid.frames_per_chunk:
            raise ValueError(f"pacer_config: expected fps {grid.fps} and frames_per_chunk "
                             f"{grid.frames_per_chunk} (the model's), got {self.pacer.config}")
        self.lead = LeadController(lead_config or LeadConfig.for_model(
            grid, initial_chunks=max_lead_chunks, max_chunks=max(max_lead_chunks, self.pacer.config.buffer_chunks + 3)))
        self._rewind_from: list[int] = []  # per entry of `rewinds`: the chunk the producer was about to take
        self._rewound_from_frame: int | None = None  # generated frames from here on belong to rewound chunks
        self._max_av_after_rewind: float | None = None
        self.sinks = list(sinks)
        self.metrics = metrics
        self.session = session
        self.decoder = DecoderStage(vae, self._on_decoded, queue_chunks=decoder_queue_chunks, now=self.clock.now)
        self._lock = threading.Lock()
        self._chunk_times: dict[int, dict[str, float]] = {}
        self._turns: dict[int, TurnTrace] = {}
        self._turn_by_frame: dict[int, list[TurnTrace]] = {}
        self.push_wait_ms: list[float] = []
        self.lead_wait_ms: list[float] = []
        self.buffer_ms: list[float] = []
        self.publish_ms: list[float] = []
        self.e2e_ms: list[float] = []
        self.submitted = 0
        self._stalls_seen = 0
        self._playout_error: BaseException | None = None
        self._last_published_s: float | None = None
        self._thread: threading.Thread | None = None
        self.rewinds: list[Rewind] = []

    # ---- the producer's side ------------------------------------------------------------------------
    def start(self) -> Playout:
        if self._thread is None:
            self.decoder.start()
            self._thread = threading.Thread(target=self._playout, name="vivant-playout", daemon=True)
            self._thread.start()
        return self

    @property
    def failed(self) -> BaseException | None:
        """The playout thread's error, if it stopped (re-raised by `finish`)."""
        return self._playout_error

    def current_lead(self, n: int) -> int:
        """The lead for taking chunk n (re-fitted to the measurements); before playout starts, at least the pacer's
        start_chunks (else it would never start)."""
        lead = self.lead.update(n)
        return lead if self.pacer.t0 is not None else max(lead, self.pacer.config.start_chunks)

    def wait_lead(self, n: int, wake: Callable[[], bool] | None = None) -> None:
        """Block until chunk n may be taken: chunk n − lead has started playing (or playout failed), or `wake()`
        returns True (checked every 5 ms: a turn that starts ends the wait, its rewind makes room)."""
        t = time.perf_counter()
        while True:
            lead = self.current_lead(n)
            if n < lead or self.pacer.wait_until_started(n - lead + 1, 0.25 if wake is None else 0.005):
                break
            if self._playout_error is not None or (wake is not None and wake()):
                break
        self.lead_wait_ms.append((time.perf_counter() - t) * 1e3)

    def observe_diffuse(self, seconds: float) -> None:
        """The producer's diffusion time of one chunk (s), for the lead."""
        self.lead.observe_diffuse(seconds)

    def record_rewind(self, from_chunk: int) -> None:
        """The latest `rewind` was made when the producer was about to take `from_chunk` (for the report)."""
        with self._lock:
            if len(self._rewind_from) >= len(self.rewinds):
                raise RuntimeError(f"record_rewind(from_chunk={from_chunk}): no rewind left to attach it to")
            self._rewind_from.append(from_chunk)
            last = self.rewinds[-1]
            self._rewound_from_frame = last.to_chunk * self.pacer.config.frames_per_chunk + last.frame

    def record_turns(self, turns: Iterable[TurnStart], t_diffused: float) -> None:
        """Speech turns whose first sample is in the chunk just diffused at `t_diffused` (clock seconds)."""
        pc = self.pacer.config
        with self._lock:
            for start in turns:
                frame = start.chunk_index * pc.frames_per_chunk
                while pc.frame_sample(frame + 1) <= start.stream_sample:
                    frame += 1
                trace = TurnTrace(start.turn, start.pushed_s, start.chunk_index, frame, diffused_s=t_diffused)
                # the turn's rewind: the latest made after its first sample was pushed, cutting at or before that
                # sample's frame (speech a splice gave back to the queue may come first), not another turn's
                rewind = next((rw for rw in reversed(self.rewinds)
                               if rw.at_s >= start.pushed_s and rw.to_chunk * pc.frames_per_chunk + rw.frame <= frame
                               and not any(t.rewound_s == rw.at_s and t.rewound_to == rw.to_chunk
                                           for t in self._turns.values() if t.turn != start.turn)), None)
                if rewind is not None:  # this turn's speech starts at or after the frame the stream was rewound to
                    trace.rewound_to, trace.rewound_s = rewind.to_chunk, rewind.at_s
                self._turns[start.turn] = trace
                self._turn_by_frame.setdefault(frame, []).append(trace)

    def submit(self, chunk: LatentChunk) -> float:
        """Hand a diffused chunk to the decoder stage (its `times` carry "audio_taken" and "diffused"); returns
        the seconds spent waiting for queue space."""
        waited = self.decoder.submit(chunk)
        self.submitted += 1
        return waited

    def discard_speech_before(self, index: int) -> list[int]:
        return self.pacer.discard_speech_before(index)

    def rewind(self, min_lead_s: float = 0.0, *, oldest: int = 0, keep_pending_due: bool = False) -> int:
        """At a turn start: r = the first chunk not begun and not due within `min_lead_s` seconds from now. With
        `keep_pending_due` the chunks submitted and still in the decoder stage are judged the same way, by the slots
        they will get (one due that soon cannot be made again in time: it is kept); without it they are all dropped.
        Drops chunks ≥ r from the pacer and the decoder stage, rewinds the decoder's causal state to after r − 1,
        records the rewind (`rewinds`) and returns r; the producer submits chunk r next (its generator and audio input
        rewound to r). r ≥ `oldest` (the producer's undo logs hold chunks from there). The half-shown rule and the
        drop are the pacer's (`Pacer.drop_unstarted`). Holds the decoder stage's lock, so no chunk reaches the pacer
        between the two drops."""
        return self._rewind(min_lead_s, oldest, keep_pending_due, frames=False)[0]

    def splice(self, min_lead_s: float = 0.0, *, oldest: int = 0, keep_pending_due: bool = True,
               cause: str = "turn", next_chunk_s: float = 0.0) -> tuple[int, int]:
        """`rewind` at a frame (docs/ARCHITECTURE.md, "Rewind at a turn start"): f* = the first frame not published
        and due later than now + `min_lead_s`, in chunk m at index k (`Pacer.splice_unshown`; the chunks in the
        decoder stage are judged whole, as by `rewind`, or all dropped without `keep_pending_due`). Frames of m before k stay; the
        decoder's causal state returns to after m − 1; returns (m, k). The producer makes chunk m again (its
        generator at m, its audio input at m keeping the samples of frames < k) and submits it; the pacer shows
        only its frames k.. . The rewind record carries k (`Rewind.frame`) and `cause`: "turn" (a speech turn starts)
        or "interrupt" (`clear_buffer`: the producer makes chunk m again from silence from frame k, so the speech stops
        at the cut without a held frame; `Pacer.splice_unshown(interrupt=True)` records the discard).
        `next_chunk_s`: the producer's time for the chunk after the remade one (`Pacer.splice_unshown`)."""
        if cause not in ("turn", "interrupt"):
            raise ValueError(f"splice cause = {cause!r}; expected 'turn' or 'interrupt'")
        return self._rewind(min_lead_s, oldest, keep_pending_due, frames=True, cause=cause, next_chunk_s=next_chunk_s)

    def _rewind(self, min_lead_s: float, oldest: int, keep_pending_due: bool, *, frames: bool,
                cause: str = "turn", next_chunk_s: float = 0.0) -> tuple[int, int]:
        if not min_lead_s >= 0:
            raise ValueError(f"rewind min_lead_s = {min_lead_s!r}; expected seconds ≥ 0")
        with self.decoder.lock:
            buffered = self.pacer.buffered_indices()
            oldest = max(oldest, self.decoder.oldest_rewind())
            pending = self.submitted if keep_pending_due else None
            if frames:
                r, k = self.pacer.splice_unshown(self.clock.now() + min_lead_s, oldest=oldest, pending_until=pending,
                                                 interrupt=cause == "interrupt", next_chunk_s=next_chunk_s)
            else:
                r, k = self.pacer.drop_unstarted(self.clock.now() + min_lead_s, oldest=oldest,
                                                 pending_until=pending), 0
            self.decoder.rewind(r)
            dropped = sorted({i for i in buffered if i >= r} | set(self.decoder.rewind_dropped))
            self.submitted = min(self.submitted, r)
        first_dropped = r * self.pacer.config.frames_per_chunk + k
        with self._lock:
            for index in [i for i in self._chunk_times if i >= r]:
                del self._chunk_times[index]
            for frame in [f for f in self._turn_by_frame if f >= first_dropped]:
                del self._turn_by_frame[frame]
            self.rewinds.append(Rewind(self.clock.now(), r, dropped, frame=k, cause=cause))
        return r, k

    def finish(self) -> None:
        """Decode and play out what was submitted, stop both threads and close every sink (even after a failure,
        so files are finalised); re-raises the first error."""
        errors: list[BaseException] = []
        try:
            self.decoder.close()
        except RuntimeError as exc:
            errors.append(exc)
        self.pacer.close_input()
        if self._thread is not None:
            self._thread.join()
        for sink in self.sinks:
            try:
                sink.close()
            except Exception as exc:  # noqa: BLE001
                errors.append(exc)
        if self._playout_error is not None:
            raise RuntimeError(f"playout failed: {self._playout_error!r}") from self._playout_error
        if errors:
            raise errors[0]

    # ---- decoder thread -----------------------------------------------------------------------------
    def _on_decoded(self, chunk: DecodedChunk) -> None:
        with self._lock:
            self._chunk_times[chunk.index] = chunk.times
            for trace in self._turns.values():
                if trace.chunk_index == chunk.index:
                    trace.decoded_s = chunk.times["decoded"]
        if self.decoder.decode_ms:
            self.lead.observe_decode(self.decoder.decode_ms[-1] / 1e3)
        if self.metrics is not None:
            self.metrics.decoder_seconds(self.decoder.decode_ms[-1] / 1e3)
            self.metrics.observe_chunk("decode", self.decoder.decode_ms[-1] / 1e3)
        t = time.perf_counter()
        while True:
            try:
                self.pacer.push(chunk)
                break
            except PacerFull:
                if self._playout_error is not None:
                    raise RuntimeError("playout stopped; the pacer will not drain") from self._playout_error
                self.pacer.wait_for_space(0.25)
        self.push_wait_ms.append((time.perf_counter() - t) * 1e3)
        if self.metrics is not None:
            self.metrics.buffer_depth(self.session, self.pacer.depth())

    # ---- playout thread -----------------------------------------------------------------------------
    def _playout(self) -> None:
        try:
            while not self.pacer.wait_for_start(0.25):
                pass
            while True:
                frames = self.pacer.poll()
                for frame in frames:
                    self._publish(frame)
                if self.pacer.drained and not frames:
                    return
                due = self.pacer.next_due()
                if due is not None:
                    self.clock.sleep_until(due)
        except BaseException as exc:  # noqa: BLE001 (re-raised by finish)
            self._playout_error = exc

    def _publish(self, frame: PublishedFrame) -> None:
        t = time.perf_counter()
        for sink in self.sinks:
            sink.write(frame)
        self.publish_ms.append((time.perf_counter() - t) * 1e3)
        self._last_published_s = frame.published_s
        m = self.metrics
        if not frame.repeated:
            rewound_from = self._rewound_from_frame
            if rewound_from is not None and frame.content_index >= rewound_from and frame.av_offset_s is not None:
                self._max_av_after_rewind = max(self._max_av_after_rewind or 0.0, abs(frame.av_offset_s))
            if frame.first_of_chunk:  # timed from the first frame shown: frame k of a chunk remade at a splice
                times = frame.chunk_times or {}
                if "decoded" in times and "audio_taken" in times:
                    self.buffer_ms.append((frame.published_s - times["decoded"]) * 1e3)
                    self.e2e_ms.append((frame.published_s - times["audio_taken"]) * 1e3)
                    if m is not None:
                        m.observe_chunk("total", (frame.published_s - times["audio_taken"]))
            with self._lock:
                traces = self._turn_by_frame.pop(frame.content_index, [])
            for trace in traces:
                trace.published_s = frame.published_s
                trace.av_offset_ms = None if frame.av_offset_s is None else round(frame.av_offset_s * 1e3, 3)
                if m is not None:
                    m.turn_latency(trace.latency_s)
            if m is not None:
                m.frames_published(self.session, 1)
        if m is not None:
            m.observe_chunk("publish", self.publish_ms[-1] / 1e3)
            if frame.repeated:
                stalls = self.pacer.stall_count()
                for _ in range(stalls - self._stalls_seen):
                    m.stall(self.session)
                self._stalls_seen = stalls

    def production_seconds(self) -> float:
        """First chunk's audio taken → last chunk decoded (0 before any chunk was decoded)."""
        with self._lock:
            times = list(self._chunk_times.values())
        taken = [t["audio_taken"] for t in times if "audio_taken" in t]
        decoded = [t["decoded"] for t in times if "decoded" in t]
        return max(decoded) - min(taken) if taken and decoded else 0.0

    def turn_traces(self) -> list[TurnTrace]:
        with self._lock:
            return [self._turns[k] for k in sorted(self._turns)]

    def report(self, chunks: int, production_s: float, diffuse_ms: list[float], *, speech_samples_in: int = 0,
               cleared_samples: int = 0, chunks_generated: int | None = None) -> StreamReport:
        """The session's StreamReport, once `finish` returned: `chunks` of content made (the stream's length),
        production seconds (first audio taken → last chunk decoded), the producer's diffusion times,
        `chunks_generated` (default `chunks`: rewinds regenerate some)."""
        stats = self.pacer.stats()
        pc = self.pacer.config
        turns = [t.to_dict() for t in self.turn_traces()]
        content_s = chunks * pc.frames_per_chunk / pc.fps
        t0 = stats.t0 or 0.0
        playout_s = (self._last_published_s - t0 + 1 / pc.fps) if self._last_published_s is not None else 0.0
        fps = stats.generated_frames_published / playout_s if playout_s > 0 else 0.0
        if self.metrics is not None:
            self.metrics.session_fps(self.session, fps)
            self.metrics.streamed_seconds(self.session, playout_s)
        return StreamReport(
            session=self.session, chunks=chunks, content_seconds=content_s, production_seconds=production_s,
            playout_seconds=playout_s, frames_published=stats.frames_published,
            generated_frames_published=stats.generated_frames_published, repeated_frames=stats.repeated_frames,
            stalls=stats.stall_count, stall_frames=[s.frames for s in stats.stalls],
            stall_causes=[s.cause for s in stats.stalls],
            discarded_chunks=[i for d in stats.discards for i in d.chunks], delivered_fps=fps,
            real_time_factor=max(sum(diffuse_ms), sum(self.decoder.decode_ms)) / 1e3 / content_s if chunks else 0.0,
            production_real_time_factor=production_s / content_s if chunks else 0.0,
            max_abs_av_offset_ms=stats.max_abs_av_offset_s * 1e3,
            stages_ms={"lead_wait": percentiles(self.lead_wait_ms), "diffuse": percentiles(diffuse_ms), "submit_wait": percentiles(self.decoder.submit_wait_ms),
                       "decode": percentiles(self.decoder.decode_ms), "pacer_push_wait": percentiles(self.push_wait_ms),
                       "buffer": percentiles(self.buffer_ms), "publish_frame": percentiles(self.publish_ms),
                       "end_to_end": percentiles(self.e2e_ms)},
            buffer_depth=[(round(t - t0, 3), d) for t, d in stats.depth_history],
            turns=turns, speech_samples_in=speech_samples_in, cleared_samples=cleared_samples,
            chunks_generated=chunks if chunks_generated is None else chunks_generated,
            rewinds=[{"from_chunk": from_chunk, "to_chunk": rw.to_chunk, "to_frame": rw.frame, "dropped": rw.dropped,
                      "at_s": round(rw.at_s - t0, 4), "cause": rw.cause}
                     for from_chunk, rw in zip(self._rewind_from, self.rewinds, strict=False)],
            lead_chunks=self.lead.lead, lead_changes=list(self.lead.changes),
            max_abs_av_offset_after_rewind_ms=(None if self._max_av_after_rewind is None
                                               else self._max_av_after_rewind * 1e3),
            turn_stages_ms=turn_stage_percentiles(turns), discarded_frames=stats.discarded_frames,
        )
