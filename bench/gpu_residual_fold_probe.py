"""Probe: the gated residual add folded into the row-parallel GEMM (O, down) instead of the row kernel after it.

Why: each block half ends with an FP8 GEMM whose bf16 output δ [757, 8192] the residual kernel reads with the
residual x, computing x + gate·δ, then LayerNorm, modulation and FP8 (kernels/fused_quant.residual_ln_mod_quant,
476 calls per chunk). The gate is one value per output column, which is what the GEMM's per-column weight scale
already is (cuBLASLt's outer-vector scale mode): with sw·gate as that scale and x as the epilogue's C (beta = 1,
in place), the GEMM writes x + gate·δ itself — rounded once instead of twice — and the row kernel after it is the
cheaper LayerNorm + modulation + FP8 one (kernels/fused_quant.ln_mod_quant: x and δ read, x written, no more).

Timed here in one process at the 57b TP = 4 shapes, each variant in a CUDA graph cycling six weight sets (so no
call finds its weights in L2 from the call before), alternated over rounds: "unfused" = torch's FP8 GEMM then the
residual kernel (what the engine runs); "folded" = cuBLASLt (kernels/cublaslt.Fp8Gemm, the heuristic's algorithm)
with C = x in place, then ln_mod_quant; and the GEMMs alone both ways; then every cuBLASLt configuration of the GEMM
with C in place (`kernels.cublaslt.tune(with_c=True)`: does another tile or cluster shape take the epilogue's C
read better than the heuristic's?). Errors: the new residual and the FP8 rows
of each variant against float32 (x + gate·(a·sa)(w·sw)ᵀ, then the float twin's LayerNorm/modulation/FP8).
Run by `STEPS=tune TUNE_PARTS=fold bash bench/run_gpu.sh $OUT`.
"""

from __future__ import annotations

import torch
from vivant.bench.gpu_probes import deq, rel

DEV = "cuda"


def probe_residual_fold(cfg, tp: int = 4, sets: int = 6, rounds: int = 3) -> dict:
    """Both GEMMs that end a block half (O: k = heads·head_dim / tp; down: k = d_ff / tp), each as `_probe_shape`."""
    res: dict = {"rows": cfg.tokens_per_chunk, "d_model": cfg.d_model, "sets": sets, "rounds": rounds}
    for name, k in (("o", cfg.n_heads * cfg.head_dim // tp), ("down", cfg.d_ff // tp)):
        res[name] = _probe_shape(name, cfg.tokens_per_chunk, cfg.d_model, k, sets, rounds)
    return res


def _probe_shape(name: str, m: int, d: int, k: int, sets: int, rounds: int) -> dict:
    """One GEMM shape [m, k] × [k, d]: errors once, then every variant's µs per call (module docstring)."""
    from vivant.kernels import fused_quant as fq
    from vivant.kernels.cublaslt import CublasLtError, Fp8Gemm, graph_us, tune
    from vivant.kernels.fp8 import quantize_rows_ref
    from vivant.kernels.fp8_gemm import fp8_linear, fp8_linear_ref

    bf = torch.bfloat16
    g = torch.Generator(device=DEV).manual_seed(0)
    ws = [quantize_rows_ref(torch.randn(d, k, device=DEV, generator=g) / k ** 0.5) for _ in range(sets)]
    a, sa = quantize_rows_ref(torch.randn(m, k, device=DEV, generator=g))
    gate, shift, scale = ((0.3 * torch.randn(d, device=DEV, generator=g)).to(bf) for _ in range(3))
    sg = [sw * gate.float() for _, sw in ws]  # the gate folded into the per-column weight scale
    x0 = (2 * torch.randn(m, d, device=DEV, generator=g)).to(bf)
    gemm = Fp8Gemm(m, d, k, fast_accum=True)
    row: dict = {"k": k}
    # correctness on weight set 0, once, outside any graph
    want_x = x0.float() + gate.float() * fp8_linear_ref(a, sa, *ws[0])
    want_q = fq.ln_mod_quant_ref(want_x.to(bf), shift, scale)
    y = fp8_linear(a, sa, *ws[0], fast_accum=True)
    xu, qu, su = fq.residual_ln_mod_quant(x0, y, gate, shift, scale)
    row["unfused_x_rel"], row["unfused_q_rel"] = rel(xu, want_x), rel(deq(qu, su), deq(*want_q))
    try:
        xf = x0.clone()
        gemm(a, sa, ws[0][0], sg[0], out=xf, c=xf)
        qf, sf = fq.ln_mod_quant(xf, shift, scale)
    except (CublasLtError, RuntimeError) as e:
        row["error"] = f"{type(e).__name__}: {e}"[:300]
        print(f"  fold {name}: {row['error']}", flush=True)
        return row
    row["folded_x_rel"], row["folded_q_rel"] = rel(xf, want_x), rel(deq(qf, sf), deq(*want_q))
    row["folded_x_max_abs"] = float((xf.float() - want_x).abs().max())
    row["unfused_x_max_abs"] = float((xu.float() - want_x).abs().max())
    xs = [x0.clone() for _ in range(sets)]
    ys = [torch.empty(m, d, dtype=bf, device=DEV) for _ in range(sets)]

    def gemm_torch(i):
        torch._scaled_mm(a, ws[i][0].t(), scale_a=sa.view(-1, 1), scale_b=ws[i][1].view(1, -1), out_dtype=bf,
                         use_fast_accum=True, out=ys[i])

    def gemm_c(i):
        gemm(a, sa, ws[i][0], sg[i], out=xs[i], c=xs[i])

    def residual_kernel(i):
        fq.residual_ln_mod_quant(x0, ys[i], gate, shift, scale)

    def ln_kernel(i):
        fq.ln_mod_quant(xs[i], shift, scale)

    def unfused(i):
        gemm_torch(i)
        residual_kernel(i)

    def folded(i):
        gemm_c(i)
        ln_kernel(i)

    variants = {"unfused": unfused, "folded": folded, "gemm_torch": gemm_torch, "gemm_lt_c": gemm_c,
                "gemm_lt_no_c": lambda i: gemm(a, sa, ws[i][0], sg[i], out=ys[i]),
                "residual_kernel": residual_kernel, "ln_mod_quant_kernel": ln_kernel}
    times: dict[str, list[float]] = {v: [] for v in variants}
    for _ in range(rounds):
        for v, fn in variants.items():
            times[v].append(round(graph_us(fn, sets, 20), 2))
            for x in xs:  # the in-place variants grew x: back to the start (outside the timing)
                x.copy_(x0)
    row["us"] = times
    med = row["median_us"] = {v: sorted(t)[len(t) // 2] for v, t in times.items()}
    # every cuBLASLt configuration of the GEMM with C in place, as `fast_parts.tune_gemms` times them without C
    plan = tune(m, ws, fast_accum=True, with_c=True)
    row["tuned_with_c"] = None if plan is None else {"algorithm": plan.algo.describe(), "us": round(plan.chosen_us, 2),
                                                     "heuristic_us": round(plan.heuristic_us, 2)}
    print(f"  fold {name}: tuned with C: {row['tuned_with_c'] or 'no configuration beats the heuristic by 3 %'}",
          flush=True)
    print(f"  fold {name} (k={k}): unfused {med['unfused']} µs, folded {med['folded']} µs "
          f"(GEMM torch {med['gemm_torch']}, Lt+C {med['gemm_lt_c']}, Lt {med['gemm_lt_no_c']}; residual kernel "
          f"{med['residual_kernel']}, ln_mod_quant {med['ln_mod_quant_kernel']}); x rel err unfused "
          f"{row['unfused_x_rel']:.2e} folded {row['folded_x_rel']:.2e}, FP8 rows {row['unfused_q_rel']:.2e} / "
          f"{row['folded_q_rel']:.2e}", flush=True)
    return row
