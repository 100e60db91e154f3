"""A livekit-agents avatar plugin for vivant: `VivantAvatarSession`, for voice-agent developers.

Why: a LiveKit voice agent adds a hosted avatar in three lines (`AvatarSession(...)`,
`await avatar.start(session, room=ctx.room)`, then start the AgentSession). This class keeps those
three lines and points them at a vivant session API (`vivant api`) instead of a hosted service:

1. mint a LiveKit token for the avatar participant: kind `agent`, identity `avatar_identity`,
   grants to join this one room and publish/subscribe/data (nothing else), attribute
   `lk.publish_on_behalf` = the agent's identity (so LiveKit clients show the avatar's video as the
   agent's);
2. `POST {api_url}/v1/realtime_sessions` with the same body the hosted-avatar plugins send (`avatar`,
   `livekit: {url, token, roomName, agentIdentity}`, `maxDuration`) and a bearer API key; the API
   answers `{"id"}` (or a JSON error, raised here as `VivantAvatarError` with status and code);
3. route the agent's audio to the avatar: `agent_session.output.audio = DataStreamAudioOutput(...)`
   (byte streams on `lk.audio_stream`, interrupts via `lk.clear_buffer`), waiting for the avatar's
   video track before the first word;
4. on the agent session's close: send `{"type": "END_CALL"}` to the avatar and `DELETE` the session.

Settings come from arguments or the environment: `VIVANT_API_URL`, `VIVANT_API_KEY`, `LIVEKIT_URL`,
`LIVEKIT_API_KEY`, `LIVEKIT_API_SECRET`. Nothing here imports the worker or torch.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import logging
import os
from typing import Any

import aiohttp
from livekit import api, rtc
from livekit.agents import AgentSession, get_job_context
from livekit.agents.voice.avatar import AvatarSession, DataStreamAudioOutput

log = logging.getLogger(__name__)

PUBLISH_ON_BEHALF_ATTRIBUTE = "lk.publish_on_behalf"
DEFAULT_AVATAR_IDENTITY = "vivant-avatar"
SAMPLE_RATE = 16_000
SESSIONS_PATH = "/v1/realtime_sessions"


class VivantAvatarError(RuntimeError):
    """The session API refused or failed: HTTP status and the API's error code (if it sent one)."""

    def __init__(self, message: str, status: int | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.code = status, code


def mint_avatar_token(*, api_key: str, api_secret: str, room: str, avatar_identity: str, agent_identity: str,
                      ttl: datetime.timedelta = datetime.timedelta(minutes=15)) -> str:
    """The avatar participant's token: one room, publish/subscribe/data, publishing on behalf of the agent."""
    if not api_key or not api_secret:
        raise VivantAvatarError("LiveKit api_key and api_secret are required to mint the avatar's token")
    grants = api.VideoGrants(room_join=True, room=room, can_publish=True, can_subscribe=True, can_publish_data=True)
    return (api.AccessToken(api_key, api_secret)
            .with_kind("agent")
            .with_identity(avatar_identity)
            .with_name(avatar_identity)
            .with_grants(grants)
            .with_attributes({PUBLISH_ON_BEHALF_ATTRIBUTE: agent_identity})
            .with_ttl(ttl)
            .to_jwt())


def session_request_body(*, avatar_id: str, livekit_url: str, token: str, room: str, agent_identity: str,
                         max_duration_s: int | None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "avatar": {"type": "custom", "avatarId": avatar_id},
        "livekit": {"url": livekit_url, "token": token, "roomName": room, "agentIdentity": agent_identity},
    }
    if max_duration_s is not None:
        body["maxDuration"] = int(max_duration_s)
    return body


class VivantAvatarSession(AvatarSession):
    """A vivant character in the agent's room (see module doc)."""

    def __init__(self, *, avatar_id: str, api_url: str | None = None, api_key: str | None = None,
                 max_duration_s: int | None = None, avatar_identity: str = DEFAULT_AVATAR_IDENTITY,
                 http_timeout_s: float = 10.0) -> None:
        super().__init__()
        self.avatar_id = avatar_id
        self.api_url = (api_url or os.environ.get("VIVANT_API_URL") or "").rstrip("/")
        self._api_key = api_key or os.environ.get("VIVANT_API_KEY") or ""
        if not self.api_url:
            raise VivantAvatarError("api_url: pass it or set VIVANT_API_URL (e.g. http://vivant-api.vivant:8080)")
        if not self._api_key:
            raise VivantAvatarError("api_key: pass it or set VIVANT_API_KEY")
        self.max_duration_s = max_duration_s
        self._avatar_identity = avatar_identity
        self._timeout = aiohttp.ClientTimeout(total=http_timeout_s)
        self.session_id: str | None = None
        self._end_task: asyncio.Task[None] | None = None

    @property
    def avatar_identity(self) -> str:
        return self._avatar_identity

    @property
    def provider(self) -> str:
        return "vivant"

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self._api_key}"}

    async def create_session(self, body: dict[str, Any]) -> str:
        """POST the session; returns its id. Errors carry the API's status and code."""
        async with aiohttp.ClientSession(timeout=self._timeout) as http, \
                http.post(self.api_url + SESSIONS_PATH, json=body, headers=self._headers()) as resp:
            text = await resp.text()
            if resp.status != 201:
                code = None
                try:
                    code = json.loads(text)["error"]["code"]
                except (ValueError, KeyError, TypeError):
                    pass
                retry = resp.headers.get("Retry-After")
                hint = f" (retry after {retry} s)" if retry else ""
                raise VivantAvatarError(f"vivant API answered {resp.status} {code or ''}{hint}", resp.status, code)
            self.session_id = json.loads(text)["id"]
            return self.session_id

    async def delete_session(self) -> None:
        if self.session_id is None:
            return
        async with aiohttp.ClientSession(timeout=self._timeout) as http, \
                http.delete(f"{self.api_url}{SESSIONS_PATH}/{self.session_id}", headers=self._headers()) as resp:
            if resp.status not in (204, 404):
                log.warning("vivant API: DELETE session answered %s", resp.status)

    async def start(self, agent_session: AgentSession, room: rtc.Room, *, livekit_url: str | None = None,
                    livekit_api_key: str | None = None, livekit_api_secret: str | None = None) -> None:
        await super().start(agent_session, room)
        agent_identity = get_job_context().local_participant_identity
        token = mint_avatar_token(
            api_key=livekit_api_key or os.environ.get("LIVEKIT_API_KEY", ""),
            api_secret=livekit_api_secret or os.environ.get("LIVEKIT_API_SECRET", ""),
            room=room.name, avatar_identity=self._avatar_identity, agent_identity=agent_identity)
        url = livekit_url or os.environ.get("LIVEKIT_URL", "")
        if not url:
            raise VivantAvatarError("livekit_url: pass it or set LIVEKIT_URL")
        await self.create_session(session_request_body(
            avatar_id=self.avatar_id, livekit_url=url, token=token, room=room.name,
            agent_identity=agent_identity, max_duration_s=self.max_duration_s))
        agent_session.on("close", lambda _ev: self._schedule_end(room))
        agent_session.output.audio = DataStreamAudioOutput(
            room=room, destination_identity=self._avatar_identity,
            wait_remote_track=rtc.TrackKind.KIND_VIDEO, sample_rate=SAMPLE_RATE)

    def _schedule_end(self, room: rtc.Room) -> asyncio.Task[None]:
        if self._end_task is None:
            self._end_task = asyncio.create_task(self._end(room))
        return self._end_task

    async def _end(self, room: rtc.Room) -> None:
        if room.isconnected():
            try:
                await room.local_participant.publish_data(
                    json.dumps({"type": "END_CALL"}).encode(), reliable=True,
                    destination_identities=[self._avatar_identity])
            except Exception as exc:  # the DELETE below still ends it
                log.warning("could not send END_CALL to the avatar: %s", type(exc).__name__)
        await self.delete_session()

    async def aclose(self) -> None:
        if self._room is not None:
            await asyncio.shield(self._schedule_end(self._room))
        await super().aclose()
