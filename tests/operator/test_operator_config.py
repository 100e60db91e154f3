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
])
def test_bad_environment_names_the_variable(env, name):
    with pytest.raises(ValueError, match=name):
        OperatorConfig.from_env(env)


def test_cli_refuses_to_start_without_redis(monkeypatch, capsys):
    for key in GOOD:
        monkeypatch.delenv(key, raising=False)
    assert vivant_main(["operator", "--standalone"]) == 2
    assert "VIVANT_REDIS_URL" in capsys.readouterr().out
