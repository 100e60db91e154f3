"""A voice agent on livekit-agents whose face is a vivant character, through the published Runway plugin.

The only vivant-specific setting is the Runway plugin's base URL: `livekit-plugins-runway`'s `AvatarSession`
POSTs `/v1/realtime_sessions` to `api_url`, which here is a vivant session API (`vivant api`, or
`vivant api --local` without a cluster). The agent speaks scripted turns through `EspeakTTS` (espeak-ng; no
STT, LLM or model service), so the whole call runs on one machine.

Run it like any livekit-agents worker, with in the environment:
  LIVEKIT_URL, LIVEKIT_API_KEY, LIVEKIT_API_SECRET   the LiveKit server (the avatar's token is minted here)
  VIVANT_API_URL, VIVANT_API_KEY                     the vivant session API and one of its keys
and dispatch it to a room (agent name `vivant-example`) with an optional JSON script as the dispatch's
metadata (`Script` below), e.g. `lk dispatch create --agent-name vivant-example --room demo --metadata '{...}'`:

    python examples/livekit_agent/agent.py start

While it speaks, it publishes one data message per turn on topic `vivant.agent` —
`{"type": "turn", "turn": i, "text": ..., "audio_sent_at": <unix s>}`, the time its first audio frame of the
turn left for the avatar — so a listener can measure turn latency (`vivant demo --livekit` does).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Literal

from livekit.agents import (
    Agent,
    AgentServer,
    AgentSession,
    JobContext,
    JobExecutorType,
    cli,
)
from livekit.agents.voice.room_io import RoomOptions
from livekit.plugins import runway
from pydantic import BaseModel, ConfigDict, Field

sys.path.insert(0, str(Path(__file__).resolve().parent))
from espeak_tts import EspeakTTS  # noqa: E402

AGENT_NAME = "vivant-example"
EVENTS_TOPIC = "vivant.agent"
log = logging.getLogger("vivant-example-agent")


class Script(BaseModel):
    """What the agent does in a room, from the dispatch metadata (JSON; empty = the defaults)."""

    model_config = ConfigDict(extra="forbid")
    avatar: str = Field(default="ada", min_length=1, max_length=128)
    turns: list[str] = Field(default_factory=lambda: ["Hello! I am a vivant character, speaking in a real room."],
                             max_length=100)
    pause_s: float = Field(default=1.0, ge=0, le=60, description="silence after each turn")
    repeat_for_s: float = Field(default=0.0, ge=0, le=3600,
                                description="keep cycling through the turns until this many seconds passed")
    end: Literal["end_call", "leave", "stay"] = Field(
        default="end_call", description="after the script: close the agent session (the plugin sends END_CALL), "
                                        "leave the room without a word, or stay until the room closes")
    max_duration_s: int | None = Field(default=None, ge=10, le=86_400, description="the avatar's maxDuration")
    interrupt_every: int = Field(default=0, ge=0, le=100,
                                 description="interrupt every n-th turn (0 = never): the framework's interrupt, "
                                             "which sends the avatar `lk.clear_buffer`")
    interrupt_after_s: float = Field(default=1.0, gt=0, le=60, description="how far into such a turn to interrupt")

    @classmethod
    def from_metadata(cls, metadata: str) -> Script:
        return cls.model_validate_json(metadata) if metadata.strip() else cls()


# A scripted agent is light: jobs run in threads of this process, and it never refuses a job on a busy machine.
# VIVANT_AGENT_HTTP_PORT: the framework's health server (0 = any free port; the framework's default is 8081).
server = AgentServer(job_executor_type=JobExecutorType.THREAD, num_idle_processes=0, load_fnc=lambda: 0.0,
                     port=int(os.environ.get("VIVANT_AGENT_HTTP_PORT", "8081")))


@server.rtc_session(agent_name=AGENT_NAME)
async def entrypoint(ctx: JobContext) -> None:
    script = Script.from_metadata(ctx.job.metadata)
    await ctx.connect()
    # VIVANT_TTS_CACHE: speech made beforehand (espeak_tts.py), for machines without espeak-ng
    session = AgentSession(tts=EspeakTTS(cache_dir=os.environ.get("VIVANT_TTS_CACHE") or None))

    kwargs = {"max_duration": script.max_duration_s} if script.max_duration_s else {}
    avatar = runway.AvatarSession(avatar_id=script.avatar, api_url=os.environ["VIVANT_API_URL"],
                                  api_key=os.environ["VIVANT_API_KEY"], **kwargs)
    await avatar.start(session, room=ctx.room)  # POST /v1/realtime_sessions; TTS audio now goes to the avatar
    turn_marks: list[float] = []
    session.output.audio.on("playback_started", lambda ev: turn_marks.append(ev.created_at))

    await session.start(agent=Agent(instructions="A scripted agent: it only says its turns."), room=ctx.room,
                        room_options=RoomOptions(audio_input=False,  # scripted: no STT listens
                                                 audio_output=False))  # the avatar publishes the speech

    started, turn = time.monotonic(), 0
    while True:
        for text in script.turns:
            handle = session.say(text)
            await asyncio.sleep(0)
            cut = script.interrupt_every and (turn + 1) % script.interrupt_every == 0
            if cut:
                await asyncio.sleep(script.interrupt_after_s)
                handle.interrupt()
            await handle.wait_for_playout()
            event = {"type": "turn", "turn": turn, "text": text,  # one playback_started per turn, in order
                     "audio_sent_at": turn_marks[turn] if len(turn_marks) > turn else None,
                     "interrupted": bool(cut and handle.interrupted)}
            await ctx.room.local_participant.publish_data(json.dumps(event), reliable=True, topic=EVENTS_TOPIC)
            turn += 1
            await asyncio.sleep(script.pause_s)
        if time.monotonic() - started >= script.repeat_for_s:
            break

    if script.end == "end_call":
        await session.aclose()  # the plugin sends {"type": "END_CALL"} to the avatar
        await asyncio.sleep(1.0)
        ctx.shutdown("script done")
    elif script.end == "leave":
        await ctx.room.disconnect()
        ctx.shutdown("script done")


if __name__ == "__main__":
    cli.run_app(server)
