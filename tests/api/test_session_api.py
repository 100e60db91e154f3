"""Session gateway (`vivant.gateway.server`) parts that need no Kubernetes API: the command line, the
rotating API keys, and an apiserver that cannot be reached at all.

Everything the gateway does against a Kubernetes API is shown on the real apiserver in
tests/cluster/test_api_sessions.py. The unreachable case stays here: it needs no stand-in (a loopback port
where nothing listens is the real thing), and it is not something a running apiserver can show.
"""

from __future__ import annotations

import logging
import uuid
from typing import Any

import kubernetes
import pytest
from aiohttp.test_utils import TestClient, TestServer
from vivant.gateway import server as session_api

pytestmark = pytest.mark.timeout(60)

NS = "team-a"
KEY = "vk_test_0123456789abcdef"
TOKEN = "eyJhbGciOiJIUzI1NiJ9.SECRET-LIVEKIT-TOKEN-" + uuid.uuid4().hex  # unique: searchable everywhere
AUTH = {"Authorization": f"Bearer {KEY}"}


def body() -> dict[str, Any]:
    """The body livekit-plugins-runway posts, with our avatar id."""
    return {
        "model": "gwm1_avatars",
        "avatar": {"type": "custom", "avatarId": "ada"},
        "livekit": {"url": "wss://lk.example.com", "token": TOKEN, "roomName": "room-1", "agentIdentity": "agent-1"},
        "maxDuration": 300,
    }


# ------------------------------------------------------------------------------------------ CLI


def test_cli_refuses_to_start_without_keys_or_with_a_bad_avatars_file(tmp_path: Any, monkeypatch: Any,
                                                                      capsys: Any) -> None:
    import argparse

    monkeypatch.delenv("VIVANT_API_KEYS", raising=False)
    parser = argparse.ArgumentParser()
    session_api.add_arguments(parser)
    good = tmp_path / "avatars.yaml"
    good.write_text("avatars:\n  ada: {character: ada-v1, pool: h200}\n")
    assert session_api.run(parser.parse_args(["--avatars", str(good)])) == 2
    assert "no API keys" in capsys.readouterr().out
    bad = tmp_path / "bad.yaml"
    bad.write_text("avatars:\n  ada: {character: ada-v1, pool: H200!}\n")
    assert session_api.run(parser.parse_args(["--avatars", str(bad)])) == 2
    assert "pool" in capsys.readouterr().out, "the error must name the bad field"


def test_keys_file_is_reread_when_the_secret_changes(tmp_path: Any) -> None:
    import os

    path = tmp_path / "keys"
    path.write_text("# rotated weekly\nkey-one\n")
    keys = session_api.ApiKeys(path=path)
    assert keys.accepts("key-one") and not keys.accepts("key-two") and not keys.accepts("# rotated weekly")
    path.write_text("key-two\n")
    os.utime(path, (1, 1))  # a new mtime, as a Secret update swaps the file
    assert keys.accepts("key-two") and not keys.accepts("key-one")
    assert "key-two" not in repr(keys), "keys must not appear in repr"


def test_keys_file_comments_after_a_key_are_comments(tmp_path: Any) -> None:
    """Item 9 of issue 36: the line `key # comment` made the whole line the key."""
    path = tmp_path / "keys"
    path.write_text("# team keys\nkey-one  # agents of team a\nkey-two\t# team b\nkey#3\n   \n")
    keys = session_api.ApiKeys(path=path)
    assert keys.current() == ("key-one", "key-two", "key#3")
    assert not keys.accepts("key-one  # agents of team a")


def test_a_keys_line_with_two_words_is_refused_naming_the_line(tmp_path: Any, monkeypatch: Any, capsys: Any) -> None:
    import argparse

    with pytest.raises(ValueError, match="line 2: expected one key"):
        session_api.ApiKeys.parse("key-one\nkey two\n")
    path = tmp_path / "keys"
    path.write_text("key-one\nkey two\n")
    assert session_api.ApiKeys(path=path).current() == (), "a malformed keys file must grant nothing"
    monkeypatch.delenv("VIVANT_API_KEYS", raising=False)
    avatars = tmp_path / "avatars.yaml"
    avatars.write_text("avatars:\n  ada: {character: ada-v1, pool: h200}\n")
    parser = argparse.ArgumentParser()
    session_api.add_arguments(parser)
    assert session_api.run(parser.parse_args(["--avatars", str(avatars), "--keys-file", str(path)])) == 2
    out = capsys.readouterr().out
    assert "--keys-file" in out and "line 2" in out, out


# ------------------------------------------------------------------------------------------ outage


async def test_kubernetes_unreachable_is_503_with_retry_after(caplog: pytest.LogCaptureFixture) -> None:
    from vivant.ports import free_port

    cfg = kubernetes.client.Configuration(host=f"http://127.0.0.1:{free_port()}")  # nothing listens there
    cfg.retries = 0
    config = session_api.ApiConfig(namespace=NS, avatars={"ada": session_api.AvatarEntry(character="a", pool="h200")})
    api = session_api.SessionApi(config, session_api.ApiKeys(static=(KEY,)), kubernetes.client.ApiClient(cfg))
    caplog.set_level(logging.DEBUG)
    async with TestClient(TestServer(api.app())) as c:
        resp = await c.post("/v1/realtime_sessions", json=body(), headers=AUTH)
        text = await resp.text()
    assert resp.status == 503 and resp.headers.get("Retry-After") == "5", f"got {resp.status}: {text}"
    assert (await resp.json())["error"]["code"] == "kubernetes_unavailable"
    assert TOKEN not in text and TOKEN not in caplog.text
