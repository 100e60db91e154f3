"""The decoder rank: latents in from DiT rank 0, frames and audio out (docs/multi_gpu.md).

It receives what rank 0 sends over the link (vivant.worker.serving.wire) and owns everything after the DiT:
the causal VAE decoder, the pacer and the session's sinks, so the frames (9 MB per 57b chunk) never travel back.
Per session, by `RunnerKind`:

  generator  keeps the latents (`<out>/<session>/latents/chunk_NNNNN.npy`, float32 [C, h, w]) and decodes nothing;
  pipeline   decoder stage → pacer → an MP4 on the content timeline (`<out>/<session>/video.mp4`) or a null sink
             (vivant.worker.stream.playout), the lead limit holding rank 0 to `max_lead_chunks` ahead of playout;
  livekit    decoder stage → the assignment's LiveKit room (vivant.worker.serving.livekit_avatar.RoomSession: the
             avatar's AvatarRunner publishes through its AVSynchronizer at real time; the agent's speech, interrupts
             and end reasons go to rank 0 on the status queue), held to `lead_chunks` chunks ahead of publication;
             with `--out` its record gets the room's published frame indices (as runs) and splices at END.

A turn start or an interrupt (REWIND from rank 0, its cause in the word): frames not shown and not due within the
keep horizon (`keep_horizon_s`: the lead rank 0 sent — its diffuse time with a margin — plus this rank's own decode
time) are dropped from f* = frame k of chunk r on, and the rank answers (r, k): generation restarts at chunk r, whose
remade frames ≥ k are shown. The pipeline's playout cuts its pacer (`splice_for_rewind`: a chunk still in the decoder
stage is judged whole by its slot, as in the one-process loop: kept when due within the horizon, for it could not be
made again in time); the livekit kind cuts the room's queue (`splice_room` → `RoomVideo.splice`, on the room's event
loop under the decoder stage's lock: the frames the AvatarRunner and its AVSynchronizer hold count as shown, nothing
behind the room's queued speech is cut, the chunks in the stage are judged whole, kept when due within the horizon
or carrying speech) and then rewinds its decoder stage to r. The generator kind has no playout and answers rank 0's
next chunk (no rewind). Latents received again for chunk r … replace the kept files.

With `--out`, every kind also keeps the latents it received, and the pipeline keeps its playout report
(`<out>/<session>/playout.json`: delivered fps, stalls, per-stage p50/p99 ms). A failure inside a session (a sink that cannot
write, a decoder error) does not stop the rank: it is reported at once on the status queue (rank 0 then ends the
session with it as the reason), the session's remaining chunks are received and dropped, and END is answered
with the error in the acknowledgement. A failure of the link itself ends the process (rank 0's supervisor ends
the session).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import torch
from vivant.worker.serving.ranks import Groups, RankSpec, RunnerKind, SessionTrace, session_dir
from vivant.worker.serving.wire import Ack, DecoderLink, LinkMessage, Op
from vivant.worker.stream.decoder_stage import DecoderStage, LatentChunk
from vivant.worker.stream.lead import LeadConfig
from vivant.worker.stream.pacer import DecodedChunk
from vivant.worker.stream.playout import Playout
from vivant.worker.stream.sinks import Mp4Sink, NullSink
from vivant.worker.stream.vae import build_vae_decoder, load_vae_decoder

log = logging.getLogger(__name__)


def keep_horizon_s(lead_s: float, decode_ms: list[float]) -> float:
    """A splice's keep horizon (s): rank 0's lead (its time to diffuse chunk r again, with its margin) + the longest
    of this rank's last 8 decode times (ms)."""
    return lead_s + max(decode_ms[-8:], default=0.0) / 1e3


def splice_for_rewind(playout: Playout, m: LinkMessage) -> tuple[int, int]:
    """The decoder rank's splice for REWIND `m` (module docstring): (r, k). Keep horizon (s) = `m.lead_s` (rank 0's
    time to diffuse chunk r again, with its margin) + the longest of this rank's last 8 decode times; the chunks in the
    decoder stage are judged whole by their slots (`Playout.splice(keep_pending_due=True)`), so one due within the
    horizon is kept and r moves past it. Every chunk before the REWIND word was submitted already (the link is in
    order), so the stage's chunks are exactly those rank 0 made and the pacer has not taken."""
    horizon_s = keep_horizon_s(m.lead_s, playout.decoder.decode_ms)
    return playout.splice(horizon_s, oldest=m.oldest, keep_pending_due=True, cause="interrupt" if m.interrupt else "turn",
                          next_chunk_s=m.next_chunk_s)


class DecoderRank:
    def __init__(self, spec: RankSpec, rank: int, groups: Groups, status) -> None:  # noqa: ANN001 (mp queue)
        self.spec, self.rank, self.status = spec, rank, status
        self.cfg = spec.model_config()
        self.device = spec.layout.device_of(rank)
        self.link = DecoderLink(self.cfg, groups.link, peer=0, device=spec.layout.link_device_of(rank))
        self.vae = None
        if spec.runner is not RunnerKind.GENERATOR:
            vae_cfg = spec.vae_config()
            self.vae = (load_vae_decoder(vae_cfg, spec.vae_weights, device=self.device) if spec.vae_weights
                        else build_vae_decoder(vae_cfg, device=self.device))
            self._warm_up()
        self._reset()

    @torch.no_grad()
    def _warm_up(self) -> None:
        """Two chunks through a throw-away causal cache (the first with an empty cache, the second with a full
        one) before the rank says ready: library handles, kernel selection and allocations happen here, not
        in a session's first chunk."""
        c = self.cfg
        cache = self.vae.new_cache()
        for _ in range(2):
            self.vae.decode_chunk(torch.zeros(c.latent_channels, c.latent_h, c.latent_w, device=self.device), cache)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _reset(self) -> None:
        self.session = 0
        self.session_id = ""
        self.folder: Path | None = None
        self.playout: Playout | None = None
        self.room = None  # a LiveKit RoomSession
        self.stage: DecoderStage | None = None  # the LiveKit output's decoder stage (the playout has its own)
        self.meta: dict = {}  # the room's chunks in the decoder stage: index → ChunkMeta (livekit_avatar)
        self.chunks = 0
        self.error = ""
        self.trace = SessionTrace(None, self.rank)

    def serve(self) -> None:
        while True:
            m = self.link.receive()
            if m.op is Op.SHUTDOWN:
                return
            if m.op is Op.BEGIN:
                self.begin(m)
            elif m.op is Op.CHUNK:
                self.chunk(m)
            elif m.op is Op.REWIND:
                r, k, dropped = self.rewind(m)
                self.link.send_rewind_answer(m.session, r, dropped, k)
            elif m.op is Op.END:
                self.link.send_ack(self.end(m))

    # ---- one session --------------------------------------------------------------------------------------
    def begin(self, m: LinkMessage) -> None:
        self._reset()
        payload = m.payload or {}
        self.session, self.session_id = m.session, str(payload.get("session_id", f"session-{m.session}"))
        self.folder = session_dir(self.spec.out_dir, self.session_id)
        self.trace = SessionTrace(self.folder, self.rank)
        self.trace.write(event="begin", session=m.session, session_id=self.session_id)
        try:
            self._open(payload)
        except Exception as exc:  # noqa: BLE001 (the session fails, the rank stays)
            self._fail(exc)

    def _open(self, payload: dict) -> None:
        cfg, runner = self.cfg, self.spec.runner
        if self.folder is not None:
            (self.folder / "latents").mkdir(exist_ok=True)
        if runner is RunnerKind.GENERATOR:
            return
        if runner is RunnerKind.LIVEKIT:
            from vivant.worker.serving.livekit_avatar import AvatarJoin, RoomSession
            from vivant.worker.serving.room_video import RoomGrid

            session = self.session

            def forward(event: tuple) -> None:
                self.status.put(("room", self.rank, session, event))

            grid = RoomGrid.of(cfg, self.vae.cfg.out_w, self.vae.cfg.out_h)  # the frames' size is the decoder's
            self.room = RoomSession(grid, AvatarJoin.from_payload(payload), forward).start()
            self.stage = DecoderStage(self.vae, self._to_room).start()
            return
        if self.folder is not None:
            vae_cfg = self.vae.cfg  # the frames' size is the decoder's
            sinks = [Mp4Sink(self.folder / "video.mp4", vae_cfg.out_w, vae_cfg.out_h, cfg.fps, cfg.audio_sample_rate,
                             timeline="content")]
        else:
            sinks = [NullSink()]
        n = self.spec.min_lead_chunks
        lead = LeadConfig.for_model(cfg, initial_chunks=max(3, n), min_chunks=n, max_chunks=max(6, n))
        self.playout = Playout(cfg, self.vae, sinks, session=self.session_id, lead_config=lead).start()

    def chunk(self, m: LinkMessage) -> None:
        if m.session != self.session:
            raise RuntimeError(f"decoder rank: chunk {m.chunk} of session {m.session} while session {self.session} "
                               "is open: rank 0 and the decoder rank are out of step")
        if self.error:
            return  # the session failed here; rank 0 is ending it
        try:
            if self.folder is not None:
                np.save(self.folder / "latents" / f"chunk_{m.chunk:05d}.npy", m.latents.cpu().numpy())
            chunk = LatentChunk(m.chunk, m.latents.to(self.device), m.pcm,
                                {"audio_taken": m.times[0], "diffused": m.times[1]}, finite=m.finite)
            if self.playout is not None:
                self.playout.wait_lead(m.chunk)
                if self.playout.failed is not None:
                    raise RuntimeError(f"playout failed: {self.playout.failed!r}")
                self.playout.submit(chunk)
            elif self.room is not None:
                from vivant.worker.serving.room_video import ChunkMeta

                self.room.wait_lead(upstream=len(self.meta))
                self.meta[m.chunk] = ChunkMeta(m.chunk, m.speech_samples, m.ends_segment, m.clear_epoch)
                self.stage.submit(chunk)
            self.chunks += 1
            self.trace.write(event="chunk", session=m.session, chunk=m.chunk, finite=m.finite)
        except Exception as exc:  # noqa: BLE001
            self._fail(exc)

    def rewind(self, m: LinkMessage) -> tuple[int, int, int]:
        """(r, k, chunks dropped) for a REWIND, the splice at frame k of chunk r (module docstring); a failed session
        answers "no rewind" (the next chunk, 0)."""
        r, k, dropped = m.chunk, 0, 0
        lead = m.lead_s
        if not self.error and m.session == self.session and (self.playout is not None or self.room is not None):
            try:
                if self.playout is not None:
                    lead = keep_horizon_s(m.lead_s, self.playout.decoder.decode_ms)
                    r, k = splice_for_rewind(self.playout, m)
                    self.playout.record_rewind(m.chunk)
                    dropped = len(self.playout.rewinds[-1].dropped)
                else:
                    lead = keep_horizon_s(m.lead_s, self.stage.decode_ms)
                    r, k = self._splice_room(lead, m.oldest, m.next_chunk_s)
                    dropped = m.chunk - r
            except Exception as exc:  # noqa: BLE001
                self._fail(exc)
                r, k, dropped = m.chunk, 0, 0
        self.trace.write(event="rewind", session=m.session, chunk=r, frame=k, next_chunk=m.chunk, dropped=dropped,
                         cause="interrupt" if m.interrupt else "turn", lead_ms=round(lead * 1e3, 3),
                         next_chunk_ms=round(m.next_chunk_s * 1e3, 3))
        return r, k, dropped

    def _splice_room(self, lead_s: float, oldest: int, next_chunk_s: float) -> tuple[int, int]:
        from vivant.worker.serving.livekit_avatar import splice_room

        return splice_room(self.room, self.stage, self.meta, lead_s, oldest=oldest, next_chunk_s=next_chunk_s)

    def end(self, m: LinkMessage) -> Ack:
        report = None
        if self.playout is not None:
            try:
                self.playout.finish()
                report = self.playout.report(self.chunks, self.playout.production_seconds(), [])
                log.info("session %s played out: %s", self.session_id, report.format_text())
                if self.folder is not None:
                    (self.folder / "playout.json").write_text(json.dumps(report.to_dict(), indent=1))
            except Exception as exc:  # noqa: BLE001
                self._fail(exc, report=False)
        if self.room is not None:
            try:
                self.stage.close()
            except Exception as exc:  # noqa: BLE001
                self._fail(exc, report=False)
            try:
                self.room.close((m.payload or {}).get("reason", ""))
            except Exception as exc:  # noqa: BLE001
                self._fail(exc, report=False)
            stats = self.room.video.stats if self.room.video is not None else None
            if stats is not None:  # what the room handed to its runner: frame indices as [first, last] runs
                self.trace.write(event="room", session=m.session, published=stats.published, splices=stats.splices,
                                 spliced_frames=stats.spliced_frames, frames=stats.video_frames,
                                 turn_waits=stats.turn_waits)
        self.trace.write(event="end", session=m.session, chunks=self.chunks, error=self.error)
        self.trace.close()
        ack = Ack(session=m.session, chunks=self.chunks, error=self.error)
        if report is not None:
            ack = Ack(session=m.session, chunks=self.chunks, frames_published=report.frames_published,
                      generated_frames_published=report.generated_frames_published, stalls=report.stalls,
                      repeated_frames=report.repeated_frames, error=self.error, played_out=True)
        self._reset()
        return ack

    def _to_room(self, chunk: DecodedChunk) -> None:
        """The decoder stage's thread: a decoded chunk to the room's event loop."""
        meta = self.meta.pop(chunk.index)
        self.room.deliver(chunk.index, chunk.frames, chunk.audio, meta.speech_samples, meta.ends_segment, meta.epoch)

    def _fail(self, exc: BaseException, *, report: bool = True) -> None:
        text = f"{type(exc).__name__}: {exc}"
        log.error("session %s failed on the decoder rank: %s", self.session_id, text)
        if not self.error:
            self.error = text
            if report:  # rank 0 polls these between chunks and ends the session with the reason
                self.status.put(("session_error", self.rank, self.session, text))
