"""Operator settings: read from the environment the chart sets; bad values name the variable."""

from __future__ import annotations

import pytest
from vivant.cli import main as vivant_main
from vivant.operator.config import OperatorConfig

GOOD = {"VIVANT_REDIS_URL": "redis://redis:6379/0", "LIVEKIT_API_KEY": "APIkey", "LIVEKIT_API_SECRET": "s" * 32}


def test_defaults_and_overrides():
    cfg = OperatorConfig.from_env({**GOOD, "VIVANT_CONNECT_TIMEOUT_S": "15", "VIVANT_OPERATOR_METRICS_PORT": "9090"})
    assert cfg.redis_url == GOOD["VIVANT_REDIS_URL"]
    assert cfg.timeouts.connect_s == 15.0 and cfg.timeouts.pending_s == 300.0
    assert cfg.metrics_port == 9090
    assert "s" * 32 not in repr(cfg), "the LiveKit secret must not appear in the config's repr"


@pytest.mark.parametrize("env,name", [
    ({k: v for k, v in GOOD.items() if k != "VIVANT_REDIS_URL"}, "VIVANT_REDIS_URL"),
    ({**GOOD, "LIVEKIT_API_SECRET": ""}, "LIVEKIT_API_SECRET"),
    ({**GOOD, "VIVANT_CONNECT_TIMEOUT_S": "soon"}, "VIVANT_CONNECT_TIMEOUT_S"),
    ({**GOOD, "VIVANT_PENDING_TIMEOUT_S": "-5"}, "VIVANT_PENDING_TIMEOUT_S"),
    ({**GOOD, "VIVANT_OPERATOR_METRICS_PORT": "http"}, "VIVANT_OPERATOR_METRICS_PORT"),
    ({**GOOD, "VIVANT_OPERATOR_PRIORITY": "high"}, "VIVANT_OPERATOR_PRIORITY"),
    ({**GOOD, "VIVANT_PEERING_LIFETIME_S": "1"}, "VIVANT_PEERING_LIFETIME_S"),
    ({**GOOD, "VIVANT_OPERATOR_METRICS_ADDRESS": "localhost"}, "VIVANT_OPERATOR_METRICS_ADDRESS"),
])
def test_bad_environment_names_the_variable(env, name):
    with pytest.raises(ValueError, match=name):
        OperatorConfig.from_env(env)


def test_replicas_get_distinct_peering_priorities_from_their_pod_names():
    a = OperatorConfig.from_env({**GOOD, "HOSTNAME": "vivant-operator-7d9c-abcde"})
    b = OperatorConfig.from_env({**GOOD, "HOSTNAME": "vivant-operator-7d9c-fghij"})
    assert a.peering_priority != b.peering_priority, "equal priorities would pause both replicas"
    assert a.peering_priority == OperatorConfig.from_env({**GOOD, "HOSTNAME": "vivant-operator-7d9c-abcde"}).peering_priority
    assert OperatorConfig.from_env({**GOOD, "VIVANT_OPERATOR_PRIORITY": "7"}).peering_priority == 7
    assert a.peering_lifetime_s == 15


def test_cli_refuses_to_start_without_redis(monkeypatch, capsys):
    for key in GOOD:
        monkeypatch.delenv(key, raising=False)
    assert vivant_main(["operator", "--standalone"]) == 2
    assert "VIVANT_REDIS_URL" in capsys.readouterr().out


def test_metrics_listen_on_loopback_unless_told_otherwise():
    """Item 7 of issue 36: the metrics server listened on 0.0.0.0 with no option. It listens where the
    configuration says, loopback by default (a real HTTP server, asked where it is bound)."""
    from prometheus_client import CollectorRegistry
    from vivant.operator.metrics import serve
    from vivant.ports import free_port

    assert OperatorConfig.from_env(GOOD).metrics_address == "127.0.0.1"
    assert OperatorConfig.from_env({**GOOD, "VIVANT_OPERATOR_METRICS_ADDRESS": "0.0.0.0"}).metrics_address == "0.0.0.0"
    server, thread = serve(free_port(), registry=CollectorRegistry())
    try:
        assert server.server_address[0] == "127.0.0.1", server.server_address
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def test_cli_refuses_a_metrics_address_that_is_not_an_ip(capsys):
    with pytest.raises(SystemExit) as exit_:
        vivant_main(["operator", "--metrics-address", "all-interfaces"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "--metrics-address" in err and "expected an IP address" in err, err
