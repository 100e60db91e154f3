"""The streaming loop in one process: audio in → generator → decoder stage → pacer → sinks (`vivant demo`).

Why: this is where "as fast as it plays" is won or lost, so the loop measures itself. The generator runs on
the caller's thread: it takes each chunk's audio from `AudioInput` (silence when nobody speaks: idle chunks are
generated too), diffuses it and submits the latents to the `Playout` (vivant.worker.stream.playout: the
decoder stage and the playout thread, so decode(n) overlaps diffuse(n + 1)), at most `lead` chunks ahead of
playout (the lead fitted to the measured diffuse + decode times: vivant.worker.stream.lead). The report adds the
diffusion times and the speech taken to the playout's measurements. The worker runs the same playout on its
decoder rank, fed from the DiT ranks (vivant.worker.serving).

Rewind at a turn start: the chunks generated ahead of playback were made from silence (a listening face), and new
speech would wait behind all of them. So before taking a chunk whose audio holds a turn's first sample, the loop
splices at a frame (`Playout.splice`): f* is the first frame not published and due later than now + `min_lead_s`, in
chunk m at index k; every frame from f* on is dropped, buffered or still being decoded (a chunk in the decoder stage
is judged whole: kept if its first frame is due within the horizon, else dropped), and the decoder's causal state returns to after m − 1. The loop rewinds the generator's ring and
positions to the state after chunk m − 1 (`ChunkGenerator.rewind`) and the audio input to chunk m keeping the samples
m took for its frames < k (the turn's speech starts at frame k's first sample), and goes on from m: chunk m is made
again and only its frames k.. are shown, so the speech's first frame is conditioned on exactly what the viewer saw.
`min_lead_s` is the measured p99 of diffuse + decode plus the lead's margin (at least one frame), so frame k is ready before its slot. Where a turn starts is
`AudioInput.turn_starts_next` (the same rule as the served runtime's: a turn queued right behind speech still
playing continues it, no rewind; after `clear_buffer` the next turn rewinds). r is never below what the
generator's and the audio input's undo logs hold. See docs/ARCHITECTURE.md (Turns: rewind and lead).

An interrupt (`clear_buffer`, from any thread) is the same splice, made by the loop before it takes its next chunk
(the lead wait ends at once): f* = the first frame due later than now + `min_lead_s`, frame k of chunk m; frames from
f* on are dropped; the generator, the decoder and the audio input rewind to m (chunk m keeps the samples of its frames
< k, the cleared speech becomes silence from frame k's first sample), and chunk m is made again. So the face stops
talking at f* and the next frame slot is filled by the remade frame, not by a held one. Without rewinds
(`rewind_on_turn=False`) the pacer discards the speech chunks not begun instead (`Pacer.discard_speech_before`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from vivant.worker.stream.audio_in import AudioInput
from vivant.worker.stream.decoder_stage import LatentChunk
from vivant.worker.stream.lead import LeadConfig
from vivant.worker.stream.pacer import Clock, MonotonicClock, PacerConfig
from vivant.worker.stream.playout import Playout, StreamReport, TurnTrace, percentiles
from vivant.worker.stream.sinks import FrameSink
from vivant.worker.stream.splice import Splice, splice_cause
from vivant.worker.stream.vae import VAEDecoder

__all__ = ["StreamPipeline", "StreamReport", "TurnTrace", "percentiles"]


class StreamPipeline:
    """One session's loop. `generator` needs `generate_chunk(audio, sample_rate) -> obj with .latents` (and
    `.finite`, False for latents with NaN/Inf, if it checks them: the decoder then holds its last frame)
    and a `cfg` (ModelConfig: fps, frames_per_chunk, audio_sample_rate, chunk_sample_range)."""

    def __init__(self, generator, vae: VAEDecoder, sinks: list[FrameSink], audio_in: AudioInput | None = None,
                 pacer_config: PacerConfig | None = None, clock: Clock | None = None, decoder_queue_chunks: int = 2,
                 metrics=None, session: str = "local", max_lead_chunks: int = 3,
                 lead_config: LeadConfig | None = None, rewind_on_turn: bool = True) -> None:
        self.cfg = generator.cfg
        self.generator = generator
        self.clock = clock or MonotonicClock()
        self.audio_in = audio_in or AudioInput(self.cfg, clock=self.clock)
        lead_config = self._lead_config(lead_config, max_lead_chunks, pacer_config, rewind_on_turn)
        self.playout = Playout(self.cfg, vae, sinks, pacer_config=pacer_config, clock=self.clock,
                               decoder_queue_chunks=decoder_queue_chunks, metrics=metrics, session=session,
                               max_lead_chunks=max_lead_chunks, lead_config=lead_config)
        self.pacer, self.decoder, self.sinks = self.playout.pacer, self.playout.decoder, self.playout.sinks
        self.metrics = metrics
        self.session = session
        self.rewind_on_turn = rewind_on_turn
        self.diffuse_ms: list[float] = []
        self._speech_in = 0
        self._next = 0  # index of the next chunk to take
        self._last_speech_chunk = -1  # highest chunk taken with speech not cut by clear_buffer (−1: none)
        self._interrupt = threading.Event()  # clear_buffer came; the loop splices before its next chunk

    def _lead_config(self, given: LeadConfig | None, max_lead_chunks: int, pacer_config: PacerConfig | None,
                     rewind_on_turn: bool) -> LeadConfig:
        """The lead's bounds: a rewind drops at most lead − 1 chunks (chunk n − lead is playing when n is taken),
        so with rewinds on the lead may not exceed the generator's `rewind_chunks` + 1."""
        buffer_chunks = (pacer_config or PacerConfig()).buffer_chunks
        cap = self.generator.rewind_chunks + 1 if rewind_on_turn else buffer_chunks + 3
        if given is None:
            top = max(1, min(cap, max(max_lead_chunks, buffer_chunks + 3)))
            return LeadConfig.for_model(self.cfg, initial_chunks=min(max_lead_chunks, top), max_chunks=top)
        if given.max_chunks > cap:
            raise ValueError(f"lead_config.max_chunks = {given.max_chunks}; expected ≤ {cap} (the generator's "
                             f"rewind_chunks + 1: a rewind must reach every chunk not begun)")
        return given

    # ---- control ------------------------------------------------------------------------------------
    def clear_buffer(self) -> int:
        """Interrupt the character's speech: audio not yet taken is dropped (AudioInput.clear_buffer), and the
        loop splices before its next chunk (module docstring): the frames from f* on are made again from silence, so
        the speech stops at f* with no held frame. Without rewinds, the chunks of speech taken before the cut that
        have not started playing are discarded by the pacer (the speech stops within the chunk on screen). Thread-safe
        (a transport's thread may call it). Returns the audio samples dropped."""
        dropped = self.audio_in.clear_buffer()
        if self.rewind_on_turn:
            self._interrupt.set()
        else:
            self.playout.discard_speech_before(self.audio_in.last_cut_chunk)
        self._last_speech_chunk = -1  # what was not on screen is discarded
        return dropped

    @property
    def next_index(self) -> int:
        """Index of the chunk the loop takes next (it goes back at a rewind)."""
        return self._next

    def speech_queued(self) -> bool:
        """True while speech waits in the audio input or its last chunk taken has not started playing."""
        last = self._last_speech_chunk
        return self.audio_in.pending_samples() > 0 or (last >= 0 and not self.pacer.wait_until_started(last + 1, 0))

    def _turn_to_rewind(self) -> bool:
        """A turn starts in the next chunk and the loop rewinds for it."""
        return splice_cause(self._next, interrupted=False, turn_starts=self._turn_starts()) is not None

    def _turn_starts(self) -> bool:
        return self.rewind_on_turn and self.audio_in.turn_starts_next()

    def _cut_pending(self) -> bool:
        """The loop splices before its next chunk (a turn starts in it, or an interrupt came): ends the lead wait."""
        return self._interrupt.is_set() or self._turn_to_rewind()

    def _maybe_rewind(self) -> None:
        """Splice before taking the next chunk when an interrupt came or a turn starts in it (module docstring); one
        splice serves both (cause "interrupt" then)."""
        interrupted = self._interrupt.is_set()
        self._interrupt.clear()  # a clear_buffer after this line is spliced at the next chunk
        n = self._next
        cause = splice_cause(n, interrupted=interrupted, turn_starts=not interrupted and self._turn_starts())
        if cause is None:
            return
        oldest = max(self.generator.oldest_rewind(), self.audio_in.oldest_rewind())
        lead = self.playout.lead
        r, k = self.playout.splice(lead.min_lead_s(), oldest=oldest, cause=cause, next_chunk_s=lead.diffuse_p99_s())
        splice = Splice.checked(n, r, k, oldest=oldest, cause=cause)
        self.generator.rewind(r)
        self.audio_in.rewind(r, keep_samples=splice.keep_samples(self.pacer.config))
        self.playout.record_rewind(n)
        self._next = r
        self._last_speech_chunk = min(self._last_speech_chunk, r - 1)

    def make_next_chunk(self) -> int:
        """One step of the loop on the caller's thread: the splice due before it (`_maybe_rewind`), the chunk's audio
        taken, diffused and submitted to the playout's decoder stage; returns the chunk's index. `run` calls it after
        the lead wait; it needs only the decoder stage running (so its steps can also be driven on a FakeClock while
        the caller polls the pacer)."""
        self._maybe_rewind()
        n = self._next
        audio = self.audio_in.next_chunk()
        if audio.index != n:
            raise RuntimeError(f"audio input gave chunk {audio.index}; expected {n} (the loop's index)")
        self._speech_in += audio.speech_samples
        if audio.speech_samples:
            self._last_speech_chunk = n
        t_taken = self.clock.now()
        t = time.perf_counter()
        out = self.generator.generate_chunk(audio.samples, self.cfg.audio_sample_rate)
        self.diffuse_ms.append((time.perf_counter() - t) * 1e3)
        self.playout.observe_diffuse(self.diffuse_ms[-1] / 1e3)
        t_diffused = self.clock.now()
        self.playout.record_turns(audio.turns, t_diffused)
        self.playout.submit(LatentChunk(n, out.latents, audio.samples, {"audio_taken": t_taken, "diffused": t_diffused},
                                        finite=getattr(out, "finite", True)))
        self._next = n + 1
        if self.metrics is not None:
            self.metrics.observe_chunk("diffuse", self.diffuse_ms[-1] / 1e3)
        return n

    def turn_traces(self) -> list[TurnTrace]:
        return self.playout.turn_traces()

    def run(self, chunks: int, before_chunk: Callable[[int, StreamPipeline], None] | None = None, *,
            stop: threading.Event | None = None) -> StreamReport:
        """Stream `chunks` chunks of video (indices 0 … chunks − 1; a rewind makes some again, counted in the
        report's `chunks_generated`). `before_chunk(step, self)` runs on the generator thread before each chunk's
        audio is taken, `step` counting the chunks taken so far (0, 1, …; equal to the chunk index until the
        first rewind; `self.next_index` is the index): scripts push speech or interrupt there. Returns when the
        last frame is out.

        `stop` ends the stream early (a live session that ended): once it is set, checked before and
        after `before_chunk`, no further chunk is taken; chunks already taken are decoded and played
        out, and the report covers the chunks made (possibly 0)."""
        if chunks < 1:
            raise ValueError(f"chunks: expected a positive number of chunks, got {chunks}")
        playout = self.playout.start()
        made = 0
        step = 0
        errors: list[BaseException] = []
        try:
            while self._next < chunks:
                if playout.failed is not None or (stop is not None and stop.is_set()):
                    break
                playout.wait_lead(self._next, self._cut_pending)
                if before_chunk is not None:
                    before_chunk(step, self)
                if stop is not None and stop.is_set():
                    break
                made = max(made, self.make_next_chunk() + 1)
                step += 1
        except BaseException as exc:  # noqa: BLE001 (re-raised below, after the threads are stopped)
            errors.append(exc)
        try:
            playout.finish()
        except BaseException as exc:  # noqa: BLE001
            if not errors or playout.failed is not None:
                errors.insert(0, exc)
        if errors:
            raise errors[0]
        return playout.report(made, playout.production_seconds(), self.diffuse_ms, speech_samples_in=self._speech_in,
                              cleared_samples=self.audio_in.cleared_samples, chunks_generated=step)
