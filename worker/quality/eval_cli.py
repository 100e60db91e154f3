"""`vivant eval quality`: the quality gate for every speed-up, on the trained `ref` character.

The same held-out speech (sentences and voices never used in training, spoken by espeak-ng, or --wav)
goes through two paths of the same weights and the same per-chunk noise:

    reference  the float parts, baseline cache mode, FP8 off (full-precision K/V, per-call whole-cache rotation)
    optimized  the engine a worker serves with (`build_generator`, engine auto: the FP8 parts with CUDA graphs on
               a GPU, the float parts on a CPU) on the ring cache: FP8 K/V quantized at write, delta rotation at
               position resets

Both latents streams are decoded by the same VAE decoder (separate causal caches). Reported: per-chunk
relative RMS of the latents ‖opt − ref‖ / ‖ref‖, PSNR/SSIM between the two videos, the lip-sync proxy
of each (worker/quality/lipsync.py) and, for orientation, of the procedural ground truth drawn from the same
audio, and PSNR of each path against that ground truth. The gate fails (exit 1) when the optimized
path's lip-sync correlation is more than `--max-lipsync-drop` (1 %, relative) below the reference's, or
when the latents drift: the mean relative RMS over the last quarter of chunks exceeds
max(--drift-ratio × the first quarter's mean, --drift-floor).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from vivant.worker.model.config import ModelConfig
from vivant.worker.model.generator import ChunkGenerator, build_generator
from vivant.worker.model.model import VideoDiT
from vivant.worker.model.options import CacheMode, EngineName
from vivant.worker.model.ref_model import ref_paths
from vivant.worker.model.weights import load_weights
from vivant.worker.quality.lipsync import lip_sync, psnr, ssim
from vivant.worker.stream.vae import VAEDecoder, load_ref_decoder


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("what", choices=["quality"], help="what to evaluate")
    p.add_argument("--json", action="store_true", help="print the report as JSON on stdout")
    p.add_argument("--weights", default=None, help="directory with ref_dit/ref_vae safetensors (default weights/ref)")
    p.add_argument("--seconds", type=float, default=20.0, help="seconds of held-out speech session to generate")
    p.add_argument("--seed", type=int, default=0, help="seed of the held-out sentences and the sampler noise")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--wav", default=None, help="use this speech file (its first --seconds) instead of held-out "
                   "espeak-ng sentences (weights/ref/data/held_out.wav holds such sentences)")
    p.add_argument("--max-lag", type=int, default=6, help="lip-sync lag search range (frames, ±)")
    p.add_argument("--max-lipsync-drop", type=float, default=0.01, help="relative drop allowed (0.01 = 1 %%)")
    p.add_argument("--drift-ratio", type=float, default=2.0)
    p.add_argument("--drift-floor", type=float, default=0.05)
    p.add_argument("--video", default=None, help="write reference | optimized | ground truth side by side (MP4)")


def held_out_audio(cfg: ModelConfig, seconds: float, seed: int) -> tuple[np.ndarray, list[str]]:
    """Held-out sessions (train/dataset.HELD_OUT_WORDS and voices) concatenated to ≥ `seconds`."""
    from vivant.worker.train.dataset import session_audio

    rng = np.random.default_rng(10_000 + seed)
    parts, texts, total = [], [], 0
    while total < seconds * cfg.audio_sample_rate:
        audio, text = session_audio(rng, cfg, held_out=True, sentences=2)
        parts.append(audio)
        texts.append(text)
        total += len(audio)
    return np.concatenate(parts)[: int(seconds * cfg.audio_sample_rate)], texts


def read_audio_at(path: str | Path, rate: int) -> np.ndarray:
    """Any audio file PyAV reads → float32 mono samples at `rate` (libswresample)."""
    import av

    with av.open(str(path)) as container:
        resampler = av.AudioResampler(format="flt", layout="mono", rate=rate)
        parts = [f.to_ndarray().reshape(-1) for fr in container.decode(container.streams.audio[0])
                 for f in resampler.resample(fr)]
        parts += [f.to_ndarray().reshape(-1) for f in resampler.resample(None)]
    if not parts:
        raise ValueError(f"--wav {str(path)!r}: no audio samples")
    return np.concatenate(parts).astype(np.float32)


def run_path(gen: ChunkGenerator, vae: VAEDecoder, audio: np.ndarray, chunks: int, seed: int):
    """Generate and decode `chunks` chunks: latents float32 [chunks, C, h, w], frames uint8 [4·chunks, H, W, 3],
    and per chunk 1 where it reset positions (else 0)."""
    cfg = gen.cfg
    gen.reset_session(seed)
    cache = vae.new_cache()
    lats, frames, resets = [], [], []
    for n in range(chunks):
        a, b = cfg.chunk_sample_range(n)
        out = gen.generate_chunk(audio[a:b], cfg.audio_sample_rate)
        resets.append(int(out.reset))
        lats.append(out.latents.cpu())
        frames.append(vae.decode_chunk(out.latents, cache).cpu().numpy())
    return torch.stack(lats), np.concatenate(frames), tuple(resets)


def ground_truth_frames(audio: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    """The procedural character driven by the same audio (eyes open, head still): uint8 [N, H, W, 3]."""
    from vivant.worker.train.dataset import frame_envelope, mouth_from_envelope, render_faces

    n = len(audio) * cfg.fps // cfg.audio_sample_rate
    opening = torch.from_numpy(mouth_from_envelope(frame_envelope(audio, n, cfg.audio_sample_rate, cfg.fps)))
    zeros = torch.zeros(n)
    f = render_faces(opening, torch.ones(n), zeros, zeros, height=cfg.height, width=cfg.width)
    return ((f + 1) * 127.5).round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).numpy()


def judge(lip_ref: float, lip_opt: float, rel_rms: list[float], max_drop: float = 0.01, drift_ratio: float = 2.0,
          drift_floor: float = 0.05) -> dict:
    """The gate's decision from the numbers: failures (empty = passed) with what differed."""
    if not rel_rms:
        raise ValueError("rel_rms: expected at least one chunk")
    q = max(1, len(rel_rms) // 4)
    first_q, last_q = float(np.mean(rel_rms[:q])), float(np.mean(rel_rms[-q:]))
    drift_limit = max(drift_ratio * first_q, drift_floor)
    drop = (lip_ref - lip_opt) / max(abs(lip_ref), 1e-6)
    failures = []
    if drop > max_drop:
        failures.append(f"lip-sync: optimized {lip_opt:.4f} is {100 * drop:.2f} % below reference "
                        f"{lip_ref:.4f} (allowed {100 * max_drop:.1f} %)")
    if last_q > drift_limit:
        failures.append(f"drift: latent relative RMS over the last quarter {last_q:.4f} > limit {drift_limit:.4f} "
                        f"(first quarter {first_q:.4f})")
    return {"drop": drop, "first_quarter": first_q, "last_quarter": last_q, "drift_limit": drift_limit,
            "failures": failures}


@dataclass(frozen=True)
class Generated:
    """Both paths generated and decoded over one session's audio (what `score` reports on).

    Generation is causal: chunk n sees only its own audio and the chunks before it, and both paths restart from
    `seed`, so the first k chunks of a longer session are the session of those k chunks' audio."""

    cfg: ModelConfig
    weights_dir: Path
    device: str
    seed: int
    texts: list[str]
    audio: np.ndarray  # float32, exactly `chunks` chunks of samples
    lat_ref: torch.Tensor  # [chunks, C, h, w]
    vid_ref: np.ndarray  # uint8 [frames, H, W, 3]
    lat_opt: torch.Tensor
    vid_opt: np.ndarray
    resets: tuple[int, ...]  # 1 where the reference path reset positions at that chunk

    @property
    def chunks(self) -> int:
        return len(self.lat_ref)


def generate(weights: str | None, seconds: float, seed: int, device: str = "cpu", wav: str | None = None) -> Generated:
    """Run the held-out speech (or `wav`'s first `seconds`) through the reference and the optimized path."""
    cfg = ModelConfig.from_name("ref")
    dit_path, _ = ref_paths(weights)
    _, vae = load_ref_decoder(weights, device=device)
    if wav:
        audio, texts = read_audio_at(wav, cfg.audio_sample_rate)[: int(seconds * cfg.audio_sample_rate)], [str(wav)]
    else:
        audio, texts = held_out_audio(cfg, seconds, seed)
    chunks = max(1, math.floor(len(audio) / (cfg.audio_sample_rate * cfg.chunk_seconds)))
    audio = audio[: cfg.chunk_sample_range(chunks - 1)[1]]
    model = VideoDiT(cfg)
    load_weights(model, dit_path)
    ref_gen = ChunkGenerator(cfg, mode=CacheMode.BASELINE, fp8=False, device=device, model=model, seed=seed)
    opt_gen = build_generator(cfg, mode=CacheMode.OPTIMIZED, device=device, seed=seed, engine=EngineName.AUTO,
                              model=copy.deepcopy(model))  # the served engine installs its parts in place
    lat_ref, vid_ref, resets = run_path(ref_gen, vae, audio, chunks, seed)
    lat_opt, vid_opt, _ = run_path(opt_gen, vae, audio, chunks, seed)
    return Generated(cfg=cfg, weights_dir=dit_path.parent, device=device, seed=seed, texts=texts, audio=audio,
                     lat_ref=lat_ref, vid_ref=vid_ref, lat_opt=lat_opt, vid_opt=vid_opt, resets=resets)


def score(g: Generated, chunks: int | None = None, max_lag: int = 6, max_drop: float = 0.01,
          drift_ratio: float = 2.0, drift_floor: float = 0.05, video: str | None = None) -> dict:
    """The report (and the gate's decision) over the first `chunks` chunks of `g` (all of them by default)."""
    cfg = g.cfg
    chunks = g.chunks if chunks is None else chunks
    if not 1 <= chunks <= g.chunks:
        raise ValueError(f"chunks = {chunks}; expected 1..{g.chunks}")
    audio = g.audio[: cfg.chunk_sample_range(chunks - 1)[1]]
    frames = chunks * cfg.frames_per_chunk
    lat_ref, lat_opt, vid_ref, vid_opt = g.lat_ref[:chunks], g.lat_opt[:chunks], g.vid_ref[:frames], g.vid_opt[:frames]
    resets = sum(g.resets[:chunks])
    rel = ((lat_opt - lat_ref).flatten(1).norm(dim=1) / lat_ref.flatten(1).norm(dim=1).clamp_min(1e-12)).tolist()
    gt = ground_truth_frames(audio, cfg)[: len(vid_ref)]
    ls_ref = lip_sync(vid_ref, audio, cfg.audio_sample_rate, cfg.fps, max_lag)
    ls_opt = lip_sync(vid_opt, audio, cfg.audio_sample_rate, cfg.fps, max_lag)
    ls_gt = lip_sync(gt, audio, cfg.audio_sample_rate, cfg.fps, max_lag)
    g_ = judge(ls_ref.correlation, ls_opt.correlation, rel, max_drop, drift_ratio, drift_floor)
    drop, first_q, last_q, drift_limit, failures = (g_["drop"], g_["first_quarter"], g_["last_quarter"],
                                                     g_["drift_limit"], g_["failures"])
    if video:
        write_side_by_side(video, [vid_ref, vid_opt, gt], audio, cfg)
    stability = {"reference": stability_over_time(vid_ref, gt), "optimized": stability_over_time(vid_opt, gt)}
    return {
        "preset": cfg.name, "weights": _shown(g.weights_dir), "device": g.device, "seed": g.seed,
        "seconds": round(chunks * cfg.chunk_seconds, 3), "chunks": chunks, "position_resets": resets,
        "texts": g.texts,
        "lip_sync_reference": round(ls_ref.correlation, 4), "lip_sync_optimized": round(ls_opt.correlation, 4),
        "lip_sync_ground_truth": round(ls_gt.correlation, 4),
        "lip_sync_lag_frames": {"reference": ls_ref.lag_frames, "optimized": ls_opt.lag_frames,
                                "ground_truth": ls_gt.lag_frames},
        "lip_sync_relative_drop": round(drop, 5),
        "latent_rel_rms_per_chunk": [round(r, 6) for r in rel],
        "latent_rel_rms_first_quarter": round(first_q, 6), "latent_rel_rms_last_quarter": round(last_q, 6),
        "latent_rel_rms_max": round(max(rel), 6),
        "psnr_reference_vs_optimized_db": round(psnr(vid_ref, vid_opt), 3),
        "ssim_reference_vs_optimized": round(ssim(vid_ref, vid_opt), 4),
        "psnr_vs_procedural_db": {"reference": round(psnr(vid_ref, gt), 3), "optimized": round(psnr(vid_opt, gt), 3)},
        "ssim_vs_procedural": {"reference": round(ssim(vid_ref, gt), 4), "optimized": round(ssim(vid_opt, gt), 4)},
        "stability": stability,
        "gate": {"passed": not failures, "failures": failures, "max_lipsync_drop": max_drop,
                 "drift_limit": round(drift_limit, 6)},
    }


def evaluate(weights: str | None, seconds: float, seed: int, device: str = "cpu", wav: str | None = None,
             max_lag: int = 6, max_drop: float = 0.01, drift_ratio: float = 2.0, drift_floor: float = 0.05,
             video: str | None = None) -> dict:
    return score(generate(weights, seconds, seed, device, wav), None, max_lag, max_drop, drift_ratio, drift_floor,
                 video)


def _shown(path: Path) -> str:
    """`path` relative to the working directory when it is under it (reports get committed: no machine's paths)."""
    try:
        return str(Path(path).resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def stability_over_time(video: np.ndarray, gt: np.ndarray) -> dict:
    """Identity and flicker, first vs last quarter of the session: PSNR against the procedural character
    outside the mouth box (dB; identity kept ⇔ no drop), and flicker = mean |frame − previous frame|
    (0–255; flicker growth ⇔ the last quarter's is larger)."""
    from vivant.worker.train.dataset import mouth_box

    y0, y1, x0, x1 = mouth_box(video.shape[1], video.shape[2])
    keep = np.ones(video.shape[1:3], bool)
    keep[y0:y1, x0:x1] = False
    n = len(video)
    q = max(2, n // 4)

    def ident(sl):
        d = (video[sl].astype(np.float64) - gt[sl].astype(np.float64))[:, keep]
        return round(float(10 * np.log10(255.0 ** 2 / max(float((d ** 2).mean()), 1e-12))), 3)

    def flick(sl):
        v = video[sl].astype(np.float64)
        return round(float(np.abs(np.diff(v, axis=0)).mean()), 4)

    first, last = slice(0, q), slice(n - q, n)
    return {"identity_psnr_first_quarter_db": ident(first), "identity_psnr_last_quarter_db": ident(last),
            "flicker_first_quarter": flick(first), "flicker_last_quarter": flick(last)}


def write_side_by_side(path: str, videos: list[np.ndarray], audio: np.ndarray, cfg: ModelConfig) -> None:
    from vivant.worker.stream.pacer import PublishedFrame
    from vivant.worker.stream.sinks import Mp4Sink

    frames = np.concatenate([v[: min(map(len, videos))] for v in videos], axis=2)
    sink = Mp4Sink(path, frames.shape[2], frames.shape[1], cfg.fps, cfg.audio_sample_rate)
    per = cfg.audio_sample_rate // cfg.fps
    try:
        for i, rgb in enumerate(frames):
            a = (i * cfg.audio_sample_rate) // cfg.fps
            sink.write(PublishedFrame(slot=i, pts_s=i / cfg.fps, chunk_index=i // cfg.frames_per_chunk,
                                      content_index=i, repeated=False, rgb=rgb,
                                      audio=audio[a: a + per + (1 if (i % 3 == 2) else 0)].astype(np.float32),
                                      due_s=0.0, published_s=0.0, av_offset_s=0.0))
    finally:
        sink.close()


def format_report(r: dict) -> str:
    rel = r["latent_rel_rms_per_chunk"]
    lines = [
        f"vivant eval quality: preset {r['preset']}, {r['seconds']} s ({r['chunks']} chunks, "
        f"{r['position_resets']} position resets), device {r['device']}, weights {r['weights']}",
        f"  lip-sync (r at best lag): reference {r['lip_sync_reference']:.4f}, optimized {r['lip_sync_optimized']:.4f} "
        f"(drop {100 * r['lip_sync_relative_drop']:.2f} %), procedural ground truth {r['lip_sync_ground_truth']:.4f}",
        f"  latents rel RMS opt vs ref: first quarter {r['latent_rel_rms_first_quarter']:.4g}, last quarter "
        f"{r['latent_rel_rms_last_quarter']:.4g}, max {max(rel):.4g}",
        f"  video opt vs ref: PSNR {r['psnr_reference_vs_optimized_db']:.2f} dB, SSIM {r['ssim_reference_vs_optimized']:.4f}",
        f"  vs procedural ground truth: PSNR ref {r['psnr_vs_procedural_db']['reference']:.2f} dB, "
        f"opt {r['psnr_vs_procedural_db']['optimized']:.2f} dB",
        "  identity PSNR (outside the mouth) first → last quarter: "
        + ", ".join(f"{k} {v['identity_psnr_first_quarter_db']:.2f} → {v['identity_psnr_last_quarter_db']:.2f} dB"
                    for k, v in r["stability"].items())
        + "; flicker " + ", ".join(f"{k} {v['flicker_first_quarter']:.2f} → {v['flicker_last_quarter']:.2f}"
                                   for k, v in r["stability"].items()),
        "  gate: " + ("PASSED" if r["gate"]["passed"] else "FAILED: " + "; ".join(r["gate"]["failures"])),
    ]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    if not args.seconds > 0:
        raise ValueError(f"--seconds = {args.seconds}; expected > 0")
    if args.max_lag < 0:
        raise ValueError(f"--max-lag = {args.max_lag}; expected ≥ 0")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: CUDA is not available on this machine; expected --device cpu")
    report = evaluate(args.weights, args.seconds, args.seed, args.device, args.wav, args.max_lag,
                      args.max_lipsync_drop, args.drift_ratio, args.drift_floor, args.video)
    if args.json:
        json.dump(report, sys.stdout, indent=1)
        print()
    else:
        print(format_report(report))
    return 0 if report["gate"]["passed"] else 1
