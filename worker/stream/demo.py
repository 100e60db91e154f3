"""`vivant demo`: the full streaming loop on this machine, speaking real speech, written to an MP4.

What runs: the trained reference character (`ref` preset, weights from weights/ref written by
`vivant train ref`; the `tiny` preset with random weights when those are absent or `--preset tiny`)
→ the causal VAE decoder on its own thread (the decoder stage) → the 24 fps pacer on the wall clock → sinks. The speech is a wav that espeak-ng speaks at run
time (22.05 kHz, resampled to the model's 16 kHz by the audio input). The script: the character
listens (idle chunks) for a moment, speaks a turn, listens again, starts a second turn and is
interrupted halfway through it (`clear_buffer`), listens briefly, speaks a third turn, then listens until the
end. Each turn starts with a rewind to the last chunk on screen (vivant.worker.stream.pipeline); the report
prints each turn's latency by stage (audio in → rewound → diffused → decoded → first frame published).

Two timelines, stated in the report: the live pacer runs on the wall clock and records every stall
honestly (on 2 CPU cores the loop may be slower than real time); the MP4 (`--out`) is the content
timeline: every generated frame at an exact 1/24 s step with its own audio muxed in. `--live-out`
also writes what a live viewer saw (stall repeats and silence included).
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np
from vivant.worker.model.config import ModelConfig
from vivant.worker.model.generator import ChunkGenerator
from vivant.worker.model.options import CacheMode
from vivant.worker.model.ref_model import ref_paths, ref_weights_present
from vivant.worker.stream.audio_in import AudioInput, read_audio
from vivant.worker.stream.pacer import PacerConfig
from vivant.worker.stream.pipeline import StreamPipeline
from vivant.worker.stream.sinks import Mp4Sink
from vivant.worker.stream.vae import VAEConfig, build_vae_decoder, load_vae_decoder

DEFAULT_TEXT = "Hello! I am a vivant character. Can you see my lips move when I speak?"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seconds", type=float, default=10.0, help="seconds of video to generate")
    p.add_argument("--out", default="out/demo.mp4", help="MP4 (content timeline) to write")
    p.add_argument("--live-out", default=None, help="also write the live timeline (stall repeats included) here")
    p.add_argument("--preset", default=None,
                   help="model preset (default: ref, the trained character, when weights/ref holds its weights; else tiny)")
    p.add_argument("--weights", default=None, help="directory of the ref weights (default: weights/ref)")
    p.add_argument("--mode", default=CacheMode.OPTIMIZED.value, choices=[m.value for m in CacheMode])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--text", default=DEFAULT_TEXT, help="what the character says (spoken by espeak-ng)")
    p.add_argument("--wav", default=None, help="use this speech file instead of running espeak-ng")
    p.add_argument("--vae-weights", default=None, help="safetensors file of the VAE decoder (default: random)")
    p.add_argument("--buffer-chunks", type=int, default=3, help="pacer jitter buffer capacity (chunks)")
    p.add_argument("--start-chunks", type=int, default=2, help="chunks buffered before the first frame")
    p.add_argument("--json", default=None, help="write the full report as JSON here")


def speak_to_wav(text: str, path: Path) -> Path:
    """Run espeak-ng to make a speech wav; a clear error when it is missing or fails."""
    exe = shutil.which("espeak-ng")
    if exe is None:
        raise SystemExit("vivant demo: espeak-ng not found; install it (`make sysdeps`, or apt-get install "
                         "espeak-ng) or pass --wav FILE with speech to use")
    proc = subprocess.run([exe, "-w", str(path), text], capture_output=True, text=True, timeout=60)
    if proc.returncode != 0 or not path.exists():
        raise SystemExit(f"vivant demo: espeak-ng failed (exit {proc.returncode}): {proc.stderr.strip()}")
    return path


def demo_script(speech: np.ndarray, rate: int, chunks: int, chunk_s: float):
    """Actions by loop step (chunks taken so far; rewinds make the step run ahead of the chunk index): idle,
    turn 0, idle, turn 1 cut halfway by clear_buffer, idle, turn 2, idle."""
    speech_chunks = math.ceil(len(speech) / rate / chunk_s)
    turn0 = 3
    turn1 = turn0 + speech_chunks + 6
    cut = turn1 + max(1, speech_chunks // 2)
    turn2 = cut + 4
    events: list[str] = []

    def push_turn(pipe: StreamPipeline) -> None:
        step = rate // 2  # the agent sends 0.5 s segments (faster than real time, as TTS does)
        for i in range(0, len(speech), step):
            pipe.audio_in.push(speech[i:i + step], rate)
        pipe.audio_in.end_segment()

    def before_chunk(n: int, pipe: StreamPipeline) -> None:
        at = f"step {n} (next chunk {pipe.next_index})"
        if n == turn0:
            push_turn(pipe)
            events.append(f"{at}: turn 0 pushed ({len(speech) / rate:.2f} s of speech at {rate} Hz)")
        elif n == turn1:
            push_turn(pipe)
            events.append(f"{at}: turn 1 pushed")
        elif n == cut:
            dropped = pipe.clear_buffer()
            events.append(f"{at}: clear_buffer (interrupt) dropped {dropped / pipe.cfg.audio_sample_rate:.2f} s")
        elif n == turn2:
            push_turn(pipe)
            events.append(f"{at}: turn 2 pushed (after the interruption)")

    return before_chunk, events


def run(args: argparse.Namespace) -> int:
    if not args.seconds > 0:
        raise SystemExit(f"vivant demo: --seconds = {args.seconds}; expected > 0")
    preset = args.preset or ("ref" if ref_weights_present(args.weights) else "tiny")
    cfg = ModelConfig.from_name(preset)
    vae_cfg = VAEConfig.for_model(cfg)
    with tempfile.TemporaryDirectory(prefix="vivant-demo-") as tmp:
        wav = Path(args.wav) if args.wav else speak_to_wav(args.text, Path(tmp) / "speech.wav")
        speech, rate = read_audio(wav)
    chunks = math.ceil(args.seconds / cfg.chunk_seconds)
    dit_weights, vae_weights = ref_paths(args.weights) if preset == "ref" else (None, None)
    vae_weights = args.vae_weights or vae_weights
    gen = ChunkGenerator(cfg, mode=args.mode, seed=args.seed, weights=dit_weights)
    vae = (load_vae_decoder(vae_cfg, vae_weights) if vae_weights
           else build_vae_decoder(vae_cfg, seed=args.seed))
    sinks = [Mp4Sink(args.out, cfg.width, cfg.height, cfg.fps, cfg.audio_sample_rate, timeline="content")]
    if args.live_out:
        sinks.append(Mp4Sink(args.live_out, cfg.width, cfg.height, cfg.fps, cfg.audio_sample_rate, timeline="live"))
    pacer_cfg = PacerConfig.for_model(cfg, buffer_chunks=args.buffer_chunks, start_chunks=args.start_chunks)
    pipe = StreamPipeline(gen, vae, sinks, audio_in=AudioInput(cfg), pacer_config=pacer_cfg, session="demo")
    before_chunk, events = demo_script(speech, rate, chunks, cfg.chunk_seconds)
    report = pipe.run(chunks, before_chunk)
    print(f"wrote {args.out}: {cfg.width}x{cfg.height} H.264 + AAC {cfg.audio_sample_rate} Hz, "
          f"{report.generated_frames_published} frames at exact 1/{cfg.fps} s steps (content timeline)")
    if args.live_out:
        print(f"wrote {args.live_out}: the live timeline, {report.frames_published} slots "
              f"({report.repeated_frames} stall repeats)")
    for e in events:
        print(f"  script: {e}")
    print(report.format_text())
    print("  note: stalls and delivered fps are measured on the live wall clock (this machine's speed); "
          "the MP4 content timeline has every frame regardless.")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report.to_dict(), indent=1))
    return 0
