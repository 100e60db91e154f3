"""The fleet benchmark's CPU readings: its own process tree by name, and the whole machine."""

from __future__ import annotations

import subprocess
import sys

from vivant.bench.fleet.probes import cpu_by_process, machine_busy_seconds

BUSY_THEN_WAIT = "sum(i * i for i in range(3_000_000)); print('done', flush=True); input()"


def test_cpu_by_process_names_children_as_told_and_counts_their_cpu() -> None:
    child = subprocess.Popen([sys.executable, "-c", BUSY_THEN_WAIT], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "done"
        cpu = cpu_by_process({child.pid: "operator-0"})
        assert cpu["operator-0"] > 0  # the loop it ran
        assert "bench-driver" in cpu  # this process
    finally:
        child.communicate("\n", timeout=30)
    assert "operator-0" not in cpu_by_process({child.pid: "operator-0"})  # ended: no longer counted


def test_machine_busy_seconds_only_grow() -> None:
    a = machine_busy_seconds()
    sum(i * i for i in range(1_000_000))
    assert machine_busy_seconds() >= a > 0
