"""Which FP8 part moves the trained `ref` model: the served engine's parts undone one at a time, on a CPU.

    python bench/fp8_sensitivity.py --seconds 10 --out bench/results/fp8_sensitivity_ref_cpu_<date>.json
        [--device cuda]   (the served engine's own parts: cuBLASLt FP8 GEMMs, fast accumulation, CUDA graphs)

On a CPU the FP8 parts run their float32 twins, which round weights, activations and the ring to e4m3 exactly
as the GPU kernels do (kernels/fp8.py: RNE to e4m3 after the per-row or per-channel scale) and differ from
them only in accumulation order; so the quality question "which rounding hurts" can be asked here, chunk for
chunk, without a GPU. Every variant generates the same held-out speech (weights/ref/data/held_out.wav) from the
same seed and is compared with the float32 model on a float cache (the gate's reference,
worker/quality/eval_cli.py): per-chunk latent relative RMS ‖x − ref‖ / ‖ref‖, reported as max, median and the
last quarter's mean.

Variants: the float parts on a float ring and on the FP8 ring (float32, and in the served engine's dtype); the FP8
parts as served; the FP8 parts with the weights of one projection role (qkv, o, gate_up, down) kept in float32 —
the activations still arrive as FP8 rows and are dequantized — and with all four kept; and, to split what is left,
the FP8 parts without fast accumulation and with the ring's read image written unquantized (the bf16 of the rotated
K and V rows instead of the bf16 of their FP8 codes: what attention would read from a bf16 ring; at a position
reset the rotated keys are still re-derived from the FP8 ring), alone and combined; and the served option that
makes this real, a bf16 ring (EngineOptions.ring = "bf16": the ring stores the rotated rows in bf16 and is itself
the image attention reads). On the served ring, the activations of one GEMM kept unquantized (that GEMM in bf16 with the
checkpoint's weights, the rest FP8): o (attention's output rows: the served option EngineOptions.o_gemm = bf16), down (the SwiGLU's output), and qkv + gate_up
together (both take the fused LayerNorm-modulation's rows, one part per block) — which activation rounding moves the
trained model, and so which GEMM a per-role bf16 fix would have to pay for. Also the weight rounding error
alone per role: per output channel (served) against one scale per 32 input elements (a finer granularity).
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
from vivant.kernels.fp8_gemm import quantize_weight
from vivant.worker.model.config import ModelConfig
from vivant.worker.model.engine import Engine
from vivant.worker.model.fused_tp import SummedProduct
from vivant.worker.model.generator import ChunkGenerator
from vivant.worker.model.model import VideoDiT
from vivant.worker.model.options import AttentionBackend, CacheMode, EngineOptions, RingFormat
from vivant.worker.model.ref_model import ref_paths
from vivant.worker.model.weights import load_weights
from vivant.worker.quality.eval_cli import read_audio_at

ROLES = (("attn", "qkv"), ("attn", "o"), ("mlp", "gate_up"), ("mlp", "down"))


class DequantizedRowsLinear(nn.Module, SummedProduct):
    """A projection fed FP8 rows (`Rows8`: q [M, K], scale [M]) that multiplies their dequantized values by float32
    weights [N, K]: the FP8 parts with this role's weight rounding removed and nothing else changed."""

    def __init__(self, weight: torch.Tensor, out_dtype: torch.dtype) -> None:
        super().__init__()
        self.weight, self.out_dtype = weight.float(), out_dtype
        self.out_features, self.in_features = weight.shape

    def forward(self, rows) -> torch.Tensor:  # noqa: ANN001 (fast_parts.Rows8)
        return ((rows.q.float() * rows.scale[:, None]) @ self.weight.t()).to(self.out_dtype)


class UnquantizedRowsLinear(nn.Module, SummedProduct):
    """A float projection (the checkpoint's weights, in the model's dtype) fed the unquantized rows of an FP8
    engine's part, cast to its dtype (on a CPU the attention's image rows are bf16 while the model is float32)."""

    def __init__(self, linear: nn.Module) -> None:
        super().__init__()
        self.linear = linear
        self.out_features, self.in_features = linear.out_features, linear.in_features

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.linear(h.to(self.linear.weight.dtype))


class UnquantizedImage:
    """Wraps `KVCache.write_qkv` of one cache: after the served write (ring + image from FP8 codes), the chunk's
    image rows are overwritten with the bf16 of the exact rotated K and the exact V (float32 math of the fused
    kernel's twin), sink rows included. Study only: it isolates the ring's FP8 rounding from the rest of the
    served path; the ring itself (and the keys re-derived at a position reset) stays FP8."""

    def __init__(self, cache) -> None:  # noqa: ANN001 (KVCache)
        self.cache, self.write = cache, cache.write_qkv
        cache.write_qkv = self

    def __call__(self, layer, qkv, q_weight, k_weight, eps):  # noqa: ANN001, ANN204
        from vivant.kernels.qkv_ring import _rms, _rotate

        c = self.cache
        q_rot = self.write(layer, qkv, q_weight, k_weight, eps)
        if c.k_image is None:
            return q_rot
        b, n, d = c.step, qkv.shape[0], q_weight.shape[0]
        _, k, v = qkv.float().view(n, 3, c.heads, d).unbind(1)
        k = _rms(k, k_weight.float(), eps)
        rows = [(b.slots, _rotate(k, b.cos, b.sin), v)]
        if b.writes_sink:
            m = b.sink_slots.shape[0]
            rows.append((b.sink_slots, _rotate(k[:m], b.sink_cos, b.sink_sin), v[:m]))
        for slots, kr, vr in rows:
            c.k_image[layer].index_copy_(0, slots, kr.to(c.k_image.dtype))
            c.v_image[layer].index_copy_(0, slots, vr.to(c.v_image.dtype))
        return q_rot


def generate(gen: ChunkGenerator, audio: np.ndarray, chunks: int) -> torch.Tensor:
    """Latents float32 [chunks, C, h, w] of one session from seed 0."""
    cfg = gen.cfg
    gen.reset_session(0)
    out = []
    for n in range(chunks):
        a, b = cfg.chunk_sample_range(n)
        out.append(gen.generate_chunk(audio[a:b], cfg.audio_sample_rate).latents.float().cpu())
    return torch.stack(out)


def summary(x: torch.Tensor, ref: torch.Tensor) -> dict:
    r = ((x - ref).flatten(1).norm(dim=1) / ref.flatten(1).norm(dim=1).clamp_min(1e-12)).numpy()
    q = max(1, len(r) // 4)
    return {"max": float(r.max()), "median": float(np.median(r)), "last_quarter_mean": float(r[-q:].mean())}


def weight_rounding(model: VideoDiT) -> dict:
    """Relative RMS of e4m3 weight rounding per role over all blocks: per output channel vs per 32-element block."""
    out = {}
    for part, role in ROLES:
        num_c = num_b = den = 0.0
        for blk in model.blocks:
            w = getattr(getattr(blk, part), role).weight.data.float()
            n, k = w.shape
            q, s = quantize_weight(w)
            num_c += float(((q.float() * s[:, None]) - w).pow(2).sum())
            b = 32 if k % 32 == 0 else k
            wb = w.view(n, k // b, b)
            sb = (wb.abs().amax(-1, keepdim=True) / 448.0).clamp_min(1e-12)
            num_b += float((((wb / sb).to(torch.float8_e4m3fn).float() * sb).view(n, k) - w).pow(2).sum())
            den += float(w.pow(2).sum())
        out[role] = {"per_channel": (num_c / den) ** 0.5, "per_32_block": (num_b / den) ** 0.5}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=10.0, help="seconds of held-out speech")
    p.add_argument("--weights", default=None, help="directory with ref_dit.safetensors (default weights/ref)")
    p.add_argument("--wav", default=None, help="speech (default weights/ref/data/held_out.wav)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--only", action="append", default=[],
                   help="run only the variants whose name contains this text (repeatable; default: all)")
    p.add_argument("--out", required=True, help="the JSON result")
    args = p.parse_args(argv)
    if not args.seconds > 0:
        raise SystemExit(f"--seconds = {args.seconds}; expected > 0")
    torch.manual_seed(0)
    cfg = ModelConfig.from_name("ref")
    dit, _ = ref_paths(args.weights)
    wav = Path(args.wav) if args.wav else dit.parent / "data" / "held_out.wav"
    audio = read_audio_at(str(wav), cfg.audio_sample_rate)[: int(args.seconds * cfg.audio_sample_rate)]
    chunks = int(len(audio) // (cfg.audio_sample_rate * cfg.chunk_seconds))
    if chunks < 1:
        raise SystemExit(f"--seconds = {args.seconds}: shorter than one chunk ({cfg.chunk_seconds:.3f} s)")
    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: CUDA is not available on this machine; expected --device cpu")
    fp8_dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32  # the dtype the served engine runs in
    base = VideoDiT(cfg)
    load_weights(base, dit)
    base.eval()
    ref = generate(ChunkGenerator(cfg, mode=CacheMode.BASELINE, fp8=False, device=dev, model=copy.deepcopy(base)),
                   audio, chunks)

    def float_weights(roles, blocks=None):  # noqa: ANN001, ANN202
        def patch(m: VideoDiT) -> None:
            for i in (range(cfg.n_layers) if blocks is None else blocks):
                for part, role in roles:
                    w = getattr(getattr(base.blocks[i], part), role).weight.data.to(dev)
                    setattr(getattr(m.blocks[i], part), role, DequantizedRowsLinear(w, fp8_dtype))
        return patch

    def bf16_roles(which):  # noqa: ANN001, ANN202
        """Patch: the GEMMs `which` names ("down", "qkv+gate_up") take unquantized rows (bf16 GEMMs); the O GEMM's
        is the served option EngineOptions.o_gemm."""
        from vivant.worker.model.model import ResidualNormMod, SwiGLUAct

        def patch(m: VideoDiT) -> None:
            for i, blk in enumerate(m.blocks):
                src = base.blocks[i]
                if which == "down":
                    blk.mlp.act = SwiGLUAct()
                    blk.mlp.down = UnquantizedRowsLinear(copy.deepcopy(src.mlp.down).to(device=dev, dtype=fp8_dtype))
                else:
                    blk.res_norm = ResidualNormMod(cfg.norm_eps)
                    blk.attn.qkv = UnquantizedRowsLinear(copy.deepcopy(src.attn.qkv).to(device=dev, dtype=fp8_dtype))
                    blk.mlp.gate_up = UnquantizedRowsLinear(copy.deepcopy(src.mlp.gate_up).to(device=dev, dtype=fp8_dtype))
        return patch

    served = EngineOptions.served(dev)
    slow = served.replace(fast_accum=False)
    # (name, options, FP8 ring, model dtype, weight patch, exact image)
    variants = [("float parts, float ring", EngineOptions(), False, torch.float32, None, False),
                ("float parts, FP8 ring", EngineOptions(), True, torch.float32, None, False)]
    if fp8_dtype != torch.float32:
        variants += [(f"float parts {str(fp8_dtype)[6:]}, float ring", EngineOptions(), False, fp8_dtype, None, False),
                     (f"float parts {str(fp8_dtype)[6:]}, FP8 ring", EngineOptions(), True, fp8_dtype, None, False)]
    variants += [("FP8 parts (as served)", served, True, fp8_dtype, None, False)]
    variants += [(f"FP8 parts, {role} weights float32", served, True, fp8_dtype, float_weights([(part, role)]), False)
                 for part, role in ROLES]
    variants += [("FP8 parts, all weights float32", served, True, fp8_dtype, float_weights(ROLES), False)]
    if served.attention is AttentionBackend.IMAGE:
        if served.fast_accum:
            variants += [("FP8 parts, no fast accumulation", slow, True, fp8_dtype, None, False)]
        bf16 = served.replace(ring="bf16")
        variants += [("FP8 parts, bf16 ring", bf16, False, fp8_dtype, None, False),
                     ("FP8 parts, bf16 ring, all weights float32", bf16, False, fp8_dtype, float_weights(ROLES), False)]
        variants += [("FP8 parts, image unquantized", served, True, fp8_dtype, None, True),
                     ("FP8 parts, image unquantized, all weights float32", served, True, fp8_dtype, float_weights(ROLES),
                      True)]
        if served.fast_accum:
            variants += [("FP8 parts, image unquantized, no fast accumulation", slow, True, fp8_dtype, None, True),
                         ("FP8 parts, image unquantized, all weights float32, no fast accumulation", slow, True,
                          fp8_dtype, float_weights(ROLES), True)]
    # the served ring (bf16 on CUDA; the CPU twins' FP8 ring), one GEMM's activations unquantized at a time
    ring = "bf16 ring" if served.ring is RingFormat.BF16 else "FP8 ring"
    fp8_ring = served.ring is RingFormat.FP8
    variants += [(f"FP8 parts, {ring}, o activations unquantized (o_gemm = bf16)", served.replace(o_gemm="bf16"),
                  fp8_ring, fp8_dtype, None, False)]
    # (qkv+gate_up swaps in the float res_norm, which adds a summed product: the GEMMs keep the residual out)
    variants += [(f"FP8 parts, {ring}, {which} activations unquantized",
                  served if which == "down" else served.replace(residual_in_gemm=False), fp8_ring, fp8_dtype,
                  bf16_roles(which), False) for which in ("down", "qkv+gate_up")]
    if args.only:
        variants = [v for v in variants if any(text in v[0] for text in args.only)]
        if not variants:
            raise SystemExit(f"--only {args.only}: no variant's name contains it")
    rows = []
    for name, options, fp8_ring, dtype, patch, exact_image in variants:
        t0 = time.perf_counter()
        eng = Engine.build(copy.deepcopy(base).to(device=dev, dtype=dtype), options, inplace=True)
        if patch is not None:
            patch(eng.model)  # before the first pass: CUDA graphs capture the patched projections
        gen = ChunkGenerator(cfg, mode=CacheMode.OPTIMIZED, fp8=fp8_ring, device=dev, dtype=dtype, engine=eng)
        if exact_image:
            UnquantizedImage(gen.cache)
        rows.append({"variant": name, **summary(generate(gen, audio, chunks), ref),
                     "seconds": round(time.perf_counter() - t0, 1)})
        r = rows[-1]
        print(f"{name:72s} latent rel RMS max {100 * r['max']:5.1f} %  median {100 * r['median']:5.1f} %  "
              f"last quarter {100 * r['last_quarter_mean']:5.1f} %", flush=True)
    result = {"bench": "fp8_sensitivity", "preset": "ref",
              "device": (torch.cuda.get_device_name(dev) + " (the served engine's FP8 parts)" if dev.type == "cuda"
                         else "cpu (float32 twins of the FP8 kernels)"),
              "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"), "chunks": chunks,
              "speech": wav.name, "variants": rows, "weight_rounding_rel_rms": weight_rounding(base)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    for role, e in result["weight_rounding_rel_rms"].items():
        print(f"weight rounding {role:8s} per channel {100 * e['per_channel']:.2f} %  per 32-block "
              f"{100 * e['per_32_block']:.2f} %")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
