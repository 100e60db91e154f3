"""`vivant bench step` on a GPU: one tensor-parallel rank of a preset (57b: 16 heads, QKV N=6144, O K=2048,
gate+up N=13824, down K=6912 at TP = 4) with random bf16 weights, the served engine against the eager baseline in
one process on the same weights.

  optimized  the engine a worker serves (`EngineOptions.served`: FP8 GEMMs with cuBLASLt's tuned algorithms, the
             fused row kernels, the ring written at write time and read by cuDNN attention with split-KV, one CUDA
             graph per pass); `--attn-kv-splits` alone may change the split
  baseline   the original step (TP > 1 only: a TP = 1 rank keeps no bf16 copy): the float parts in bf16, eager,
             with per-call whole-cache work (concatenate the cache with the new tokens, rotate every key, quantize)

The all-reduce after O and down is left out (identity; one GPU cannot time a 4-GPU NVLink reduction). Reported:
median / p99 ms per chunk and every chunk's time; the FP8 GEMM ceiling (`torch._scaled_mm` rowwise and bf16 at the
rank's four shapes, replayed in CUDA graphs) and the achieved FP8 TFLOP/s against it; where the device time goes
(torch.profiler over two graph-replayed chunks: ms per chunk by kernel category, the top kernels, the idle gaps);
the host's chunk-start phases; the engine's per-shape GEMM algorithms; its memory by part (bench/memory.py); with
`--mode both`, the latents' relative RMS against the baseline, and with `--numerics-chunks N` the ring against the
baseline cache in the same FP8 engine over N chunks with position resets (`t_limit` lowered to force them).
"""

from __future__ import annotations

import math
import shlex
import sys
import time

import numpy as np
import torch
from vivant.bench.harness import build_rank, chunk_audio, emit_result, graph_us, time_chunks
from vivant.bench.memory import StepMemory
from vivant.kernels.fp8_gemm import fp8_linear, prefer_static_gemm_schedule, quantize_weight
from vivant.kernels.fused_quant import quant_rows
from vivant.worker.model.config import ModelConfig
from vivant.worker.model.engine import Engine
from vivant.worker.model.fast_parts import auto_kv_splits, gemm_plan_report
from vivant.worker.model.generator import ChunkGenerator
from vivant.worker.model.options import CacheMode, EngineOptions
from vivant.worker.model.tp import local_shapes

GEMM_NAMES = ("gemm", "xmma", "cutlass", "scaled_mm", "cublas", "sm90_")
ATTENTION_NAMES = ("fmha", "flash", "sdpa", "attention", "_ring_attn", "cudnn")
FUSED_NAMES = ("_ln_mod", "_residual_ln", "_swiglu", "_quant_rows", "_qk_norm", "_write_kv", "_qkv_ring")


def categorize(name: str) -> str:
    """The profile category of a CUDA kernel by its name: gemms, attention, dequant, fused_kernels or other."""
    low = name.lower()
    if any(t in low for t in GEMM_NAMES) and not any(t in low for t in ("fmha", "sdpa", "flash")):
        return "gemms"
    if any(t in low for t in ATTENTION_NAMES):
        return "attention"
    if "_dequant" in low:
        return "dequant"
    if any(t in low for t in FUSED_NAMES):
        return "fused_kernels"
    return "other"


def device_gaps(spans: list[tuple[float, float, str]], chunks: int) -> dict:
    """Idle device time between consecutive device events (µs timestamps from the profiler), per chunk: in total,
    split at 20 µs (launch gaps inside a graph vs the host making the device wait), and the largest gaps with the
    events on either side."""
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


def profile_chunks(gen: ChunkGenerator, cfg: ModelConfig, start: int, n: int = 2) -> dict:
    """torch.profiler's CUDA activity over chunks start .. start + n − 1: ms per chunk by category, the 25 kernels
    with the most time (calls and ms per chunk), and the idle gaps between device events."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for i in range(n):
            gen.generate_chunk(chunk_audio(cfg, start + i), cfg.audio_sample_rate)
        torch.cuda.synchronize()
    cats: dict[str, float] = {}
    kernels: dict[str, list] = {}
    spans: list[tuple[float, float, str]] = []
    for ev in prof.events():
        if ev.device_type != torch.autograd.DeviceType.CUDA or ev.device_time_total <= 0:
            continue
        dur = ev.device_time_total
        spans.append((ev.time_range.start, ev.time_range.end, ev.name[:60]))
        cat = categorize(ev.name)
        cats[cat] = cats.get(cat, 0.0) + dur / 1e3 / n
        k = kernels.setdefault(ev.name[:90], [0, 0.0])
        k[0] += 1
        k[1] += dur / 1e3 / n
    top = sorted(kernels.items(), key=lambda kv: -kv[1][1])[:25]
    return {"kernel_events": len(spans), "ms_per_chunk_by_category": cats,
            "top_kernels_ms_per_chunk": {k: {"calls_per_chunk": v[0] / n, "ms": v[1]} for k, v in top},
            "gaps": device_gaps(spans, n)}


def gemm_ceiling(cfg: ModelConfig, tp: int) -> dict:
    """The four projections' GEMMs alone at the rank's shapes (M = new tokens per chunk), FP8 rowwise and bf16,
    ms per call replayed in CUDA graphs, and the FP8 rate over one layer-pass: the ceiling the step is held to."""
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
        out[name] = {"N": n, "K": k, "fp8_ms": ms8, "bf16_ms": ms16, "fp8_tflops": f / ms8 / 1e9,
                     "bf16_tflops": f / ms16 / 1e9}
        total_ms += ms8
        flops += f
    out["fp8_ms_per_layer_pass"] = total_ms
    out["fp8_ceiling_tflops"] = flops / total_ms / 1e9
    out["bf16_ms_per_layer_pass"] = sum(v["bf16_ms"] for v in out.values() if isinstance(v, dict))
    out["flops_per_layer_pass"] = flops
    return out


def numerics(args, model: torch.nn.Module, timed: Engine) -> dict:
    """The ring against the baseline cache over `args.numerics_chunks` chunks with position resets.

    mode_only: the timed engine's FP8 weights and options with the ring (graphs) against the same FP8 engine with
      the baseline cache mode (per-call concatenate, rotate, quantize; eager) — what the cache optimizations change.
    vs_bf16_gemms: the ring against the bf16 baseline model on the FP8-dequantized weights — adds the FP8
      activation quantization of the GEMMs.
    """
    ncfg = ModelConfig.from_name(args.preset, t_limit=args.numerics_t_limit)
    fast_o = Engine(timed.model, timed.options)
    fast_b = Engine(timed.model, timed.options.replace(cuda_graphs=False))
    with torch.no_grad():  # the bf16 baseline then runs on exactly the weights the FP8 path holds
        for blk, fblk in zip(model.blocks, timed.model.blocks, strict=True):
            for mod, fmod in ((blk.attn, fblk.attn), (blk.mlp, fblk.mlp)):
                for name in ("qkv", "o") if mod is blk.attn else ("gate_up", "down"):
                    lin, f8 = getattr(mod, name), getattr(fmod, name)
                    lin.weight.copy_((f8.w8.float() * f8.sw[:, None]).to(lin.weight.dtype))
    kw = dict(device="cuda", dtype=torch.bfloat16, seed=7)
    g_ring = ChunkGenerator(ncfg, mode=CacheMode.OPTIMIZED, engine=fast_o, **kw)
    g_base = ChunkGenerator(ncfg, mode=CacheMode.BASELINE, engine=fast_b, **kw)
    g_bf16 = ChunkGenerator(ncfg, mode=CacheMode.BASELINE, model=model, **kw)
    e_mode, e_bf16, resets = [], [], 0
    for n in range(args.numerics_chunks):
        audio = chunk_audio(ncfg, n)
        ring = g_ring.generate_chunk(audio, ncfg.audio_sample_rate)
        base = g_base.generate_chunk(audio, ncfg.audio_sample_rate)
        bf16 = g_bf16.generate_chunk(audio, ncfg.audio_sample_rate)
        resets += ring.reset
        e_mode.append(float((ring.latents - base.latents).norm() / base.latents.norm()))
        e_bf16.append(float((ring.latents - bf16.latents).norm() / bf16.latents.norm()))
    q = len(e_mode) // 4

    def summary(errs):
        return {"max_rel_rms": max(errs), "first_quarter_max": max(errs[:q]), "last_quarter_max": max(errs[-q:]),
                "rel_rms_per_chunk": [round(e, 6) for e in errs]}

    return {"chunks": len(e_mode), "t_limit": args.numerics_t_limit, "resets": resets,
            "mode_only": summary(e_mode), "vs_bf16_gemms": summary(e_bf16)}


def _times(result: dict, key: str, times: list[float]) -> None:
    result[f"{key}_ms"] = float(np.median(times))
    result[f"{key}_p99_ms"] = float(np.percentile(times, 99))
    result[f"{key}_per_chunk_ms"] = [round(t, 3) for t in times]


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
    options = EngineOptions.served("cuda").replace(kv_splits=splits)
    import triton

    result = {"bench": "step", "command": "vivant " + shlex.join(sys.argv[1:]), "date": time.strftime("%Y-%m-%d"),
              "preset": cfg.name, "tp": tp, "rank": rank, "gpus": 1, "gpu": props.name, "torch": torch.__version__,
              "triton": triton.__version__, "chunks": args.chunks, "warmup": args.warmup, "passes": cfg.passes,
              "layers": cfg.n_layers, "init": args.init, "cublaslt_workspace_kib": workspace,
              "engine_options": {k: getattr(v, "value", v) for k, v in vars(options).items()}}
    ceil = gemm_ceiling(cfg, tp)
    result["gemm_ceiling"] = ceil
    keep_bf16 = tp > 1
    model = build_rank(cfg, tp, rank, keep_bf16=keep_bf16, seed=args.seed, init=args.init)
    memory.mark("before_fp8_weights")
    fast = Engine.build(model, options, inplace=not keep_bf16)  # keep_bf16: the float model stays the baseline
    memory.mark("after_fp8_weights")
    result["gemm_plans"] = gemm_plan_report(fast.model)
    result["weights_gb"] = torch.cuda.memory_allocated() / 1e9  # the engine's weights (and the baseline's at TP > 1)
    memory.mark("before_cache")
    opt = ChunkGenerator(cfg, mode=CacheMode.OPTIMIZED, device="cuda", dtype=torch.bfloat16, engine=fast,
                         seed=args.seed)
    memory.mark("before_chunk0")
    memory.reset_peak()
    result["optimized_host_ms"] = {}
    t_opt, lat_opt = time_chunks(opt, cfg, args.warmup, args.chunks, memory.chunk_hook(),
                                 host=result["optimized_host_ms"])
    result["memory"] = memory.report(fast.model, opt.cache)
    _times(result, "optimized", t_opt)
    result["graph_replays"] = fast.graph_replays
    result["optimized_profile"] = profile_chunks(opt, cfg, args.warmup + args.chunks)
    result["fp8_tflops"] = ceil["flops_per_layer_pass"] * cfg.n_layers * cfg.passes / result["optimized_ms"] / 1e9
    result["pct_fp8_ceiling"] = 100.0 * result["fp8_tflops"] / ceil["fp8_ceiling_tflops"]
    if keep_bf16 and args.mode in ("both", CacheMode.BASELINE):
        base = ChunkGenerator(cfg, mode=CacheMode.BASELINE, device="cuda", dtype=torch.bfloat16, model=model,
                              seed=args.seed)
        t_base, lat_base = time_chunks(base, cfg, args.warmup, args.chunks)
        _times(result, "baseline", t_base)
        result["speedup"] = result["baseline_ms"] / result["optimized_ms"]
        errs = [float((a - b).norm() / b.norm()) for a, b in zip(lat_opt, lat_base, strict=True)]
        result["rel_rms_per_chunk"] = [round(e, 6) for e in errs]
        result["max_rel_rms"] = max(errs)
        if args.numerics_chunks:
            result["numerics"] = numerics(args, model, fast)
    emit_result(result, args.out, args.json)
    if not args.json:
        print(f"{cfg.name} tp={tp} rank={rank} on {props.name}")
        for k in ("baseline_ms", "optimized_ms", "speedup", "fp8_tflops", "pct_fp8_ceiling", "max_rel_rms"):
            if k in result:
                print(f"  {k:<18} {result[k]:.3f}")
    return 0
