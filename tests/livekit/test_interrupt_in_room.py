"""An interruption over the wire: a real `vivant worker --runner livekit` (1 DiT rank + the decoder rank, tiny
preset) in a real room on a real livekit-server honours livekit-agents' `lk.clear_buffer`.

The test agent starts a 4 s utterance through livekit-agents' avatar audio output (`DataStreamAudioOutput`, the
same object an `AgentSession` with an avatar plugin uses) and, 1 s after the avatar reported
`lk.playback_started`, interrupts it as livekit-agents does on a barge-in: `DataStreamAudioOutput.clear_buffer()`,
which performs the `lk.clear_buffer` RPC to the avatar participant. The worker must answer
`lk.playback_finished(interrupted=True)` at a position inside the utterance, start no new playback until the
agent speaks again (no `lk.playback_started`), stop diffusing the utterance's speech on rank 0 (its trace), and
go on streaming: a short second utterance plays and finishes uninterrupted; `END_CALL` then ends the session and
releases the lease. Real everything: Redis, the worker and its ranks, the LiveKit server, the SDK on both sides.
(`clear_buffer_timeout=None`: the agent never makes up a `playback_finished` of its own, so every one seen here
came from the worker.)
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from livekit import rtc
from livekit.agents.voice.avatar import DataStreamAudioOutput
from test_worker_in_room import AVATAR, agent_token, assign_in_room, speech_frames, until
from vivant.devcluster.livekit import LiveKitState
from worker_proc import WorkerProcess

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
ROOM, SESSION, WORKER = "room-interrupt", "ns/interrupt", "worker-interrupt"
RATE, LONG_S, SHORT_S = 16000, 4.0, 1.0


def chunk_speech(trace: Path) -> list[int]:
    """Speech samples rank 0 diffused per chunk so far, from its trace (written and flushed line by line; a
    line still being written is left out)."""
    if not trace.exists():
        return []
    lines = trace.read_text().split("\n")[:-1]
    return [e.get("speech_samples", 0) for e in map(json.loads, lines) if e["event"] == "chunk"]


async def test_the_worker_honours_an_interruption_in_a_real_room(livekit_server: LiveKitState, redis_url, tmp_path):
    w = WorkerProcess(redis_url, tmp_path, "--runner", "livekit", worker_id=WORKER, tp=1)
    agent = rtc.Room()
    video: list[int] = []
    started: list = []
    finished: list = []
    try:
        await asyncio.to_thread(w.wait_idle)

        @agent.on("track_subscribed")
        def _on_track(track: rtc.Track, *_: object) -> None:
            if track.kind == rtc.TrackKind.KIND_VIDEO:
                async def read() -> None:
                    async for event in rtc.VideoStream(track):
                        video.append(event.frame.width)
                asyncio.ensure_future(read())

        await agent.connect(livekit_server.url, agent_token(livekit_server, ROOM))
        assign_in_room(w, livekit_server, SESSION, ROOM)
        await until("the character's video at the agent", lambda: len(video) >= 12, 120)

        out = DataStreamAudioOutput(agent, destination_identity=AVATAR, sample_rate=RATE, wait_playback_start=True,
                                    clear_buffer_timeout=None)
        out.on("playback_started", started.append)
        out.on("playback_finished", finished.append)

        # a long utterance, interrupted 1 s into its playback
        for frame in speech_frames(LONG_S, RATE):
            await out.capture_frame(frame)
        out.flush()
        await until("lk.playback_started from the avatar", lambda: started, 60)
        await asyncio.sleep(1.0)
        assert not finished, f"the {LONG_S} s utterance finished within 1 s of its start: {finished}"
        out.clear_buffer()
        await until("lk.playback_finished after lk.clear_buffer", lambda: finished, 30)
        cut = finished[0]
        assert cut.interrupted is True, cut
        assert 0.0 < cut.playback_position < LONG_S, cut

        # rank 0 goes back to silence: the rest of the utterance is not diffused
        trace = w.folder(SESSION) / "rank0.jsonl"
        await until("rank 0 diffusing silence after the interrupt",
                    lambda: (s := chunk_speech(trace)) and any(s) and s[-1] == 0, 30)
        before = chunk_speech(trace)
        first = sum(before)
        assert 0 < first < LONG_S * RATE, f"rank 0 diffused {first} samples of the interrupted {LONG_S} s utterance"
        await asyncio.sleep(1.0)
        assert len(started) == 1 and len(finished) == 1, (
            f"after the interrupt, with no new speech: playback started {len(started)}x, finished {len(finished)}x")

        # the session goes on: a short utterance plays out, uninterrupted
        for frame in speech_frames(SHORT_S, RATE):
            await out.capture_frame(frame)
        out.flush()
        await until("lk.playback_finished of the second utterance", lambda: len(finished) >= 2, 60)
        assert finished[1].interrupted is False, finished[1]
        assert len(started) == 2, started

        await agent.local_participant.publish_data(json.dumps({"type": "END_CALL"}), reliable=True)
        final = await asyncio.to_thread(w.ended, SESSION, 60)
        assert (final.phase, final.end_reason) == ("Ended", "EndCall"), final
        await asyncio.to_thread(w.assert_released, SESSION)
        assert await asyncio.to_thread(w.idle_again) == [WORKER]
        after = [e.get("speech_samples", 0) for e in w.trace(SESSION, 0) if e["event"] == "chunk"][len(before):]
        assert abs(sum(after) - SHORT_S * RATE) <= 2667, f"rank 0 diffused {sum(after)} samples of the 1 s utterance"
    finally:
        await agent.disconnect()
        code = await asyncio.to_thread(w.stop)
    assert code == 0, w.log()[-3000:]
