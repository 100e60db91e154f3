"""Scrape live worker and operator metrics endpoints and check every series the rules and dashboard read.

Real components: prometheus_client's own HTTP exposition server on 127.0.0.1 (free ports), driven only
through the public methods of `WorkerMetrics` / `OperatorMetrics` / `ApiMetrics`, scraped over HTTP with
urllib and parsed with `prometheus_client.parser`. Nothing is listed twice: the series names, label
matchers and grouping labels are parsed out of charts/vivant/files/rules.yaml and files/dashboard.json.
"""

from __future__ import annotations

import json
import re
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families
from vivant.gateway.metrics import ApiMetrics
from vivant.operator import metrics as operator_metrics
from vivant.ports import free_port
from vivant.worker.serving import metrics as worker_metrics

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "charts" / "vivant" / "files" / "rules.yaml"
DASHBOARD = ROOT / "charts" / "vivant" / "files" / "dashboard.json"
POOL = "vivant-system/h200"

Samples = dict[str, list[dict[str, str]]]


def scrape(port: int) -> Samples:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        assert resp.status == 200
        text = resp.read().decode()
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples.setdefault(s.name, []).append(dict(s.labels))
    return samples


def drive_worker(m: worker_metrics.WorkerMetrics) -> None:
    for stage, seconds in (("diffuse", 0.120), ("decode", 0.030), ("publish", 0.004), ("total", 0.150)):
        m.observe_chunk(stage, seconds)
    m.decoder_seconds(0.031)
    m.numerical_fault()
    m.turn_latency(0.47)
    m.kernel_info("fused_gemm_all_reduce", 7)
    # a live session, and two finished ones (one met, one missed)
    for session, frames, seconds in (("live", 240, 10.0), ("good", 48, 2.0), ("bad", 40, 2.0)):
        m.frames_published(session, frames)
        m.streamed_seconds(session, seconds)
        m.session_fps(session, frames / seconds)
        m.buffer_depth(session, 2)
        m.stall(session)
    assert m.session_ended("good") == "met"
    assert m.session_ended("bad") == "missed"


def drive_operator(m: operator_metrics.OperatorMetrics) -> None:
    m.set_session_counts({("vivant-system", POOL, "Streaming"): 1, ("vivant-system", POOL, "Pending"): 2})
    m.observe_assignment(POOL, 0.8)
    m.set_pool_workers(POOL, desired=3, idle=0, busy=2, starting=1)
    m.reconcile_error("WorkerPool")
    m.flag_rollback(POOL, "fusedGemmAllReduce", "numerical_fault")
    m.observe_worker_failures(POOL, {"fault": 0, "lost": 0})
    m.observe_worker_failures(POOL, {"fault": 1, "lost": 0})
    m.observe_dead_letters(3)
    m.observe_dead_letters(4)
    for handler, seconds in (("assign", 0.004), ("session_sweep", 0.02), ("release", 0.3)):
        m.observe_reconcile(handler, seconds)
    m.set_queue_depth("waiting_for_worker", POOL, 2)
    m.queue_change("awaiting_end", POOL, +1)


@pytest.fixture(scope="module")
def endpoints() -> Iterator[dict[str, Samples]]:
    worker_registry, operator_registry = CollectorRegistry(), CollectorRegistry()
    w = worker_metrics.WorkerMetrics(pool=POOL, registry=worker_registry)
    o = operator_metrics.OperatorMetrics(registry=operator_registry)
    api = ApiMetrics(registry=operator_registry)
    drive_worker(w)
    drive_operator(o)
    api.observe_request("POST", "/v1/realtime_sessions", 201, 0.02)
    servers = []
    try:
        wport, oport = free_port(), free_port()
        servers.append(worker_metrics.serve(wport, addr="127.0.0.1", registry=worker_registry))
        servers.append(operator_metrics.serve(oport, addr="127.0.0.1", registry=operator_registry))
        yield {"worker": scrape(wport), "operator": scrape(oport)}
    finally:
        for server, thread in servers:
            server.shutdown()
            server.server_close()
            thread.join(timeout=5)


# ------------------------------------------------------------------------------ expression parsing

SELECTOR = re.compile(r"\b(vivant_[a-z0-9_]+)(\{([^}]*)\})?")
MATCHER = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)\s*(=~|!~|!=|=)\s*"([^"]*)"')
GROUPING = re.compile(r"\b(?:by|on|without|ignoring)\s*\(([^)]*)\)")
RECORDED = re.compile(r"\bvivant:[a-z0-9_:]+")


def rule_expressions() -> list[tuple[str, str]]:
    doc = yaml.safe_load(RULES.read_text())
    return [(r.get("record") or r["alert"], r["expr"]) for g in doc["groups"] for r in g["rules"]]


def dashboard_expressions() -> list[tuple[str, str]]:
    dash = json.loads(DASHBOARD.read_text())
    return [(p["title"], t["expr"]) for p in dash["panels"] for t in p.get("targets", [])]  # a row has none


def problems(expr: str, samples: Samples) -> list[str]:
    """What `expr` reads that `samples` does not have: names, labels, label values, grouping labels."""
    found = []
    raw = []
    for m in SELECTOR.finditer(expr):
        name, matchers = m.group(1), m.group(3) or ""
        if name not in samples:
            found.append(f"series {name} is not exported")
            continue
        raw.append(name)
        label_sets = samples[name]
        for label, op, value in MATCHER.findall(matchers):
            if not any(label in ls for ls in label_sets):
                found.append(f"{name} has no label {label!r}")
                continue
            if "$" in value:  # a dashboard variable
                continue
            values = {ls.get(label) for ls in label_sets}
            if op == "=" and value not in values:
                found.append(f"{name}{{{label}={value!r}}}: exported values are {sorted(v for v in values if v)}")
            if op == "=~":
                for alt in value.split("|"):
                    if re.fullmatch(r"[\w/.-]+", alt) and alt not in values:
                        found.append(f"{name}{{{label}=~...{alt!r}}}: exported values are {sorted(v for v in values if v)}")
    for group in GROUPING.findall(expr):
        for label in (x.strip() for x in group.split(",") if x.strip()):
            for name in raw:
                if not any(label in ls for ls in samples[name]):
                    found.append(f"grouping label {label!r} missing on {name}")
    return found


def all_samples(endpoints: dict[str, Samples]) -> Samples:
    merged: Samples = {}
    for samples in endpoints.values():
        for name, label_sets in samples.items():
            merged.setdefault(name, []).extend(label_sets)
    return merged


# ------------------------------------------------------------------------------ the checks


def test_rules_read_only_exported_series_and_labels(endpoints):
    samples = all_samples(endpoints)
    exprs = rule_expressions()
    assert sum(1 for _, e in exprs if SELECTOR.search(e)) >= 10, "the rules file reads suspiciously few raw series"
    report = {name: p for name, e in exprs if (p := problems(e, samples))}
    assert not report, "rules read series the scrape does not have:\n" + json.dumps(report, indent=1)


def test_dashboard_reads_only_exported_series_and_labels(endpoints):
    samples = all_samples(endpoints)
    report = {title: p for title, e in dashboard_expressions() if (p := problems(e, samples))}
    assert not report, "dashboard panels read series the scrape does not have:\n" + json.dumps(report, indent=1)


def test_recorded_series_used_are_defined():
    recorded = {r for r, _ in rule_expressions() if r.startswith("vivant:")}
    used = {m for _, e in [*rule_expressions(), *dashboard_expressions()] for m in RECORDED.findall(e)}
    assert used, "no recording rule is used"
    assert used <= recorded, f"used but never recorded: {sorted(used - recorded)}"


def test_worker_and_operator_label_the_pool_alike(endpoints):
    """Rules join worker and operator series on `pool`; both must carry the same pool id."""
    worker_pools = {ls["pool"] for ls in endpoints["worker"]["vivant_worker_build_info"]}
    operator_pools = {ls["pool"] for ls in endpoints["operator"]["vivant_operator_pool_desired_workers"]}
    assert worker_pools == operator_pools == {POOL}


def test_per_session_series_carry_pool_and_session_and_finished_sessions_are_counted(endpoints):
    w = endpoints["worker"]
    for name in ("vivant_worker_session_frames_total", "vivant_worker_session_streamed_seconds",
                 "vivant_worker_session_delivered_fps", "vivant_worker_session_stalls_total",
                 "vivant_worker_session_buffer_chunks"):
        assert [ls for ls in w[name]] == [{"pool": POOL, "session": "live"}], (
            f"{name}: {w[name]} (ended sessions must be gone, the live one present)"
        )
    results = {ls["result"] for ls in w["vivant_worker_sessions_finished_total"]}
    assert results == {"met", "missed", "short"}
    info = w["vivant_worker_kernel_path_info"]
    assert info == [{"pool": POOL, "path": "fused_gemm_all_reduce", "flag_version": "7"}]


def test_the_check_notices_a_missing_series_label_or_value(endpoints):
    samples = all_samples(endpoints)
    assert problems("rate(vivant_worker_chunk_step_second_bucket[5m])", samples) == [
        "series vivant_worker_chunk_step_second_bucket is not exported"
    ]
    assert problems('vivant_worker_chunk_step_seconds_bucket{phase="x"}', samples) == [
        "vivant_worker_chunk_step_seconds_bucket has no label 'phase'"
    ]
    assert problems('vivant_operator_pool_workers{state="lost"}', samples)
    assert problems("sum by (namespace) (vivant_operator_pool_workers)", samples) == [
        "grouping label 'namespace' missing on vivant_operator_pool_workers"
    ]
