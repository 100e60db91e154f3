"""The cache kernels compile for sm_90 (H100/H200) on a machine without a GPU, and use the intended PTX.

The interpreted tests check the kernels' numbers; this checks that the same source also lowers to
real GPU code (the interpreter accepts things the compiler rejects), that the bf16 ring's writes
convert with round-to-nearest (``cvt.rn.bf16*``, torch's rounding), and that the kernels launched
with programmatic dependent launch wait before their first global access.
Runs ``sm90_compile.py`` in a subprocess without TRITON_INTERPRET and with a fresh Triton cache.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

SCRIPT = Path(__file__).with_name("sm90_compile.py")


@pytest.fixture(scope="module")
def ptx_report(tmp_path_factory) -> dict[str, dict[str, int]]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path_factory.mktemp("triton_cache"))
    proc = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, f"sm_90 compile failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}"
    return json.loads(proc.stdout)


def test_every_variant_compiles(ptx_report):
    assert sorted(ptx_report) == sorted(
        [
            "qkv_ring bf16",
            "delta_rotate bf16",
            "delta_rotate fp32",
            "pdl residual_ln_mod_quant",
            "pdl combine_quant",
            "pdl qkv_ring",
        ]
    ), f"variants compiled: {sorted(ptx_report)}"


@pytest.mark.parametrize("variant", ["qkv_ring bf16", "delta_rotate bf16"])
def test_bf16_ring_writes_convert_with_round_to_nearest(ptx_report, variant):
    ops = ptx_report[variant]
    assert any(k.startswith("cvt.rn.bf16") for k in ops), f"{variant}: no cvt.rn.bf16.* in the PTX; instructions: {ops}"


@pytest.mark.parametrize("variant", ["pdl residual_ln_mod_quant", "pdl combine_quant", "pdl qkv_ring"])
def test_pdl_kernels_wait_before_their_first_global_access(ptx_report, variant):
    """With programmatic dependent launch the programs may start while the previous kernel still writes their
    inputs (or reads what they overwrite): `griddepcontrol.wait` must come before every global load and store."""
    r = ptx_report[variant]
    wait, ld, st = (r[f"line_of_first_{op}"] for op in ("griddepcontrol.wait", "ld.global", "st.global"))
    assert wait >= 0, f"{variant}: no griddepcontrol.wait in the PTX ({r})"
    assert 0 <= wait < ld and wait < st, f"{variant}: the wait (PTX line {wait}) is not before the first ld.global " \
                                         f"(line {ld}) and st.global (line {st})"
