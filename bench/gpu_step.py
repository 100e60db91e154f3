"""The DiT chunk step on one GPU at the 57b shapes: baseline vs optimized, same process, same weights.

`vivant bench step --preset 57b --tp 4 --rank 0 --device cuda --json` builds one tensor-parallel rank's
exact shard (16 heads; QKV N=6144, O K=2048, gate+up N=13824, down K=6912) with random bf16 weights on
the GPU; the all-reduce after O and down is replaced by its one-GPU stand-in and timed separately.

  baseline   the original step: bf16 GEMMs, eager, per-call whole-cache work (concatenate the cache
             with the new tokens, rotate every cached key, quantize the whole K/V set), SDPA attention.
  optimized  FP8 GEMMs (cuBLASLt rowwise), activation quantization fused into norm/modulation and
             SwiGLU, RoPE + ring write at write time, attention reading the bf16 ring, CUDA graph
             per pass (the FP8 parts of worker/model/fast_parts.py in the served engine, worker/model/engine.py).

Breakdown: each component is timed alone with CUDA events (median of do_bench) at its exact shapes and
multiplied by its count per chunk (60 layers × 4 passes); "other" is the measured chunk time minus the
sum. FLOPs count the four GEMMs (2·M·N·K each) per layer and pass. The FP8 ceiling is the measured
median rate of `torch._scaled_mm` rowwise at the same four shapes.
`--tp 1` builds the whole model layer by layer in FP8 (≈57 GB) and times the optimized path only.
"memory": the optimized engine's device memory per rank by part and its headroom on an 80 GB H100 and a 141 GB
H200 (bench/memory.py). `--ablation` runs bench/ablation.py instead (each engine choice against its absence).
"""

from __future__ import annotations

import json
import math
import time

import numpy as np
import torch
from vivant.bench.memory import StepMemory
from vivant.kernels import cublaslt
from vivant.kernels.fp8_gemm import fp8_linear, prefer_static_gemm_schedule, quantize_weight
from vivant.kernels.fused_quant import ln_mod_quant, quant_rows, residual_ln_mod_quant, swiglu_quant
from vivant.kernels.qk_norm_rope import qk_norm_rope
from vivant.kernels.qkv_ring import qkv_ring_write
from vivant.kernels.ring_attention import ring_attention
from vivant.kernels.split_kv import split_kv_attention_fp8
from vivant.worker.model.config import ModelConfig
from vivant.worker.model.engine import Engine
from vivant.worker.model.fast_parts import Fp8Linear, auto_kv_splits, gemm_plan_report
from vivant.worker.model.generator import ChunkGenerator
from vivant.worker.model.model import VideoDiT
from vivant.worker.model.options import AttentionBackend, CacheMode, EngineOptions
from vivant.worker.model.tp import apply_tensor_parallel, local_shapes


def _bench(fn, rep_ms=200) -> float:
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=25, rep=rep_ms, return_mode="median"))


INITS = ("unit", "scaled")
RESIDUAL_OUT = ("attn.o.weight", "mlp.down.weight")  # the projections that write into the residual stream


@torch.no_grad()
def _init_(module: torch.nn.Module, gen: torch.Generator, init: str = "unit", n_layers: int = 1) -> None:
    """Random weights of the exact shapes. "unit": every matrix N(0, 1/fan_in) (unit gain). "scaled": the same,
    but the two residual-writing projections (attention O, MLP down) are further scaled by 1/sqrt(2·n_layers),
    the standard deep-transformer initialization (GPT-2, Megatron-LM) that keeps the residual stream's growth
    bounded over depth; with unit gain and 60 layers the random network amplifies rounding-sized differences
    several-fold (bench/gpu_floor.py), which is a property of those weights, not of any engine."""
    if init not in INITS:
        raise ValueError(f"init must be one of {INITS}, got {init!r}")
    for name, p in module.named_parameters(recurse=True):
        if p.numel() == 0:
            continue
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        elif name.endswith("mod_table"):
            p.normal_(0.0, 0.1, generator=gen)
        elif p.dim() == 1:
            p.zero_()
        else:
            std = 1.0 / math.sqrt(p.shape[1])
            if init == "scaled" and name.endswith(RESIDUAL_OUT):
                std /= math.sqrt(2 * n_layers)
            p.normal_(0.0, std, generator=gen)


def build_rank(cfg: ModelConfig, tp: int, rank: int, *, keep_bf16: bool, seed: int = 0, reduce: str = "none",
               device: str = "cuda", init: str = "unit"):
    """One rank's shard, materialized block by block on the GPU (never the full model in bf16); keep_bf16=False
    quantizes each block's four projections to FP8 as it is built (`Fp8Linear`), freeing their bf16 weights.
    reduce="none" for the one-GPU benchmark (all-reduce left out); "dist" on a real TP group."""
    dev = torch.device(device)
    with torch.device("meta"):
        model = VideoDiT(cfg)
    # The all-reduce is left out of the step (identity) and reported on its own line: one GPU cannot time
    # a 4-GPU NVLink reduction, and a local stand-in would only measure this GPU's memory traffic.
    model = apply_tensor_parallel(model, rank, tp, reduce=reduce) if tp > 1 else model
    gen = torch.Generator(device=dev).manual_seed(seed)
    for name, mod in model.named_children():
        if name != "blocks":
            mod.to_empty(device=dev)
            mod.to(torch.bfloat16)
            _init_(mod, gen, init, cfg.n_layers)
    for p_name in ("audio_pos",):
        setattr(model, p_name, torch.nn.Parameter(torch.empty_like(getattr(model, p_name), device=dev, dtype=torch.bfloat16)))
        getattr(model, p_name).data.normal_(0, 0.02, generator=gen)
    for blk in model.blocks:
        blk.to_empty(device=dev)
        blk.to(torch.bfloat16)
        _init_(blk, gen, init, cfg.n_layers)
        if not keep_bf16:
            for mod, name in ((blk.attn, "qkv"), (blk.attn, "o"), (blk.mlp, "gate_up"), (blk.mlp, "down")):
                setattr(mod, name, Fp8Linear.of(getattr(mod, name), fast_accum=False))
    model.eval()
    return model


def graph_us(fn, inner: int = 20, reps: int = 30) -> float:
    """µs per call of fn, replayed inside one CUDA graph of `inner` calls (median of `reps` replays)."""
    return cublaslt.graph_us(lambda i: fn(), inner, reps)


def categorize(name: str) -> str:
    low = name.lower()
    if any(t in low for t in ("gemm", "xmma", "cutlass", "scaled_mm", "cublas", "sm90_")) and "fmha" not in low \
            and "sdpa" not in low and "flash" not in low:
        return "gemms"
    if any(t in low for t in ("fmha", "flash", "sdpa", "attention", "_ring_attn", "cudnn")):
        return "attention"
    if "_dequant" in low:  # the sdpa backend's whole-ring dequantization, or an image refresh outside qkv_ring
        return "dequant"
    if any(t in low for t in ("_ln_mod", "_residual_ln", "_swiglu", "_quant_rows", "_qk_norm", "_write_kv", "_qkv_ring")):
        return "fused_kernels"
    return "other"


def profile_chunks(gen, cfg, start, n=2) -> dict:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for i in range(n):
            gen.generate_chunk(_audio(cfg, start + i), cfg.audio_sample_rate)
        torch.cuda.synchronize()
    cats: dict[str, float] = {}
    kernels: dict[str, list] = {}
    spans: list[tuple[float, float, str]] = []
    count = 0
    for ev in prof.events():
        if ev.device_type != torch.autograd.DeviceType.CUDA:
            continue
        dur = ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total
        if dur <= 0:
            continue
        spans.append((ev.time_range.start, ev.time_range.end, ev.name[:60]))
        count += 1
        c = categorize(ev.name)
        cats[c] = cats.get(c, 0.0) + dur / 1e3 / n
        k = kernels.setdefault(ev.name[:90], [0, 0.0])
        k[0] += 1
        k[1] += dur / 1e3 / n
    top = sorted(kernels.items(), key=lambda kv: -kv[1][1])[:25]
    return {"kernel_events": count, "ms_per_chunk_by_category": cats,
            "top_kernels_ms_per_chunk": {k: {"calls_per_chunk": v[0] / n, "ms": v[1]} for k, v in top},
            "gaps": device_gaps(spans, n), "memset_neighbours": memset_neighbours(spans)}


def memset_neighbours(spans: list[tuple[float, float, str]]) -> dict[str, int]:
    """Which device events come just before and just after each memset (the graph's memset nodes have no
    name of their own): "before → after" → count over the profiled chunks."""
    spans = sorted(spans)
    out: dict[str, int] = {}
    for i, (_, _, name) in enumerate(spans):
        if name.startswith("Memset") and 0 < i < len(spans) - 1:
            k = f"{spans[i - 1][2]} → {spans[i + 1][2]}"
            out[k] = out.get(k, 0) + 1
    return dict(sorted(out.items(), key=lambda kv: -kv[1])[:8])


def device_gaps(spans: list[tuple[float, float, str]], chunks: int) -> dict:
    """Idle device time between consecutive device events (µs timestamps from the profiler), per chunk: in
    total, split at 20 µs (launch gaps inside a graph vs the host making the device wait), and the largest gaps
    with the events on either side."""
    spans.sort()
    gaps = []
    end = spans[0][1] if spans else 0.0
    for (s0, e0, name), prev in zip(spans[1:], spans, strict=False):
        if s0 > end:
            gaps.append((s0 - end, prev[2], name))
        end = max(end, e0)
    small = [g for g in gaps if g[0] <= 20]
    large = sorted((g for g in gaps if g[0] > 20), reverse=True)
    return {"ms_per_chunk": sum(g[0] for g in gaps) / 1e3 / chunks,
            "under_20us_ms_per_chunk": sum(g[0] for g in small) / 1e3 / chunks,
            "under_20us_count_per_chunk": len(small) / chunks,
            "over_20us_ms_per_chunk": sum(g[0] for g in large) / 1e3 / chunks,
            "largest": [{"us": round(g[0], 1), "after": g[1], "before": g[2]} for g in large[:12]]}


def gemm_ceiling(cfg, tp) -> dict:
    m = cfg.tokens_per_chunk
    out, total_ms, flops = {}, 0.0, 0.0
    for name, (n, k) in local_shapes(cfg, tp).items():
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / math.sqrt(k)
        a8, sa = quant_rows(a)
        w8, sw = quantize_weight(w)
        ms8 = graph_us(lambda a8=a8, sa=sa, w8=w8, sw=sw: fp8_linear(a8, sa, w8, sw)) / 1e3
        ms16 = graph_us(lambda a=a, w=w: a @ w.t()) / 1e3
        f = 2.0 * m * n * k
        out[name] = {"N": n, "K": k, "fp8_ms": ms8, "bf16_ms": ms16, "fp8_tflops": f / ms8 / 1e9, "bf16_tflops": f / ms16 / 1e9}
        total_ms += ms8
        flops += f
    out["fp8_ms_per_layer_pass"] = total_ms
    out["fp8_ceiling_tflops"] = flops / total_ms / 1e9
    out["bf16_ms_per_layer_pass"] = sum(v["bf16_ms"] for v in out.values() if isinstance(v, dict))
    out["flops_per_layer_pass"] = flops
    return out


def component_times(cfg, tp, splits: int = 1) -> dict:
    """Per-call medians of the non-GEMM pieces at the exact shapes (ms): replayed inside CUDA graphs as the engine
    runs them, except the baseline's eager cache work (do_bench, cold L2, as the baseline runs it)."""
    n, h, d, S = cfg.tokens_per_chunk, cfg.shard_heads(tp), cfg.head_dim, cfg.cache_slots
    dm, f = cfg.d_model, cfg.d_ff // tp
    dev, bf = "cuda", torch.bfloat16
    x = torch.randn(n, dm, device=dev, dtype=bf)
    x2 = torch.randn(n, dm, device=dev, dtype=bf)
    sh, sc = torch.randn(dm, device=dev, dtype=bf) * 0.1, torch.randn(dm, device=dev, dtype=bf) * 0.1
    gu = torch.randn(n, 2 * f, device=dev, dtype=bf)
    att = torch.randn(n, h * d, device=dev, dtype=bf)
    q = torch.randn(n, h, d, device=dev, dtype=bf)
    kf = torch.randn(S, h, d, device=dev, dtype=bf)
    from vivant.kernels.fp8 import quantize_rows_ref
    from vivant.kernels.rope import apply_rope_ref

    kb, vb = kf.clone(), torch.randn(S, h, d, device=dev, dtype=bf)  # the bf16 ring of one layer
    valid = torch.ones(S, dtype=torch.bool, device=dev)
    qkv = torch.randn(n, 3 * h * d, device=dev, dtype=bf)
    w_d = torch.ones(d, device=dev, dtype=bf)
    cos, sin = torch.rand(n, d // 2, device=dev), torch.rand(n, d // 2, device=dev)
    pos = torch.randint(0, 30, (S, 3), device=dev)
    slots = torch.randperm(S, device=dev)[:n]

    def ms(fn):  # inside a CUDA graph, as the engine runs them
        return graph_us(fn) / 1e3

    res = {
        "ln_mod_quant": ms(lambda: ln_mod_quant(x, sh, sc)),
        "residual_ln_mod_quant": ms(lambda: residual_ln_mod_quant(x, x2, sc, sh, sc)),
        "swiglu_quant": ms(lambda: swiglu_quant(gu)),
        "quant_rows_o": ms(lambda: quant_rows(att)),
        "qk_norm_rope": ms(lambda: qk_norm_rope(qkv, w_d, w_d, cos, sin, h)),
        "qkv_ring_write": ms(lambda: qkv_ring_write(qkv, w_d, w_d, cos, sin, slots, kb, vb, h)),
        "attn_image": ms(lambda: ring_attention(q, kb, vb, valid, backend="image", all_valid=True)),
        "attn_image_split_fp8": ms(lambda: split_kv_attention_fp8(q.transpose(0, 1).unsqueeze(0).expand(splits, h, n, d),
                                                                  kb, vb)) if splits > 1 else None,
        "attn_image_kv_splits_2": ms(lambda: ring_attention(q, kb, vb, valid, backend="image", all_valid=True,
                                                            kv_splits=2)),
        "attn_sdpa_bf16": ms(lambda: torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1)[None], kf.transpose(0, 1)[None], kf.transpose(0, 1)[None])),
        "baseline_cache_work": _bench(lambda: quantize_rows_ref(apply_rope_ref(torch.cat([kf, q]).float(),
                                                                               torch.cat([pos, pos[:n]]), cfg.rope_dims))),
    }
    return res


def _audio(cfg, n):
    a, b = cfg.chunk_sample_range(n)
    return (0.3 * np.sin(np.arange(a, b) * 2 * np.pi * 220 / cfg.audio_sample_rate)).astype(np.float32)


def time_chunks(gen: ChunkGenerator, cfg, warmup: int, chunks: int, hook=None, host: dict | None = None):
    """ms per chunk of the `chunks` after `warmup` (CUDA events on a GPU, the host clock on a CPU) and the latents
    of every chunk run. hook(n, last) runs after chunk n (bench/memory.py's snapshots). `host`, when given, receives
    the timed chunks' host-side phases (`ChunkOutput.timings_ms`: the chunk start before the position-reset check
    — audio features included — and the host's launch of all passes), median ms each."""
    cuda = gen.device.type == "cuda"
    times, lat, phases = [], [], []
    for n in range(warmup + chunks):
        audio = _audio(cfg, n)
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        out = gen.generate_chunk(audio, cfg.audio_sample_rate)
        if cuda:
            end.record()
            torch.cuda.synchronize()
        ms = start.elapsed_time(end) if cuda else (time.perf_counter() - t0) * 1e3
        if n >= warmup:
            times.append(ms)
            phases.append(out.timings_ms)
        lat.append(out.latents.cpu())
        if hook is not None:
            hook(n, n == warmup + chunks - 1)
    if host is not None and phases:
        host.update({k: float(np.median([p[k] for p in phases])) for k in ("reset", "host_launch") if k in phases[0]})
    return times, lat


def compare_o_gemm(cfg, model, options: EngineOptions, timed: ChunkGenerator, lat_timed, args, keep_bf16: bool) -> dict:
    """The same step with the O GEMM in bf16 (bench/ablation_parts.py, bf16_o_gemm), in this process on the same weights:
    timed after the optimized engine, then the optimized engine timed again (A, B, A), so a drift of the card
    shows. ms are medians over `args.chunks` chunks after `args.warmup`; the latents are compared with the timed
    engine's (relative RMS per chunk, max)."""
    if not keep_bf16:
        return {"error": "needs the rank's bf16 projections (TP > 1 keeps them; TP = 1 quantizes in place)"}
    from vivant.bench.ablation_parts import install_bf16_o_gemm

    alt = ChunkGenerator(cfg, mode=CacheMode.OPTIMIZED, device=timed.device, dtype=torch.bfloat16,
                         engine=Engine(install_bf16_o_gemm(model, options), options), seed=args.seed)
    t_alt, lat_alt = time_chunks(alt, cfg, args.warmup, args.chunks)
    del alt
    if timed.device.type == "cuda":
        torch.cuda.empty_cache()
    t_again, _ = time_chunks(timed, cfg, 0, args.chunks)  # warm already: graphs captured
    errs = [float((a - b).norm() / b.norm()) for a, b in zip(lat_alt, lat_timed, strict=True)]
    ms_alt, ms_again = float(np.median(t_alt)), float(np.median(t_again))
    return {"o_gemm": "bf16", "ms": ms_alt, "p99_ms": float(np.percentile(t_alt, 99)),
            "per_chunk_ms": [round(t, 3) for t in t_alt], "optimized_again_ms": ms_again,
            "optimized_again_per_chunk_ms": [round(t, 3) for t in t_again],
            "max_rel_rms_vs_optimized": max(errs)}


def numerics(cfg, model, args, timed: Engine) -> dict:
    """Optimized vs baseline over many chunks with position resets (t_limit lowered to force them).

    mode_only: the same FP8 engine (same FP8 weights, same FP8 activations) with the ring cache + graphs vs the
      baseline cache mode (per-call concat, rotate, quantize) — the difference the cache optimizations make.
    vs_bf16_gemms: the optimized engine vs the bf16 baseline model running on the FP8-dequantized weights —
      adds the FP8 activation quantization of the GEMMs.
    """

    ncfg = ModelConfig.from_name(args.preset, t_limit=args.numerics_t_limit)
    # the timed engine's FP8 model and options, its own graphs and buffers; the baseline cache mode runs eagerly
    fast_o = Engine(timed.model, timed.options)
    fast_b = Engine(timed.model, timed.options.replace(cuda_graphs=False))
    with torch.no_grad():  # the bf16 baseline then runs on exactly the weights the FP8 path holds
        for blk, fblk in zip(model.blocks, timed.model.blocks, strict=True):
            for mod, fmod in ((blk.attn, fblk.attn), (blk.mlp, fblk.mlp)):
                for name in ("qkv", "o") if mod is blk.attn else ("gate_up", "down"):
                    lin, f8 = getattr(mod, name), getattr(fmod, name)
                    lin.weight.copy_((f8.w8.float() * f8.sw[:, None]).to(lin.weight.dtype))
    kw = dict(device="cuda", dtype=torch.bfloat16, seed=7)
    g_o = ChunkGenerator(ncfg, mode=CacheMode.OPTIMIZED, engine=fast_o, **kw)
    g_b = ChunkGenerator(ncfg, mode=CacheMode.BASELINE, engine=fast_b, **kw)
    g_r = ChunkGenerator(ncfg, mode=CacheMode.BASELINE, model=model, **kw)
    e_mode, e_bf16, resets, t_b = [], [], 0, []
    for n in range(args.numerics_chunks):
        a = _audio(ncfg, n)
        oo = g_o.generate_chunk(a, ncfg.audio_sample_rate)
        t0 = time.perf_counter()
        ob = g_b.generate_chunk(a, ncfg.audio_sample_rate)
        t_b.append((time.perf_counter() - t0) * 1e3)
        orf = g_r.generate_chunk(a, ncfg.audio_sample_rate)
        resets += oo.reset
        e_mode.append(float((oo.latents - ob.latents).norm() / ob.latents.norm()))
        e_bf16.append(float((oo.latents - orf.latents).norm() / orf.latents.norm()))
    q = len(e_mode) // 4

    def summary(errs):
        return {"max_rel_rms": max(errs), "first_quarter_max": max(errs[:q]), "last_quarter_max": max(errs[-q:]),
                "rel_rms_per_chunk": [round(e, 6) for e in errs]}

    return {"chunks": len(e_mode), "t_limit": args.numerics_t_limit, "resets": resets,
            "mode_only": summary(e_mode), "vs_bf16_gemms": summary(e_bf16),
            "fp8_engine_baseline_cache_ms_median": float(np.median(t_b[q:]))}


def run(args) -> int:
    memory = StepMemory("cuda")  # first: the CUDA context before this process allocates
    torch.backends.cuda.matmul.allow_tf32 = False
    workspace = prefer_static_gemm_schedule()  # before the first GEMM of the process, as the worker does
    cfg = ModelConfig.from_name(args.preset)
    tp, rank = args.tp, args.rank
    props = torch.cuda.get_device_properties(0)
    splits = args.attn_kv_splits
    if splits == "auto":
        splits = auto_kv_splits(cfg.tokens_per_chunk, cfg.shard_heads(tp), cfg.cache_slots, props.multi_processor_count)
    import triton

    result = {"bench": "step", "preset": cfg.name, "tp": tp, "rank": rank, "gpus": 1, "gpu": props.name,
              "torch": torch.__version__, "triton": triton.__version__, "date": time.strftime("%Y-%m-%d"),
              "chunks": args.chunks, "passes": cfg.passes, "layers": cfg.n_layers,
              "attn_calls_per_chunk": cfg.n_layers * cfg.passes, "attn_backend": args.attn_backend,
              "cublaslt_workspace_kib": workspace, "attn_kv_splits": splits}
    ceil = gemm_ceiling(cfg, tp)
    comp = component_times(cfg, tp, splits)
    result["gemm_ceiling"] = ceil
    result["components_ms_per_call"] = comp
    calls = cfg.n_layers * cfg.passes
    attn_cost = {AttentionBackend.IMAGE: comp["attn_image"]}  # per call, over the bf16 ring
    args.attn_backend = AttentionBackend.IMAGE  # "auto": the GPU's one backend
    result["attn_backend"] = args.attn_backend.value
    flops_chunk = ceil["flops_per_layer_pass"] * calls
    keep_bf16 = tp > 1
    model = build_rank(cfg, tp, rank, keep_bf16=keep_bf16, seed=args.seed, init=args.init)
    result["init"] = args.init
    result["fast_accum"] = args.fast_accum
    options = EngineOptions(fp8=True, attention=args.attn_backend, kv_splits=splits, fast_accum=args.fast_accum,
                            cuda_graphs=not args.no_graphs,
                            gemm_algorithms=getattr(args, "gemm_algorithms", None)
                            or EngineOptions.served("cuda").gemm_algorithms)
    result["ring"] = "bf16"
    result["o_gemm"] = "fp8"
    result["gemm_algorithms"] = options.gemm_algorithms.value
    memory.mark("before_fp8_weights")
    fast = Engine.build(model, options, inplace=not keep_bf16)  # keep_bf16: the float model stays the baseline
    memory.mark("after_fp8_weights")
    result["gemm_plans"] = gemm_plan_report(fast.model)
    result["weights_gb"] = torch.cuda.memory_allocated() / 1e9
    memory.mark("before_cache")
    opt = ChunkGenerator(cfg, mode=CacheMode.OPTIMIZED, device="cuda", dtype=torch.bfloat16, engine=fast,
                         seed=args.seed)
    memory.mark("before_chunk0")
    memory.reset_peak()
    result["optimized_host_ms"] = {}
    t_opt, lat_opt = time_chunks(opt, cfg, args.warmup, args.chunks, memory.chunk_hook(), host=result["optimized_host_ms"])
    result["memory"] = memory.report(fast.model, opt.cache)
    result["optimized_ms"] = float(np.median(t_opt))
    result["optimized_p99_ms"] = float(np.percentile(t_opt, 99))
    result["optimized_per_chunk_ms"] = [round(t, 3) for t in t_opt]
    result["graph_replays"] = fast.graph_replays
    if not args.no_graphs:  # where the GPU time goes, kernel by kernel (CUDA activity of two graph-replayed chunks)
        result["optimized_profile"] = profile_chunks(opt, cfg, args.warmup + args.chunks)
    if getattr(args, "compare_o_gemm", False):
        result["o_gemm_compare"] = compare_o_gemm(cfg, model, options, opt, lat_opt, args, keep_bf16)
    result["fp8_tflops"] = flops_chunk / result["optimized_ms"] / 1e9
    result["pct_fp8_ceiling"] = 100.0 * result["fp8_tflops"] / ceil["fp8_ceiling_tflops"]
    o = result["optimized_ms"]
    gem = ceil["fp8_ms_per_layer_pass"] * calls
    split = splits > 1 and args.attn_backend is AttentionBackend.IMAGE  # the split attention quantizes its output
    att = (comp["attn_image_split_fp8"] if split else attn_cost[args.attn_backend]) * calls
    # per layer-pass: 2 residual_ln_mod_quant, swiglu_quant, quant_rows (unless split), qkv_ring_write
    # (+ one ln_mod_quant per pass)
    elem = ((2 * comp["residual_ln_mod_quant"] + comp["swiglu_quant"] + (0 if split else comp["quant_rows_o"])
             + comp["qkv_ring_write"]) * calls + comp["ln_mod_quant"] * cfg.passes)
    # NVLink estimate for the two all-reduces per layer-pass (757×8192 bf16 = 12.4 MB each), reported apart:
    # ring all-reduce moves 2·(W−1)/W of the buffer per GPU; at ~360 GB/s achieved bus bandwidth per GPU.
    ar_bytes = cfg.tokens_per_chunk * cfg.d_model * 2
    ar_ms = 2 * (tp - 1) / tp * ar_bytes / 360e9 * 1e3 if tp > 1 else 0.0
    result["allreduce_estimate_ms_per_chunk"] = 2 * ar_ms * calls
    result["allreduce_note"] = ("not in optimized_ms/baseline_ms: estimated from bytes at 360 GB/s NVLink bus "
                                "bandwidth; measured on several GPUs by the multi-GPU issue")
    result["optimized_breakdown_ms"] = {"gemms": gem, "attention": att, "fused_quant_elementwise": elem,
                                        "other": o - gem - att - elem}
    if keep_bf16 and args.mode in ("both", CacheMode.BASELINE):
        base = ChunkGenerator(cfg, mode=CacheMode.BASELINE, device="cuda", dtype=torch.bfloat16, model=model,
                              seed=args.seed)
        t_base, lat_base = time_chunks(base, cfg, args.warmup, args.chunks)
        result["baseline_ms"] = float(np.median(t_base))
        result["baseline_p99_ms"] = float(np.percentile(t_base, 99))
        result["baseline_per_chunk_ms"] = [round(t, 3) for t in t_base]
        result["speedup"] = result["baseline_ms"] / result["optimized_ms"]
        b = result["baseline_ms"]
        bgem = ceil["bf16_ms_per_layer_pass"] * calls
        batt = comp["attn_sdpa_bf16"] * calls
        bcache = comp["baseline_cache_work"] * calls
        result["baseline_breakdown_ms"] = {"gemms": bgem, "attention": batt, "cache_work": bcache,
                                           "other": b - bgem - batt - bcache}
        errs = [float((a - bb).norm() / bb.norm()) for a, bb in zip(lat_opt, lat_base, strict=True)]
        result["rel_rms_per_chunk"] = [round(e, 6) for e in errs]
        result["max_rel_rms"] = max(errs)
        if args.numerics_chunks:
            result["numerics"] = numerics(cfg, model, args, fast)  # the timed engine's FP8 weights and settings
    text = json.dumps(result, indent=2)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    if args.json:
        print(text)
    else:
        print(f"{cfg.name} tp={tp} rank={rank} on {props.name}")
        for k in ("baseline_ms", "optimized_ms", "speedup", "fp8_tflops", "pct_fp8_ceiling", "max_rel_rms"):
            if k in result:
                print(f"  {k:<18} {result[k]:.3f}")
    return 0
