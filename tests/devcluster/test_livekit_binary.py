"""`VIVANT_LIVEKIT_SERVER` hands a machine without Go a livekit-server built elsewhere (bench/run_gpu.sh)."""

from __future__ import annotations

import pytest
from vivant.devcluster.binaries import BinaryError, ensure_livekit_server


def test_a_given_binary_is_used_as_it_is(tmp_path, monkeypatch):
    binary = tmp_path / "livekit-server"
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o755)
    monkeypatch.setenv("VIVANT_LIVEKIT_SERVER", str(binary))
    monkeypatch.setenv("VIVANT_GO", str(tmp_path / "no-go"))  # no toolchain is asked for
    assert ensure_livekit_server(build_missing=False) == binary


@pytest.mark.parametrize("case", ["missing", "not-executable"])
def test_a_given_path_that_is_not_a_binary_is_refused_by_name(tmp_path, monkeypatch, case):
    binary = tmp_path / "livekit-server"
    if case == "not-executable":
        binary.write_text("#!/bin/sh\n")
        binary.chmod(0o644)
    monkeypatch.setenv("VIVANT_LIVEKIT_SERVER", str(binary))
    with pytest.raises(BinaryError, match="VIVANT_LIVEKIT_SERVER = .*expected an executable livekit-server"):
        ensure_livekit_server(build_missing=False)
