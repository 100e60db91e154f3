"""The ablation table at the head of docs/BENCHMARKS.md, rendered from `vivant bench step --ablation`'s JSON
(bench/ablation.py), and the sentence that quotes its fair ratios (README.md cites the page).

`head_section(results_dir)` renders the newest committed `ablation_*.json` under bench/results/ (by file name, which
carries the date), or says that none is committed yet. `section(doc, name)` renders one document:
  - per row: what is undone, ms per chunk (median, p99), × of the optimized median, numerics (max and median
    relative RMS against the float reference over N chunks)
  - the whole-window policy's per-call kernel time beside the ring write's (µs per call, ms per chunk)
  - the optimized engine's memory per rank and its headroom on an 80 GB H100 and a 141 GB H200
  - `fair_ratios(doc)`: each choice's gain against its absence in the same engine, and the eager baseline's
"""

from __future__ import annotations

import json
from pathlib import Path

LABELS = {"baseline": "eager baseline (float parts, per-call whole-cache work)", "optimized": "**optimized (served)**",
          "whole_window": "whole-window cache policy instead of the ring", "bf16_gemm": "bf16 GEMMs instead of FP8",
          "heuristic_gemm": "cuBLASLt's heuristic GEMM algorithms instead of the tuned ones",
          "residual_after_gemm": "residual added after the O/down GEMMs instead of in their epilogue",
          "unfused_norm": "unfused norm / modulation / quantization", "no_cuda_graphs": "no CUDA graphs",
          "no_split_kv": "no split-KV attention (kv_splits = 1)"}
CHOICES = (("whole_window", "the ring"), ("bf16_gemm", "FP8 GEMMs"), ("heuristic_gemm", "the tuned GEMM algorithms"),
           ("residual_after_gemm", "the residual in the GEMM epilogue"), ("unfused_norm", "the fused kernels"),
           ("no_cuda_graphs", "CUDA graphs"), ("no_split_kv", "split-KV attention"))


def _gb(b: float) -> str:
    return f"{b / 1e9:.1f} GB"


def latest(results_dir: Path) -> Path | None:
    files = sorted(results_dir.glob("ablation_*.json"))
    return files[-1] if files else None


def _row(r: dict) -> str:
    label = LABELS.get(r["row"], r["row"])
    if "error" in r:
        return f"| {label} | failed: {r['error'][:120]} | | | |"
    n = r.get("numerics")
    num = (f"{100 * n['max_rel_rms']:.2f} % max, {100 * n['median_rel_rms']:.2f} % median ({n['chunks']} chunks)"
           if n and r["row"] != "baseline" else "reference")
    note = f" ({r['note']})" if r.get("note") else ""
    ms = f"**{r['ms']:.1f}**" if r["row"] == "optimized" else f"{r['ms']:.1f}"
    return f"| {label}{note} | {ms} | {r['p99_ms']:.1f} | {r['x_optimized']:.2f}× | {num} |"


def fair_ratios(doc: dict) -> str:
    """One sentence: each choice's gain against its absence in the same engine, then the eager baseline's."""
    rows = {r["row"]: r for r in doc["rows"] if "x_optimized" in r}
    parts = [f"{what} {rows[name]['x_optimized']:.2f}×" for name, what in CHOICES if name in rows]
    opt = rows.get("optimized")
    text = (f"Each choice against its absence in the same engine ({doc['preset']}, TP = {doc['tp']} rank "
            f"{doc['rank']}, {doc['machine'].get('gpu', doc['machine']['device'])}, optimized "
            f"{opt['ms']:.1f} ms per chunk): " if opt else "Each choice against its absence in the same engine: ")
    text += ", ".join(parts) + "."
    if "baseline" in rows:
        text += (f" The eager baseline is {rows['baseline']['x_optimized']:.2f}× the optimized step; it mostly measures "
                 "CUDA graphs and fused kernels against a host-bound Python loop, so it is not quoted as the design's "
                 "gain.")
    return text


def _kernels(doc: dict) -> str:
    k = doc.get("policy_kernels")
    if not k:
        return ""
    served = doc.get("ring", "fp8")
    parts = []
    for ring in (served, *(r for r in ("fp8", "bf16") if r != served)):
        if ring not in k:
            continue
        w, call, fn = k[ring]["ring_write"], k[ring]["whole_window_call"], k[ring]["whole_window_function"]
        what = "re-rotation + re-quantization" if ring == "fp8" else "re-rotation"
        parts.append(f"{ring} ring{' (served)' if ring == served else ''}: the ring write "
                     f"{w['graph_us_per_call']:.1f} µs ({w['graph_ms_per_chunk']:.1f} ms per chunk), the whole-window "
                     f"call {call['graph_us_per_call']:.1f} µs ({call['graph_ms_per_chunk']:.1f} ms per chunk), of "
                     f"which the compiled {what} of the window {fn['graph_us_per_call']:.1f} µs; do_bench (cold L2): "
                     f"{w['do_bench_us_per_call']:.1f} vs {call['do_bench_us_per_call']:.1f} µs")
    return (f"\nPer attention call at these shapes ({k['shapes']['tokens']} tokens, {k['shapes']['heads']} heads, "
            f"{k['shapes']['slots']} slots; {k['calls_per_chunk']} calls per chunk), replayed in a CUDA graph — "
            + "; ".join(parts) + ".\n")


def _memory(doc: dict) -> str:
    m = doc.get("memory")
    if not m:
        return ""
    h = m["headroom_bytes"]
    return (f"\nMemory of the optimized engine on this rank: CUDA context {_gb(m['context_bytes'])}, weights "
            f"{_gb(m['weights_bytes'])}, ring {_gb(m['ring_bytes'])}"
            + (f" + read image {_gb(m['read_image_bytes'])}" if "read_image_bytes" in m else "") + " + "
            f"rewind undo log {_gb(m.get('undo_log_bytes', 0))}, "
            f"activations (peak of an eager chunk) {_gb(m['activations_peak_bytes'])}, CUDA graphs' pools "
            f"{_gb(m['graphs_reserved_bytes'])}: {_gb(m['served_estimate_bytes'])} served per rank, leaving "
            f"{_gb(h['h100_80gb'])} on an 80 GB H100 and {_gb(h['h200_141gb'])} on a 141 GB H200 (this process's own "
            f"peak, with the bf16 shard the other rows use, was {_gb(m['process_peak_reserved_bytes'])} reserved).\n")


def section(doc: dict, name: str) -> str:
    rows = "\n".join(_row(r) for r in doc["rows"])
    return f"""## Each choice against its absence (the ablation, {doc['date']})

`{doc['command']}` → `bench/results/{name}`: in one process on the same weights, the served engine and the engine
with exactly one choice undone (bench/ablation.py); {doc['chunks']} chunks timed after {doc['warmup']} of warm-up;
numerics: relative RMS of each chunk's latents against {doc['reference'].split(';')[0]}.

| engine | ms / chunk (median) | p99 | × of optimized | numerics vs the float reference |
|---|---:|---:|---:|---|
{rows}

{fair_ratios(doc)}
{_kernels(doc)}{_memory(doc)}"""


def head_section(results_dir: Path) -> str:
    path = latest(results_dir)
    if path is None:
        return ("## Each choice against its absence (the ablation)\n\nNo ablation run is committed yet: "
                "`bash bench/run_gpu.sh $OUT` with `STEPS=ablation` writes `ablation_57b_tp4_rank0.json` "
                "(`vivant bench step --ablation`, bench/ablation.py).\n")
    return section(json.loads(path.read_text()), path.name)
