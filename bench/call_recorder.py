"""The "user" of a LiveKit call: a participant that subscribes to the avatar, records what arrives, and measures it.

`UserRecorder` joins a room (livekit rtc), subscribes to every track the avatar publishes (video and the speech
it publishes on the agent's behalf) and to the example agent's data messages (topic `vivant.agent`: per turn the
wall-clock time its first audio frame left for the avatar), and keeps, per received item, its arrival time
(`time.time()`, seconds; every process of the call runs on this machine, so the agent's and the user's clocks
are the same clock). `CallMeasurement.from_recording` turns that into the call's figures:

* frames received, received fps = (frames − 1) / (last arrival − first arrival);
* freezes: gaps between consecutive video arrivals > 2 frame intervals (2/24 s), counted, summed, longest;
* mouth opening per received frame: the dark-pixel fraction (luma < 0.25) of the reference character's mouth
  box (vivant.worker.quality.lipsync.mouth_opening, the quality gate's lip-sync proxy; 0 for the reference
  character's closed lips, 0.05-0.3 open). **Mouth moving** = opening above the resting level by more than 0.03
  (3 % of the box): resting level = the 10th percentile of the call's openings (the closed mouth of the pauses
  between turns), or the median of the frames received before the first turn when that is lower (≥ 12 frames);
* turn latency, per turn: the agent's first audio sample sent → arrival of the first frame after it (and
  before the next turn's) whose mouth is moving (as defined above);
* A/V offset at the receiver: the received audio's loudness (RMS per 10 ms frame, at arrival time) and the
  received mouth opening (held per frame, at arrival time), both on a 10 ms grid, cross-correlated over lags of
  ±500 ms; the offset is the lag of the peak (positive: the mouth moves after the sound it goes with), with the
  peak's Pearson r (a low r means the offset is not meaningful, e.g. random weights whose mouth does not follow
  speech). It includes the model's own lip lag, which the quality gate measures separately.

* per minute of the call (from the first frame received): frames, received fps, freezes and the longest gap, so
  drift and slow decay show in a long call;
* turn latency p50 and p99 over the call's turns (a turn whose mouth never moved counts as missing, not as fast).

`python -m vivant.bench.call_recorder` is one user as a process of its own (`main`; `vivant bench call` runs one
per call, so N concurrent receivers do not share one interpreter): it joins, records until the avatar has come
and gone, and writes the measurement as JSON (and, with `--mp4`, what it received).

`write_mp4` writes what the user received: video at its arrival times (variable frame rate, freezes visible)
with the received audio from its first arrival, H.264 + AAC.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from fractions import Fraction
from pathlib import Path

import numpy as np
from livekit import rtc

AGENT_EVENTS_TOPIC = "vivant.agent"
FREEZE_INTERVALS = 2.0
GRID_S = 0.010
MOUTH_OPEN_DELTA = 0.03  # a mouth is open when this much more of its box is dark than at rest
MAX_LAG_S = 0.5


@dataclass
class Recording:
    """Everything the user received, each with its arrival time (unix seconds)."""

    video_t: list[float] = field(default_factory=list)
    video: list[np.ndarray] = field(default_factory=list)  # uint8 [H, W, 3] each
    audio_t: list[float] = field(default_factory=list)
    audio: list[np.ndarray] = field(default_factory=list)  # int16 mono per received frame
    audio_rate: int = 48000
    turns: list[dict] = field(default_factory=list)  # the agent's per-turn events
    joined_at: float = 0.0  # unix s; the MP4's time 0 is video_t[0]
    left: dict[str, float] = field(default_factory=dict)  # identity -> when it left


class UserRecorder:
    """Join `url` with `token`, record the avatar's tracks (identity `avatar_identity`) and the agent's events."""

    def __init__(self, url: str, token: str, avatar_identity: str, audio_rate: int = 48000) -> None:
        self.url, self.token, self.avatar_identity = url, token, avatar_identity
        self.rec = Recording(audio_rate=audio_rate)
        self.room = rtc.Room()
        self._tasks: list[asyncio.Task] = []
        self._streams: list[rtc.VideoStream | rtc.AudioStream] = []

    async def start(self) -> None:
        room = self.room

        @room.on("track_subscribed")
        def _on_track(track: rtc.Track, _pub: rtc.RemoteTrackPublication, p: rtc.RemoteParticipant) -> None:
            if p.identity != self.avatar_identity:
                return
            if track.kind == rtc.TrackKind.KIND_VIDEO:
                self._tasks.append(asyncio.ensure_future(self._read_video(track)))
            elif track.kind == rtc.TrackKind.KIND_AUDIO:
                self._tasks.append(asyncio.ensure_future(self._read_audio(track)))

        @room.on("data_received")
        def _on_data(packet: rtc.DataPacket) -> None:
            if packet.topic == AGENT_EVENTS_TOPIC:
                try:
                    self.rec.turns.append(json.loads(packet.data))
                except ValueError:
                    pass

        @room.on("participant_disconnected")
        def _on_left(p: rtc.RemoteParticipant) -> None:
            self.rec.left[p.identity] = time.time()

        await room.connect(self.url, self.token)
        self.rec.joined_at = time.time()

    def avatar_present(self) -> bool:
        return any(p.identity == self.avatar_identity for p in self.room.remote_participants.values())

    async def _read_video(self, track: rtc.Track) -> None:
        stream = rtc.VideoStream(track)
        self._streams.append(stream)
        async for event in stream:
            now = time.time()
            rgb = event.frame.convert(rtc.VideoBufferType.RGB24)
            img = np.frombuffer(rgb.data, dtype=np.uint8).reshape(rgb.height, rgb.width, 3).copy()
            self.rec.video_t.append(now)
            self.rec.video.append(img)

    async def _read_audio(self, track: rtc.Track) -> None:
        stream = rtc.AudioStream(track, sample_rate=self.rec.audio_rate, num_channels=1)
        self._streams.append(stream)
        async for event in stream:
            self.rec.audio_t.append(time.time())
            self.rec.audio.append(np.frombuffer(event.frame.data, dtype=np.int16).copy())

    async def stop(self) -> Recording:
        """Close the streams, then leave (the SDK's native side must not outlive its Python objects)."""
        for stream in self._streams:
            await stream.aclose()
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.room.disconnect()
        return self.rec


# ------------------------------------------------------------------------------------------- analysis


@dataclass
class CallMeasurement:
    """The call's figures at the receiving participant (module docstring defines each)."""

    frames_received: int
    received_fps: float
    span_s: float
    freezes: int
    frozen_s: float
    longest_gap_ms: float
    frame_size: list[int]
    audio_received_s: float
    mouth_baseline: float
    mouth_threshold: float
    turn_latency_s: list[float | None]
    av_offset_ms: float | None
    av_offset_r: float | None
    turns_sent: int
    turn_latency_p50_s: float | None = None
    turn_latency_p99_s: float | None = None
    turns_without_motion: int = 0
    minutes: list[dict] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_recording(cls, rec: Recording, fps: int = 24) -> CallMeasurement:
        vt = np.asarray(rec.video_t, dtype=np.float64)
        n = len(vt)
        span = float(vt[-1] - vt[0]) if n > 1 else 0.0
        gaps = np.diff(vt) if n > 1 else np.zeros(0)
        frozen = gaps[gaps > FREEZE_INTERVALS / fps]
        opening = mouth_series(rec.video) if n else np.zeros(0, np.float32)
        sent = sorted(t["audio_sent_at"] for t in rec.turns if t.get("audio_sent_at"))
        first_turn = sent[0] if sent else (vt[-1] if n else 0.0)
        idle = opening[vt < first_turn] if n else opening
        base = float(np.percentile(opening, 10)) if n else 0.0  # the closed mouth of the pauses between turns
        if len(idle) >= 12:
            base = min(base, float(np.median(idle)))
        threshold = base + MOUTH_OPEN_DELTA
        latencies: list[float | None] = []
        for i, t0 in enumerate(sent):
            t_next = sent[i + 1] if i + 1 < len(sent) else np.inf
            moving = np.nonzero((vt >= t0) & (vt < t_next) & (opening > threshold))[0]
            latencies.append(round(float(vt[moving[0]] - t0), 4) if len(moving) else None)
        offset, r = av_offset(rec, vt, opening)
        audio_s = sum(len(a) for a in rec.audio) / rec.audio_rate
        size = [max(f.shape[1] for f in rec.video), max(f.shape[0] for f in rec.video)] if n else [0, 0]
        found = np.asarray([x for x in latencies if x is not None], np.float64)
        return cls(frames_received=n, received_fps=round((n - 1) / span, 3) if span > 0 else 0.0,
                   span_s=round(span, 3), freezes=int(len(frozen)), frozen_s=round(float(frozen.sum()), 3),
                   longest_gap_ms=round(float(gaps.max()) * 1000, 1) if len(gaps) else 0.0, frame_size=size,
                   audio_received_s=round(audio_s, 3), mouth_baseline=round(base, 4),
                   mouth_threshold=round(threshold, 4), turn_latency_s=latencies,
                   av_offset_ms=offset, av_offset_r=r, turns_sent=len(sent),
                   turn_latency_p50_s=round(float(np.percentile(found, 50)), 4) if len(found) else None,
                   turn_latency_p99_s=round(float(np.percentile(found, 99)), 4) if len(found) else None,
                   turns_without_motion=sum(x is None for x in latencies), minutes=per_minute(vt, fps))


def per_minute(vt: np.ndarray, fps: int = 24, minute_s: float = 60.0) -> list[dict]:
    """Per minute from the first arrival in `vt` (unix s, sorted): frames, received fps, freezes (gaps > 2 frame
    intervals, counted in the minute the gap ends in) and the longest gap. A minute's fps is its frames over the
    minute (the last, partial one: over its span); a minute with under 2 s of video is left out."""
    if len(vt) < 2:
        return []
    rel = vt - vt[0]
    gaps = np.diff(vt)
    out = []
    for m in range(int(rel[-1] // minute_s) + 1):
        lo, hi = m * minute_s, (m + 1) * minute_s
        idx = np.nonzero((rel >= lo) & (rel < hi))[0]
        if len(idx) < 2:
            continue
        length = min(hi, rel[-1]) - lo if hi > rel[-1] else minute_s
        if length < 2.0:
            continue
        ends = idx[idx > 0]  # gap k ends at arrival k
        g = gaps[ends - 1] if len(ends) else np.zeros(0)
        out.append({"minute": m, "frames": int(len(idx)), "received_fps": round(len(idx) / length, 3),
                    "freezes": int(np.sum(g > FREEZE_INTERVALS / fps)),
                    "longest_gap_ms": round(float(g.max()) * 1000, 1) if len(g) else 0.0,
                    "seconds": round(float(length), 2)})
    return out


def full_size(frames: list[np.ndarray]) -> list[np.ndarray]:
    """Frames at the largest received size: a subscriber may get a smaller simulcast layer for a while; those
    frames are scaled up by nearest neighbour, so every figure is on one pixel grid."""
    h = max(f.shape[0] for f in frames)
    w = max(f.shape[1] for f in frames)
    out = []
    for f in frames:
        if f.shape[:2] != (h, w):
            ys = np.arange(h) * f.shape[0] // h
            xs = np.arange(w) * f.shape[1] // w
            f = f[ys][:, xs]
        out.append(f)
    return out


def mouth_series(frames: list[np.ndarray]) -> np.ndarray:
    """Mouth opening of each received frame (float32 [N]); the reference character's mouth box."""
    from vivant.worker.quality.lipsync import mouth_opening

    return mouth_opening(np.stack(full_size(frames)))


def av_offset(rec: Recording, vt: np.ndarray, opening: np.ndarray) -> tuple[float | None, float | None]:
    """(lag in ms of the peak correlation of audio loudness and mouth opening on the arrival clock, its r)."""
    if len(vt) < 24 or not rec.audio:
        return None, None
    at = np.asarray(rec.audio_t)
    rms = np.array([np.sqrt(np.mean((a.astype(np.float32) / 32768.0) ** 2)) if len(a) else 0.0 for a in rec.audio])
    t0, t1 = max(vt[0], at[0]), min(vt[-1], at[-1])
    if t1 - t0 < 2.0:
        return None, None
    grid = np.arange(t0, t1, GRID_S)
    mouth = opening[np.clip(np.searchsorted(vt, grid, side="right") - 1, 0, len(vt) - 1)]
    loud = rms[np.clip(np.searchsorted(at, grid, side="right") - 1, 0, len(at) - 1)]
    if mouth.std() == 0 or loud.std() == 0:
        return None, None
    mouth = (mouth - mouth.mean()) / mouth.std()
    loud = (loud - loud.mean()) / loud.std()
    max_lag = int(MAX_LAG_S / GRID_S)
    best, best_lag = -2.0, 0
    for lag in range(-max_lag, max_lag + 1):  # mouth[i + lag] against loud[i]
        a = loud[max(0, -lag): len(loud) - max(0, lag)]
        b = mouth[max(0, lag): len(mouth) - max(0, -lag)]
        r = float(np.mean(a * b))
        if r > best:
            best, best_lag = r, lag
    return round(best_lag * GRID_S * 1000, 1), round(best, 3)


def write_mp4(rec: Recording, path: Path) -> Path | None:
    """What the user received as an MP4 (module docstring); None when no video arrived."""
    import av

    if not rec.video:
        return None
    path.parent.mkdir(parents=True, exist_ok=True)
    t0 = rec.video_t[0]
    frames = full_size(rec.video)
    h, w = frames[0].shape[:2]
    with av.open(str(path), "w") as out:
        vs = out.add_stream("libx264", rate=24)
        vs.width, vs.height, vs.pix_fmt = w - w % 2, h - h % 2, "yuv420p"
        vs.time_base = Fraction(1, 1000)
        a_s = out.add_stream("aac", rate=rec.audio_rate)
        a_s.layout = "mono"
        a_s.time_base = Fraction(1, rec.audio_rate)
        last = -1
        for t, img in zip(rec.video_t, frames, strict=True):
            pts = int(round((t - t0) * 1000))
            if pts <= last:
                pts = last + 1
            last = pts
            frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(img[: vs.height, : vs.width]), format="rgb24")
            frame.pts = pts
            for packet in vs.encode(frame):
                out.mux(packet)
        for packet in vs.encode():
            out.mux(packet)
        if rec.audio:
            start = max(0, int(round((rec.audio_t[0] - t0) * rec.audio_rate)))
            pcm = np.concatenate(rec.audio).astype(np.int16)
            step = 1024
            for i in range(0, len(pcm), step):
                piece = pcm[i:i + step].reshape(1, -1)
                frame = av.AudioFrame.from_ndarray(piece, format="s16", layout="mono")
                frame.sample_rate, frame.pts = rec.audio_rate, start + i
                for packet in a_s.encode(frame):
                    out.mux(packet)
            for packet in a_s.encode():
                out.mux(packet)
    return path


# ------------------------------------------------------------------------------------------- one user, one process


async def record_call(url: str, token: str, avatar_identity: str, max_s: float,
                      join_timeout_s: float = 120.0) -> tuple[Recording, bool, bool]:
    """Join and record until the avatar has come and gone, `max_s` passed, or it never came within
    `join_timeout_s`. Returns (the recording, whether the avatar was seen, whether it left)."""
    user = UserRecorder(url, token, avatar_identity)
    await user.start()
    start = time.monotonic()
    seen = False
    while time.monotonic() - start < max_s:
        present = user.avatar_present()
        seen |= present
        if (seen and not present) or (not seen and time.monotonic() - start > join_timeout_s):
            break
        await asyncio.sleep(0.25)
    left = seen and not user.avatar_present()
    return await user.stop(), seen, left


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="one user of a LiveKit call: record the avatar, write the measurement")
    p.add_argument("--url", required=True, help="the LiveKit server's URL")
    p.add_argument("--avatar-identity", required=True)
    p.add_argument("--max-seconds", type=float, required=True, help="leave after this long whatever happens")
    p.add_argument("--out", type=Path, required=True, help="the measurement (JSON)")
    p.add_argument("--mp4", type=Path, default=None, help="also write what was received here")
    args = p.parse_args(argv)
    token = os.environ.get("VIVANT_USER_TOKEN", "")  # a secret: not on the command line, where ps shows it
    if not token:
        print("call_recorder: VIVANT_USER_TOKEN (the user's LiveKit token) is not set", file=sys.stderr)
        return 2
    if not args.max_seconds > 0:
        print(f"call_recorder: --max-seconds = {args.max_seconds}; expected > 0", file=sys.stderr)
        return 2
    rec, seen, left = asyncio.run(record_call(args.url, token, args.avatar_identity, args.max_seconds))
    measurement = CallMeasurement.from_recording(rec)
    mp4 = write_mp4(rec, args.mp4) if args.mp4 is not None else None
    doc = {"measurement": measurement.to_dict(), "turns": rec.turns, "avatar_seen": seen, "avatar_left": left,
           "joined_at": rec.joined_at, "first_video_at": rec.video_t[0] if rec.video_t else None,
           "mp4": str(mp4) if mp4 else None}
    args.out.write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
