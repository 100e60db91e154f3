"""The streaming loop in one process: audio in → generator → decoder stage → pacer → sinks (`vivant demo`).

Why: this is where "as fast as it plays" is won or lost, so the loop measures itself. The generator runs on
the caller's thread: it takes each chunk's audio from `AudioInput` (silence when nobody speaks: idle chunks are
generated too), diffuses it and submits the latents to the `Playout` (vivant.worker.stream.playout: the
decoder stage and the playout thread, so decode(n) overlaps diffuse(n + 1)), at most `max_lead_chunks` chunks
ahead of playout. The report adds the diffusion times and the speech taken to the playout's measurements.
The worker runs the same playout on its decoder rank, fed from the DiT ranks (vivant.worker.serving).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from vivant.worker.stream.audio_in import AudioInput
from vivant.worker.stream.decoder_stage import LatentChunk
from vivant.worker.stream.pacer import Clock, MonotonicClock, PacerConfig
from vivant.worker.stream.playout import Playout, StreamReport, TurnTrace, percentiles
from vivant.worker.stream.sinks import FrameSink
from vivant.worker.stream.vae import VAEDecoder

__all__ = ["StreamPipeline", "StreamReport", "TurnTrace", "percentiles"]


class StreamPipeline:
    """One session's loop. `generator` needs `generate_chunk(audio, sample_rate) -> obj with .latents`
    and a `cfg` (ModelConfig: fps, frames_per_chunk, audio_sample_rate, chunk_sample_range)."""

    def __init__(self, generator, vae: VAEDecoder, sinks: list[FrameSink], audio_in: AudioInput | None = None,
                 pacer_config: PacerConfig | None = None, clock: Clock | None = None, decoder_queue_chunks: int = 2,
                 metrics=None, session: str = "local", max_lead_chunks: int = 3) -> None:
        self.cfg = generator.cfg
        self.generator = generator
        self.clock = clock or MonotonicClock()
        self.audio_in = audio_in or AudioInput(self.cfg, clock=self.clock)
        self.playout = Playout(self.cfg, vae, sinks, pacer_config=pacer_config, clock=self.clock,
                               decoder_queue_chunks=decoder_queue_chunks, metrics=metrics, session=session,
                               max_lead_chunks=max_lead_chunks)
        self.pacer, self.decoder, self.sinks = self.playout.pacer, self.playout.decoder, self.playout.sinks
        self.metrics = metrics
        self.session = session
        self.diffuse_ms: list[float] = []
        self._speech_in = 0

    # ---- control ------------------------------------------------------------------------------------
    def clear_buffer(self) -> int:
        """Interrupt the character's speech: audio not yet taken is dropped (AudioInput.clear_buffer) and
        chunks of speech taken before the cut that have not started playing are discarded by the pacer,
        so the speech stops within the chunk on screen. Returns the audio samples dropped."""
        dropped = self.audio_in.clear_buffer()
        self.playout.discard_speech_before(self.audio_in.last_cut_chunk)
        return dropped

    def turn_traces(self) -> list[TurnTrace]:
        return self.playout.turn_traces()

    def run(self, chunks: int, before_chunk: Callable[[int, StreamPipeline], None] | None = None, *,
            stop: threading.Event | None = None) -> StreamReport:
        """Stream `chunks` chunks; `before_chunk(n, self)` runs on the generator thread before chunk n's
        audio is taken (scripts push speech or interrupt there). Returns when the last frame is out.

        `stop` ends the stream early (a live session that ended): once it is set, checked before and
        after `before_chunk`, no further chunk is taken; chunks already taken are decoded and played
        out, and the report covers the chunks made (possibly 0)."""
        if chunks < 1:
            raise ValueError(f"chunks: expected a positive number of chunks, got {chunks}")
        playout = self.playout.start()
        made = 0
        errors: list[BaseException] = []
        try:
            for n in range(chunks):
                if playout.failed is not None or (stop is not None and stop.is_set()):
                    break
                playout.wait_lead(n)
                if before_chunk is not None:
                    before_chunk(n, self)
                if stop is not None and stop.is_set():
                    break
                audio = self.audio_in.next_chunk()
                self._speech_in += audio.speech_samples
                t_taken = self.clock.now()
                t = time.perf_counter()
                out = self.generator.generate_chunk(audio.samples, self.cfg.audio_sample_rate)
                self.diffuse_ms.append((time.perf_counter() - t) * 1e3)
                t_diffused = self.clock.now()
                playout.record_turns(audio.turns, t_diffused)
                playout.submit(LatentChunk(n, out.latents, audio.samples, {"audio_taken": t_taken, "diffused": t_diffused}))
                made = n + 1
                if self.metrics is not None:
                    self.metrics.observe_chunk("diffuse", self.diffuse_ms[-1] / 1e3)
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
                              cleared_samples=self.audio_in.cleared_samples)
