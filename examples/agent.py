"""An existing LiveKit voice agent with a vivant character as its face.

Run it like any livekit-agents worker (`python examples/agent.py dev`) with, in the environment:
  LIVEKIT_URL, LIVEKIT_API_KEY, LIVEKIT_API_SECRET   your LiveKit project (the avatar's token is minted here)
  VIVANT_API_URL, VIVANT_API_KEY                     the `vivant api` Service and one of its keys
  VIVANT_AVATAR                                      an avatar id from the API's avatars file (default "ada")
plus whatever your STT/LLM/TTS plugins need. The only vivant-specific lines are the three marked below;
everything else is a plain AgentSession. The agent's own audio track is turned off because the avatar
publishes the speech in sync with its video (on the agent's behalf, `lk.publish_on_behalf`).
"""

from __future__ import annotations

import os

from livekit.agents import Agent, AgentServer, AgentSession, JobContext, RoomOutputOptions, cli
from vivant.gateway.agent_plugin import VivantAvatarSession

server = AgentServer()


@server.rtc_session()
async def entrypoint(ctx: JobContext) -> None:
    await ctx.connect()
    # Your pipeline as it is, e.g. AgentSession(stt=..., llm=..., tts=..., vad=...).
    session = AgentSession()

    avatar = VivantAvatarSession(avatar_id=os.environ.get("VIVANT_AVATAR", "ada"), max_duration_s=900)  # vivant
    await avatar.start(session, room=ctx.room)  # vivant: starts the character, routes the TTS audio to it

    await session.start(
        agent=Agent(instructions="You are Ada, a friendly guide. Keep answers short."),
        room=ctx.room,
        room_output_options=RoomOutputOptions(audio_enabled=False),  # vivant: the avatar publishes the audio
    )


if __name__ == "__main__":
    cli.run_app(server)
