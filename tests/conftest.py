"""Shared fixtures.

`redis_server` starts a real redis-server (Debian package, installed by `make sysdeps`) on a free
loopback port for the whole test session and stops it afterwards; `redis_url` hands each test a
freshly flushed database on it; `spare_redis` is a server of one test's own, which it may stop and
start (a Redis outage). Nothing here mocks Redis.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from servers import RedisServer


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    server = RedisServer()
    yield server
    server.stop()


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    import redis

    client = redis.Redis.from_url(redis_server.url)
    client.flushall()
    client.close()
    return redis_server.url


@pytest.fixture
def spare_redis() -> Iterator[RedisServer]:
    """A redis-server of the test's own (not the session's), for tests that stop and start it (an outage)."""
    server = RedisServer()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def livekit_server(tmp_path_factory: pytest.TempPathFactory):
    """A real livekit-server (built from tools/livekit/go.mod, cached) on loopback for the whole test
    session, stopped afterwards (devcluster/livekit.py)."""
    import sys

    from vivant.devcluster.livekit import LocalLiveKit

    server = LocalLiveKit(tmp_path_factory.mktemp("livekit"), log=lambda m: print(m, file=sys.stderr, flush=True))
    state = server.up()
    try:
        yield state
    finally:
        server.down()
