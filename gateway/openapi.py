"""The OpenAPI 3.1 document of the session gateway, generated from the wire models in `models.py`.

Why generated: the document, the server's validation and the agent plugin's requests come from the same
pydantic models, so they cannot disagree. Served at `GET /openapi.json`; schemathesis fuzzes the live
API against it in the tests (docs/reliability.md).
"""

from __future__ import annotations

import functools
from typing import Any

from pydantic.json_schema import models_json_schema
from vivant.gateway import models as wire

_REF = "#/components/schemas/{model}"


def _error(description: str, headers: dict[str, Any] | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"description": description,
                           "content": {"application/json": {"schema": {"$ref": _REF.format(model="ApiError")}}}}
    if headers:
        out["headers"] = headers
    return out


_RETRY_AFTER = {"Retry-After": {"description": "seconds to wait before retrying", "schema": {"type": "string"}}}
_AUTH_ERRORS = {"401": _error("missing, malformed or invalid API key",
                              {"WWW-Authenticate": {"schema": {"type": "string"}}})}
_ID = {"name": "id", "in": "path", "required": True,
       "schema": {"type": "string", "pattern": wire.SESSION_ID_PATTERN, "maxLength": 63}}


@functools.cache
def openapi_document(avatar_ids: tuple[str, ...] = ()) -> dict[str, Any]:
    """The document; with `avatar_ids` (the avatars this server serves), `avatarId`/`presetId` list them as
    an enum, so a generated request can name one. Callers never mutate the (cached) result."""
    shapes = [(wire.CreateSessionRequest, "validation"), (wire.CreateSessionResponse, "serialization"),
              (wire.SessionStatusResponse, "serialization"), (wire.ApiError, "serialization")]
    _, schemas = models_json_schema(shapes, by_alias=True, ref_template=_REF)
    if avatar_ids:
        schemas["$defs"]["CustomAvatar"]["properties"]["avatarId"]["enum"] = list(avatar_ids)
        schemas["$defs"]["PresetAvatar"]["properties"]["presetId"]["enum"] = list(avatar_ids)
    json_body = {"application/json": {"schema": {"$ref": _REF.format(model="CreateSessionRequest")}}}
    unavailable = _error("overloaded, pool unknown or full, or the Kubernetes API unreachable: retry after "
                         "Retry-After", _RETRY_AFTER)
    return {
        "openapi": "3.1.0",
        "info": {"title": "vivant session API", "version": "v1",
                 "description": "Hosted-avatar REST contract of LiveKit agents, served over Kubernetes "
                                "(docs/livekit.md)."},
        "components": {"schemas": schemas["$defs"],
                       "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
        "security": [{"bearer": []}],
        "paths": {
            wire.ROUTE_COLLECTION: {"post": {
                "operationId": "createSession",
                "parameters": [{"name": wire.IDEMPOTENCY_HEADER, "in": "header", "required": False,
                                "schema": {"type": "string", "pattern": wire.IDEMPOTENCY_KEY_PATTERN,
                                           "maxLength": wire.IDEMPOTENCY_KEY_MAX}}],
                "requestBody": {"required": True, "content": json_body},
                "responses": {
                    "201": {"description": "the session (a retry of the same request answers the same id)",
                            "content": {"application/json": {"schema": {"$ref": _REF.format(
                                model="CreateSessionResponse")}}}},
                    "400": _error("body not a JSON object, or a malformed header"),
                    **_AUTH_ERRORS,
                    "404": _error("unknown avatar"),
                    "409": _error("the avatar's pool has an invalid spec, or the session is being deleted"),
                    "413": _error("body over 64 KiB"),
                    "422": _error("a field is invalid (named in error.field)"),
                    "502": _error("the Kubernetes API failed", _RETRY_AFTER),
                    "503": unavailable,
                }}},
            wire.ROUTE_ITEM: {
                "get": {"operationId": "getSession", "parameters": [_ID], "responses": {
                    "200": {"description": "the session's state", "content": {"application/json": {
                        "schema": {"$ref": _REF.format(model="SessionStatusResponse")}}}},
                    **_AUTH_ERRORS, "404": _error("unknown session"), "503": unavailable}},
                "delete": {"operationId": "deleteSession", "parameters": [_ID], "responses": {
                    "204": {"description": "deleted; the worker is told to stop"},
                    **_AUTH_ERRORS, "404": _error("unknown session"), "503": unavailable}},
            },
        },
    }
