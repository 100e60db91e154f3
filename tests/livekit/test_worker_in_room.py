"""The served runtime in a real LiveKit room: `vivant worker --runner livekit` (1 DiT rank + the decoder rank, tiny
preset) is assigned a session whose room a test agent has joined on a real livekit-server (tests/livekit/conftest.py).

The decoder rank joins with the operator's kind of token (`mint_avatar_token`), publishes the character's video
(frames arrive at the agent's subscription), receives the agent's speech through livekit-agents' own avatar
protocol (`DataStreamAudioOutput` → `lk.audio_stream` → the worker's `DataStreamAudioReceiver`), forwards it to rank
0, which diffuses it, and reports `lk.playback_finished` back once the segment played; the agent's `END_CALL` data
message ends the session with reason EndCall and the worker is idle again. Real everything: Redis, the worker and
its ranks, the LiveKit server, the SDK on both sides.
"""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest
from livekit import api, rtc
from livekit.agents.voice.avatar import DataStreamAudioOutput
from vivant.apis.livekit_token import LiveKitCredentials, mint_avatar_token
from vivant.devcluster.livekit import LiveKitState
from worker_proc import POOL, WorkerProcess, assignment

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
AGENT, AVATAR, ROOM = "agent-1", "vivant-avatar-room", "room-worker"


def agent_token(state: LiveKitState, room: str = ROOM) -> str:
    grants = api.VideoGrants(room_join=True, room=room, can_publish=True, can_subscribe=True, can_publish_data=True)
    return (api.AccessToken(state.api_key, state.api_secret).with_identity(AGENT).with_kind("agent")
            .with_grants(grants).to_jwt())


def speech_frames(seconds: float, rate: int = 16000, ms: int = 100) -> list[rtc.AudioFrame]:
    t = np.arange(int(seconds * rate)) / rate
    pcm = (0.4 * np.sin(2 * np.pi * 200 * t) * 32767).astype(np.int16)
    n = rate * ms // 1000
    return [rtc.AudioFrame(pcm[i:i + n].tobytes(), rate, 1, len(pcm[i:i + n])) for i in range(0, len(pcm), n)]


def assign_in_room(w: WorkerProcess, state: LiveKitState, session: str, room: str = ROOM) -> str:
    """Give worker `w` the session in `room` as the control plane does: the avatar's token minted the operator's way
    (`mint_avatar_token`), the worker claimed for the session, the assignment sent to its inbox. Returns the token."""
    token = mint_avatar_token(LiveKitCredentials(state.api_key, state.api_secret), room=room, identity=AVATAR,
                              agent_identity=AGENT)
    a = assignment(session, livekit_url=state.url, token=token, agent_identity=AGENT, room=room)
    assert w.registry.claim_idle_worker(POOL, session) == w.worker_id
    w.registry.send_assignment(w.worker_id, a)
    return token


async def until(what: str, cond, timeout: float) -> None:  # noqa: ANN001
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not cond():
        if loop.time() > end:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.1)


async def test_a_livekit_worker_talks_with_an_agent_in_a_real_room(livekit_server: LiveKitState, redis_url, tmp_path):
    w = WorkerProcess(redis_url, tmp_path, "--runner", "livekit", worker_id="worker-room", tp=1)
    agent = rtc.Room()
    video: list[tuple[int, int]] = []
    finished: list = []
    try:
        await asyncio.to_thread(w.wait_idle)

        @agent.on("track_subscribed")
        def _on_track(track: rtc.Track, *_: object) -> None:
            if track.kind == rtc.TrackKind.KIND_VIDEO:
                async def read() -> None:
                    async for event in rtc.VideoStream(track):
                        video.append((event.frame.width, event.frame.height))
                asyncio.ensure_future(read())

        await agent.connect(livekit_server.url, agent_token(livekit_server))
        token = assign_in_room(w, livekit_server, "ns/room")

        await until("the character's video at the agent", lambda: len(video) >= 24, 120)
        assert set(video) == {(192, 128)}, set(video)

        out = DataStreamAudioOutput(agent, destination_identity=AVATAR, sample_rate=16000)
        out.on("playback_finished", finished.append)
        for frame in speech_frames(1.0):
            await out.capture_frame(frame)
        out.flush()
        await until("lk.playback_finished from the avatar", lambda: finished, 120)
        assert finished[0].interrupted is False, finished[0]

        await agent.local_participant.publish_data(json.dumps({"type": "END_CALL"}), reliable=True)
        final = await asyncio.to_thread(w.ended, "ns/room", 60)
        assert (final.phase, final.end_reason) == ("Ended", "EndCall"), final
        # a room session has no pacer count from the decoder rank: the worker's own count stands (not 0 fps)
        assert final.chunks > 0 and final.fps > 0, final
        await asyncio.to_thread(w.assert_released, "ns/room")
        assert await asyncio.to_thread(w.idle_again) == ["worker-room"]
        speech = sum(e.get("speech_samples", 0) for e in w.trace("ns/room", 0) if e["event"] == "chunk")
        assert abs(speech - 16000) <= 2667, f"rank 0 diffused {speech} samples of the agent's 1 s of speech"
    finally:
        await agent.disconnect()
        code = await asyncio.to_thread(w.stop)
    assert code == 0, w.log()[-3000:]
    assert token not in w.log(), "the LiveKit token appeared in the worker's log"
