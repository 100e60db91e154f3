"""`livekit_server`: a real livekit-server (built from tools/livekit/go.mod, cached) on loopback for the
whole test session, stopped afterwards (devcluster/livekit.py)."""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest
from vivant.devcluster.livekit import LiveKitState, LocalLiveKit


@pytest.fixture(scope="session")
def livekit_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveKitState]:
    server = LocalLiveKit(tmp_path_factory.mktemp("livekit"), log=lambda m: print(m, file=sys.stderr, flush=True))
    state = server.up()
    try:
        yield state
    finally:
        server.down()
