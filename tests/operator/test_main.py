"""`vivant operator`'s process set-up (operator/main.py): kopf settings by mode, and its log levels."""

from __future__ import annotations

import logging

from vivant.operator.main import RoutineTimerLogs, operator_settings


def test_namespaced_mode_skips_the_cluster_scan_and_cluster_wide_keeps_it():
    """A namespaced operator may not list namespaces; kopf retried that for ~30 s before handling anything."""
    assert operator_settings(["studio-a", "studio-b"]).scanning.disabled is True
    assert operator_settings([]).scanning.disabled is False  # cluster-wide: CRDs may come and go


def _record(message: str, level: int = logging.INFO) -> logging.LogRecord:
    return logging.LogRecord("kopf.objects", level, __file__, 1, message, None, None)


def test_timer_runs_are_debug_and_everything_else_passes():
    routine = RoutineTimerLogs()
    root = logging.getLogger()
    old = root.level
    try:
        root.setLevel(logging.INFO)
        record = _record("Timer 'session_tick' succeeded.")
        assert routine.filter(record) is False and record.levelname == "DEBUG"
        root.setLevel(logging.DEBUG)  # --verbose: shown, as DEBUG
        assert routine.filter(_record("Timer 'pool_tick' succeeded.")) is True
        root.setLevel(logging.INFO)
        for kept in (_record("Handler 'pool_apply' succeeded."),
                     _record("Timer 'session_tick' failed temporarily: boom", logging.ERROR)):
            level = kept.levelno
            assert routine.filter(kept) is True and kept.levelno == level
    finally:
        root.setLevel(old)
