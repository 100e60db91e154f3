"""`vivant worker --tensor-parallel N`: one process that forms its N + 1 ranks and serves sessions on them.

Rank 0 is this process. `RankRuntime.start` spawns ranks 1 … N (vivant.worker.serving.supervisor), joins the
world, builds its own DiT shard while the others build theirs, and waits until every rank is ready. It is then
the `SessionRunner` the worker service drives (vivant.worker.serving.service): the service owns the session
(Redis lease, heartbeats, inbox, flags); the runtime turns each of the service's calls into words for the ranks
(vivant.worker.serving.wire):

  begin(assignment, flags)  the session's audio input (silence, `--speak FILE`, or — runner livekit — the agent's
                            speech as the decoder rank's room forwards it), the generator reset to the session's
                            seed and flags; BEGIN to the DiT ranks and to the decoder rank (livekit: it joins the
                            room; begin waits for the join, and a failed join fails the session)
  apply_flags(flags)        rank 0 swaps its row-parallel step now; the fused bit rides in the next CHUNK word,
                            so every DiT rank swaps at the same chunk boundary
  step()                    the chunk's audio (checked: a bad sample ends the session cleanly, before any rank
                            started the chunk), CHUNK + PCM to the DiT ranks, the tensor-parallel passes, the
                            latents and PCM to the decoder rank (asynchronously); a session error the decoder rank
                            reported ends the session with its reason
                            — when the chunk begins a new speech turn, a rewind first (below)
  end(reason)               END to every rank; the decoder rank plays out, closes the sinks and acknowledges
  end_reason                the room's reason to end (the agent left, END_CALL, the room disconnected), which the
                            service checks at every chunk boundary
  idle()                    an IDLE tick to every rank (between sessions, once per inbox poll)

Rewind at a turn start (docs/ARCHITECTURE.md): before taking a chunk whose first sample starts a new turn (the agent's
speech after silence, after `lk.clear_buffer`, or a `--speak` file), rank 0 asks the decoder rank (REWIND on the
link, with the lead to keep: a few recent diffuse times) where generation restarts; the decoder rank drops what was
not shown (frames from f*, frame k of chunk r: the pipeline runner's `Playout.splice`, the livekit runner's room
queue, `RoomVideo.splice`) and answers (r, k); rank 0 sends REWIND r to every DiT rank before the next CHUNK word, and
rewinds its generator to r and its audio input to r keeping the samples chunk r took for its frames < k, so the
turn's speech is taken by chunk r from frame k's first sample (the decoder rank shows, or publishes in the room, the
remade chunk r from frame k). An interrupt (`lk.clear_buffer`: the audio input's `clears` moved since the last chunk)
is the same splice, marked as one on REWIND: the speech the dropped frames took stays discarded, so chunk r is made
again from silence from frame k, and the decoder rank's pacer shows the remade frame in the cut's slot (no held
frame); in a room, which mutes the interrupted speech itself, the cut returns the face to idle sooner. One code path
for both runners; the generator runner (no playout) answers the next chunk: no rewind.

Any failure of a collective or of a rank is a `RankFailure` naming the rank (the supervisor's reason when a
child died), which the service turns into the session's end reason before the worker exits non-zero.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TypeVar

import numpy as np
import torch.distributed as dist
from vivant.apis.feature_flags import FlagValues
from vivant.sessions.models import Assignment
from vivant.worker.model.options import RowParallelPath
from vivant.worker.serving.ranks import (
    RankSpec,
    RunnerKind,
    SessionTrace,
    build_dit,
    join,
    session_dir,
    set_device,
)
from vivant.worker.serving.room_feed import RoomFeed
from vivant.worker.serving.runner import ChunkReport, PlayoutAccount, SessionFailed, SessionInputError
from vivant.worker.serving.supervisor import RankFailure, Supervisor
from vivant.worker.serving.wire import Ack, Control, ControlBus, DecoderLink, Op
from vivant.worker.stream.audio_in import AudioInput, read_audio
from vivant.worker.stream.pacer import PacerConfig
from vivant.worker.stream.splice import Splice, SpliceCause, splice_cause

log = logging.getLogger(__name__)
T = TypeVar("T")


class RankRuntime:
    """Rank 0 of a worker (module docstring)."""

    def __init__(self, spec: RankSpec) -> None:
        self.spec, self.layout = spec, spec.layout
        self.cfg = spec.model_config()
        self.layout.check(self.cfg)  # tp divides the model; the GPUs exist — before anything is spawned
        self.frames_per_chunk = self.cfg.frames_per_chunk
        self.chunk_seconds = self.cfg.chunk_seconds
        self.supervisor = Supervisor(spec)
        self.kernel_path: RowParallelPath | None = None
        self.last_ack: Ack | None = None
        self.join_timeout_s = 60.0  # livekit: the decoder rank's join (connect + the agent's arrival)
        self.sessions = 0
        self.flags = FlagValues()
        self.generator = None
        self._speech: tuple[np.ndarray, int] | None = None
        self._audio: AudioInput | None = None
        self._feed: RoomFeed | None = None
        self._trace = SessionTrace(None, 0)
        self._open = False
        self._diffuse_ms: list[float] = []
        self.rewinds: list[tuple[int, int, int]] = []  # (next chunk, r, k) of this session's rewinds: frame k of r
        self._clears_seen = 0  # the audio input's interrupts already spliced

    # ---- forming the ranks ------------------------------------------------------------------------------
    def start(self, ready_timeout_s: float = 600.0) -> RankRuntime:
        """Spawn ranks 1 … N, join them, build rank 0's shard, wait for every rank (RankFailure if one fails)."""
        self.supervisor.start()
        set_device(self.spec, 0)
        groups = join(self.spec, 0)
        self.generator = build_dit(self.spec, 0, groups.tp)
        self.kernel_path = self.generator.engine.row_parallel_path
        self.bus = ControlBus(self.cfg, groups.tp, self.layout.tp, self.layout.device_of(0))
        self.link = DecoderLink(self.cfg, groups.link, peer=self.layout.decoder_rank,
                                device=self.layout.link_device_of(0))
        self.supervisor.wait_ready(ready_timeout_s)
        log.info("worker ranks formed: %d DiT rank(s) + 1 decoder rank (%s), pids %s", self.layout.tp,
                 self.layout.device_of(self.layout.decoder_rank), self.supervisor.pids())
        return self

    def shutdown(self) -> None:
        """SHUTDOWN to every rank (when they are healthy), then wait for them to exit."""
        if self.supervisor.failure is None and self.generator is not None:
            try:
                self._collective(lambda: (self.bus.publish(Control(Op.SHUTDOWN)), self.link.send_shutdown()))
            except RankFailure as exc:
                log.error("shutdown: %s", exc)
        self.supervisor.stop()
        if dist.is_initialized():
            dist.destroy_process_group()

    def _collective(self, fn: Callable[[], T]) -> T:
        """Run a step that talks to other ranks; any failure becomes a RankFailure with the rank's reason."""
        if self.supervisor.failure is not None:
            raise RankFailure(self.supervisor.failure)
        try:
            return fn()
        except Exception as exc:
            reason = self.supervisor.failure_within(2.0)  # a dead peer: the watchdog names it
            if reason is None:
                self.supervisor.fail(f"{self.layout.describe(0)} raised {type(exc).__name__}: {exc}")
                reason = self.supervisor.failure
            raise RankFailure(reason) from exc

    # ---- SessionRunner ----------------------------------------------------------------------------------
    def begin(self, assignment: Assignment, flags: FlagValues) -> None:
        audio = AudioInput(self.cfg)
        self._feed = RoomFeed(audio) if self.spec.runner is RunnerKind.LIVEKIT else None
        if self.spec.speak and self._feed is None:  # the session's speech: read and queued before any rank hears of it
            if self._speech is None:
                self._speech = read_audio(self.spec.speak)
            try:
                audio.push(*self._speech)
                audio.end_segment()
            except ValueError as exc:
                raise SessionInputError(f"--speak {self.spec.speak}: {exc}") from exc
        self._audio = audio
        self._clears_seen = 0
        self._diffuse_ms = []
        self.rewinds = []
        self.sessions += 1
        self.generator.reset_session(assignment.seed)
        self.apply_flags(flags)
        session = {"session_id": assignment.session_id}
        payload = {**session, "seed": assignment.seed, "runner": self.spec.runner.value}
        if self.spec.runner is RunnerKind.LIVEKIT:
            payload.update(livekit_url=assignment.livekit_url, token=assignment.token.get_secret_value(),
                           agent_identity=assignment.agent_identity, room=assignment.room)
        self._collective(lambda: (
            self.bus.publish(Control(Op.BEGIN, self.sessions, seed=assignment.seed, fused=self.flags.fusedGemmAllReduce,
                                     payload=session)),
            self.link.send_begin(self.sessions, payload)))
        self._open = True
        self._trace = SessionTrace(session_dir(self.spec.out_dir, assignment.session_id), 0)
        self._trace.write(event="begin", session=self.sessions, session_id=assignment.session_id,
                          path=self.kernel_path.value)
        if self._feed is not None:
            self._wait_joined()

    def _wait_joined(self) -> None:
        """The decoder rank joined the room (its "joined" event), or the session fails with its error."""
        deadline = time.monotonic() + self.join_timeout_s
        while time.monotonic() < deadline:
            if self._room_events(until="joined"):
                return
            failed = self._session_error()
            if failed is not None:
                self.end(failed)
                raise SessionFailed(failed)
            if self.supervisor.failure is not None:
                raise RankFailure(self.supervisor.failure)
            time.sleep(0.05)
        reason = f"{self.layout.describe(self.layout.decoder_rank)}: no room join within {self.join_timeout_s:.0f}s"
        self.end(reason)
        raise SessionFailed(reason)

    def _room_events(self, until: str | None = None) -> bool:
        """Apply the room's events for this session to its audio input; True once an `until` event was seen."""
        seen = False
        while not self.supervisor.room_events.empty():
            session, event = self.supervisor.room_events.get_nowait()
            if session != self.sessions or self._feed is None:
                continue  # a previous session's late event
            if event[0] == "joined":
                seen = seen or until == "joined"
            else:
                self._feed.apply(event)
        return seen

    @property
    def end_reason(self) -> str | None:
        """The room's reason to end the session (runner livekit), for the service's chunk boundary."""
        if self._feed is None:
            return None
        self._room_events()
        return self._feed.end_reason

    def apply_flags(self, flags: FlagValues) -> RowParallelPath:
        self.flags = flags
        self.kernel_path = self.generator.apply_flags(flags)
        return self.kernel_path

    def step(self) -> ChunkReport:
        failed = self._session_error()
        if failed is not None:
            raise SessionFailed(failed)
        if self._feed is not None:
            try:
                self._room_events()
            except ValueError as exc:  # the agent's audio: a rate out of range, more than the input holds
                raise SessionInputError(f"room audio: {exc}") from exc
        clears = self._audio.clears
        interrupted, self._clears_seen = clears != self._clears_seen, clears
        cause = splice_cause(self.generator.chunk, interrupted=interrupted,
                             turn_starts=not interrupted and self._audio.turn_starts_next())
        if cause is not None:
            self._rewind(cause)
        gen, n = self.generator, self.generator.chunk
        chunk = self._audio.next_chunk()
        ends_segment = self._feed is not None and self._feed.ends_segment(chunk)
        clear_epoch = self._feed.clears if self._feed is not None else 0  # the decoder rank mutes older epochs
        pcm = chunk.samples
        bad = int((~np.isfinite(pcm)).sum())
        if bad:
            raise SessionInputError(f"audio for chunk {n}: {bad} of {len(pcm)} samples are not finite (NaN/Inf)")
        t_taken = time.monotonic()

        def run() -> tuple:
            self.bus.publish(Control(Op.CHUNK, self.sessions, n, len(pcm), self.flags.fusedGemmAllReduce, pcm=pcm))
            t0 = time.perf_counter()
            out = gen.generate_chunk(pcm, self.cfg.audio_sample_rate)
            ms = (time.perf_counter() - t0) * 1e3
            self.link.send_chunk(self.sessions, n, out.latents, pcm, (t_taken, time.monotonic()),
                                 speech_samples=chunk.speech_samples, ends_segment=ends_segment,
                                 clear_epoch=clear_epoch, finite=out.finite)
            return out, ms

        out, ms = self._collective(run)
        self._diffuse_ms = (self._diffuse_ms + [ms])[-8:]
        self._trace.write(event="chunk", session=self.sessions, chunk=n, path=self.kernel_path.value,
                          diffuse_ms=round(ms, 3), speech_samples=chunk.speech_samples)
        return ChunkReport(index=n, compute_ms=ms, frames=self.frames_per_chunk, numerical_fault=not out.finite)

    @property
    def audio_in(self) -> AudioInput | None:
        """The session's audio input (None between sessions): the room feed pushes the agent's speech into it."""
        return self._audio

    def _rewind(self, cause: SpliceCause) -> None:
        """A turn starts with the next chunk, or (cause "interrupt") an interrupt came: rewind every rank to where the
        decoder rank says (module docstring)."""
        gen, n = self.generator, self.generator.chunk
        interrupt = cause == "interrupt"
        oldest = max(gen.oldest_rewind(), self._audio.oldest_rewind())
        diffuse_s = max(self._diffuse_ms, default=0.0) / 1e3
        lead_s = 1.5 * diffuse_s  # time to diffuse chunk r again, with a margin
        r, k, dropped = self._collective(lambda: self.link.request_rewind(self.sessions, n, lead_s, oldest,
                                                                          interrupt=interrupt, next_chunk_s=diffuse_s))
        splice = Splice.checked(n, r, k, oldest=oldest, cause=cause)
        if splice.moves:
            self._collective(lambda: self.bus.publish(Control(Op.REWIND, self.sessions, r)))
            gen.rewind(r)
            self._audio.rewind(r, keep_samples=splice.keep_samples(PacerConfig.for_model(self.cfg)))
        self.rewinds.append((n, r, k))
        self._trace.write(event="rewind", session=self.sessions, chunk=r, frame=k, next_chunk=n, dropped=dropped,
                          cause=cause)
        log.info("session %d: %s before chunk %d; rewound to frame %d of chunk %d (%d chunks dropped)",
                 self.sessions, "an interrupt" if interrupt else "a turn starts", n, k, r, dropped)

    def end(self, reason: str) -> PlayoutAccount | None:
        """END on every rank; the decoder rank's acknowledgement is the playout's account (frames, stalls)."""
        if not self._open or self.supervisor.failure is not None:
            return None  # a failed rank: nothing to tell the others (the supervisor killed them)
        self._open = False
        ack = self._collective(lambda: (self.bus.publish(Control(Op.END, self.sessions)),
                                        self.link.send_end(self.sessions, reason))[1])
        self.last_ack = ack
        self._trace.write(event="end", session=self.sessions, chunks=self.generator.chunk, reason=reason,
                          decoder=ack.__dict__)
        self._trace.close()
        log.info("session %d ended on every rank (%s): decoder rank %d chunks, %d frames published, %d stalls%s",
                 self.sessions, reason, ack.chunks, ack.frames_published, ack.stalls,
                 f", error: {ack.error}" if ack.error else "")
        if not ack.played_out:  # a room session: the room's sink keeps no pacer count, the loop's estimate stands
            return None
        return PlayoutAccount(frames_published=ack.frames_published, stalls=ack.stalls)

    def idle(self) -> None:
        if self.supervisor.failure is None:
            self._collective(lambda: (self.bus.publish(Control(Op.IDLE)), self.link.send_idle()))

    def _session_error(self) -> str | None:
        """A failure this session's ranks reported without dying (e.g. the decoder rank's sink), as a reason."""
        while not self.supervisor.session_errors.empty():
            rank, session, text = self.supervisor.session_errors.get_nowait()
            if session == self.sessions:
                return f"{self.layout.describe(rank)}: {text}"
        return None
