"""The worker service ends a session when its runner (or the operator) says so, reports why, and releases itself.

Runs for real: redis-server (conftest), `WorkerService` in a thread, the operator-side `Registry`,
`LiveKitSessionRunner` (its event-loop thread, `VivantVideoGenerator`, `EndWatch`), livekit-agents'
`AvatarRunner` with its real `rtc.AVSynchronizer` / `rtc.VideoSource` / `rtc.AudioSource` (the frames go
into the native SDK and come back out of an `rtc.VideoStream` on a local video track), `rtc.Room` event
dispatch with real `rtc.DataPacket` / `rtc.RemoteParticipant` objects, the tiny model in the pipeline
runner and the `--runner livekit` loader.

Replaced, because no LiveKit server can run here (no livekit-server binary in any reachable registry):
`LiveKitSessionRunner._connect` (the room stays unconnected; the test records that it was asked to join
the assignment's URL with its token as the agent's avatar), `_audio_receiver` (`DataStreamAudioReceiver`
waits for the agent participant of a connected room; the framework's in-process `QueueAudioOutput`
stands in) and `AvatarRunner._publish_track` (publishing needs a connected room; here the tracks are
created locally on the runner's own sources). The room events a server would deliver (a data message,
a participant leaving) are emitted on the real `rtc.Room` on the runner's loop, as the SDK does. The one
test that joins for real (`--runner livekit` against a closed port) shows the join failing cleanly.

The agent's speech into the avatar and `clear_buffer` are covered in tests/livekit/test_livekit_avatar.py.
Budget: under 60 s for this file on 2 cores.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
from conftest import free_port
from livekit import rtc
from livekit.agents.voice.avatar import AvatarRunner, QueueAudioOutput
from livekit.rtc._proto import handle_pb2
from livekit.rtc._proto import participant_pb2 as proto_participant
from vivant.apis.feature_flags import FlagValues
from vivant.sessions.flags import FlagStore
from vivant.sessions.models import Assignment, SessionStats, WorkerInfo
from vivant.sessions.registry import Registry
from vivant.worker.model.config import ModelConfig
from vivant.worker.serving.cli import add_arguments
from vivant.worker.serving.cli import run as run_worker_cli
from vivant.worker.serving.livekit_avatar import (
    AvatarJoin,
    EndReason,
    LiveKitSessionRunner,
    VivantVideoGenerator,
)
from vivant.worker.serving.runner import MAX_DURATION_REASON, ChunkReport, SessionEnded
from vivant.worker.serving.runners import build_runner
from vivant.worker.serving.service import WorkerService
from vivant.worker.stream.pipeline import StreamPipeline

CFG = ModelConfig.from_name("tiny")  # 192x128, 24 fps, 4 frames per chunk, 16 kHz
POOL, WID, AGENT = "gpu-lk", "worker-lk-0", "agent-1"
pytestmark = pytest.mark.timeout(60)


# ------------------------------------------------------------------------------------------ the runner


class FlatRenderer:
    """Paints each chunk one grey level (the pixels are not what these tests are about)."""

    def __init__(self) -> None:
        self.chunks = 0

    def render(self, samples: np.ndarray, sample_rate: int) -> np.ndarray:
        self.chunks += 1
        return np.full((CFG.frames_per_chunk, CFG.height, CFG.width, 3), 40 + self.chunks % 200, np.uint8)


class LocalTracksAvatarRunner(AvatarRunner):
    """The framework's AvatarRunner; only the track publication is local (publishing needs a connected
    room). A `rtc.VideoStream` on the local video track reads back what reached the native SDK."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.video_out: list[tuple[int, int]] = []
        self._stream: rtc.VideoStream | None = None
        self._reader: asyncio.Task[None] | None = None

    async def _publish_track(self) -> None:
        if self._stream is None:
            self._stream = rtc.VideoStream(rtc.LocalVideoTrack.create_video_track("avatar_video", self._video_source))
            rtc.LocalAudioTrack.create_audio_track("avatar_audio", self._audio_source)
            self._reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        assert self._stream is not None
        async for event in self._stream:
            self.video_out.append((event.frame.width, event.frame.height))

    async def aclose(self) -> None:
        await super().aclose()
        if self._reader is not None:
            self._reader.cancel()
            await self._stream.aclose()  # type: ignore[union-attr]


class OfflineLiveKitRunner(LiveKitSessionRunner):
    """The real `LiveKitSessionRunner` with the server-facing parts replaced (see module doc)."""

    def __init__(self) -> None:
        super().__init__(FlatRenderer(), CFG, connect_timeout_s=5, stall_timeout_s=10)
        self.joins: list[AvatarJoin] = []
        self.rooms: list[rtc.Room] = []
        self.avatars: list[LocalTracksAvatarRunner] = []
        self.watches: list[Any] = []

    async def _connect(self, room: rtc.Room, join: AvatarJoin) -> None:
        self.joins.append(join)
        self.rooms.append(room)

    def _audio_receiver(self, room: rtc.Room, join: AvatarJoin) -> Any:
        return QueueAudioOutput(sample_rate=CFG.audio_sample_rate)

    def _avatar_runner(self, room: rtc.Room, receiver: Any, gen: VivantVideoGenerator) -> AvatarRunner:
        runner = LocalTracksAvatarRunner(room, audio_recv=receiver, video_gen=gen, options=self.avatar_options())
        self.avatars.append(runner)
        return runner

    def begin(self, assignment: Any, flags: Any) -> None:
        super().begin(assignment, flags)
        self.watches.append(self._session["end"])

    def emit(self, event: str, *args: Any) -> None:
        """A room event as the SDK delivers it: on the room's event loop."""
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self.rooms[-1].emit, event, *args)


def remote_participant(identity: str) -> rtc.RemoteParticipant:
    """A real `rtc.RemoteParticipant` (built from the FFI's protobuf, as the SDK does on a join)."""
    return rtc.RemoteParticipant(proto_participant.OwnedParticipant(
        handle=handle_pb2.FfiOwnedHandle(id=0),
        info=proto_participant.ParticipantInfo(identity=identity, sid=f"PA_{identity}",
                                               kind=proto_participant.PARTICIPANT_KIND_AGENT)))


def data_packet(payload: dict[str, Any]) -> rtc.DataPacket:
    return rtc.DataPacket(data=json.dumps(payload).encode(), kind=1, participant=None)


# ------------------------------------------------------------------------------------------ harness


def wait_for(what: str, cond: Callable[[], Any], timeout: float = 15.0) -> Any:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = cond()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def assignment(session_id: str = "ns/s1", **over: Any) -> Assignment:
    body: dict[str, Any] = dict(session_id=session_id, namespace="ns", pool=POOL, character="ada", room="room-1",
                                livekit_url="wss://lk.example", agent_identity=AGENT, token="secret-tok",
                                max_duration_s=60)
    body.update(over)
    return Assignment(**body)


class Worker:
    """A WorkerService in a thread plus an operator-side registry client to drive it."""

    def __init__(self, url: str, runner: Any) -> None:
        self.registry = Registry(url, heartbeat_ttl_s=3.0)
        self.runner = runner
        self.service = WorkerService(Registry(url, heartbeat_ttl_s=3.0), FlagStore(url),
                                     WorkerInfo(worker_id=WID, pool=POOL), runner, poll_s=0.1, stats_interval_s=0.05)
        self.thread = threading.Thread(target=self.service.run, daemon=True)
        self.thread.start()
        wait_for("worker idle", lambda: self.registry.idle_workers(POOL) == [WID])

    def assign(self, a: Assignment) -> None:
        assert self.registry.claim_idle_worker(POOL, a.session_id) == WID, "worker was not idle"
        self.registry.send_assignment(WID, a)

    def streaming(self, session_id: str, chunks: int = 3) -> SessionStats:
        return wait_for(f"{session_id} streaming {chunks} chunks",
                        lambda: (s := self.registry.session_stats(session_id)) and s.phase == "Streaming"
                        and s.chunks >= chunks and s)

    def ended(self, session_id: str) -> SessionStats:
        return wait_for(f"{session_id} to end", lambda: (s := self.registry.session_stats(session_id))
                        and s.phase in ("Ended", "Failed") and s)

    def assert_released(self, session_id: str) -> None:
        wait_for("worker idle again", lambda: self.registry.idle_workers(POOL) == [WID])
        assert self.registry.worker_of(session_id) is None, "the session's lease is still held"
        assert self.registry.session_of(POOL, WID) is None, "the worker still holds a session"
        assert self.registry.redis.llen(self.registry.processing_key(WID)) == 0, "inbox message left unacked"

    def stop(self) -> None:
        self.service.stop.set()
        self.thread.join(timeout=15)
        assert not self.thread.is_alive(), "worker did not stop"


@pytest.fixture
def worker(redis_url: str) -> Iterator[Callable[[Any], Worker]]:
    made: list[Worker] = []

    def start(runner: Any) -> Worker:
        made.append(Worker(redis_url, runner))
        return made[-1]

    yield start
    for w in made:
        if w.thread.is_alive():
            w.stop()


def assert_ended(stats: SessionStats, reason: str) -> None:
    assert (stats.phase, stats.end_reason) == ("Ended", reason), \
        f"expected phase Ended with end_reason {reason!r}, got {stats.phase} / {stats.end_reason!r}"


# ------------------------------------------------------------------------------------------ LiveKit runner


class TestLiveKitRunnerEndReasons:
    def test_end_call_data_message_ends_the_session(self, worker):
        runner = OfflineLiveKitRunner()
        w = worker(runner)
        w.assign(assignment())
        w.streaming("ns/s1")
        join = runner.joins[0]
        assert (join.url, join.token, join.agent_identity) == ("wss://lk.example", "secret-tok", AGENT), join
        runner.emit("data_received", data_packet({"type": "HELLO"}))  # other traffic on the data channel
        runner.emit("data_received", rtc.DataPacket(data=b"\xff not json", kind=1, participant=None))
        before = w.streaming("ns/s1").chunks
        w.streaming("ns/s1", before + 2)  # still streaming two chunks later
        runner.emit("data_received", data_packet({"type": "END_CALL"}))
        final = w.ended("ns/s1")
        assert_ended(final, EndReason.END_CALL.value)
        w.assert_released("ns/s1")
        assert final.chunks >= before + 2 and final.fps > 0, final
        avatar = runner.avatars[0]
        assert avatar.video_out and set(avatar.video_out) == {(CFG.width, CFG.height)}, \
            f"expected {CFG.width}x{CFG.height} frames out of the SDK's video track, got {set(avatar.video_out)}"
        assert not runner._session, "runner.end did not leave the session"

    def test_agent_leaving_the_room_ends_the_session(self, worker):
        runner = OfflineLiveKitRunner()
        w = worker(runner)
        w.assign(assignment())
        before = w.streaming("ns/s1").chunks
        runner.emit("participant_disconnected", remote_participant("someone-else"))
        w.streaming("ns/s1", before + 2)
        assert runner.end_reason is None, "another participant leaving must not end the session"
        runner.emit("participant_disconnected", remote_participant(AGENT))
        assert_ended(w.ended("ns/s1"), EndReason.AGENT_LEFT.value)
        w.assert_released("ns/s1")

    def test_max_duration_ends_the_session(self, worker):
        runner = OfflineLiveKitRunner()
        w = worker(runner)
        t0 = time.monotonic()
        w.assign(assignment(max_duration_s=0.6))
        final = w.ended("ns/s1")
        assert_ended(final, MAX_DURATION_REASON)
        assert time.monotonic() - t0 >= 0.6 and final.chunks >= 3, final
        w.assert_released("ns/s1")
        assert runner.watches[0].reason is None, "no room-side reason: the service's clock ended it"

    def test_operator_end_request_ends_the_session_as_deleted(self, worker):
        """What the operator sends when the CharacterSession is deleted (reconcile.release_session)."""
        runner = OfflineLiveKitRunner()
        w = worker(runner)
        w.assign(assignment())
        w.streaming("ns/s1")
        w.registry.send_end(WID, "ns/s1", EndReason.DELETED.value)
        assert_ended(w.ended("ns/s1"), EndReason.DELETED.value)
        w.assert_released("ns/s1")
        assert runner.watches[0].reason == EndReason.DELETED, "the runner's EndWatch should record the deletion"

    def test_video_never_consumed_fails_the_session_and_releases_the_worker(self, worker):
        """Joined but the tracks never publish (here: the framework's own AvatarRunner on a room that never
        connects, so its lazy publication waits forever): the step gives up after `stall_timeout_s`."""

        class NeverPublishes(OfflineLiveKitRunner):
            def _avatar_runner(self, room: rtc.Room, receiver: Any, gen: VivantVideoGenerator) -> AvatarRunner:
                return LiveKitSessionRunner._avatar_runner(self, room, receiver, gen)

        runner = NeverPublishes()
        runner.stall_timeout_s = 1.0
        w = worker(runner)
        w.assign(assignment())
        final = w.ended("ns/s1")
        assert final.phase == "Failed" and "published video stalled" in (final.end_reason or ""), final
        w.assert_released("ns/s1")
        assert not runner._session, "runner.end did not leave the session"

    def test_released_worker_serves_the_next_session(self, worker):
        runner = OfflineLiveKitRunner()
        w = worker(runner)
        w.assign(assignment("ns/a"))
        w.streaming("ns/a")
        runner.emit("participant_disconnected", remote_participant(AGENT))
        assert_ended(w.ended("ns/a"), EndReason.AGENT_LEFT.value)
        w.assert_released("ns/a")
        w.assign(assignment("ns/b", room="room-2"))
        w.streaming("ns/b")
        assert len(runner.rooms) == 2 and runner.rooms[0] is not runner.rooms[1], "each session joins its own room"
        runner.emit("data_received", data_packet({"type": "END_CALL"}))
        assert_ended(w.ended("ns/b"), EndReason.END_CALL.value)
        w.assert_released("ns/b")
        assert [s.end_reason for s in w.service.sessions_done] == [EndReason.AGENT_LEFT.value,
                                                                    EndReason.END_CALL.value]


# ------------------------------------------------------------------------------------------ the protocol


class EndsItselfRunner:
    """Ends its session from inside `step` (chunk `at`), as a runner does when the room ends mid-wait."""

    frames_per_chunk, chunk_seconds = 4, 4 / 24

    def __init__(self, at: int = 3) -> None:
        self.at, self.n, self.ended = at, 0, []

    def begin(self, assignment: Assignment, flags: FlagValues) -> None:
        self.n = 0

    def apply_flags(self, flags: FlagValues) -> None:
        pass

    def step(self) -> ChunkReport:
        if self.n == self.at:
            raise SessionEnded("EndCall")
        self.n += 1
        time.sleep(0.01)
        return ChunkReport(index=self.n - 1, compute_ms=10.0, frames=4)

    def end(self, reason: str) -> None:
        self.ended.append(reason)


def test_step_raising_session_ended_ends_the_session(worker):
    runner = EndsItselfRunner(at=3)
    w = worker(runner)
    w.assign(assignment())
    final = w.ended("ns/s1")
    assert_ended(final, "EndCall")
    assert final.chunks == 3, f"the 3 chunks made before the end should be counted, got {final.chunks}"
    w.assert_released("ns/s1")
    assert runner.ended == ["EndCall"]


def test_session_ended_needs_a_reason():
    with pytest.raises(ValueError, match="reason must be a non-empty string"):
        SessionEnded("")


# ------------------------------------------------------------------------------------------ pipeline runner


def test_pipeline_stops_early_and_reports_the_chunks_made():
    from vivant.worker.model.generator import ChunkGenerator
    from vivant.worker.stream.sinks import NullSink
    from vivant.worker.stream.vae import VAEConfig, build_vae_decoder

    stop = threading.Event()
    sink = NullSink()
    pipe = StreamPipeline(ChunkGenerator(CFG), build_vae_decoder(VAEConfig.for_model(CFG)), [sink])
    report = pipe.run(1000, lambda n, _p: stop.set() if n == 3 else None, stop=stop)
    assert report.chunks == 3, f"stop set before chunk 3: expected 3 chunks made, got {report.chunks}"
    assert report.generated_frames_published == 12 and sink.closed, report.format_text()


def test_pipeline_stopped_before_its_first_chunk_reports_none():
    from vivant.worker.model.generator import ChunkGenerator
    from vivant.worker.stream.sinks import NullSink
    from vivant.worker.stream.vae import VAEConfig, build_vae_decoder

    stop = threading.Event()
    stop.set()
    sink = NullSink()
    report = StreamPipeline(ChunkGenerator(CFG), build_vae_decoder(VAEConfig.for_model(CFG)), [sink]).run(10, stop=stop)
    assert (report.chunks, report.frames_published, sink.frames) == (0, 0, 0), report.format_text()
    assert sink.closed, "the sinks must be closed even when no chunk was made"


def test_pipeline_runner_serves_a_session_until_the_end_request(worker):
    args = argparse.Namespace(runner="pipeline", preset="tiny", mode="optimized", device="cpu", out=None,
                              vae_weights=None)
    runner = build_runner(args, None)
    w = worker(runner)
    w.assign(assignment())
    w.streaming("ns/s1", chunks=4)
    w.registry.send_end(WID, "ns/s1", EndReason.DELETED.value)
    final = w.ended("ns/s1")
    assert_ended(final, EndReason.DELETED.value)
    w.assert_released("ns/s1")
    report = runner.report
    assert report is not None and report.chunks == final.chunks, \
        f"pipeline made {report and report.chunks} chunks, the service counted {final.chunks}"
    assert report.generated_frames_published == 4 * final.chunks, report.format_text()


# ------------------------------------------------------------------------------------------ CLI


def cli_args(**over: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    ns = parser.parse_args(["--pool", POOL])
    for k, v in over.items():
        setattr(ns, k, v)
    return ns


def test_cli_rejects_an_unknown_runner_from_the_environment(monkeypatch, capsys):
    monkeypatch.setenv("VIVANT_RUNNER", "webrtc")
    assert run_worker_cli(cli_args()) == 2
    out = capsys.readouterr().out
    assert "runner: expected one of generator, pipeline, livekit" in out and "'webrtc'" in out, out


def test_cli_rejects_a_relative_vae_weights_path(capsys):
    assert run_worker_cli(cli_args(runner="pipeline", vae_weights="vae.safetensors")) == 2
    assert "vae-weights: expected an absolute path" in capsys.readouterr().out


def test_livekit_runner_without_a_server_fails_the_session_and_releases_the_worker(worker, monkeypatch):
    """`--runner livekit` joins for real: with no LiveKit server listening the join is refused, the
    session is reported Failed with the connect error (never the token) and the worker is idle again."""
    monkeypatch.setenv("VIVANT_RUNNER", "livekit")
    runner = build_runner(cli_args(), None)
    assert isinstance(runner, LiveKitSessionRunner)
    runner.connect_timeout_s = 5
    w = worker(runner)
    w.assign(assignment(livekit_url=f"ws://127.0.0.1:{free_port()}"))
    final = w.ended("ns/s1")
    assert final.phase == "Failed" and final.end_reason and "worker error" in final.end_reason, final
    assert "secret-tok" not in final.model_dump_json(), "the token leaked into the session's stats"
    w.assert_released("ns/s1")


def test_vivant_worker_runner_pipeline_end_to_end(redis_url: str, tmp_path):
    """The real `vivant worker --runner pipeline` process (tiny model, MP4 sink): streams a session until
    the operator's EndRequest, reports the reason, releases itself, writes the session's video."""
    import os
    import signal
    import subprocess
    import sys

    import av

    env = {**os.environ, "VIVANT_WORKER_ID": "worker-pipe-0"}
    proc = subprocess.Popen([sys.executable, "-m", "vivant", "worker", "--runner", "pipeline", "--pool", POOL,
                             "--redis", redis_url, "--preset", "tiny", "--out", str(tmp_path), "--heartbeat-ttl", "3"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    reg = Registry(redis_url, heartbeat_ttl_s=3)
    try:
        wait_for("worker warm and idle", lambda: reg.idle_workers(POOL) == ["worker-pipe-0"], timeout=40)
        assert reg.claim_idle_worker(POOL, "ns/cli") == "worker-pipe-0"
        reg.send_assignment("worker-pipe-0", assignment("ns/cli", token="LK-SECRET-TOKEN-9c1e"))
        wait_for("4 chunks", lambda: (s := reg.session_stats("ns/cli")) and s.chunks >= 4, timeout=30)
        reg.send_end("worker-pipe-0", "ns/cli", EndReason.DELETED.value)
        final = wait_for("ended", lambda: (s := reg.session_stats("ns/cli")) and s.phase == "Ended" and s)
        assert final.end_reason == EndReason.DELETED.value, final
        wait_for("released", lambda: reg.idle_workers(POOL) == ["worker-pipe-0"])
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out
    assert "runner pipeline" in out and "LK-SECRET-TOKEN-9c1e" not in out, out
    with av.open(str(tmp_path / "ns_cli.mp4")) as f:
        frames = sum(1 for _ in f.decode(video=0))
    assert frames == 4 * final.chunks, f"expected {4 * final.chunks} frames in the session's MP4, got {frames}"
