"""Turn latency through the streaming loop: how long a turn's first sample takes to reach the screen, by stage.

What runs: `StreamPipeline` on the wall clock (generator → decoder stage → 24 fps pacer → a sink that keeps
nothing), one process, the decoder on the generator's device. A conversation script runs beside it on its own
thread, as a voice agent would: `--turns` turns of speech, each pushed once the previous turn's speech has
played out and a silence of varying length has passed (0.35 … 1.6 s, stepped by an irrational fraction of the
chunk period so turns start at varying phases of the chunk clock). The speech is a synthetic voiced signal
(a 110–170 Hz harmonic series under a 4 Hz syllable envelope, 0.6 … 1.3 s per turn), not espeak-ng: it needs no
system package and its length is exact. One turn, halfway through the script, is interrupted by `clear_buffer`
0.4 s after its first frame is on screen (the loop splices there: the speech stops at a frame, made again from
silence), and the next turn follows it.

Reported (JSON and a short table), per stage over turns (ms from the turn's first sample pushed): rewound,
diffused, decoded, published (p50/p99/max); the pipeline's share of a turn (audio in → first frame published);
the interrupted turn and the turn after it by themselves; stalls (and their causes), the lead chosen and its
changes, rewinds (turn starts) and interrupt splices, max |A/V offset| over frames after rewinds and over all frames, delivered fps, and the
machine, torch, date and command. `--step-ms X` pads each chunk's diffusion to X ms with a sleep (the JSON says
so): how the bench runs at the 57b per-rank step time with the `ref` model on one GPU. Goals printed beside the
figures: share ≤ 0.35 s at the 57b step time, ≤ 0.1 s with ref on the GPU, 0 stalls, |A/V| ≤ one frame.
`--no-rewind` runs the same script with turns queued behind the chunks already made (the comparison).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shlex
import threading
import time
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import torch
from vivant.worker.model.cadence import PaddedGenerator
from vivant.worker.model.config import ModelConfig
from vivant.worker.model.generator import build_generator
from vivant.worker.model.options import EngineName
from vivant.worker.model.ref_model import ref_paths, ref_weights_present
from vivant.worker.stream.pipeline import StreamPipeline
from vivant.worker.stream.playout import percentiles
from vivant.worker.stream.sinks import NullSink
from vivant.worker.stream.vae import VAEConfig, build_vae_decoder, load_vae_decoder

GOAL_SHARE_57B_S = 0.35
GOAL_SHARE_REF_GPU_S = 0.10
FRAME_MS = 1000 / 24


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", default="ref", choices=["ref", "tiny"],
                   help="model (ref: the trained character from weights/ref; tiny: random weights)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="generator and decoder device")
    p.add_argument("--turns", type=int, default=20, help="speech turns in the script (≥ 3)")
    p.add_argument("--step-ms", type=float, default=None,
                   help="pad each chunk's diffusion to this many ms with a sleep (e.g. the 57b per-rank step time)")
    p.add_argument("--weights", default=None, help="directory of the ref weights (default: weights/ref)")
    p.add_argument("--no-rewind", action="store_true",
                   help="turns do not rewind (speech waits behind the chunks already made): the comparison run")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the JSON document here")


def voiced(seconds: float, rate: int, f0: float) -> np.ndarray:
    """A synthetic voiced signal: harmonics of f0 (1/k amplitudes) under a 4 Hz syllable envelope, float32."""
    t = np.arange(int(round(seconds * rate))) / rate
    x = sum(np.sin(2 * np.pi * k * f0 * t) / k for k in range(1, 9))
    env = 0.55 + 0.45 * np.sin(2 * np.pi * 4.0 * t - np.pi / 2)
    return (0.25 * x * env).astype(np.float32)


def script_plan(turns: int, chunk_s: float) -> list[dict]:
    """Per turn: speech seconds, f0, the silence before it, and whether it is interrupted (one, mid-script)."""
    if turns < 3:
        raise SystemExit(f"vivant bench turn: --turns = {turns}; expected ≥ 3 (one interrupted turn and one after it)")
    golden = (math.sqrt(5) - 1) / 2
    plan = []
    for k in range(turns):
        plan.append({"speech_s": round(0.6 + 0.7 * ((k * golden) % 1.0), 3), "f0": 110 + 60 * ((k * 0.37) % 1.0),
                     "silence_s": round(0.35 + 1.25 * ((k * golden * 1.7 + chunk_s / 7) % 1.0), 3),
                     "interrupted": k == turns // 2})
    plan[turns // 2]["speech_s"] = 2.5  # long enough to be cut mid-turn
    return plan


class Conversation:
    """The script's thread: pushes each turn after the previous one has played out plus its silence, interrupts
    one, then sets `done`. Waits poll the pipeline every 5 ms (wall clock)."""

    def __init__(self, pipe: StreamPipeline, plan: list[dict], lead_in_s: float = 1.0) -> None:
        self.pipe, self.plan, self.lead_in_s = pipe, plan, lead_in_s
        self.done = threading.Event()
        self.error: BaseException | None = None
        self.events: list[str] = []
        self.thread = threading.Thread(target=self._run, name="vivant-bench-turns", daemon=True)

    def start(self, step: int, pipe: StreamPipeline) -> None:
        if step == 0:
            self.thread.start()

    def _wait(self, cond, timeout_s: float = 120.0) -> None:
        end = time.monotonic() + timeout_s
        while not cond():
            if self.done.is_set() or self.pipe.playout.failed is not None:
                raise RuntimeError("the stream stopped before the script ended")
            if time.monotonic() > end:
                raise TimeoutError(f"bench turn: a script wait passed {timeout_s} s")
            time.sleep(0.005)

    def _published(self, turn: int) -> bool:
        traces = {t.turn: t for t in self.pipe.turn_traces()}
        return turn in traces and traces[turn].published_s is not None

    def _run(self) -> None:
        rate = self.pipe.cfg.audio_sample_rate
        try:
            time.sleep(self.lead_in_s)
            self._wait(lambda: self.pipe.pacer.t0 is not None)
            for k, turn in enumerate(self.plan):
                if k:
                    self._wait(lambda: not self.pipe.speech_queued())
                time.sleep(turn["silence_s"])
                self.pipe.audio_in.push(voiced(turn["speech_s"], rate, turn["f0"]), rate)
                self.pipe.audio_in.end_segment()
                self.events.append(f"turn {k}: {turn['speech_s']} s of speech after {turn['silence_s']} s of silence")
                if turn["interrupted"]:
                    self._wait(lambda k=k: self._published(k))
                    time.sleep(0.4)
                    dropped = self.pipe.clear_buffer()
                    self.events.append(f"turn {k}: clear_buffer 0.4 s after its first frame dropped "
                                       f"{dropped / rate:.2f} s of speech")
            self._wait(lambda: not self.pipe.speech_queued())
            time.sleep(0.3)
        except BaseException as exc:  # noqa: BLE001 (reported by run)
            self.error = exc
        finally:
            self.done.set()


def build(args) -> tuple[ModelConfig, object, object, str]:
    preset = args.preset
    note = ""
    if preset == "ref" and not ref_weights_present(args.weights):
        raise SystemExit("vivant bench turn: --preset ref needs weights/ref (run `vivant train ref`) or --weights DIR; "
                         "use --preset tiny for random weights")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("vivant bench turn: --device cuda: no CUDA device is visible")
    cfg = ModelConfig.from_name(preset)
    dit_w, vae_w = ref_paths(args.weights) if preset == "ref" else (None, None)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    # the engine a worker serves with (on CUDA: the FP8 parts, the bf16 ring, CUDA graphs), warmed as a worker
    # warms it before it says idle, so no turn pays for graph capture
    gen = build_generator(cfg, device=args.device, seed=args.seed, weights=dit_w, engine=EngineName.AUTO)
    gen.warm_up()
    vae_cfg = VAEConfig.for_model(cfg)
    vae = (load_vae_decoder(vae_cfg, vae_w, device=args.device, dtype=dtype) if vae_w
           else build_vae_decoder(vae_cfg, device=args.device, dtype=dtype, seed=args.seed))
    if args.step_ms is not None:
        if not args.step_ms > 0:
            raise SystemExit(f"vivant bench turn: --step-ms = {args.step_ms}; expected > 0 ms")
        gen = PaddedGenerator(gen, args.step_ms)
        note = f"each chunk's diffusion padded to {args.step_ms} ms with a sleep"
    return cfg, gen, vae, note


def summarize(report, plan: list[dict], cut_turn: int) -> dict:
    turns = report.turns
    share = [t["published_ms"] for t in turns if t["published_ms"] is not None]
    turn_cuts = [rw for rw in report.rewinds if rw["cause"] == "turn"]
    return {
        "turns": len(turns),
        "turns_published": len(share),
        "stages_ms": report.turn_stages_ms,
        "share_ms": percentiles(share),
        "interrupted_turn": turns[cut_turn] if cut_turn < len(turns) else None,
        "turn_after_interrupt": turns[cut_turn + 1] if cut_turn + 1 < len(turns) else None,
        "rewinds": len(turn_cuts),
        "rewind_points": [[rw["to_chunk"], rw["to_frame"]] for rw in turn_cuts],  # the splice (chunk, frame k)
        "interrupt_points": [[rw["to_chunk"], rw["to_frame"]] for rw in report.rewinds if rw["cause"] == "interrupt"],
        "turns_rewound": sum(1 for t in turns if t["rewound_to"] is not None),
        "stalls": report.stalls,
        "stall_causes": {c: report.stall_causes.count(c) for c in sorted(set(report.stall_causes))},
        "repeated_frames": report.repeated_frames,
        "lead_chunks": report.lead_chunks,
        "lead_changes": report.lead_changes,
        "max_abs_av_offset_after_rewind_ms": report.max_abs_av_offset_after_rewind_ms,
        "max_abs_av_offset_ms": report.max_abs_av_offset_ms,
        "delivered_fps": round(report.delivered_fps, 3),
        "chunks": report.chunks,
        "chunks_generated": report.chunks_generated,
        "discarded_frames": report.discarded_frames,  # decoded and never shown (cut by rewinds and the interrupt)
        "chunk_stages_ms": {k: report.stages_ms[k] for k in ("diffuse", "decode", "buffer", "end_to_end")},
    }


def command(args: argparse.Namespace) -> str:
    """The command line that reproduces this run (from the parsed options)."""
    argv = ["--preset", args.preset, "--turns", str(args.turns), "--device", args.device]
    if args.step_ms is not None:
        argv += ["--step-ms", f"{args.step_ms:g}"]
    if args.weights:
        argv += ["--weights", args.weights]
    if args.no_rewind:
        argv += ["--no-rewind"]
    if args.seed:
        argv += ["--seed", str(args.seed)]
    if args.json:
        argv += ["--json", args.json]
    return "vivant bench turn " + shlex.join(argv)


def run(args: argparse.Namespace) -> int:
    plan = script_plan(args.turns, ModelConfig.from_name(args.preset).chunk_seconds)
    cfg, gen, vae, pad_note = build(args)
    cut_turn = args.turns // 2
    pipe = StreamPipeline(gen, vae, [NullSink()], session="bench-turn", rewind_on_turn=not args.no_rewind)
    convo = Conversation(pipe, plan)
    total_s = 1.0 + sum(t["speech_s"] + t["silence_s"] for t in plan) + 30.0
    report = pipe.run(math.ceil(total_s / cfg.chunk_seconds) * 4, convo.start, stop=convo.done)
    if convo.error is not None:
        raise SystemExit(f"vivant bench turn: the script failed: {convo.error!r}")
    doc = {
        "bench": "turn",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": command(args),
        "preset": args.preset, "device": args.device, "rewind": not args.no_rewind,
        "step_padded": args.step_ms is not None, "step_ms": args.step_ms, "step_note": pad_note or None,
        "speech": "synthetic voiced signal (110-170 Hz harmonics, 4 Hz syllable envelope), not espeak-ng",
        "machine": {"platform": platform.platform(), "cores": os.cpu_count(), "python": platform.python_version(),
                    "torch": torch.__version__,
                    "gpu": torch.cuda.get_device_name(0) if args.device == "cuda" else None},
        "goals": {"share_s_at_57b_step": GOAL_SHARE_57B_S, "share_s_ref_gpu": GOAL_SHARE_REF_GPU_S, "stalls": 0,
                  "max_abs_av_offset_ms": round(FRAME_MS, 1)},
        "script": plan,
        **summarize(report, plan, cut_turn),
    }
    print(format_table(doc))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")
    return 0


def format_table(doc: dict) -> str:
    goal = (f"goal ≤ {GOAL_SHARE_57B_S * 1e3:.0f} ms at the 57b step time, ≤ {GOAL_SHARE_REF_GPU_S * 1e3:.0f} ms "
            f"with ref on the GPU")
    lines = [f"bench turn: {doc['preset']} on {doc['device']}" + ("" if doc["rewind"] else ", no rewinds")
             + (f", diffusion padded to {doc['step_ms']} ms" if doc["step_padded"] else "")
             + f"; {doc['turns']} turns ({doc['turns_rewound']} rewound), {doc['chunks_generated']} chunks generated "
             f"for {doc['chunks']}, {doc.get('discarded_frames', 'n/a')} decoded frames never shown",
             "  stage (ms from audio in)   n      p50       p99"]
    for name, s in [*doc["stages_ms"].items(), ("share (published)", doc["share_ms"])]:
        if s["n"]:
            lines.append(f"  {name:<25}{s['n']:>3} {s['p50']:>9.2f} {s['p99']:>9.2f}")
    lines.append(f"  share of a turn p50 {doc['share_ms']['p50']} ms ({goal})")
    av = doc["max_abs_av_offset_after_rewind_ms"]
    lines.append(f"  stalls {doc['stalls']} {doc['stall_causes']} (goal 0); |A/V| max after rewinds "
                 f"{'n/a' if av is None else f'{av:.2f}'} ms (goal ≤ {FRAME_MS:.1f}); lead {doc['lead_chunks']} "
                 f"chunks, changes {doc['lead_changes']}; {doc['delivered_fps']} fps delivered")
    points = doc.get("rewind_points", [])
    lines.append(f"  rewinds {doc['rewinds']}, {sum(1 for _, k in points if k)} of them inside a chunk (frame k > 0); "
                 f"k: {[k for _, k in points]}; interrupts spliced at (chunk, k) {doc.get('interrupt_points', [])}")
    for key in ("interrupted_turn", "turn_after_interrupt"):
        t = doc[key]
        if t is not None:
            lines.append(f"  {key.replace('_', ' ')}: turn {t['turn']} rewound {t['rewound_ms']} → diffused "
                         f"{t['diffused_ms']} → decoded {t['decoded_ms']} → published {t['published_ms']} ms")
    return "\n".join(lines)
