"""What the worker's ranks say to each other, chunk by chunk (docs/multi_gpu.md).

Rank 0 decides; the others follow. Every message starts with a fixed-size int64 word, so a receiver always
knows what comes next and every rank issues the same collectives in the same order:

    control (rank 0 → DiT ranks, a broadcast over the TP group), int64 [8]:
        [op, session, chunk, samples, fused, seed, payload bytes, 0]  then, for BEGIN, the payload (uint8, JSON:
        the session's id); for CHUNK, PCM float32 [max_samples]
    link (rank 0 → the decoder rank, point to point), int64 [8]:
        [op, session, chunk, samples, payload bytes, speech samples, ends segment, 0]  then, for BEGIN and END,
        the payload (uint8, JSON: the session; the end reason); CHUNK: [CHUNK, session, chunk, samples, not finite,
        speech samples, ends segment, clear epoch] (not finite 1: the generator found NaN/Inf in the latents, so the
        decoder holds its last frame instead of decoding them; clear epoch: the interrupts rank 0 had applied), then
        times float64 [2] (audio taken,
        diffused: CLOCK_MONOTONIC seconds, shared by the processes of one host), latents float32 [C, h, w],
        PCM float32 [max_samples]; speech samples and "ends segment" say what the chunk's audio is (the LiveKit
        output publishes speech and marks a segment's end); REWIND: [REWIND, session, next chunk, lead µs, oldest,
        interrupt, next-chunk µs, 0] (interrupt 1: an interrupt's splice, 0: a turn start's; next-chunk µs: rank 0's
        time for one more chunk after the remade one, which the splice leaves it), answered by
    rewind answer (the decoder rank → rank 0, after REWIND), int64 [8]:
        [session, r, chunks dropped, k, 0, …]: (r, k) is the frame generation restarts at, frame k of chunk r
        (`Playout.splice(lead, oldest=…)` or, runner livekit, `RoomVideo.splice`: chunk r is made again and its
        frames < k were kept); (next chunk, 0), i.e. no rewind, for the generator runner (no playout)
    acknowledgement (the decoder rank → rank 0, after END), int64 [8]:
        [session, chunks, frames published, generated frames published, stalls, repeated frames, error bytes, 0]
        then the error text (uint8, UTF-8) when there is one

Ops: IDLE (a tick while no session runs, so no rank waits on a collective for longer than the tick interval:
the process group's timeout can then stay short), BEGIN, CHUNK, END, SHUTDOWN, REWIND (a turn starts: rank 0 asks
the decoder rank where to restart, then tells every DiT rank; all rewind before the next CHUNK word, so the
collectives still pair; docs/ARCHITECTURE.md, "Rewind at a turn start"). The fused bit travels in every
CHUNK word: the fused and unfused row-parallel steps issue different collectives, so every DiT rank must
switch at the same chunk boundary. Rank 0's link sends are asynchronous (isend): it starts diffusing chunk
n + 1 while chunk n is on the wire, and waits for a send only before the next one, which bounds how far it
runs ahead of the decoder rank.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from enum import IntEnum

import numpy as np
import torch
import torch.distributed as dist

WORDS = 8


class Op(IntEnum):
    IDLE = 0
    BEGIN = 1
    CHUNK = 2
    END = 3
    SHUTDOWN = 4
    REWIND = 5


def max_samples(cfg) -> int:
    """The most PCM samples one chunk can carry (the chunk grid alternates, e.g. 2666 / 2667 at 16 kHz)."""
    return -(-cfg.audio_sample_rate * cfg.frames_per_chunk // cfg.fps)


@dataclass(frozen=True)
class Control:
    op: Op
    session: int = 0
    chunk: int = 0
    samples: int = 0
    fused: bool = False
    seed: int = 0
    pcm: np.ndarray | None = None  # float32 [samples] (CHUNK only)
    payload: dict | None = None  # BEGIN only


def _json_bytes(payload: dict) -> torch.Tensor:
    return torch.frombuffer(bytearray(json.dumps(payload).encode()), dtype=torch.uint8)


def _from_json_bytes(data: torch.Tensor) -> dict:
    return json.loads(bytes(data.cpu().tolist()).decode())


class ControlBus:
    """Rank 0's per-chunk control to the DiT ranks: a broadcast over the TP group (nothing to send at TP = 1)."""

    def __init__(self, cfg, group: dist.ProcessGroup | None, size: int, device: torch.device, src: int = 0) -> None:
        self.group, self.size, self.src, self.device = group, size, src, device
        self.word = torch.zeros(WORDS, dtype=torch.int64, device=device)
        self.pcm = torch.zeros(max_samples(cfg), dtype=torch.float32, device=device)

    def publish(self, c: Control) -> None:
        if self.size == 1:
            return
        data = _json_bytes(c.payload or {}) if c.op is Op.BEGIN else None
        n = 0 if data is None else data.numel()
        self.word.copy_(torch.tensor([int(c.op), c.session, c.chunk, c.samples, int(c.fused), c.seed, n, 0]))
        dist.broadcast(self.word, src=self.src, group=self.group)
        if data is not None:
            dist.broadcast(data.to(self.device), src=self.src, group=self.group)
        if c.op is Op.CHUNK:
            self.pcm.zero_()
            self.pcm[: c.samples] = torch.from_numpy(np.ascontiguousarray(c.pcm, dtype=np.float32))
            dist.broadcast(self.pcm, src=self.src, group=self.group)

    def receive(self) -> Control:
        dist.broadcast(self.word, src=self.src, group=self.group)
        op, session, chunk, samples, fused, seed, n = (int(v) for v in self.word.tolist()[:7])
        pcm = payload = None
        if op == Op.BEGIN:
            data = torch.zeros(n, dtype=torch.uint8, device=self.device)
            dist.broadcast(data, src=self.src, group=self.group)
            payload = _from_json_bytes(data)
        if op == Op.CHUNK:
            dist.broadcast(self.pcm, src=self.src, group=self.group)
            pcm = self.pcm[:samples].cpu().numpy().copy()
        return Control(Op(op), session, chunk, samples, bool(fused), seed, pcm, payload)


@dataclass(frozen=True)
class LinkMessage:
    op: Op
    session: int = 0
    chunk: int = 0
    payload: dict | None = None  # BEGIN, END
    latents: torch.Tensor | None = None  # CHUNK: float32 [C, h, w] on the link's device
    pcm: np.ndarray | None = None  # CHUNK: float32 [samples]
    times: tuple[float, float] = (0.0, 0.0)  # CHUNK: (audio taken, diffused), monotonic seconds
    speech_samples: int = 0  # CHUNK: samples of speech in pcm (the rest is silence)
    ends_segment: bool = False  # CHUNK: the last chunk of a finished speech segment
    clear_epoch: int = 0  # CHUNK: interrupts (lk.clear_buffer) rank 0 had applied when it took the chunk's audio
    finite: bool = True  # CHUNK: False when the generator found NaN/Inf in the latents (a numerical fault)
    lead_s: float = 0.0  # REWIND: keep the chunks due within this many seconds (the pipeline's time to make one)
    oldest: int = 0  # REWIND: the earliest chunk rank 0 can rewind to (its undo logs' depth)
    interrupt: bool = False  # REWIND: an interrupt's splice (the speech stops at the cut), not a turn start's
    next_chunk_s: float = 0.0  # REWIND: rank 0's time for one more chunk after the remade one (its recent max diffuse)


@dataclass(frozen=True)
class Ack:
    """The decoder rank's account of a session, sent after END."""

    session: int
    chunks: int = 0
    frames_published: int = 0
    generated_frames_published: int = 0
    stalls: int = 0
    repeated_frames: int = 0
    error: str = ""
    played_out: bool = False  # a pacer counted frames and stalls (MP4/null runners); False for a room session


class DecoderLink:
    """Rank 0 ↔ the decoder rank over their two-rank group (module docstring). `peer`: the other end's rank."""

    def __init__(self, cfg, group: dist.ProcessGroup, peer: int, device: torch.device) -> None:
        self.group, self.peer, self.device = group, peer, device
        self.shape = (cfg.latent_channels, cfg.latent_h, cfg.latent_w)
        self.max_samples = max_samples(cfg)
        self._pending: list = []  # (work, tensor) of the last sends, kept alive until they complete

    # ---- rank 0 -----------------------------------------------------------------------------------------
    def _wait_pending(self) -> None:
        for work, _ in self._pending:
            work.wait()
        self._pending = []

    def _send(self, tensors: list[torch.Tensor], *, wait: bool) -> None:
        self._wait_pending()
        on_link = [t.to(self.device) for t in tensors]  # kept alive with the work until it completes
        self._pending = [(dist.isend(t, dst=self.peer, group=self.group), t) for t in on_link]
        if wait:
            self._wait_pending()

    def _word(self, *values: int) -> torch.Tensor:
        w = torch.zeros(WORDS, dtype=torch.int64)
        w[: len(values)] = torch.tensor(values, dtype=torch.int64)
        return w

    def send_idle(self) -> None:
        self._send([self._word(Op.IDLE)], wait=True)

    def send_shutdown(self) -> None:
        self._send([self._word(Op.SHUTDOWN)], wait=True)

    def send_begin(self, session: int, payload: dict) -> None:
        data = _json_bytes(payload)
        self._send([self._word(Op.BEGIN, session, 0, 0, data.numel()), data], wait=True)

    def send_chunk(self, session: int, index: int, latents: torch.Tensor, pcm: np.ndarray,
                   times: tuple[float, float], *, speech_samples: int = 0, ends_segment: bool = False,
                   clear_epoch: int = 0, finite: bool = True) -> None:
        if tuple(latents.shape) != self.shape:
            raise ValueError(f"latents: expected shape {list(self.shape)}, got {list(latents.shape)}")
        if len(pcm) > self.max_samples:
            raise ValueError(f"pcm: expected at most {self.max_samples} samples, got {len(pcm)}")
        audio = torch.zeros(self.max_samples, dtype=torch.float32)
        audio[: len(pcm)] = torch.from_numpy(np.ascontiguousarray(pcm, dtype=np.float32))
        word = self._word(Op.CHUNK, session, index, len(pcm), int(not finite), speech_samples, int(ends_segment),
                          clear_epoch)
        self._send([word, torch.tensor(times, dtype=torch.float64),
                    latents.detach().to(torch.float32).contiguous(), audio], wait=False)

    def request_rewind(self, session: int, next_chunk: int, lead_s: float, oldest: int, *,
                       interrupt: bool = False, next_chunk_s: float = 0.0) -> tuple[int, int, int]:
        """A turn starts (or, `interrupt`, the speech was interrupted) before chunk `next_chunk`: REWIND to the
        decoder rank, which drops what was not shown and answers (r, k, chunks dropped): the splice at frame k of
        chunk r; oldest ≤ r ≤ next_chunk, k = 0 unless r < next_chunk. `next_chunk_s`: the time one more chunk takes
        rank 0 after the remade one (the splice leaves it that time, `Pacer.splice_unshown`)."""
        self._send([self._word(Op.REWIND, session, next_chunk, round(lead_s * 1e6), oldest, int(interrupt),
                               round(next_chunk_s * 1e6))], wait=True)
        word = torch.zeros(WORDS, dtype=torch.int64, device=self.device)
        dist.recv(word, src=self.peer, group=self.group)
        session_, r, dropped, k = (int(v) for v in word.tolist()[:4])
        if session_ != session or not oldest <= r <= next_chunk or k < 0 or (k and r == next_chunk):
            raise RuntimeError(f"rewind answer: session {session_} r = {r}, k = {k}; expected session {session}, "
                               f"{oldest} ≤ r ≤ {next_chunk} and k ≥ 0 (0 when r = {next_chunk})")
        return r, k, dropped

    def send_rewind_answer(self, session: int, r: int, dropped: int, k: int = 0) -> None:
        dist.send(self._word(session, r, dropped, k).to(self.device), dst=self.peer, group=self.group)

    def send_end(self, session: int, reason: str) -> Ack:
        """END, then the decoder rank's acknowledgement (it has played out and closed the session's sinks)."""
        data = _json_bytes({"reason": reason})
        self._send([self._word(Op.END, session, 0, 0, data.numel()), data], wait=True)
        word = torch.zeros(WORDS, dtype=torch.int64, device=self.device)
        dist.recv(word, src=self.peer, group=self.group)
        session_, chunks, frames, generated, stalls, repeated, err_len, played = (int(v) for v in word.tolist()[:8])
        error = ""
        if err_len:
            text = torch.zeros(err_len, dtype=torch.uint8, device=self.device)
            dist.recv(text, src=self.peer, group=self.group)
            error = bytes(text.cpu().tolist()).decode(errors="replace")
        return Ack(session_, chunks, frames, generated, stalls, repeated, error, bool(played))

    # ---- the decoder rank -------------------------------------------------------------------------------
    def receive(self) -> LinkMessage:
        word = torch.zeros(WORDS, dtype=torch.int64, device=self.device)
        dist.recv(word, src=self.peer, group=self.group)
        # slot 4 by op: BEGIN/END the payload's bytes, CHUNK 1 when the latents are not finite, REWIND the oldest chunk
        op, session, chunk, samples, slot4, speech, ends, epoch = (int(v) for v in word.tolist()[:8])
        op = Op(op)
        if op in (Op.BEGIN, Op.END):
            data = torch.zeros(slot4, dtype=torch.uint8, device=self.device)
            dist.recv(data, src=self.peer, group=self.group)
            return LinkMessage(op, session, payload=_from_json_bytes(data))
        if op is Op.CHUNK:
            times = torch.zeros(2, dtype=torch.float64, device=self.device)
            latents = torch.empty(self.shape, dtype=torch.float32, device=self.device)
            audio = torch.empty(self.max_samples, dtype=torch.float32, device=self.device)
            for t in (times, latents, audio):
                dist.recv(t, src=self.peer, group=self.group)
            t_taken, t_diffused = times.tolist()
            return LinkMessage(op, session, chunk, latents=latents, pcm=audio[:samples].cpu().numpy().copy(),
                               times=(t_taken, t_diffused), speech_samples=speech, ends_segment=bool(ends),
                               clear_epoch=epoch, finite=not slot4)
        if op is Op.REWIND:
            return LinkMessage(op, session, chunk, lead_s=samples / 1e6, oldest=slot4, interrupt=bool(speech),
                               next_chunk_s=ends / 1e6)
        return LinkMessage(op, session, chunk)

    def send_ack(self, ack: Ack) -> None:
        err = ack.error.encode()[:4096]
        word = self._word(ack.session, ack.chunks, ack.frames_published, ack.generated_frames_published, ack.stalls,
                          ack.repeated_frames, len(err), int(ack.played_out))
        tensors = [word] + ([torch.frombuffer(bytearray(err), dtype=torch.uint8)] if err else [])
        for t in tensors:
            dist.send(t.to(self.device), dst=self.peer, group=self.group)
