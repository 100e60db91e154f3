"""Worker inbox over a real redis-server: delivery, acknowledgement, recovery, and malformed messages
rejected into the dead-letter list with the field named (nothing lost). Plus the message models."""

from __future__ import annotations

import json
import logging

import pytest
from pydantic import ValidationError
from vivant.sessions.models import Assignment, EndRequest, SessionStats, WorkerInfo, describe_validation_error
from vivant.sessions.registry import Registry

POOL = "gpu-c"


def assignment(**over) -> Assignment:
    body = dict(session_id="ns/s1", namespace="ns", pool=POOL, character="ada", room="room-1",
                livekit_url="wss://lk.example", agent_identity="agent-1", token="TOPSECRET-TOKEN", max_duration_s=60)
    body.update(over)
    return Assignment(**body)


@pytest.fixture
def registry(redis_url: str) -> Registry:
    reg = Registry(redis_url, heartbeat_ttl_s=30)
    reg.register(WorkerInfo(worker_id="w0", pool=POOL, warm=True))
    yield reg
    reg.close()


class TestDelivery:
    def test_assignment_round_trips_with_its_token_and_stays_in_processing_until_acked(self, registry: Registry):
        registry.send_assignment("w0", assignment())
        got = registry.next_message("w0", 1)
        assert isinstance(got, Assignment) and got.token.get_secret_value() == "TOPSECRET-TOKEN"
        assert registry.redis.llen(registry.processing_key("w0")) == 1, "popped message not kept until ack"
        assert registry.ack("w0", got) is True
        assert registry.redis.llen(registry.processing_key("w0")) == 0

    def test_unacked_messages_are_requeued_in_order(self, registry: Registry):
        registry.send_assignment("w0", assignment())
        registry.send_end("w0", "ns/s1", "deleted")
        registry.next_message("w0", 1)
        registry.next_message("w0", 1)
        assert registry.next_message("w0", 0) is None
        assert registry.recover_unacked("w0") == 2
        first, second = registry.next_message("w0", 1), registry.next_message("w0", 1)
        assert (first.kind, second.kind) == ("assign", "end"), "requeue changed the order"
        assert second.reason == "deleted"

    def test_timeout_returns_none(self, registry: Registry):
        assert registry.next_message("w0", 0.05) is None
        assert registry.next_message("w0", 0) is None

    def test_pending_lists_waiting_messages(self, registry: Registry):
        registry.send_assignment("w0", assignment())
        assert [m.session_id for m in registry.pending("w0")] == ["ns/s1"]


BAD_MESSAGES = [
    (b"{not json", "Invalid JSON"),
    (json.dumps({"kind": "assign", "session_id": "s"}), "namespace: Field required"),
    (json.dumps({"kind": "launch", "session_id": "s"}), "does not match any of the expected tags"),
    (json.dumps({"session_id": "s", "reason": "x"}), "Unable to extract tag using discriminator"),
    (json.dumps({"kind": "end", "session_id": "s", "reason": "x", "surprise": 1}), "surprise: Extra inputs"),
    (assignment(max_duration_s=5).to_wire().replace('"max_duration_s":5.0', '"max_duration_s":-1'),
     "max_duration_s: Input should be greater than 0"),
    (assignment().to_wire().replace('"flag_overrides":{}', '"flag_overrides":{"warpDrive":true}'),
     "flag_overrides: Value error, unknown flag(s) 'warpDrive'"),
    (json.dumps({"kind": "end", "session_id": "bad id with spaces"}), "session_id: String should match pattern"),
    (b"\xff\xfe", "Invalid JSON"),
]


class TestMalformed:
    def test_each_bad_message_is_dead_lettered_naming_the_field_and_the_good_one_still_arrives(
            self, registry: Registry, caplog: pytest.LogCaptureFixture):
        for raw, _ in BAD_MESSAGES:
            registry.redis.rpush(registry.inbox_key("w0"), raw)
        registry.send_assignment("w0", assignment())
        with caplog.at_level(logging.ERROR, logger="vivant.sessions.registry"):
            got = registry.next_message("w0", 2)
        assert isinstance(got, Assignment), f"the valid message after {len(BAD_MESSAGES)} bad ones was not delivered"
        dead = list(reversed(registry.dead_letters()))
        assert registry.dead_letters_total() == len(dead), "every rejected message is counted"
        assert len(dead) == len(BAD_MESSAGES), f"expected {len(BAD_MESSAGES)} dead letters, got {len(dead)}"
        for (raw, expected), entry in zip(BAD_MESSAGES, dead, strict=True):
            assert expected in entry["error"], f"error for {raw!r} was {entry['error']!r}, expected {expected!r}"
            assert entry["worker_id"] == "w0"
        logged = "\n".join(r.getMessage() for r in caplog.records)
        assert "namespace: Field required" in logged and "max_duration_s" in logged, logged
        assert registry.redis.llen(registry.processing_key("w0")) == 1, "dead letters left in processing"

    def test_dead_letter_keeps_the_message_but_not_the_token(self, registry: Registry):
        raw = assignment().to_wire().replace('"room":"room-1",', "")
        registry.redis.rpush(registry.inbox_key("w0"), raw)
        assert registry.next_message("w0", 0) is None
        [entry] = registry.dead_letters()
        assert "room: Field required" in entry["error"]
        assert "TOPSECRET" not in json.dumps(entry), "the token leaked into the dead-letter list"
        assert json.loads(entry["raw"])["character"] == "ada", "the rejected message was not kept"


class TestModels:
    def test_token_is_hidden_everywhere_but_the_wire(self):
        a = assignment()
        assert "TOPSECRET" not in repr(a) and "TOPSECRET" not in str(a)
        assert "TOPSECRET" not in a.model_dump_json()
        assert "TOPSECRET" in a.to_wire()

    @pytest.mark.parametrize("field, value, expected", [
        ("session_id", "", "session_id: String should have at least 1 character"),
        ("max_duration_s", 0, "max_duration_s: Input should be greater than 0"),
        ("character", "", "character: String should have at least 1 character"),
        ("flag_overrides", {"fusedGemmAllReduce": "perhaps"}, "flag_overrides: Value error, flag 'fusedGemmAllReduce'"),
        ("pool", "no spaces allowed", "pool: String should match pattern"),
    ])
    def test_bad_assignment_fields_are_named(self, field, value, expected):
        with pytest.raises(ValidationError) as exc:
            assignment(**{field: value})
        assert expected in describe_validation_error(exc.value), describe_validation_error(exc.value)

    def test_stats_and_end_request_validate(self):
        with pytest.raises(ValidationError, match="phase"):
            SessionStats(session_id="s", phase="Dancing")
        with pytest.raises(ValidationError, match="fps"):
            SessionStats(session_id="s", phase="Streaming", fps=-1)
        assert EndRequest(session_id="s").reason == "ended"

    def test_reports_from_a_newer_worker_are_still_read(self):
        newer = {"session_id": "s", "phase": "Streaming", "fps": 24.0, "gpu_temp_c": 61,
                 "flags": {"fusedGemmAllReduce": True, "someFutureFlag": 3}}
        stats = SessionStats.model_validate(newer)
        assert (stats.fps, stats.flags.fusedGemmAllReduce) == (24.0, True)

    def test_flag_overrides_are_coerced(self):
        assert assignment(flag_overrides={"fusedGemmAllReduce": "true"}).flag_overrides == {"fusedGemmAllReduce": True}

    def test_session_stats_round_trip_through_redis(self, registry: Registry):
        stats = SessionStats(session_id="ns/s1", worker_id="w0", phase="Streaming", fps=23.9, stalls=1,
                             chunk_p99_ms=150.5, chunks=10, streamed_s=1.67, flag_version=3)
        registry.report_session("ns/s1", stats)
        assert registry.session_stats("ns/s1") == stats
        assert registry.session_stats("ns/none") is None
