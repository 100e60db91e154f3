"""Every cuBLASLt algorithm for the step's four FP8 GEMMs, timed against the one torch takes (bench/gpu_tune.py,
part `cublaslt`).

For each per-rank shape (57b, TP = 4: QKV, O, gate/up, down at the chunk's 757 rows) the heuristic's candidates
(kernels/cublaslt.py; with no workspace, as the engine runs, and with 32 MiB) are checked against the float32
product and timed inside CUDA graphs, alternated with torch._scaled_mm over `rounds` rounds in one process (the
card's clock moves more between minutes than between neighbouring calls). Each graph cycles through `copies`
distinct weights, as the engine's 60 layers do, so no weight is served from L2 by the call before it.
"""

from __future__ import annotations

import numpy as np
import torch
from vivant.bench.gpu_probes import rel
from vivant.kernels.cublaslt import Fp8Gemm, graph_us
from vivant.kernels.fp8 import quantize_rows_ref
from vivant.kernels.fp8_gemm import fp8_linear, prefer_static_gemm_schedule, quantize_weight
from vivant.worker.model.tp import local_shapes

DEV = "cuda"


def _graph_us(fn, copies: int, inner: int = 3, reps: int = 15) -> float:
    """µs per call of fn(i) for i cycling over `copies`, `inner` times over in one CUDA graph."""
    return graph_us(fn, copies, reps, rounds=inner)


def _kernel_names(fn) -> list[str]:
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sorted({e.name for e in prof.events() if e.device_type.name == "CUDA"})


def probe_cublaslt(cfg, tp: int = 4, rounds: int = 3, copies: int = 6, workspace: int = 32 << 20,
                   finalists: int = 12, limit: int = 600) -> dict:
    """Per GEMM: torch's time; every variant tuning would time (`Fp8Gemm.variants`, from at most `limit`
    configurations) and the heuristic's first answer, checked against the float32 product and timed once; the
    `finalists` fastest timed again in `rounds` rounds alternated with torch's call; kernel names of torch's call
    and of the three fastest."""
    prefer_static_gemm_schedule()
    res = {"workspace_env": "CUBLASLT_WORKSPACE_SIZE=0 (the engine's setting)"}
    for name, (n, k) in local_shapes(cfg, tp).items():
        res[name] = entry = _probe_shape(cfg.tokens_per_chunk, n, k, rounds, copies, workspace, finalists, limit)
        timed = sorted((row for row in entry["candidates"] if len(row.get("us", [])) == rounds),
                       key=lambda r: r["median_us"])
        entry["best"] = timed[0]["algo"] if timed else None
        entry["best_median_us"] = timed[0]["median_us"] if timed else None
        print(f"  cublaslt {name} [{entry['M']}x{n}x{k}]: torch {entry['torch_median_us']:.1f} µs "
              f"{entry['torch_kernels']}; {entry['configurations']} configurations, {entry['correct']} correct",
              flush=True)
        for row in timed:
            print(f"    {row['median_us']:.1f} µs (first {row['first_us']:.1f}) err {row['err']:.2e} {row['algo']} "
                  f"{row.get('kernels', '')}", flush=True)
        torch.cuda.empty_cache()
    return res


def _probe_shape(m: int, n: int, k: int, rounds: int, copies: int, workspace: int, finalists: int,
                 limit: int) -> dict:
    ws = [quantize_weight(torch.randn(n, k, device=DEV) / k ** 0.5) for _ in range(copies)]
    a8, sa = quantize_rows_ref(torch.randn(m, k, device=DEV))
    ref = (a8.float() * sa[:, None]) @ (ws[0][0].float() * ws[0][1][:, None]).t()
    gemm = Fp8Gemm(m, n, k, fast_accum=True)
    outs = [torch.empty(m, n, dtype=torch.bfloat16, device=DEV) for _ in range(copies)]
    heuristic = gemm.candidates(count=1)
    cands = {(algo.raw, algo.workspace): algo for algo in heuristic + gemm.variants(workspace_bytes=workspace,
                                                                                     limit=limit)}

    def torch_fn(i):
        return fp8_linear(a8, sa, ws[i][0], ws[i][1], fast_accum=True)

    def lt_fn(i, algo):
        return gemm(a8, sa, ws[i][0], ws[i][1], algo=algo, out=outs[i])

    entry = {"N": n, "K": k, "M": m, "torch_err": rel(torch_fn(0).float(), ref), "torch_us": [],
             "configurations": len(cands), "heuristic": heuristic[0].describe() if heuristic else None}
    rows = []
    for algo in cands.values():
        row = {"algo": algo.describe(), "config": dict(algo.config), "workspace": algo.workspace, "waves": algo.waves}
        try:
            row["err"] = rel(lt_fn(0, algo).float(), ref)
            torch.cuda.synchronize()
            if row["err"] <= 2 * entry["torch_err"] + 1e-3:
                row["first_us"] = _graph_us(lambda i, algo=algo: lt_fn(i, algo), copies, inner=1, reps=3)
        except Exception as e:  # a configuration cuBLASLt accepts but cannot run here
            row["error"] = f"{type(e).__name__}: {e}"[:200]
        rows.append((algo, row))
    entry["correct"] = sum("first_us" in row for _, row in rows)
    first = sorted((p for p in rows if "first_us" in p[1]), key=lambda p: p[1]["first_us"])[:finalists]
    if heuristic and heuristic[0] not in [algo for algo, _ in first]:
        first += [p for p in rows if p[0] == heuristic[0] and "first_us" in p[1]]
    for _ in range(rounds):
        entry["torch_us"].append(_graph_us(torch_fn, copies))
        for algo, row in first:
            row.setdefault("us", []).append(_graph_us(lambda i, algo=algo: lt_fn(i, algo), copies))
    entry["torch_median_us"] = float(np.median(entry["torch_us"]))
    for _, row in first:
        row["median_us"] = float(np.median(row["us"]))
    entry["torch_kernels"] = _kernel_names(lambda: torch_fn(0))
    for algo, row in sorted(first, key=lambda p: p[1]["median_us"])[:3]:
        row["kernels"] = _kernel_names(lambda algo=algo: lt_fn(0, algo))
    entry["candidates"] = [row for _, row in rows]
    return entry
