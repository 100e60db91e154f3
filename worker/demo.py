"""`vivant demo`: the whole generation loop on this machine, written to an MP4 a person can watch.

First version (generation core): the `tiny` DiT on random weights generates S seconds of chunks; a
placeholder linear decoder maps each latent frame to 4 RGB frames (16× nearest upsampling of a fixed
random 16→3 projection); PyAV writes H.264 at 24 fps. The stream issue replaces the placeholder with the
causal VAE decoder, the pacer and muxed speech audio.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import torch

from .config import ModelConfig
from .generator import ChunkGenerator


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seconds", type=float, default=10.0, help="seconds of video to generate")
    p.add_argument("--out", default="out/demo.mp4", help="MP4 file to write")
    p.add_argument("--preset", default="tiny")
    p.add_argument("--mode", default="optimized", choices=["optimized", "baseline"])
    p.add_argument("--seed", type=int, default=0)


def placeholder_decode(latents: torch.Tensor, cfg: ModelConfig, proj: torch.Tensor) -> np.ndarray:
    """[C, h, w] → uint8 [frames_per_chunk, H, W, 3]: a linear map to RGB, upsampled, the same for 4 frames."""
    rgb = torch.einsum("chw,cr->hwr", latents, proj)
    rgb = torch.sigmoid(rgb).repeat_interleave(cfg.vae_spatial, 0).repeat_interleave(cfg.vae_spatial, 1)
    frame = (rgb * 255).clamp(0, 255).to(torch.uint8).numpy()
    return np.repeat(frame[None], cfg.frames_per_chunk, axis=0)


def run(args: argparse.Namespace) -> int:
    import av

    if args.seconds <= 0:
        raise SystemExit(f"--seconds = {args.seconds}; expected > 0")
    cfg = ModelConfig.from_name(args.preset)
    gen = ChunkGenerator(cfg, mode=args.mode, seed=args.seed)
    proj = torch.randn(cfg.latent_channels, 3, generator=torch.Generator().manual_seed(args.seed)) / cfg.latent_channels**0.5
    chunks = int(np.ceil(args.seconds / cfg.chunk_seconds))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    times = []
    t_start = time.perf_counter()
    with av.open(str(out), "w") as container:
        stream = container.add_stream("libx264", rate=cfg.fps)
        stream.width, stream.height, stream.pix_fmt = cfg.width, cfg.height, "yuv420p"
        for n in range(chunks):
            a, b = cfg.chunk_sample_range(n)
            t = np.arange(a, b) / cfg.audio_sample_rate
            audio = (0.3 * np.sin(2 * np.pi * 220 * t) * (np.sin(2 * np.pi * 2 * t) > 0)).astype(np.float32)
            res = gen.generate_chunk(audio, cfg.audio_sample_rate)
            times.append(res.timings_ms["total"])
            for frame in placeholder_decode(res.latents, cfg, proj):
                for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                    container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    wall = time.perf_counter() - t_start
    video_s = chunks * cfg.chunk_seconds
    print(f"wrote {out} ({chunks} chunks, {video_s:.2f} s of {cfg.width}x{cfg.height} video at {cfg.fps} fps)")
    print(f"chunk ms: median {np.median(times):.1f}, p99 {np.percentile(times, 99):.1f}; "
          f"real-time factor {video_s / wall:.2f} (video seconds per wall second)")
    return 0
