"""`vivant bench step --ablation`: each of the engine's choices measured against its absence, in one process on
the same weights (docs/BENCHMARKS.md's head table; docs/ARCHITECTURE.md, "The engine's choices and their ablation").

Rows (one engine each, built, timed and freed before the next; the FP8 rows share one FP8 quantization of the
rank's bf16 weights, the bf16-GEMM row and the baseline run those bf16 weights themselves). A row undoes one
choice either by an option of the served engine (EngineOptions) or by a variant's parts swapped into it
(bench/ablation_parts.py):
  baseline        the eager float parts with the baseline cache (per-call whole-cache work): the original step
                  and the numerics reference
  optimized       the served engine (EngineOptions.served: FP8 GEMMs, fused kernels, the bf16 ring read by image
                  attention with split-KV, tuned GEMM algorithms, CUDA graphs)
  whole_window    variant: the window kept un-rotated, re-rotated on every attention call (compiled)
  bf16_gemm       variant: bf16 GEMMs, the norm/modulation and SwiGLU compiled with bf16 output
  heuristic_gemm  gemm_algorithms = heuristic: cuBLASLt's first answer for every GEMM
  residual_after_gemm  residual_in_gemm = False: the O and down GEMMs write their product and the fused residual
                  kernel adds it (instead of the GEMMs' epilogue adding the residual, the gate in their scales)
  unfused_norm    variant: residual, LayerNorm, modulation, SwiGLU as torch ops, then quant_rows
  no_cuda_graphs  cuda_graphs = False: every pass launched eagerly
  no_split_kv     kv_splits = 1: one attention call over all slots
The rows with compiled parts (whole_window, bf16_gemm) run under CUDA graphs; should their capture fail, the row
runs again without graphs and says so in its "note". A row that fails otherwise carries its "error"; the others
still run.
Each row: median and p99 ms per chunk over `--chunks` chunks after `--warmup`, its ratio to the optimized median,
and the relative RMS (‖a − b‖ / ‖b‖) of its latents against the baseline's over every chunk it ran (warm-up
included: the same seed and audio per chunk). On a CPU (`--preset tiny --device cpu`) the same harness runs with
the kernels' twins: a structure check, not a performance claim (no_cuda_graphs and no_split_kv equal optimized
there). GPU only: the whole-window policy's per-call kernel time beside the ring write's at these shapes, and the
optimized engine's memory (bench/memory.py).
"""

from __future__ import annotations

import gc
import json
import platform
import shlex
import time

import numpy as np
import torch
from vivant.bench.ablation_parts import WholeWindowCache, install_variant
from vivant.bench.harness import build_rank, time_chunks
from vivant.bench.memory import StepMemory
from vivant.worker.model.config import ModelConfig
from vivant.worker.model.engine import Engine
from vivant.worker.model.fast_parts import auto_kv_splits, install_parts
from vivant.worker.model.generator import ChunkGenerator
from vivant.worker.model.options import CacheMode, EngineOptions, GemmAlgorithms

ROWS = ("baseline", "optimized", "whole_window", "bf16_gemm", "heuristic_gemm", "residual_after_gemm", "unfused_norm",
        "no_cuda_graphs", "no_split_kv")
UNDONE = {"baseline": "everything: eager float parts, per-call whole-cache work", "optimized": "nothing",
          "whole_window": "the ring (whole-window re-rotation per call)",
          "bf16_gemm": "FP8 GEMMs (bf16 GEMMs)",
          "heuristic_gemm": "the tuned cuBLASLt algorithms (each GEMM takes the heuristic's first answer)",
          "residual_after_gemm": "the residual add in the O/down GEMMs' epilogue (the GEMM writes its product, the "
                                 "fused residual kernel adds it)",
          "unfused_norm": "the fused norm/modulation/quantization kernels",
          "no_cuda_graphs": "CUDA graphs", "no_split_kv": "split-KV attention (kv_splits = 1)"}


HOW = {"whole_window": "the window kept un-rotated in bf16; per attention call every key re-rotated by one "
                       "torch.compile'd function (bench/ablation_parts.py), then the image attention the ring uses",
       "bf16_gemm": "F.linear on the bf16 weights; residual/LayerNorm/modulation and SwiGLU are the float parts "
                    "torch.compile'd (inductor-fused) with bf16 output: kernels/fused_quant.py has no non-quantizing "
                    "variant; attention output unquantized; the ring stays bf16",
       "unfused_norm": "residual add, LayerNorm, modulation and SwiGLU as torch ops (the float parts), then "
                       "quant_rows (kernels/fused_quant.py)"}
COMPILED_ROWS = ("whole_window", "bf16_gemm")  # torch.compile'd parts: run eagerly, with a note, if capture fails


VARIANT_ROWS = ("whole_window", "bf16_gemm", "unfused_norm")  # parts swapped in (bench/ablation_parts.py)


def variant_options(optimized: EngineOptions) -> dict[str, EngineOptions | None]:
    """Each row's options: the optimized engine with exactly one choice undone (baseline: None, the float parts);
    a variant row runs the optimized options with its parts swapped in."""
    return {"baseline": None, "optimized": optimized, "whole_window": optimized, "bf16_gemm": optimized,
            "heuristic_gemm": optimized.replace(gemm_algorithms=GemmAlgorithms.HEURISTIC),
            "residual_after_gemm": optimized.replace(residual_in_gemm=False), "unfused_norm": optimized,
            "no_cuda_graphs": optimized.replace(cuda_graphs=False),
            "no_split_kv": optimized.replace(kv_splits=1)}


def _options_json(o: EngineOptions | None, variant: str | None = None) -> dict | None:
    if o is None:
        return None
    return {"attention": o.attention.value, "kv_splits": o.kv_splits, "fast_accum": o.fast_accum,
            "cuda_graphs": o.cuda_graphs, "ring": "bf16", "gemm_algorithms": o.gemm_algorithms.value,
            "residual_in_gemm": o.residual_in_gemm, **({"variant": variant} if variant else {})}


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def _timed(gen: ChunkGenerator, cfg: ModelConfig, args, memory: StepMemory | None):
    if memory is not None:
        memory.mark("before_chunk0")
        memory.reset_peak()
    return time_chunks(gen, cfg, args.warmup, args.chunks, memory.chunk_hook() if memory is not None else None)


def run_row(name: str, options: EngineOptions | None, *, cfg: ModelConfig, model, fp8_model, device: torch.device,
            args, memory: StepMemory | None = None) -> tuple[dict, list[torch.Tensor]]:
    """Build one row's engine, time it, free it. Returns (the row without ratios/numerics, its latents)."""
    variant = name if name in VARIANT_ROWS else None
    row: dict = {"row": name, "undone": UNDONE[name], "options": _options_json(options, variant)}
    if name in HOW:
        row["implementation"] = HOW[name]
    kw = dict(device=device, dtype=torch.bfloat16, seed=args.seed)
    if options is None:
        gen = ChunkGenerator(cfg, mode=CacheMode.BASELINE, model=model, **kw)
    else:
        parts = (install_variant(variant, model=model, fp8_model=fp8_model, options=options) if variant else
                 install_parts(fp8_model, options))
        engine = Engine(parts, options)
        if memory is not None:
            memory.mark("before_cache")
        gen = ChunkGenerator(cfg, mode=CacheMode.OPTIMIZED, engine=engine, **kw)
        if variant == "whole_window":
            WholeWindowCache.adopt(gen.cache)
        del engine, parts
    try:
        times, lat = _timed(gen, cfg, args, memory)
        row["graph_replays"], row["eager_calls"] = gen.engine.graph_replays, gen.engine.eager_calls
        if memory is not None:
            row["memory"] = memory.report(gen.engine.model, gen.cache)
    finally:
        del gen
        _free(device)
    row.update(ms=float(np.median(times)), p99_ms=float(np.percentile(times, 99)),
               per_chunk_ms=[round(t, 3) for t in times])
    return row, lat


def policy_kernel_times(cfg: ModelConfig, tp: int) -> dict:
    """Per call, at this rank's shapes (GPU), with the served bf16 ring: the ring write (kernels/qkv_ring.py: q/k
    norm, RoPE, the chunk into the ring) beside the whole-window policy's per-call work standing in for it (q/k
    norm + RoPE(q), the chunk's un-rotated k, v into the store, the compiled re-rotation of the whole window) and
    that compiled function alone. µs per call replayed in a CUDA graph (as the engine runs them) and by do_bench
    (cold L2), and ms per chunk (× layers × passes). JSON: {"bf16": {name: times}} (the ring format as the key)."""
    from vivant.bench.ablation_parts import WindowStore
    from vivant.bench.harness import do_bench_ms, graph_us
    from vivant.kernels.qk_norm_rope import qk_norm_rope
    from vivant.kernels.qkv_ring import qkv_ring_write

    n, h, d, s = cfg.tokens_per_chunk, cfg.shard_heads(tp), cfg.head_dim, cfg.cache_slots
    dev, bf = torch.device("cuda"), torch.bfloat16
    qkv = torch.randn(n, 3 * h * d, device=dev, dtype=bf)
    w = torch.ones(d, device=dev, dtype=bf)
    cos, sin = torch.rand(n, d // 2, device=dev), torch.rand(n, d // 2, device=dev)
    slots = torch.randperm(s, device=dev)[:n]
    positions = torch.randint(0, 40, (s, 3), device=dev)
    calls = cfg.n_layers * cfg.passes
    out: dict = {"calls_per_chunk": calls, "shapes": {"tokens": n, "heads": h, "head_dim": d, "slots": s}}
    kc, vc = torch.zeros(s, h, d, device=dev, dtype=bf), torch.zeros(s, h, d, device=dev, dtype=bf)
    store = WindowStore(layers=1, slots=s, heads=h, head_dim=d, dtype=bf, device=dev, compiled=True)
    store.k.normal_()
    store.v.normal_()
    store.set_angles(positions, cfg.rope_dims, cfg.rope_theta)

    def ring_write():
        qkv_ring_write(qkv, w, w, cos, sin, slots, kc, vc, h)

    def window_function():
        store.images(0)

    def window_call():
        q_rot, k = qk_norm_rope(qkv, w, w, cos, sin, h)
        store.write(0, k, qkv.view(n, 3, h, d)[:, 2], slots)
        store.images(0)

    out["bf16"] = {}
    for name, fn in (("ring_write", ring_write), ("whole_window_call", window_call),
                     ("whole_window_function", window_function)):
        fn()  # compiles the whole-window function before any capture
        torch.cuda.synchronize()
        g_us, b_us = graph_us(fn), do_bench_ms(fn) * 1e3
        out["bf16"][name] = {"graph_us_per_call": g_us, "do_bench_us_per_call": b_us,
                             "graph_ms_per_chunk": g_us * calls / 1e3, "do_bench_ms_per_chunk": b_us * calls / 1e3}
    return out


def command(args) -> str:
    """The `vivant bench step` command line that reproduces this run (from the parsed arguments)."""
    parts = ["vivant", "bench", "step", "--ablation", "--preset", args.preset, "--tp", str(args.tp), "--rank",
             str(args.rank), "--device", args.device, "--chunks", str(args.chunks), "--warmup", str(args.warmup),
             "--attn-kv-splits", str(args.attn_kv_splits), "--init", args.init, "--seed", str(args.seed)]
    if getattr(args, "ablation_rows", None):
        parts += ["--ablation-rows", args.ablation_rows]
    return shlex.join(parts)


def machine(device: torch.device) -> dict:
    info = {"device": device.type, "cpu": platform.processor() or platform.machine(), "python": platform.python_version(),
            "torch": torch.__version__}
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(gpu=props.name, sms=props.multi_processor_count, gpu_memory_bytes=props.total_memory)
    return info


def run(args) -> int:
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    memory = StepMemory(device) if cuda else None  # first: the CUDA context before this process allocates
    cfg = ModelConfig.from_name(args.preset)
    workspace = None
    if cuda:
        from vivant.kernels.fp8_gemm import prefer_static_gemm_schedule

        torch.backends.cuda.matmul.allow_tf32 = False
        workspace = prefer_static_gemm_schedule()  # before the first GEMM of the process, as the worker does
    sms = torch.cuda.get_device_properties(device).multi_processor_count if cuda else 0
    splits = args.attn_kv_splits
    if splits == "auto":
        splits = auto_kv_splits(cfg.tokens_per_chunk, cfg.shard_heads(args.tp), cfg.cache_slots, sms)
    optimized = EngineOptions.served(device).replace(kv_splits=splits)
    result: dict = {
        "bench": "step_ablation", "preset": cfg.name, "tp": args.tp, "rank": args.rank, "gpus": 1 if cuda else 0,
        "machine": machine(device), "date": time.strftime("%Y-%m-%d"), "chunks": args.chunks, "warmup": args.warmup,
        "passes": cfg.passes, "layers": cfg.n_layers, "init": args.init, "seed": args.seed,
        "command": command(args), "cublaslt_workspace_kib": workspace, "ring": "bf16",
        "reference": "the baseline row: the float parts (bf16 GEMMs and attention on the same bf16 weights, eager) with "
                     "the baseline cache; numerics = relative RMS of each chunk's latents against it",
    }
    model = build_rank(cfg, args.tp, args.rank, keep_bf16=True, seed=args.seed, device=str(device), init=args.init)
    if memory is not None:
        memory.mark("before_fp8_weights")
    fp8_model = install_parts(model, EngineOptions(fp8=True))  # one FP8 quantization, shared by the FP8 rows
    if memory is not None:
        memory.mark("after_fp8_weights")
    rows, lats = {}, {}
    variants = variant_options(optimized)
    only = getattr(args, "ablation_rows", None)
    if only:
        wanted = {"baseline", "optimized", *only.split(",")}
        unknown = wanted - set(variants)
        if unknown:
            raise ValueError(f"--ablation-rows names {sorted(unknown)}; expected rows among {list(variants)}")
        variants = {k: v for k, v in variants.items() if k in wanted}
    for name, options in variants.items():
        attempts = [options]
        if name in COMPILED_ROWS and options.cuda_graphs:
            attempts.append(options.replace(cuda_graphs=False))
        errors = []
        for opts in attempts:
            try:
                rows[name], lats[name] = run_row(name, opts, cfg=cfg, model=model, fp8_model=fp8_model, device=device,
                                                 args=args, memory=memory if name == "optimized" else None)
                break
            except Exception as exc:  # reported in the row; the other rows still run
                errors.append(f"{type(exc).__name__}: {exc}")
                _free(device)
        if name not in rows:
            rows[name] = {"row": name, "undone": UNDONE[name], "options": _options_json(options),
                          "error": " | then: ".join(errors)}
        elif errors:
            rows[name]["note"] = f"run without CUDA graphs: under graphs it failed ({errors[0]})"
        _summarize(rows, lats)
        result["rows"] = [rows[n] for n in ROWS if n in rows]
        _write(result, args)  # after every row: a run cut short still leaves what it measured
    result["memory"] = rows["optimized"].get("memory")
    if cuda:
        del model, fp8_model
        _free(device)
        try:
            result["policy_kernels"] = policy_kernel_times(cfg, args.tp)
        except Exception as exc:  # the rows above stand without it
            result["policy_kernels_error"] = f"{type(exc).__name__}: {exc}"
    text = _write(result, args)
    if args.json:
        print(text)
    else:
        _print_table(result, cfg, args, device)
    return 0


def _summarize(rows: dict, lats: dict) -> None:
    """Each timed row's ratio to the optimized median and its numerics against the baseline (when both ran)."""
    opt_ms = rows.get("optimized", {}).get("ms")
    ref = lats.get("baseline")
    for name, row in rows.items():
        if "ms" not in row:
            continue
        row["x_optimized"] = row["ms"] / opt_ms if opt_ms else None
        if ref is not None and name in lats:
            errs = [float((a - b).norm() / b.norm()) for a, b in zip(lats[name], ref, strict=True)]
            row["numerics"] = {"chunks": len(errs), "max_rel_rms": max(errs), "median_rel_rms": float(np.median(errs)),
                               "rel_rms_per_chunk": [round(e, 6) for e in errs]}


def _write(result: dict, args) -> str:
    text = json.dumps(result, indent=2)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return text


def _print_table(result: dict, cfg: ModelConfig, args, device: torch.device) -> None:
    print(f"{cfg.name} tp={args.tp} rank={args.rank} on {result['machine'].get('gpu', device.type)}")
    print(f"{'row':<16} {'ms/chunk':>10} {'p99':>10} {'× opt':>7} {'max rel RMS':>12}")
    for r in result["rows"]:
        if "error" in r:
            print(f"{r['row']:<16} error: {r['error']}")
            continue
        x = r.get("x_optimized")
        err = r.get("numerics", {}).get("max_rel_rms")
        x_text = "—" if x is None else f"{x:.2f}"
        err_text = "—" if err is None else f"{100 * err:.2f} %"
        print(f"{r['row']:<16} {r['ms']:>10.2f} {r['p99_ms']:>10.2f} {x_text:>7} {err_text:>12}")
