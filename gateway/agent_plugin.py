"""A livekit-agents avatar plugin for vivant: `VivantAvatarSession`, for voice-agent developers.

Why: a LiveKit voice agent adds a hosted avatar in three lines (`AvatarSession(...)`,
`await avatar.start(session, room=ctx.room)`, then start the AgentSession). This class keeps those
three lines and points them at a vivant session gateway (`vivant api`) instead of a hosted service.
It is the gateway's client half, so it lives next to the server (`vivant.gateway.server`) and builds
its request from the server's own route and body models: the two cannot disagree.

1. mint a LiveKit token for the avatar participant with `vivant.apis.livekit_token.mint_avatar_token`
   (kind `agent`, identity `avatar_identity`, this one room, `lk.publish_on_behalf` = the agent's
   identity, so LiveKit clients show the avatar's video as the agent's);
2. `POST {api_url}/v1/realtime_sessions` with the same body the hosted-avatar plugins send (`avatar`,
   `livekit: {url, token, roomName, agentIdentity}`, `maxDuration`; `vivant.gateway.models`) and a
   bearer API key; the gateway answers `{"id"}` (or a JSON error, raised here as `VivantAvatarError`
   with status and code);
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
from livekit import rtc
from livekit.agents import AgentSession, get_job_context
from livekit.agents.voice.avatar import AvatarSession, DataStreamAudioOutput
from pydantic import ValidationError
from vivant.apis.livekit_token import LiveKitCredentials, mint_avatar_token
from vivant.gateway import models

log = logging.getLogger(__name__)

DEFAULT_AVATAR_IDENTITY = "vivant-avatar"
# The plugin's token waits in the gateway's Secret until a worker is assigned: a little longer than the operator's.
AVATAR_TOKEN_TTL = datetime.timedelta(minutes=15)
SAMPLE_RATE = 16_000


class VivantAvatarError(RuntimeError):
    """The session API refused or failed: HTTP status and the API's error code (if it sent one)."""

    def __init__(self, message: str, status: int | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.code = status, code


def livekit_credentials(api_key: str | None = None, api_secret: str | None = None) -> LiveKitCredentials:
    """The agent's LiveKit API key and secret: the arguments, else `LIVEKIT_API_KEY` / `LIVEKIT_API_SECRET`."""
    key = api_key or os.environ.get("LIVEKIT_API_KEY", "")
    secret = api_secret or os.environ.get("LIVEKIT_API_SECRET", "")
    if not key or not secret:
        raise VivantAvatarError("LiveKit api_key and api_secret are required to mint the avatar's token "
                                "(pass them or set LIVEKIT_API_KEY and LIVEKIT_API_SECRET)")
    return LiveKitCredentials(key, secret)


def session_request_body(*, avatar_id: str, livekit_url: str, token: str, room: str, agent_identity: str,
                         max_duration_s: int | None) -> dict[str, Any]:
    """The POST body, checked against the gateway's own request model (a bad value fails here, not at the server)."""
    body: dict[str, Any] = {
        "avatar": {"type": "custom", "avatarId": avatar_id},
        "livekit": {"url": livekit_url, "token": token, "roomName": room, "agentIdentity": agent_identity},
    }
    if max_duration_s is not None:
        body["maxDuration"] = int(max_duration_s)
    try:
        models.CreateSessionRequest.model_validate(body)
    except ValidationError as exc:  # names the field, never echoes the token
        path, msg = models.first_validation_problem(exc)
        raise VivantAvatarError(f"session request: {path}: {msg}") from None
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
                http.post(self.api_url + models.ROUTE_COLLECTION, json=body, headers=self._headers()) as resp:
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
                http.delete(f"{self.api_url}{models.ROUTE_COLLECTION}/{self.session_id}", headers=self._headers()) as resp:
            if resp.status not in (204, 404):
                log.warning("vivant API: DELETE session answered %s", resp.status)

    async def start(self, agent_session: AgentSession, room: rtc.Room, *, livekit_url: str | None = None,
                    livekit_api_key: str | None = None, livekit_api_secret: str | None = None) -> None:
        await super().start(agent_session, room)
        agent_identity = get_job_context().local_participant_identity
        token = mint_avatar_token(
            livekit_credentials(livekit_api_key, livekit_api_secret), room=room.name,
            identity=self._avatar_identity, agent_identity=agent_identity, ttl=AVATAR_TOKEN_TTL)
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
