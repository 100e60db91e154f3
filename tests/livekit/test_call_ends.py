"""The whole call against a real LiveKit server, and every way it ends (issue: "into a real room").

One `LocalCall` (bench/livekit_call.py) for the module: Redis, a livekit-server of its own (so one test may
restart it), the session API in local mode, one `vivant worker --runner livekit` (tiny preset, random weights)
and the example voice agent (examples/livekit_agent/agent.py: livekit-agents + the published Runway avatar
plugin pointed at the API by its base URL, espeak-ng TTS), registered with the server. Each test dispatches the
agent to a new room with a script and joins as the "user" who receives the character:

* the agent closes its session → the plugin's END_CALL → the worker leaves, the lease is released (EndCall);
* the example agent leaves the room → AgentLeft, or Deleted by the plugin's fallback DELETE (whichever is first);
* an agent that vanishes (no END_CALL, no DELETE) → AgentLeft;
* maxDuration (the plugin's `max_duration`, 10 s) → the service's max-duration reason;
* DELETE /v1/realtime_sessions/{id} on the API → Deleted;
* the LiveKit server killed and restarted mid-call → the session ends with a reason and the worker is idle again,
  or it is still streaming to a user who joins after the restart; never a hang (bounded waits).

Every wait is bounded; nothing here is timed for speed.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request

import pytest
from livekit import api, rtc
from vivant.bench.call_recorder import UserRecorder
from vivant.bench.livekit_call import AVATAR_IDENTITY, POOL, CallConfig, LocalCall
from vivant.sessions.registry import Registry
from vivant.worker.serving.runner import MAX_DURATION_REASON

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]
WORKER = "worker-0"
ONE_TURN = ["Hello, I am here."]


@pytest.fixture(scope="module")
def call(tmp_path_factory: pytest.TempPathFactory):
    c = LocalCall(CallConfig(folder=tmp_path_factory.mktemp("call"), preset="tiny", nice=5))
    try:
        c.start(worker_timeout=240)
        yield c
    finally:
        c.stop()


@pytest.fixture
def registry(call: LocalCall):
    r = Registry(call.redis_url)
    yield r
    r.close()


async def until(what: str, cond, timeout: float, every: float = 0.2):  # noqa: ANN001
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = cond()
        if value:
            return value
        await asyncio.sleep(every)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def api_request(call: LocalCall, method: str, path: str) -> tuple[int, dict | None]:
    req = urllib.request.Request(call.api_url + path, method=method,
                                 headers={"Authorization": f"Bearer {call.cfg.api_key}"})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            body = r.read()
            return r.status, (json.loads(body) if body else None)
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"null")


async def start_call(call: LocalCall, registry: Registry, room: str, script: dict) -> tuple[UserRecorder, str]:
    """Dispatch the agent with `script`, join as the user; returns the recorder and the registry's session id
    once the worker holds it and the user receives its video."""
    user = UserRecorder(call.lk.url, call.user_token(room), AVATAR_IDENTITY, audio_rate=16000)
    await call.dispatch(room, script)
    await user.start()
    sid = await until("the API's session on the worker", lambda: registry.session_of(POOL, WORKER), 90)
    await until("the character's video at the user", lambda: len(user.rec.video) >= 12, 120)
    return user, sid


async def ended(call: LocalCall, registry: Registry, sid: str, timeout: float = 90):
    final = await until(f"{sid} ended", lambda: (s := registry.session_stats(sid)) and s.phase in ("Ended", "Failed")
                        and s, timeout)
    await until(f"{sid}'s lease released", lambda: registry.worker_of(sid) is None, 15)
    await until("the worker idle again", lambda: registry.idle_workers(POOL) == [WORKER], 30)
    return final


async def test_end_call_from_the_agent_releases_the_worker(call: LocalCall, registry: Registry):
    user, sid = await start_call(call, registry, "room-endcall", {"turns": ONE_TURN, "pause_s": 0.5,
                                                                   "end": "end_call"})
    try:
        final = await ended(call, registry, sid)
        assert (final.phase, final.end_reason) == ("Ended", "EndCall"), final
        await until("the agent's turn event", lambda: user.rec.turns, 30)
        assert user.rec.turns[0]["audio_sent_at"] is not None, user.rec.turns
        assert user.rec.audio, "the user received no audio from the avatar"
        status, body = api_request(call, "GET", f"/v1/realtime_sessions/{sid.split('/', 1)[1]}")
        assert (status, body["status"], body["message"]) == (200, "COMPLETED", "EndCall"), body
    finally:
        await user.stop()
    sizes = [f.shape for f in user.rec.video]
    assert max(set(sizes), key=sizes.count) == (128, 192, 3), set(sizes)  # the tiny preset's frames


async def test_the_example_agent_leaving_ends_the_session(call: LocalCall, registry: Registry):
    """The Runway plugin, when its room is gone, also DELETEs the session (its fallback): either reason ends it,
    whichever reaches the worker first."""
    user, sid = await start_call(call, registry, "room-leave", {"turns": ONE_TURN, "pause_s": 0.5, "end": "leave"})
    try:
        final = await ended(call, registry, sid)
    finally:
        await user.stop()
    assert final.phase == "Ended" and final.end_reason in ("AgentLeft", "Deleted"), final


def post_session(call: LocalCall, room: str, agent: str, avatar: str) -> str:
    """POST /v1/realtime_sessions with the body livekit-plugins-runway sends; returns the session id."""
    token = (api.AccessToken(call.lk.api_key, call.lk.api_secret).with_kind("agent").with_identity(avatar)
             .with_grants(api.VideoGrants(room_join=True, room=room))
             .with_attributes({"lk.publish_on_behalf": agent}).to_jwt())
    body = {"model": "gwm1_avatars", "avatar": {"type": "custom", "avatarId": "ada"},
            "livekit": {"url": call.lk.url, "token": token, "roomName": room, "agentIdentity": agent}}
    req = urllib.request.Request(call.api_url + "/v1/realtime_sessions", data=json.dumps(body).encode(), method="POST",
                                 headers={"Authorization": f"Bearer {call.cfg.api_key}",
                                          "Content-Type": "application/json", "X-Runway-Version": "2024-11-06"})
    with urllib.request.urlopen(req, timeout=10) as r:
        assert r.status == 201
        return json.loads(r.read())["id"]


async def test_an_agent_that_vanishes_ends_the_session(call: LocalCall, registry: Registry):
    """An agent that drops out of the room with no END_CALL and no DELETE (a crash, a lost network): the worker
    sees the agent participant leave and ends the session (AgentLeft) by itself."""
    room, agent_identity, avatar = "room-vanish", "crashing-agent", "vivant-avatar-vanish"
    agent = rtc.Room()
    grants = api.VideoGrants(room_join=True, room=room, can_publish=True, can_subscribe=True, can_publish_data=True)
    await agent.connect(call.lk.url, api.AccessToken(call.lk.api_key, call.lk.api_secret).with_kind("agent")
                        .with_identity(agent_identity).with_grants(grants).to_jwt())
    user = UserRecorder(call.lk.url, call.user_token(room), avatar)
    try:
        name = await asyncio.to_thread(post_session, call, room, agent_identity, avatar)
        await user.start()
        await until("the character's video at the user", lambda: len(user.rec.video) >= 12, 120)
    finally:
        await agent.disconnect()
    try:
        final = await ended(call, registry, f"local/{name}")
    finally:
        await user.stop()
    assert (final.phase, final.end_reason) == ("Ended", "AgentLeft"), final


async def test_max_duration_ends_the_session(call: LocalCall, registry: Registry):
    user, sid = await start_call(call, registry, "room-maxdur", {"turns": ONE_TURN, "end": "stay",
                                                                  "max_duration_s": 10})
    try:
        final = await ended(call, registry, sid, timeout=120)
    finally:
        await user.stop()
    assert (final.phase, final.end_reason) == ("Ended", MAX_DURATION_REASON), final


async def test_delete_on_the_api_ends_the_session(call: LocalCall, registry: Registry):
    user, sid = await start_call(call, registry, "room-delete", {"turns": ONE_TURN, "end": "stay"})
    try:
        name = sid.split("/", 1)[1]
        assert api_request(call, "DELETE", f"/v1/realtime_sessions/{name}") == (204, None)
        final = await ended(call, registry, sid)
        assert api_request(call, "DELETE", "/v1/realtime_sessions/rt-0000")[0] == 404
    finally:
        await user.stop()
    assert (final.phase, final.end_reason) == ("Ended", "Deleted"), final


async def test_livekit_server_restarted_mid_call_never_hangs(call: LocalCall, registry: Registry):
    """Runs last in this module: it kills the module's server and starts it again on the same ports."""
    user, sid = await start_call(call, registry, "room-restart", {"turns": ONE_TURN, "end": "stay"})
    await user.stop()
    call.livekit.restart()
    late = UserRecorder(call.lk.url, call.user_token("room-restart", "late-user"), AVATAR_IDENTITY)
    for _ in range(20):  # the server takes a moment to answer again
        try:
            await late.start()
            break
        except Exception:  # noqa: BLE001 (rtc.ConnectError and friends while it starts)
            late = UserRecorder(call.lk.url, call.user_token("room-restart", "late-user"), AVATAR_IDENTITY)
            await asyncio.sleep(1)
    try:
        outcome = await until(
            "the session ended with a reason, or the character streaming to a user who joined after the restart",
            lambda: ((s := registry.session_stats(sid)) and s.phase in ("Ended", "Failed") and "ended")
            or (len(late.rec.video) >= 12 and "streaming"), 150)
    finally:
        await late.stop()
    if outcome == "streaming":  # the worker reconnected: DELETE still ends it
        assert api_request(call, "DELETE", f"/v1/realtime_sessions/{sid.split('/', 1)[1]}")[0] == 204
    final = await ended(call, registry, sid)
    assert final.end_reason, final
    if outcome == "ended":
        assert final.end_reason in ("RoomDisconnected", "AgentLeft") or final.phase == "Failed", final
