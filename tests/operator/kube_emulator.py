"""A kmock KubernetesEmulator that behaves enough like a kube-apiserver for kopf (test helper).

No kube-apiserver can run on these machines (ENVIRONMENT.md), so the kopf tests run against kmock's
in-memory emulator. Plain kmock stamps no uid/resourceVersion/creationTimestamp/generation and
merges JSON-patch lists as if they were dicts. This subclass adds what kopf relies on:
- on create: a name from metadata.generateName, metadata.uid, resourceVersion, creationTimestamp, generation=1;
- on every change: a new resourceVersion; metadata.generation + 1 when the spec changes
  (not for the status subresource);
- lists carry the current resourceVersion and a watch from that version skips objects not
  changed since (plain kmock replays every object on watch start: kopf then handles stale copies);
- JSON patches (`application/json-patch+json`, which kopf uses for finalizers with a `test` of
  resourceVersion) are applied with `jsonpatch`; a failed `test` answers 422 like a real API server.
Not emulated: schema validation, owner-reference garbage collection, selectors, scheduling.
"""

from __future__ import annotations

import copy
import itertools
import uuid
from datetime import UTC, datetime
from typing import Any

import jsonpatch
import kmock
from kmock._internal import enums

_versions = itertools.count(1000)
_last_version = [999]


def _next_version() -> str:
    _last_version[0] = next(_versions)
    return str(_last_version[0])


def _merge_diff(old: Any, new: Any) -> Any:
    """An RFC 7386 merge patch turning `old` into `new` (None deletes a key; lists are replaced)."""
    if not isinstance(old, dict) or not isinstance(new, dict):
        return copy.deepcopy(new)
    out: dict[str, Any] = {}
    for key in old.keys() - new.keys():
        out[key] = None
    for key, value in new.items():
        if key not in old:
            out[key] = copy.deepcopy(value)
        elif old[key] != value:
            out[key] = _merge_diff(old[key], value)
    return out


def _merged(base: Any, patch: Any) -> Any:
    if not isinstance(base, dict) or not isinstance(patch, dict):
        return patch
    out = dict(base)
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = _merged(base.get(key), value)
    return out


class ApiServerEmulator(kmock.KubernetesEmulator):
    async def _handle(self, request: kmock.Request):  # type: ignore[override]
        if request.resource is not None and request.action == enums.action.CREATE and isinstance(request.data, dict):
            meta = request.data.setdefault("metadata", {})
            if not meta.get("name") and meta.get("generateName"):  # kopf names its Events this way
                meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
            meta.setdefault("uid", str(uuid.uuid4()))
            meta.setdefault("creationTimestamp", datetime.now(tz=UTC).strftime("%Y-%m-%dT%H:%M:%SZ"))
            meta["resourceVersion"] = _next_version()
            meta["generation"] = 1
        elif request.resource is not None and request.action == enums.action.UPDATE and request.name is not None:
            key = (request.resource, request.namespace, request.name)
            stored = self._objects[key] if key in self._objects else None
            current = stored.raw if stored is not None and not stored.deleted else None
            if current is not None:
                data = request.data
                if isinstance(data, list):  # JSON patch
                    try:
                        new = jsonpatch.apply_patch(current, data)
                    except (jsonpatch.JsonPatchException, jsonpatch.JsonPointerException) as exc:
                        raise kmock.KubernetesError(status=422, reason="Invalid", message=f"patch failed: {exc}") from None
                    data = _merge_diff(current, new)
                data = dict(data or {})
                meta = dict(data.get("metadata") or {})
                meta["resourceVersion"] = _next_version()
                spec_changed = (request.subresource is None and "spec" in data
                                and _merged(current.get("spec"), data["spec"]) != current.get("spec"))
                if spec_changed:
                    meta["generation"] = int(current.get("metadata", {}).get("generation", 1)) + 1
                data["metadata"] = meta
                # Request is a frozen attrs class; a copy (attrs.evolve) loses kmock's routing state.
                object.__setattr__(request, "data", data)
        return await super()._handle(request)


    async def _serve_list(self, request: kmock.Request):
        listing = await super()._serve_list(request)
        listing["metadata"]["resourceVersion"] = str(_last_version[0])
        return listing

    async def _serve_watch(self, request: kmock.Request):
        since = request.params.get("resourceVersion", "")
        since_n = int(since) if since.isdigit() else None
        async for item in super()._serve_watch(request):
            if since_n is not None and isinstance(item, dict) and item.get("type") in ("ADDED", "MODIFIED"):
                version = item.get("object", {}).get("metadata", {}).get("resourceVersion", "")
                if version.isdigit() and int(version) <= since_n:
                    continue
            yield item
