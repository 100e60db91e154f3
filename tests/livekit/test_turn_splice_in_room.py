"""A turn start splices the room's queue (#21) over the wire: a real `vivant worker --runner livekit` (1 DiT rank + the
decoder rank, tiny preset with a smaller decoder, `--vae-widths 16,8,8`, that keeps ahead of real time on 2 CPU
cores) in a real room on a real livekit-server.

The test agent speaks a first utterance through livekit-agents' avatar audio output (`DataStreamAudioOutput`), waits
for its `lk.playback_finished`, lets the avatar stay silent for a while (the worker queues silent frames ahead of
publication: its decoder stage, `RoomVideo`'s queue and the AvatarRunner's synchronizer, 3 chunks + the runner's),
then speaks again. Counted in video frames the agent's subscription received (not wall-clock time): from the moment
the second utterance's first sample is sent until its speech is heard on the avatar's audio track, at most the
frames the splice keeps (the runner's `frames_held_by_runner` + the decoder rank's keep horizon, the lead rank 0
sent plus its decode time) plus one chunk for rank 0 to take the speech at its next chunk boundary, plus one chunk
for the transport (data stream in, media out), plus two chunks of scheduling slack: the worker's ranks, the server,
the agent and this receiver share 2 cores with the rest of the suite (seen: 13 on a quiet machine, 18 in a full
`make test`). The video track now arrives at its 24 fps (worker/serving/publishing.py); before, the SDK's default
encoding delivered these small frames at 15 fps, so the same count of frames spanned 1.6 times as long. Without the
splice the speech waits behind every silent frame queued (seen at 15 fps received: 16–19 frames, ≈ 26–30 at 24 fps,
above this bound). The decoder rank's record shows the splice (r, k) and that every
published frame index was handed to the runner once, with no gap: the old frames ≥ f* were never published, the
remade chunk's frames ≥ k were.
"""

from __future__ import annotations

import asyncio
import json
import math

import numpy as np
import pytest
from livekit import rtc
from livekit.agents.voice.avatar import DataStreamAudioOutput
from test_worker_in_room import AVATAR, agent_token, assign_in_room, speech_frames, until
from vivant.devcluster.livekit import LiveKitState
from vivant.worker.serving.room_video import frames_held_by_runner
from worker_proc import WorkerProcess

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
ROOM, SESSION, WORKER = "room-splice", "ns/splice", "worker-splice"
RATE, FPS, FPC = 16000, 24, 4
FAST_VAE = "16,8,8"  # a decoder that keeps ahead of real time on a 2-core CPU (48×32 frames), so silence queues up
LOUD = 3000  # int16 peak of the test's speech (a 0.4 sine) after Opus; silence stays far below


async def test_a_turn_after_silence_is_spliced_in_a_real_room(livekit_server: LiveKitState, redis_url, tmp_path):
    w = WorkerProcess(redis_url, tmp_path, "--runner", "livekit", "--vae-widths", FAST_VAE, worker_id=WORKER, tp=1)
    agent = rtc.Room()
    video: list[int] = []  # one entry per video frame the agent received
    loud: list[int] = []  # per audible audio frame received: how many video frames had been received then
    finished: list = []
    readers: list[asyncio.Task] = []
    try:
        await asyncio.to_thread(w.wait_idle)

        @agent.on("track_subscribed")
        def _on_track(track: rtc.Track, *_: object) -> None:
            if track.kind == rtc.TrackKind.KIND_VIDEO:
                async def read_video() -> None:
                    async for event in rtc.VideoStream(track):
                        video.append(event.frame.width)
                readers.append(asyncio.ensure_future(read_video()))
            elif track.kind == rtc.TrackKind.KIND_AUDIO:
                async def read_audio() -> None:
                    async for event in rtc.AudioStream(track, sample_rate=RATE, num_channels=1):
                        if np.abs(np.frombuffer(event.frame.data, np.int16)).max(initial=0) > LOUD:
                            loud.append(len(video))
                readers.append(asyncio.ensure_future(read_audio()))

        await agent.connect(livekit_server.url, agent_token(livekit_server, ROOM))
        assign_in_room(w, livekit_server, SESSION, ROOM)
        await until("the character's video at the agent", lambda: len(video) >= 24, 120)

        out = DataStreamAudioOutput(agent, destination_identity=AVATAR, sample_rate=RATE)
        out.on("playback_finished", finished.append)
        for frame in speech_frames(1.0, RATE):  # the first turn
            await out.capture_frame(frame)
        out.flush()
        await until("lk.playback_finished of the first turn", lambda: finished, 60)
        await asyncio.sleep(3.0)  # silence: the worker fills its queues with silent frames
        heard_before, frames_before = len(loud), len(video)
        for frame in speech_frames(1.0, RATE):  # the second turn, after silence
            await out.capture_frame(frame)
        out.flush()
        await until("the second turn heard at the agent", lambda: len(loud) > heard_before, 60)
        waited = loud[heard_before] - frames_before
        await until("lk.playback_finished of the second turn", lambda: len(finished) >= 2, 60)
        assert [f.interrupted for f in finished] == [False, False], finished

        await agent.local_participant.publish_data(json.dumps({"type": "END_CALL"}), reliable=True)
        final = await asyncio.to_thread(w.ended, SESSION, 60)
        assert (final.phase, final.end_reason) == ("Ended", "EndCall"), final
        await asyncio.to_thread(w.assert_released, SESSION)

        trace = w.trace(SESSION, 1)  # the decoder rank
        rewinds = [e for e in trace if e["event"] == "rewind"]
        room = next(e for e in trace if e["event"] == "room")
        second = rewinds[-1]
        keep = frames_held_by_runner(FPS) + math.ceil(second["lead_ms"] / 1e3 * FPS)
        bound = keep + 4 * FPC  # + one chunk to take the speech, one of transport, two of 2-core scheduling slack
        print(f"second turn: heard {waited} video frames after its first sample was sent, published "
              f"{room['turn_waits']} (bound {bound}: the splice keeps {keep}); rewinds {rewinds}; room splices "
              f"{room['splices']}, {room['spliced_frames']} queued frames dropped")
        assert len(rewinds) == 2 and second["next_chunk"] > rewinds[0]["next_chunk"], rewinds
        assert [second["chunk"], second["frame"]] in room["splices"], (
            f"the decoder rank answered the second turn's rewind without the room's splice: {second}, {room}")
        runs = room["published"]
        assert len(runs) == 1 and runs[0][0] == 0, (
            f"every frame index is published once and in order (old frames ≥ f* never, the remade ones once): {runs}")
        assert waited <= bound, (
            f"the second turn was heard {waited} video frames after its first sample was sent; expected ≤ {bound} "
            f"(the splice keeps {keep} frames: lead {second['lead_ms']} ms; + one chunk to take it, one of transport, "
            "two of scheduling slack)")
    finally:
        for task in readers:
            task.cancel()
        await agent.disconnect()
        code = await asyncio.to_thread(w.stop)
    assert code == 0, w.log()[-3000:]
