"""The page's head: what the suite is and where its results live, one table of every benchmark with its command, its
result file, its headline figure and the date it was measured, and how the GPU results are made (bench/run_gpu.sh).
The ablation table follows it (bench/ablation_md.py builds that)."""

from __future__ import annotations

from vivant.bench.ablation_md import head_section as ablation_head_section
from vivant.bench.ablation_md import latest as latest_ablation
from vivant.bench.benchmarks_doc import call, fleet, served, step, turn
from vivant.bench.benchmarks_doc.results import ARCHIVE_TAG, RESULTS, day, load


def _ablation_row() -> list[tuple[str, str, str, str, str]]:
    path = latest_ablation(RESULTS)
    if path is None:
        return []
    doc = load(path.name)
    ms = {r["row"]: r["ms"] for r in doc["rows"] if "ms" in r}
    undone = [v for k, v in ms.items() if k not in ("baseline", "optimized")]
    return [("each engine choice against its absence, 57b rank, H200", doc["command"], path.name,
             f"optimized {ms['optimized']:.1f} ms per chunk; one choice undone {min(undone):.1f}–{max(undone):.1f}",
             day(doc))]


def section() -> str:
    rows = [*step.suite_rows()[:1], *_ablation_row(), *step.suite_rows()[1:], *served.suite_rows(),
            *turn.suite_rows(), *call.suite_rows(), *fleet.suite_rows()]
    table = "\n".join(f"| {what} | `{command}` | `{name}` | {figure} | {date} |"
                      for what, command, name, figure, date in rows)
    return f"""# Benchmarks

`vivant bench step | decode | call | fleet | turn` (bench/cli.py) print JSON and a short table. One result per benchmark
and machine is committed under `bench/results/`, its file name undated, the date it was measured (by the code of
that date) inside the JSON; a new run replaces it. This page is generated from those
files (`python bench/benchmarks_md.py > docs/BENCHMARKS.md`; tests/bench/test_benchmarks_doc.py fails when they
differ). The one-off probes and the superseded results of the engine's development are archived at the git tag
`{ARCHIVE_TAG}`; their findings are the last section, "Tried, and why not".

| benchmark | command | `bench/results/` | figure | measured |
|---|---|---|---|---|
{table}

The GPU results come from `bash bench/run_gpu.sh $OUT` on a machine with the GPU and torch but not vivant installed:
it assembles the `vivant` namespace from symlinks, installs the wheels carried in `.whl/` (redis, pydantic, av at
requirements/worker.txt's pins) and a `redis-server` unpacked from `.deb/`, and runs the steps `STEPS` names
(`smoke,tests,tp4,tp1,decode` by default; also `ablation`, `turn`, `session`, `quality`), each writing its JSON to
`$OUT`. 57b figures use random weights of the exact shapes (docs/ARCHITECTURE.md); the session and quality figures the
trained `ref` character. Timings are CUDA-event medians after warm-up; kernel timings replay CUDA graphs, as the
engine runs them. The session, the call and the fleet run one process per component, the way a deployment runs them.

{ablation_head_section(RESULTS)}"""
