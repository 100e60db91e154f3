"""The benchmarks' shared harness: one tensor-parallel rank of random weights built on the device, the audio every
benchmark chunk is driven by, and the three ways a benchmark times work.

  build_rank    one rank's shard of a preset, materialized block by block (never the whole model in bf16), its four
                projections optionally quantized to FP8 as each block is built
  chunk_audio   chunk n's audio: a 220 Hz sine at 0.3 amplitude over the chunk's samples (float32)
  time_chunks   ms per chunk of a `ChunkGenerator` (CUDA events on a GPU, the host clock on a CPU) and its latents
  graph_us      µs per call of a function replayed inside one CUDA graph (how the engine runs its kernels)
  do_bench_ms   ms per call of a function launched eagerly (Triton's do_bench median: cold L2, host launches)

Used by `vivant bench step` (bench/step.py, bench/step_gpu.py) and `vivant bench step --ablation`
(bench/ablation.py); the CPU tests run `build_rank` and `time_chunks` at the tiny shapes.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from vivant.worker.model.config import ModelConfig
from vivant.worker.model.fast_parts import Fp8Linear
from vivant.worker.model.generator import ChunkGenerator
from vivant.worker.model.model import VideoDiT
from vivant.worker.model.tp import apply_tensor_parallel

INITS = ("unit", "scaled")
RESIDUAL_OUT = ("attn.o.weight", "mlp.down.weight")  # the projections that write into the residual stream


def do_bench_ms(fn: Callable[[], object], rep_ms: int = 200) -> float:
    """ms per call of fn, launched eagerly: the median of Triton's do_bench (25 ms of warm-up, `rep_ms` of calls)."""
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=25, rep=rep_ms, return_mode="median"))


def graph_us(fn: Callable[[], object], inner: int = 20, reps: int = 30) -> float:
    """µs per call of fn, replayed inside one CUDA graph of `inner` calls (median of `reps` replays)."""
    from vivant.kernels import cublaslt

    return cublaslt.graph_us(lambda i: fn(), inner, reps)


@torch.no_grad()
def init_weights_(module: torch.nn.Module, gen: torch.Generator, init: str = "unit", n_layers: int = 1) -> None:
    """Random weights of the exact shapes, in place. "unit": every matrix N(0, 1/fan_in). "scaled": the same, with
    the two residual-writing projections (attention O, MLP down) further scaled by 1/sqrt(2·n_layers), the standard
    deep-transformer initialization (GPT-2, Megatron-LM) that bounds the residual stream's growth over depth. Why it
    matters: at unit gain a 60-layer random network amplifies rounding-sized differences several-fold, a property of
    those weights and not of any engine, which would hide the numerics the step benchmark reports."""
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
               device: str = "cuda", init: str = "unit") -> VideoDiT:
    """Rank `rank` of `tp` of the preset `cfg`, in bf16 on `device` with random weights (`init_weights_`).

    keep_bf16=False quantizes each block's four projections to FP8 as it is built (`Fp8Linear`), freeing their bf16
    weights, so a 57b rank fits beside nothing else; True keeps the bf16 projections (the baseline and the engine's
    FP8 copy then share the device). reduce="none" leaves the all-reduce after O and down out (identity): one GPU
    cannot time a 4-GPU NVLink reduction, and a local stand-in would only measure this GPU's memory traffic; "dist"
    on a real TP group."""
    dev = torch.device(device)
    with torch.device("meta"):
        model = VideoDiT(cfg)
    model = apply_tensor_parallel(model, rank, tp, reduce=reduce) if tp > 1 else model
    gen = torch.Generator(device=dev).manual_seed(seed)
    for name, mod in model.named_children():
        if name != "blocks":
            mod.to_empty(device=dev)
            mod.to(torch.bfloat16)
            init_weights_(mod, gen, init, cfg.n_layers)
    model.audio_pos = torch.nn.Parameter(torch.empty_like(model.audio_pos, device=dev, dtype=torch.bfloat16))
    model.audio_pos.data.normal_(0, 0.02, generator=gen)
    for blk in model.blocks:
        blk.to_empty(device=dev)
        blk.to(torch.bfloat16)
        init_weights_(blk, gen, init, cfg.n_layers)
        if not keep_bf16:
            for mod, name in ((blk.attn, "qkv"), (blk.attn, "o"), (blk.mlp, "gate_up"), (blk.mlp, "down")):
                setattr(mod, name, Fp8Linear.of(getattr(mod, name), fast_accum=False))
    model.eval()
    return model


def chunk_audio(cfg: ModelConfig, n: int) -> np.ndarray:
    """Chunk n's audio samples at cfg.audio_sample_rate: a 220 Hz sine at amplitude 0.3, float32."""
    a, b = cfg.chunk_sample_range(n)
    return (0.3 * np.sin(np.arange(a, b) * 2 * np.pi * 220 / cfg.audio_sample_rate)).astype(np.float32)


def time_chunks(gen: ChunkGenerator, cfg: ModelConfig, warmup: int, chunks: int,
                hook: Callable[[int, bool], None] | None = None,
                host: dict | None = None) -> tuple[list[float], list[torch.Tensor]]:
    """ms per chunk of the `chunks` after `warmup` (CUDA events on a GPU, the host clock on a CPU) and the latents
    of every chunk run (on the CPU). hook(n, last) runs after chunk n (bench/memory.py's snapshots). `host`, when
    given, receives the timed chunks' host-side phases (`ChunkOutput.timings_ms`: the chunk start before the
    position-reset check — audio features included — and the host's launch of all passes), median ms each."""
    cuda = gen.device.type == "cuda"
    times, lat, phases = [], [], []
    for n in range(warmup + chunks):
        audio = chunk_audio(cfg, n)
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


def emit_result(result: dict, out: str | None, to_stdout: bool, indent: int = 2) -> str:
    """A benchmark's JSON document: written to `out` when given, printed when `to_stdout`; returns the text."""
    text = json.dumps(result, indent=indent)
    if out:
        Path(out).write_text(text + "\n")
    if to_stdout:
        print(text)
    return text
