"""Probes of cuDNN at the 57b TP=4 step's shapes, through the cuDNN frontend's graph API, each against what the
engine runs in the same process (µs per call in a CUDA graph, error against float32):

- `probe_fp8_attention`: cuDNN's FP8 flash attention (`sdpa_fp8`) against the served bf16 split-KV call. The step's
  attention is ≈ 19 ms per chunk (240 calls of ≈ 70.6 µs + the combine), bf16 cuDNN at about 500 TFLOP/s, and
  Hopper's FP8 tensor cores have twice the bf16 rate: is cuDNN's FP8 kernel faster at 757 queries × 16 heads over
  5,788 slots (head_dim 128, the slots in P parts batched as today), does it run inside a CUDA graph, and what error
  does its per-tensor FP8 scaling of Q, K, V, P and O add? On Hopper cuDNN writes O in FP8 (scale_o); stats (the
  log-sum-exp the split combine needs) come with generate_stats.
- `probe_cudnn_plans`: every plan cuDNN offers for the bf16 split-KV call, and each engine's knobs.
- `probe_cudnn_gemm`: cuDNN's own FP8 GEMM engines (matmul + the row/column scales as epilogue) for QKV.

Needs the `nvidia-cudnn-frontend` wheel (pyproject's `probes` extra, carried in .whl/ to the GPU machine); run by
`STEPS=tune TUNE_PARTS=fp8_attn` (`cudnn_plans`, `cudnn_gemm`).
"""

from __future__ import annotations

import time
from functools import partial

import torch
from vivant.bench.gpu_probes import rel
from vivant.bench.gpu_step import graph_us

DEV = "cuda"
E4M3_MAX = 448.0


class Fp8Sdpa:
    """One built cuDNN FP8 SDPA graph for q [P, H, N, D], k, v [P, H, S/P, D] (any strides, FP8 e4m3), writing
    o [P, H, N, D] FP8 and stats [P, H, N, 1] float32 (natural-log LSE of the scaled logits)."""

    def __init__(self, q, k, v, o, stats, scale: float):
        import cudnn

        self.handle = cudnn.create_handle()
        e4m3, f32 = cudnn.data_type.FP8_E4M3, cudnn.data_type.FLOAT
        g = cudnn.pygraph(io_data_type=e4m3, intermediate_data_type=f32, compute_data_type=f32, handle=self.handle)

        def t(x, name):
            return g.tensor(name=name, dim=list(x.shape), stride=list(x.stride()), data_type=e4m3)

        self.scalars = {n: torch.ones(1, 1, 1, 1, dtype=torch.float32, device=DEV)
                        for n in ("dq", "dk", "dv", "ds", "ss", "so")}
        st = {n: g.tensor(name=n, dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=f32) for n in self.scalars}
        tq, tk, tv = t(q, "q"), t(k, "k"), t(v, "v")
        to, tstats, tamax_s, tamax_o = g.sdpa_fp8(q=tq, k=tk, v=tv, descale_q=st["dq"], descale_k=st["dk"],
                                                  descale_v=st["dv"], descale_s=st["ds"], scale_s=st["ss"],
                                                  scale_o=st["so"], generate_stats=True, attn_scale=scale,
                                                  use_causal_mask=False, name="sdpa_fp8")
        to.set_output(True).set_dim(list(o.shape)).set_stride(list(o.stride())).set_data_type(e4m3)
        tstats.set_output(True).set_dim(list(stats.shape)).set_stride(list(stats.stride())).set_data_type(f32)
        self.amax_s = torch.zeros(1, 1, 1, 1, dtype=torch.float32, device=DEV)
        self.amax_o = torch.zeros_like(self.amax_s)
        for a in (tamax_s, tamax_o):
            a.set_output(True).set_dim([1, 1, 1, 1]).set_stride([1, 1, 1, 1]).set_data_type(f32)
        g.validate()
        g.build_operation_graph()
        g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        g.check_support()
        g.build_plans()
        self.graph = g
        self.ws = torch.empty(max(1, g.get_workspace_size()), dtype=torch.uint8, device=DEV)
        self.pack = {tq: q, tk: k, tv: v, to: o, tstats: stats, tamax_s: self.amax_s, tamax_o: self.amax_o}
        self.pack.update({st[n]: self.scalars[n] for n in st})
        self.cudnn = cudnn

    def __call__(self):
        self.cudnn.set_stream(handle=self.handle, stream=torch.cuda.current_stream().cuda_stream)
        self.graph.execute(self.pack, self.ws, handle=self.handle)


def probe_fp8_attention(cfg, tp: int = 4) -> dict:
    from vivant.kernels.split_kv import _partial_sdpa, combine_splits_ref

    n, h, d, slots = cfg.tokens_per_chunk, cfg.shard_heads(tp), cfg.head_dim, cfg.cache_slots
    import cudnn

    res = {"cudnn_backend": cudnn.backend_version(), "cudnn_frontend": getattr(cudnn, "__version__", "?")}
    g = torch.Generator(device=DEV).manual_seed(0)
    # q, k as after the qk RMSNorm (unit RMS rows), v of unit scale: the served ring's value range
    q = torch.randn(n, h, d, device=DEV, generator=g)
    k = torch.randn(slots, h, d, device=DEV, generator=g)
    v = torch.randn(slots, h, d, device=DEV, generator=g)
    scale = d ** -0.5
    ref = torch.softmax(torch.einsum("nhd,shd->hns", q, k) * scale, -1)
    ref = torch.einsum("hns,shd->nhd", ref, v)
    bf = torch.bfloat16
    qb = q.to(bf)
    sq, sk, sv = (float(t.abs().amax()) / E4M3_MAX for t in (q, k, v))
    q8, k8, v8 = (t.div(s).to(torch.float8_e4m3fn) for t, s in ((q, sq), (k, sk), (v, sv)))
    # the error of the FP8 inputs alone (float32 attention over the dequantized q, k, v): the rest is P and O
    qd, kd, vd = q8.float() * sq, k8.float() * sk, v8.float() * sv
    res["inputs_only_rel_err"] = rel(torch.einsum("hns,shd->nhd", torch.softmax(
        torch.einsum("nhd,shd->hns", qd, kd) * scale, -1), vd), ref)
    print(f"  fp8 inputs only: rel err {res['inputs_only_rel_err']:.4f}", flush=True)
    for p in (1, 2, 4, 6, 8, 12):
        row = {}
        if slots % p:  # more parts than divide the slots: timed over an image padded to a multiple (no mask)
            pad = p - slots % p
            kb, vb = (torch.cat([t, t[:pad]]) for t in (k.to(bf), v.to(bf)))
            k8p, v8p = (torch.cat([t, t[:pad]]) for t in (k8, v8))
            row["padded_slots"] = slots + pad
        else:
            kb, vb, k8p, v8p = k.to(bf), v.to(bf), k8, v8
        ns = kb.shape[0]
        kv = [t.view(p, ns // p, h, d).permute(0, 2, 1, 3) for t in (kb, vb)]
        qp = qb.transpose(0, 1).unsqueeze(0).expand(p, h, n, d)
        o_bf, lse_bf = _partial_sdpa(qp, *kv, scale)
        if "padded_slots" not in row:
            row["bf16_rel_err"] = rel(combine_splits_ref(o_bf, lse_bf), ref)
        row["bf16_us"] = graph_us(lambda qp=qp, kv=kv: _partial_sdpa(qp, *kv, scale))
        try:
            kv8 = [t.view(p, ns // p, h, d).permute(0, 2, 1, 3) for t in (k8p, v8p)]
            qp8 = q8.transpose(0, 1).unsqueeze(0).expand(p, h, n, d)
            o8 = torch.empty(p, h, n, d, dtype=torch.float8_e4m3fn, device=DEV)
            stats = torch.empty(p, h, n, 1, dtype=torch.float32, device=DEV)
            op = Fp8Sdpa(qp8, *kv8, o8, stats, scale)
            # O lies in the hull of V's rows: |o| <= max|v|, so o's scale can be v's
            so = 1.0 / sv
            for name, val in (("dq", sq), ("dk", sk), ("dv", sv), ("ds", 1.0 / E4M3_MAX), ("ss", E4M3_MAX),
                              ("so", so)):
                op.scalars[name].fill_(val)
            op()
            torch.cuda.synchronize()
            o = o8.float() / so
            lse = stats[..., 0]
            got = combine_splits_ref(o, lse)
            if "padded_slots" not in row:
                row["fp8_rel_err"] = rel(got, ref)
                row["fp8_max_abs_err"] = float((got - ref).abs().max())
            row["fp8_amax_s"], row["fp8_amax_o"] = float(op.amax_s), float(op.amax_o)
            row["fp8_us"] = graph_us(op)
            row["fp8_tflops"] = 4 * n * slots * d * h / row["fp8_us"] / 1e6  # useful FLOPs (real slots)
            row["speedup"] = row["bf16_us"] / row["fp8_us"]
        except Exception as e:  # a cuDNN that lacks the FP8 engine for this shape: recorded, not fatal
            row["error"] = f"{type(e).__name__}: {e}"[:400]
        res[f"p{p}"] = row
        print(f"  fp8 attention p{p}: {row}", flush=True)
    return res


def _bf16_graph(q, k, v, o, stats, scale: float, handle):
    """A cuDNN frontend bf16 SDPA graph (operation graph built, no plans yet) for q [P, H, N, D], k, v [P, H, S/P, D]
    → o [P, H, N, D] bf16 and stats [P, H, N, 1] float32: the same call as torch's cuDNN attention op, with the plan
    ours to choose."""
    import cudnn

    bf, f32 = cudnn.data_type.BFLOAT16, cudnn.data_type.FLOAT
    g = cudnn.pygraph(io_data_type=bf, intermediate_data_type=f32, compute_data_type=f32, handle=handle)
    tq, tk, tv = (g.tensor(name=n, dim=list(x.shape), stride=list(x.stride()), data_type=bf)
                  for n, x in (("q", q), ("k", k), ("v", v)))
    to, ts = g.sdpa(q=tq, k=tk, v=tv, generate_stats=True, attn_scale=scale, use_causal_mask=False, name="sdpa")
    to.set_output(True).set_dim(list(o.shape)).set_stride(list(o.stride())).set_data_type(bf)
    ts.set_output(True).set_dim(list(stats.shape)).set_stride(list(stats.stride())).set_data_type(f32)
    g.validate()
    g.build_operation_graph()
    return g, {tq: q, tk: k, tv: v, to: o, ts: stats}


def _time_plans(g, pack, handle, out: dict, label: str, error) -> None:
    """Run, check and time every built plan of cuDNN graph `g` (variant pack `pack`) into out[label + index]:
    error() gives the relative error of the outputs the plan just wrote; µs per call in a CUDA graph."""
    import cudnn

    for i in range(g.get_execution_plan_count()):
        name = f"{label}{i}"
        try:
            pname = g.get_plan_name_at_index(i)
            ws = torch.empty(max(1, g.get_workspace_size_plan_at_index(i)), dtype=torch.uint8, device=DEV)

            def run(i=i, ws=ws):
                cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream().cuda_stream)
                g.execute_plan_at_index(pack, ws, i, handle=handle)

            run()
            torch.cuda.synchronize()
            out[name] = {"plan": pname, "rel_err": error(), "us": graph_us(run), "workspace": ws.numel()}
        except Exception as e:
            out[name] = {"error": f"{type(e).__name__}: {e}"[:200]}
        print(f"  cudnn {name}: {out[name]}", flush=True)

def _sweep_knobs(engines, build, handle, out: dict, label: str, error, t_end: float) -> None:
    """For each (engine id, [(knob type, min, max, stride)]) in `engines` (in that order), each knob alone over its
    range (kernel configurations before split-K), until time.time() passes t_end: a fresh graph from build(), one
    plan of that engine with that knob value, run, checked and timed by `_time_plans` into out."""
    import cudnn

    for eid, knobs in engines:
        for ktype, lo, hi, stride in sorted(knobs, key=lambda kn: "SPLIT_K" in kn[0]):
            name = ktype.split(".")[-1]
            for val in range(lo, hi + 1, max(1, stride)):
                if time.time() > t_end:
                    return
                try:
                    g, pack = build()
                    g.create_execution_plan(eid, {getattr(cudnn.knob_type, name): val})
                    g.check_support()
                    g.build_plans(cudnn.build_plan_policy.ALL)
                except Exception as e:
                    out[f"{label}e{eid}_{name}={val}"] = {"error": f"{type(e).__name__}: {e}"[:160]}
                    continue
                _time_plans(g, pack, handle, out, f"{label}e{eid}_{name}={val}_", error)


def probe_cudnn_plans(cfg, tp: int = 4, sweep_s: float = 110.0) -> dict:
    """Every execution plan cuDNN offers for the step's bf16 split-KV attention call (heuristic modes A, B and
    fallback, all plans built), and each engine's knobs swept one at a time from its first heuristic plan: µs per
    call in a CUDA graph and the error against the float32 attention — whether a plan other than the one torch's
    op takes (its first heuristic choice) is faster at 757 queries × 16 heads over 5,788 slots."""
    import cudnn
    from vivant.kernels.split_kv import _partial_sdpa, combine_splits_ref

    n, h, d, slots = cfg.tokens_per_chunk, cfg.shard_heads(tp), cfg.head_dim, cfg.cache_slots
    bf = torch.bfloat16
    g0 = torch.Generator(device=DEV).manual_seed(1)
    q, k, v = (torch.randn(m, h, d, device=DEV, generator=g0) for m in (n, slots, slots))
    scale = d ** -0.5
    ref = torch.einsum("hns,shd->nhd", torch.softmax(torch.einsum("nhd,shd->hns", q, k) * scale, -1), v)
    handle = cudnn.create_handle()
    res = {}
    for p in (4, 2, 1):
        qp = q.to(bf).transpose(0, 1).unsqueeze(0).expand(p, h, n, d)
        kp, vp = (t.to(bf).view(p, slots // p, h, d).permute(0, 2, 1, 3) for t in (k, v))
        o = torch.empty(p, h, n, d, dtype=bf, device=DEV)
        stats = torch.empty(p, h, n, 1, dtype=torch.float32, device=DEV)
        row = {"torch_op_us": graph_us(lambda qp=qp, kp=kp, vp=vp: _partial_sdpa(qp, kp, vp, scale)), "plans": {}}

        def err(o=o, stats=stats):
            return rel(combine_splits_ref(o.float(), stats[..., 0]), ref)

        g, pack = _bf16_graph(qp, kp, vp, o, stats, scale, handle)
        row["engines"] = {}
        for eid in range(g.get_engine_count()):
            try:
                row["engines"][eid] = [(str(kn.type), kn.min_value, kn.max_value, kn.stride)
                                       for kn in g.get_knobs_for_engine(eid)]
            except Exception as e:
                row["engines"][eid] = f"{type(e).__name__}: {e}"[:200]
        g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.B, cudnn.heur_mode.FALLBACK])
        g.check_support()
        g.build_plans(cudnn.build_plan_policy.ALL)

        print(f"  cudnn p{p} engines and knobs: {row['engines']}", flush=True)
        _time_plans(g, pack, handle, row["plans"], f"p{p} heur", err)
        # the first heuristic plan's engine ("eng9_k24=7": engine 9) is swept first
        first_engine = int(g.get_plan_name_at_index(0).split("_")[0][3:]) if g.get_execution_plan_count() else -1
        # each engine's knobs one at a time over their range (others at the engine's defaults), 4 parts only,
        # within a time budget (cuDNN compiles its generated kernels at plan build); the first plan's engine first
        if p == 4:
            engines = sorted(((e, k) for e, k in row["engines"].items() if isinstance(k, list)),
                             key=lambda ek: ek[0] != first_engine)
            _sweep_knobs(engines, partial(_bf16_graph, qp, kp, vp, o, stats, scale, handle), handle, row["plans"],
                         f"p{p} ", err, time.time() + sweep_s)
        res[f"p{p}"] = row
    return res


def _fp8_gemm_graph(a, sa, w, sw, out, handle):
    """cuDNN frontend graph of the engine's FP8 GEMM: a [1, M, K] e4m3 × wᵀ (w [N, K] e4m3 read as [1, K, N]) in
    float32, × sa [1, M, 1] × sw [1, 1, N] → out [1, M, N] bf16 (the row/column scales of torch._scaled_mm)."""
    import cudnn

    e4m3, f32, bf = cudnn.data_type.FP8_E4M3, cudnn.data_type.FLOAT, cudnn.data_type.BFLOAT16
    m, k = a.shape[-2:]
    n = w.shape[0]
    g = cudnn.pygraph(io_data_type=bf, intermediate_data_type=f32, compute_data_type=f32, handle=handle)
    ta = g.tensor(name="a", dim=[1, m, k], stride=[m * k, k, 1], data_type=e4m3)
    tb = g.tensor(name="b", dim=[1, k, n], stride=[n * k, 1, k], data_type=e4m3)
    tsa = g.tensor(name="sa", dim=[1, m, 1], stride=[m, 1, 1], data_type=f32)
    tsw = g.tensor(name="sw", dim=[1, 1, n], stride=[n, n, 1], data_type=f32)
    c = g.matmul(ta, tb, compute_data_type=f32, name="mm")
    c.set_data_type(f32)
    c1 = g.mul(c, tsa, compute_data_type=f32, name="row_scale")
    c1.set_data_type(f32)
    c2 = g.mul(c1, tsw, compute_data_type=f32, name="col_scale")
    c2.set_output(True).set_dim([1, m, n]).set_stride([m * n, n, 1]).set_data_type(bf)
    g.validate()
    g.build_operation_graph()
    return g, {ta: a, tb: w, tsa: sa, tsw: sw, c2: out}


def probe_cudnn_gemm(cfg, tp: int = 4, sweep_s: float = 200.0) -> dict:
    """cuDNN's own FP8 GEMM engines (matmul + the row/column scales fused as epilogue) for the QKV projection
    (M = 757, N = 6144, K = 8192: 288 tiles of 128 × 128 for cuBLASLt on 132 SMs), every heuristic plan and
    each engine's knobs one at a time (tile shapes, stream-K, CTA count where cuDNN offers them), against
    torch._scaled_mm (cuBLASLt, fast accumulation) in the same process: µs per call in a CUDA graph and the error
    against the float32 product."""
    import cudnn
    from vivant.kernels.fp8 import quantize_rows_ref
    from vivant.kernels.fp8_gemm import fp8_linear, quantize_weight
    from vivant.worker.model.tp import local_shapes

    m = cfg.tokens_per_chunk
    n, k = local_shapes(cfg, tp)["qkv"]
    w8, sw = quantize_weight(torch.randn(n, k, device=DEV) / k ** 0.5)
    a8, sa = quantize_rows_ref(torch.randn(m, k, device=DEV))
    ref = (a8.float() * sa[:, None]) @ (w8.float() * sw[:, None]).t()
    out = torch.empty(1, m, n, dtype=torch.bfloat16, device=DEV)
    res = {"shape": [m, n, k], "cublas_us": graph_us(lambda: fp8_linear(a8, sa, w8, sw, fast_accum=True)),
           "cublas_exact_us": graph_us(lambda: fp8_linear(a8, sa, w8, sw, fast_accum=False)), "plans": {}}
    print(f"  gemm qkv cuBLASLt {res['cublas_us']:.1f} µs (exact {res['cublas_exact_us']:.1f})", flush=True)
    handle = cudnn.create_handle()
    a3, sa3, sw3 = a8.view(1, m, k), sa.view(1, m, 1), sw.view(1, 1, n)

    def err():
        return rel(out[0].float(), ref)

    try:
        g, pack = _fp8_gemm_graph(a3, sa3, w8, sw3, out, handle)
        engines = {}
        for eid in range(g.get_engine_count()):
            try:
                engines[eid] = [(str(kn.type), kn.min_value, kn.max_value, kn.stride)
                                for kn in g.get_knobs_for_engine(eid)]
            except Exception:  # an engine that cannot run this graph
                continue
        res["engines"] = engines
        print(f"  gemm engines and knobs: {engines}", flush=True)
        g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.B, cudnn.heur_mode.FALLBACK])
        g.check_support()
        g.build_plans(cudnn.build_plan_policy.ALL)
        _time_plans(g, pack, handle, res["plans"], "gemm heur", err)
    except Exception as e:
        res["error"] = f"{type(e).__name__}: {e}"[:400]
        print(f"  gemm graph: {res['error']}", flush=True)
        return res
    # the engine with the most kernel configurations first (the split-K knob, swept on engines 4 and 7, only slowed
    # them down)
    order = sorted(engines.items(), key=lambda kv: -max((hi - lo for _, lo, hi, _ in kv[1]), default=0))
    _sweep_knobs(order, partial(_fp8_gemm_graph, a3, sa3, w8, sw3, out, handle), handle, res["plans"], "gemm ", err,
                 time.time() + sweep_s)
    return res
