"""Procedural training clips for the `ref` character: real speech from espeak-ng, a drawn face that says it.

Why procedural: the reference model must be trainable from one command with nothing downloaded, and its
lip-sync must be checkable against a ground truth. Each clip is a stretch of a session: idle (listening,
breathing: silence or faint noise), a spoken sentence (random words, an espeak-ng voice `-v` and speed
`-s`), maybe a pause and a second sentence, idle again. The face is drawn from per-frame parameters:

    mouth opening  o[f] ∈ [0, 1]  from the speech envelope (RMS per 1/24 s frame, gated, compressed, smoothed)
    eye opening    e[f] ∈ [0, 1]  blinks every 1.5–4.5 s
    head offset    (x[f], y[f])   pixels: slow sway and breathing bob

The opening is kept per frame as the ground truth of the lip-sync proxy (worker/quality/lipsync.py).

Split of the work between machines: espeak-ng exists only here, so `build_dataset` (CPU) speaks the
sentences and stores what training needs — the model's audio features per chunk `[A, F]` (exactly what
`AudioFeaturizer` gives the generator at run time) and the per-frame face parameters — in a small
compressed .npz. `render_faces` (torch, any device) draws frames from the parameters, so the GPU machine
renders its own frames without espeak-ng. Frames are `[N, 3, H, W]` float in [-1, 1] (H = W = 96 for `ref`);
audio is 16 kHz mono float32; 4 frames (one chunk) per 1/6 s.
"""

from __future__ import annotations

import io
import json
import math
import shutil
import subprocess
import wave
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from vivant.worker.model.audio_features import AudioFeaturizer
from vivant.worker.model.config import ModelConfig

# Two disjoint vocabularies: training sentences use TRAIN_WORDS, held-out evaluation sentences HELD_OUT_WORDS.
TRAIN_WORDS = (
    "apple river morning window garden silver yellow market doctor pepper basket mountain sunday "
    "letter button coffee rabbit pocket wonder little open happy simple table paper number music "
    "people water family orange purple monkey butter kitten lemon rocket bottle candle ladder "
    "hello good very maybe always never today tomorrow really think know want like make take give "
    "look come walk talk speak sing bring call find help play read write keep start stop turn "
    "and the a to of in on with for but so we you they it this that what where when why how "
    "big small warm cold bright quiet quick slow early late new old red blue green"
).split()
HELD_OUT_WORDS = (
    "zebra thunder velvet harbor pilot meadow copper lantern violin blanket cabbage dolphin "
    "fabulous gentle honest jolly mellow nimble polite rapid sturdy tender vivid wobbly "
    "gather juggle measure notice polish rescue wander whisper yodel borrow climb dive "
    "our their some every each many few near far above below after before during"
).split()
assert not set(TRAIN_WORDS) & set(HELD_OUT_WORDS)

VOICES = ("en-us", "en-us+f3", "en-gb", "en-gb+f2", "en-gb-x-rp+m3", "en-029", "en-gb-scotland+f4", "en-us+m4")
HELD_OUT_VOICES = ("en-us+f5", "en-gb-x-rp")


class DatasetError(ValueError):
    """A dataset file or request that cannot be used; the message names the field."""


def make_sentence(rng: np.random.Generator, *, held_out: bool = False) -> str:
    words = HELD_OUT_WORDS if held_out else TRAIN_WORDS
    n = int(rng.integers(4, 11))
    text = " ".join(words[int(i)] for i in rng.integers(0, len(words), n))
    return text[0].upper() + text[1:] + rng.choice([".", "!", "?"])


def speak(text: str, *, voice: str = "en-us", speed: int = 160, sample_rate: int = 16_000) -> np.ndarray:
    """espeak-ng speech resampled to `sample_rate` (sox) → float32 mono samples in [-1, 1]."""
    exe, sox = shutil.which("espeak-ng"), shutil.which("sox")
    if exe is None or sox is None:
        raise DatasetError("building the dataset needs espeak-ng and sox (`make sysdeps`); "
                           "the GPU machine reads the prebuilt weights/ref/data/ref_data.npz instead")
    wav = subprocess.run([exe, "-v", voice, "-s", str(speed), "--stdout", text], capture_output=True, timeout=60,
                         check=True).stdout
    raw = subprocess.run([sox, "-D", "-t", "wav", "-", "-r", str(sample_rate), "-c", "1", "-b", "16", "-e", "signed",
                          "-t", "wav", "-"], input=wav, capture_output=True, timeout=60, check=True).stdout
    with wave.open(io.BytesIO(raw)) as w:
        pcm = np.frombuffer(w.readframes(w.getnframes()), dtype="<i2")
    return pcm.astype(np.float32) / 32768.0


# ---- per-frame signals ------------------------------------------------------------------------------
def frame_envelope(audio: np.ndarray, n_frames: int, sample_rate: int, fps: int) -> np.ndarray:
    """RMS of each frame's samples [floor(f·sr/fps), floor((f+1)·sr/fps)) → float32 [n_frames]."""
    edges = (np.arange(n_frames + 1) * sample_rate) // fps
    x = np.zeros(int(edges[-1]), dtype=np.float32)
    x[: min(len(audio), len(x))] = audio[: len(x)]
    sq = np.concatenate([[0.0], np.cumsum(x.astype(np.float64) ** 2)])
    return np.sqrt((sq[edges[1:]] - sq[edges[:-1]]) / np.diff(edges)).astype(np.float32)


def mouth_from_envelope(env: np.ndarray) -> np.ndarray:
    """Mouth opening in [0, 1] per frame: gated, compressed, lightly smoothed speech envelope."""
    loud = env[env > 1e-3]
    ref = float(np.percentile(loud, 90)) if loud.size else 1.0
    o = np.clip(env / max(ref, 1e-4), 0.0, 1.0) ** 0.7
    o[env < 0.08 * ref] = 0.0
    out = np.empty_like(o)
    prev = 0.0
    for i, v in enumerate(o):  # fast attack, slower release (a jaw does not snap shut)
        prev = v if v >= prev else 0.55 * v + 0.45 * prev
        out[i] = prev
    return out.astype(np.float32)


def blinks(rng: np.random.Generator, n_frames: int, fps: int) -> np.ndarray:
    e = np.ones(n_frames, dtype=np.float32)
    f = int(rng.integers(0, int(3 * fps)))
    shape = np.array([0.55, 0.1, 0.1, 0.6], dtype=np.float32)
    while f < n_frames:
        seg = e[f: f + len(shape)]
        seg[:] = shape[: len(seg)]
        f += int(rng.uniform(1.5, 4.5) * fps)
    return e


def head_motion(rng: np.random.Generator, n_frames: int, fps: int) -> tuple[np.ndarray, np.ndarray]:
    t = np.arange(n_frames) / fps
    sx = 1.5 * np.sin(2 * math.pi * rng.uniform(0.08, 0.2) * t + rng.uniform(0, 2 * math.pi))
    sy = 0.8 * np.sin(2 * math.pi * rng.uniform(0.2, 0.3) * t + rng.uniform(0, 2 * math.pi))
    return sx.astype(np.float32), sy.astype(np.float32)


# ---- the drawing --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Look:
    """Geometry (fractions of the frame) and colours (RGB in [0, 1]) of the reference character."""

    background: tuple[float, float, float] = (0.30, 0.45, 0.62)
    skin: tuple[float, float, float] = (0.95, 0.78, 0.62)
    hair: tuple[float, float, float] = (0.45, 0.28, 0.16)
    eye_white: tuple[float, float, float] = (0.98, 0.98, 0.98)
    pupil: tuple[float, float, float] = (0.12, 0.10, 0.10)
    lips: tuple[float, float, float] = (0.80, 0.35, 0.35)
    mouth_inside: tuple[float, float, float] = (0.22, 0.04, 0.06)
    head_c: tuple[float, float] = (0.5, 0.54)
    head_r: tuple[float, float] = (0.33, 0.40)
    eye_y: float = 0.46
    eye_dx: float = 0.13
    eye_r: tuple[float, float] = (0.075, 0.055)
    mouth_y: float = 0.74
    mouth_rx: float = 0.10
    mouth_ry: float = 0.075  # at full opening


LOOK = Look()


def mouth_box(height: int, width: int, look: Look = LOOK) -> tuple[int, int, int, int]:
    """(y0, y1, x0, x1) pixel box holding the mouth at any head offset (the lip-sync proxy's region)."""
    cy, cx = look.mouth_y * height, 0.5 * width
    ry, rx = (look.mouth_ry + 0.03) * height + 2, (look.mouth_rx + 0.04) * width + 2
    return int(cy - ry), int(math.ceil(cy + ry)), int(cx - rx), int(math.ceil(cx + rx))


def _ellipse_alpha(yy, xx, cy, cx, ry, rx):
    """Anti-aliased coverage of ellipses; yy/xx [H, W], centres/radii [N, 1, 1] → [N, H, W]."""
    d = torch.sqrt(((yy - cy) / ry) ** 2 + ((xx - cx) / rx) ** 2)
    return ((1.0 - d) * torch.minimum(ry, rx) + 0.5).clamp(0.0, 1.0)


def render_faces(opening: torch.Tensor, eyes: torch.Tensor, sway_x: torch.Tensor, sway_y: torch.Tensor, *,
                 height: int = 96, width: int = 96, look: Look = LOOK) -> torch.Tensor:
    """Per-frame parameters [N] (on any device) → frames [N, 3, H, W] float32 in [-1, 1]."""
    dev = opening.device
    n = opening.shape[0]
    yy = torch.arange(height, device=dev, dtype=torch.float32)[:, None] + 0.5
    xx = torch.arange(width, device=dev, dtype=torch.float32)[None, :] + 0.5

    def col(c):
        return torch.tensor(c, device=dev, dtype=torch.float32).view(1, 3, 1, 1)

    def v(x):
        return x.float().view(n, 1, 1)

    ox, oy = v(sway_x), v(sway_y)
    one = torch.ones(n, 1, 1, device=dev)
    img = col(look.background) * (0.9 + 0.2 * yy / height)  # [1, 3, H, 1] vertical gradient
    img = img.expand(n, 3, height, width)

    def paint(img, alpha, colour):
        a = alpha.unsqueeze(1)
        return img * (1 - a) + col(colour) * a

    hc_y, hc_x = look.head_c[1] * height + oy, look.head_c[0] * width + ox
    hair = _ellipse_alpha(yy, xx, hc_y - 0.08 * height, hc_x, one * (look.head_r[1] + 0.03) * height,
                          one * (look.head_r[0] + 0.03) * width)
    img = paint(img, hair, look.hair)
    head = _ellipse_alpha(yy, xx, hc_y, hc_x, one * look.head_r[1] * height, one * look.head_r[0] * width)
    img = paint(img, head, look.skin)
    e = v(eyes).clamp(0.05, 1.0)
    for side in (-1, 1):
        ey, ex = look.eye_y * height + oy, (0.5 + side * look.eye_dx) * width + ox
        white = _ellipse_alpha(yy, xx, ey, ex, e * look.eye_r[1] * height, one * look.eye_r[0] * width)
        img = paint(img, white, look.eye_white)
        pupil = _ellipse_alpha(yy, xx, ey, ex, e * 0.035 * height, one * 0.035 * width) * white
        img = paint(img, pupil, look.pupil)
    o = v(opening).clamp(0.0, 1.0)
    my, mx = look.mouth_y * height + oy, 0.5 * width + ox
    lips = _ellipse_alpha(yy, xx, my, mx, (0.02 + o * look.mouth_ry) * height + 1.2,
                          (look.mouth_rx + 0.015 * o) * width + 1.2)
    img = paint(img, lips, look.lips)
    inside = _ellipse_alpha(yy, xx, my, mx, (0.004 + o * look.mouth_ry) * height, (look.mouth_rx - 0.01) * width * one)
    img = paint(img, inside * (o > 0.02).float(), look.mouth_inside)
    return img * 2.0 - 1.0


# ---- clips and the dataset file ------------------------------------------------------------------------
@dataclass
class Clip:
    audio: np.ndarray  # float32 [samples] at 16 kHz, a whole number of chunks
    features: np.ndarray  # float32 [chunks, A, F]
    envelope: np.ndarray  # float32 [frames]
    opening: np.ndarray  # float32 [frames] (ground truth)
    eyes: np.ndarray
    sway_x: np.ndarray
    sway_y: np.ndarray
    text: str


def chunk_features(audio: np.ndarray, cfg: ModelConfig, featurizer: AudioFeaturizer | None = None) -> np.ndarray:
    """The generator's audio features of every chunk of `audio`: [chunks, A, F] float32."""
    featurizer = featurizer or AudioFeaturizer(sample_rate=cfg.audio_sample_rate, tokens=max(cfg.audio_tokens, 1),
                                               features=cfg.audio_feature_dim,
                                               nominal_samples=cfg.chunk_sample_range(0)[1])
    n = clip_chunks(len(audio), cfg)
    out = [featurizer(audio[slice(*cfg.chunk_sample_range(c))], cfg.audio_sample_rate)[: cfg.audio_tokens].numpy()
           for c in range(n)]
    return np.stack(out).astype(np.float32)


def clip_chunks(samples: int, cfg: ModelConfig) -> int:
    return max(1, math.ceil(samples * cfg.fps / (cfg.audio_sample_rate * cfg.frames_per_chunk)))


def clip_from_audio(audio: np.ndarray, cfg: ModelConfig, rng: np.random.Generator, text: str = "") -> Clip:
    """Pad `audio` to whole chunks and derive features, envelope, ground-truth mouth, blinks and motion."""
    n = clip_chunks(len(audio), cfg)
    total = cfg.chunk_sample_range(n - 1)[1]
    padded = np.zeros(total, dtype=np.float32)
    padded[: len(audio)] = audio[:total]
    frames = n * cfg.frames_per_chunk
    env = frame_envelope(padded, frames, cfg.audio_sample_rate, cfg.fps)
    sx, sy = head_motion(rng, frames, cfg.fps)
    return Clip(audio=padded, features=chunk_features(padded, cfg), envelope=env, opening=mouth_from_envelope(env),
                eyes=blinks(rng, frames, cfg.fps), sway_x=sx, sway_y=sy, text=text)


def session_audio(rng: np.random.Generator, cfg: ModelConfig, *, held_out: bool = False,
                  sentences: int | None = None) -> tuple[np.ndarray, str]:
    """idle, sentence, (pause, sentence)…, idle: float32 16 kHz audio and the text spoken."""
    sr = cfg.audio_sample_rate
    voices = HELD_OUT_VOICES if held_out else VOICES
    parts, texts = [], []

    def idle(lo, hi):
        n = int(rng.uniform(lo, hi) * sr)
        level = float(rng.choice([0.0, 0.001, 0.003]))  # silence, or faint room/breath noise
        parts.append((rng.standard_normal(n) * level).astype(np.float32))

    idle(0.3, 1.5)
    count = sentences if sentences is not None else int(rng.integers(1, 3))
    for i in range(count):
        if i:
            idle(0.3, 1.2)
        text = make_sentence(rng, held_out=held_out)
        speech = speak(text, voice=str(rng.choice(voices)), speed=int(rng.integers(120, 200)), sample_rate=sr)
        peak = float(np.abs(speech).max()) or 1.0
        parts.append(speech / peak * float(rng.uniform(0.3, 0.9)))
        texts.append(text)
    idle(0.3, 1.0)
    return np.concatenate(parts), " / ".join(texts)


def build_dataset(cfg: ModelConfig, *, clips: int, seed: int, held_out: bool = False,
                  progress=None) -> dict[str, np.ndarray]:
    """Speak and describe `clips` sessions; returns the arrays `save_dataset` writes (see module doc)."""
    rng = np.random.default_rng(seed)
    built: list[Clip] = []
    for i in range(clips):
        audio, text = session_audio(rng, cfg, held_out=held_out)
        built.append(clip_from_audio(audio, cfg, rng, text))
        if progress and (i + 1) % 20 == 0:
            progress(f"dataset: {i + 1}/{clips} clips")
    return pack_clips(built, cfg, seed=seed)


def pack_clips(built: list[Clip], cfg: ModelConfig, *, seed: int) -> dict[str, np.ndarray]:
    meta = {"preset": cfg.name, "seed": seed, "clips": len(built), "fps": cfg.fps, "audio_sample_rate":
            cfg.audio_sample_rate, "frames_per_chunk": cfg.frames_per_chunk, "texts": [c.text for c in built]}
    return {
        "features": np.concatenate([c.features for c in built]).astype(np.float16),
        "envelope": np.concatenate([c.envelope for c in built]).astype(np.float16),
        "opening": np.concatenate([c.opening for c in built]).astype(np.float16),
        "eyes": np.concatenate([c.eyes for c in built]).astype(np.float16),
        "sway_x": np.concatenate([c.sway_x for c in built]).astype(np.float16),
        "sway_y": np.concatenate([c.sway_y for c in built]).astype(np.float16),
        "clip_chunks": np.array([len(c.features) for c in built], dtype=np.int32),
        "meta": np.array(json.dumps(meta)),
    }


DATA_KEYS = ("features", "envelope", "opening", "eyes", "sway_x", "sway_y", "clip_chunks", "meta")


def save_dataset(data: dict[str, np.ndarray], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(path, **data)
    return path


def load_dataset(path: str | Path, cfg: ModelConfig) -> dict[str, np.ndarray]:
    """Read and check a dataset file against the preset; DatasetError names what does not fit."""
    path = Path(path)
    if not path.is_file():
        raise DatasetError(f"dataset {str(path)!r} does not exist (build it with `vivant train ref --build-data`)")
    with np.load(path) as z:
        missing = [k for k in DATA_KEYS if k not in z]
        if missing:
            raise DatasetError(f"dataset {path.name!r}: missing arrays {missing}")
        data = {k: z[k] for k in DATA_KEYS}
    meta = json.loads(str(data["meta"]))
    if meta.get("preset") != cfg.name:
        raise DatasetError(f"dataset {path.name!r}: preset = {meta.get('preset')!r}; expected {cfg.name!r}")
    chunks = int(data["clip_chunks"].sum())
    want = (chunks, cfg.audio_tokens, cfg.audio_feature_dim)
    if tuple(data["features"].shape) != want:
        raise DatasetError(f"dataset {path.name!r}: features shape {tuple(data['features'].shape)}; expected {want}")
    for k in ("envelope", "opening", "eyes", "sway_x", "sway_y"):
        if data[k].shape != (chunks * cfg.frames_per_chunk,):
            raise DatasetError(f"dataset {path.name!r}: {k} shape {data[k].shape}; expected ({chunks * cfg.frames_per_chunk},)")
    return data


def first_clips(data: dict[str, np.ndarray], n: int, cfg: ModelConfig) -> dict[str, np.ndarray]:
    """The dataset restricted to its first n clips (same arrays, shorter)."""
    if n < 1:
        raise DatasetError(f"max clips = {n}; expected ≥ 1")
    cc = data["clip_chunks"][:n]
    chunks = int(cc.sum())
    frames = chunks * cfg.frames_per_chunk
    out = {k: data[k][:frames] for k in ("envelope", "opening", "eyes", "sway_x", "sway_y")}
    out.update(features=data["features"][:chunks], clip_chunks=cc, meta=data["meta"])
    return out


def render_dataset_frames(data: dict[str, np.ndarray], cfg: ModelConfig, device: str | torch.device = "cpu",
                          batch: int = 4096) -> torch.Tensor:
    """All frames of a dataset as uint8 [frames, 3, H, W] on `device` (drawn from the stored parameters)."""
    params = [torch.from_numpy(data[k].astype(np.float32)) for k in ("opening", "eyes", "sway_x", "sway_y")]
    out = []
    for s in range(0, len(params[0]), batch):
        p = [t[s: s + batch].to(device) for t in params]
        f = render_faces(*p, height=cfg.height, width=cfg.width)
        out.append(((f + 1) * 127.5).round().clamp(0, 255).to(torch.uint8))
    return torch.cat(out)
