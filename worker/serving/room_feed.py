"""Rank 0's side of a LiveKit session: the room's events, forwarded by the decoder rank, applied to the session.

The room itself lives on the decoder rank (vivant.worker.serving.livekit_avatar.RoomSession); what the DiT needs
from it arrives as small events on the status queue and is applied between chunks (no LiveKit SDK here):

    ("speech", pcm float32 [n], rate)   the agent's speech, any rate → AudioInput.push (chunked on the grid)
    ("segment_end",)                     the agent's speech segment is complete → AudioInput.end_segment
    ("clear",)                           lk.clear_buffer (an interrupt) → AudioInput.clear_buffer
    ("end", reason)                      agent left / END_CALL / room disconnected → the session's end reason
    ("joined",)                          the decoder rank joined the room (begin waits for it)
"""

from __future__ import annotations

import logging

from vivant.worker.stream.audio_in import AudioInput, ChunkAudio

log = logging.getLogger(__name__)

RoomEvent = tuple


class RoomFeed:
    """Rank 0's side of the room: applies the decoder rank's room events to the session's `AudioInput` between
    chunks, and keeps the room's end reason for the service."""

    def __init__(self, audio_in: AudioInput) -> None:
        self.audio_in = audio_in
        self.end_reason: str | None = None
        self.clears = 0  # interrupts applied: each chunk carries it, the decoder rank mutes chunks from before one
        self._segment_open = False
        self._segment_end_pending = False

    def apply(self, event: RoomEvent) -> None:
        kind = event[0]
        if kind == "speech":
            self.audio_in.push(event[1], event[2])
            self._segment_open = True
        elif kind == "segment_end":
            self.audio_in.end_segment()
            if self._segment_open:
                self._segment_end_pending, self._segment_open = True, False
        elif kind == "clear":
            self.audio_in.clear_buffer()
            self.clears += 1
            self._segment_open = self._segment_end_pending = False
        elif kind == "end":
            self.end_reason = self.end_reason or str(event[1])
        else:
            log.warning("room event %r ignored", kind)

    def ends_segment(self, chunk: ChunkAudio) -> bool:
        """Whether `chunk` (just taken) carries the last speech of a finished segment (→ AudioSegmentEnd)."""
        if self._segment_end_pending and self.audio_in.pending_samples() == 0:
            self._segment_end_pending = False
            return True
        return False
