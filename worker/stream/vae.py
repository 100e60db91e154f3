"""Causal video VAE decoder: one latent frame in, four RGB frames out, chunk by chunk.

Why this shape: the DiT emits one latent frame per chunk (4 video frames at 24 fps). The decoder must
turn it into pixels while the DiT diffuses the next chunk, on its own device, and it must give the
same frames whether it sees the latents one chunk at a time (live) or all at once (offline). That
is what causal temporal padding with a per-session feature cache buys: every temporal convolution
pads only on the past side, and the past is the last `kt - 1` input frames of that convolution from
the previous chunk, kept in a `DecoderCache` (one per session; the module itself holds no session
state, so one loaded decoder can serve sessions one after another).

Layout, for a `VAEConfig` with widths w0..w4 (5 resolution levels, 4 spatial 2x ups = 16x):

    latents [B, 16, T, h, w]
      conv_in        causal 3x3x3 conv 16 -> w0
      level i:       `blocks_per_level` residual blocks (channel RMSNorm, SiLU, causal 3x3x3 conv) x2
                     temporal 2x up at the levels in `temporal_up_levels` (causal conv to 2c channels,
                       channels -> time; two of them = 4x)
                     spatial 2x up (nearest, then a 1x3x3 conv wi -> wi+1), except after the last level
      head           RMSNorm, SiLU, causal 3x3x3 conv w4 -> 3, tanh
    frames  [B, 3, 4T, 16h, 16w] in [-1, 1]

Normalisation is per frame and per position (RMS over channels), never over time, so it is causal too.
Presets: `57b` decodes 44x68 latents to 704x1088; `tiny` decodes 8x12 to 128x192 (small widths; runs on
2 CPU cores). Weights load from safetensors with every tensor's shape checked; benchmarks use random init.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from vivant.worker.model.config import ModelConfig
from vivant.worker.model.ref_model import ref_paths


class LatentShapeError(ValueError):
    """Latents handed to the decoder do not have the shape its preset expects."""


class CheckpointMismatchError(ValueError):
    """A checkpoint's tensors do not match the decoder's parameters (names or shapes)."""


@dataclass(frozen=True)
class VAEConfig:
    """Sizes of the causal video decoder. Spatial factor = 2 ** (len(widths) - 1)."""

    name: str
    latent_h: int
    latent_w: int
    widths: tuple[int, ...]
    latent_channels: int = 16
    temporal_up_levels: tuple[int, ...] = (0, 1)
    blocks_per_level: int = 1
    kernel_t: int = 3
    out_channels: int = 3

    @property
    def spatial_factor(self) -> int:
        return 2 ** (len(self.widths) - 1)

    @property
    def temporal_factor(self) -> int:
        return 2 ** len(self.temporal_up_levels)

    @property
    def out_h(self) -> int:
        return self.latent_h * self.spatial_factor

    @property
    def out_w(self) -> int:
        return self.latent_w * self.spatial_factor

    @classmethod
    def from_name(cls, name: str) -> VAEConfig:
        try:
            return VAE_PRESETS[name]
        except KeyError:
            raise ValueError(f"unknown VAE preset {name!r}; expected one of {sorted(VAE_PRESETS)}") from None

    @classmethod
    def for_model(cls, model_cfg) -> VAEConfig:
        """The preset named like a ModelConfig, checked against its latent and VAE fields."""
        vae = cls.from_name(model_cfg.name)
        pairs = {
            "latent_channels": (vae.latent_channels, model_cfg.latent_channels),
            "latent_h": (vae.latent_h, model_cfg.latent_h),
            "latent_w": (vae.latent_w, model_cfg.latent_w),
            "vae_spatial": (vae.spatial_factor, model_cfg.vae_spatial),
            "vae_temporal": (vae.temporal_factor, model_cfg.vae_temporal),
        }
        for name, (ours, theirs) in pairs.items():
            if ours != theirs:
                raise ValueError(f"ModelConfig {model_cfg.name!r}: {name} = {theirs}; the VAE preset expects {ours}")
        return vae


VAE_PRESETS: dict[str, VAEConfig] = {
    # Reference system: 16 ch latents at 44x68 -> 704x1088, 16x spatial, 4x temporal.
    "57b": VAEConfig(name="57b", latent_h=44, latent_w=68, widths=(384, 256, 128, 64, 32)),
    # Same code and factors, small widths: 8x12 -> 128x192.
    "tiny": VAEConfig(name="tiny", latent_h=8, latent_w=12, widths=(32, 32, 16, 16, 8)),
    # The trained reference character (worker/train): 8 ch latents at 12x12 -> 96x96, 8x spatial, 4x temporal.
    "ref": VAEConfig(name="ref", latent_h=12, latent_w=12, widths=(64, 48, 32, 16), latent_channels=8),
}


@dataclass
class DecoderCache:
    """Per-session temporal state: for each causal conv, its last `kt - 1` input frames.

    `chunks` counts the chunks decoded with this cache (the frame index of the next output frame is
    `chunks * temporal_factor`)."""

    frames: dict[str, torch.Tensor] = field(default_factory=dict)
    chunks: int = 0

    def reset(self) -> None:
        self.frames.clear()
        self.chunks = 0

    def snapshot(self) -> DecoderCache:
        """The state as it is now, for a rewind (worker/stream/decoder_stage.py). A shallow copy suffices and costs no
        device memory of its own: a decode replaces each entry with a new tensor (`CausalConv3d.forward`), never
        writes one in place, so the snapshot's tensors stay as they were."""
        return DecoderCache(dict(self.frames), self.chunks)


def conv_frames(conv: nn.Conv3d, xx: torch.Tensor) -> torch.Tensor:
    """`conv` (kernel (kt, 3, 3), padding (0, 1, 1)) over xx [B, C, T_in, H, W] → [B, C_out, T_in − kt + 1, H, W].

    On a CPU, the same convolution as one conv2d over frames with the kt taps stacked on channels: torch's CPU
    conv3d is a slow generic kernel, conv2d goes to oneDNN (3–5x faster at the ref decoder's sizes). Elsewhere the
    conv3d itself."""
    if xx.device.type != "cpu":
        return conv(xx)
    b, c, t_in, h, w = xx.shape
    kt = conv.kernel_size[0]
    t = t_in - kt + 1
    stacked = xx if kt == 1 else torch.cat([xx[:, :, k:k + t] for k in range(kt)], dim=1)  # [B, kt*C, T, H, W]
    stacked = stacked.permute(0, 2, 1, 3, 4).reshape(b * t, kt * c, h, w)
    weight = conv.weight.permute(0, 2, 1, 3, 4).reshape(conv.out_channels, kt * c, 3, 3)
    y = F.conv2d(stacked, weight, conv.bias, padding=1)
    return y.reshape(b, t, -1, h, w).permute(0, 2, 1, 3, 4)


class CausalConv3d(nn.Module):
    """3D conv padded 1 on each side in space and `kt - 1` frames on the past side in time.

    The past frames come from `cache.frames[key]` (zeros at the start of a session); after the call
    the cache holds this call's last `kt - 1` input frames."""

    def __init__(self, c_in: int, c_out: int, kt: int, key: str) -> None:
        super().__init__()
        self.kt = kt
        self.key = key
        self.conv = nn.Conv3d(c_in, c_out, kernel_size=(kt, 3, 3), padding=(0, 1, 1))

    def forward(self, x: torch.Tensor, cache: DecoderCache) -> torch.Tensor:
        past_n = self.kt - 1
        if past_n == 0:
            return conv_frames(self.conv, x)
        past = cache.frames.get(self.key)
        if past is None:
            b, c, _, h, w = x.shape
            past = x.new_zeros(b, c, past_n, h, w)
        xx = torch.cat([past, x], dim=2)
        cache.frames[self.key] = xx[:, :, -past_n:].detach().clone()
        return conv_frames(self.conv, xx)


class ChannelRMSNorm(nn.Module):
    """RMS over channels at each (t, y, x): causal, and independent of the chunking."""

    def __init__(self, channels: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rms = x.float().pow(2).mean(dim=1, keepdim=True).add(self.eps).rsqrt()
        return (x.float() * rms).to(x.dtype) * self.weight.view(1, -1, 1, 1, 1)


class CausalResBlock(nn.Module):
    def __init__(self, channels: int, kt: int, key: str) -> None:
        super().__init__()
        self.norm1 = ChannelRMSNorm(channels)
        self.conv1 = CausalConv3d(channels, channels, kt, f"{key}.conv1")
        self.norm2 = ChannelRMSNorm(channels)
        self.conv2 = CausalConv3d(channels, channels, kt, f"{key}.conv2")

    def forward(self, x: torch.Tensor, cache: DecoderCache) -> torch.Tensor:
        h = self.conv1(F.silu(self.norm1(x)), cache)
        h = self.conv2(F.silu(self.norm2(h)), cache)
        return x + h


class TemporalUp2x(nn.Module):
    """Doubles time: a causal conv makes 2c channels, which become two consecutive frames."""

    def __init__(self, channels: int, kt: int, key: str) -> None:
        super().__init__()
        self.conv = CausalConv3d(channels, 2 * channels, kt, f"{key}.conv")

    def forward(self, x: torch.Tensor, cache: DecoderCache) -> torch.Tensor:
        b, c, t, h, w = x.shape
        y = self.conv(x, cache).view(b, 2, c, t, h, w).permute(0, 2, 3, 1, 4, 5).reshape(b, c, 2 * t, h, w)
        return y + x.repeat_interleave(2, dim=2)


class SpatialUp2x(nn.Module):
    """Nearest 2x in height and width, then a per-frame 3x3 conv (no temporal extent, no cache)."""

    def __init__(self, c_in: int, c_out: int) -> None:
        super().__init__()
        self.conv = nn.Conv3d(c_in, c_out, kernel_size=(1, 3, 3), padding=(0, 1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return conv_frames(self.conv, F.interpolate(x, scale_factor=(1.0, 2.0, 2.0), mode="nearest"))


class VAEDecoder(nn.Module):
    """latents [B, C, T, h, w] -> frames [B, 3, temporal_factor*T, H, W] in [-1, 1] (see module doc)."""

    def __init__(self, cfg: VAEConfig) -> None:
        super().__init__()
        self.cfg = cfg
        kt, widths = cfg.kernel_t, cfg.widths
        self.conv_in = CausalConv3d(cfg.latent_channels, widths[0], kt, "conv_in")
        self.levels = nn.ModuleList()
        for i, width in enumerate(widths):
            level = nn.Module()
            level.blocks = nn.ModuleList(
                CausalResBlock(width, kt, f"levels.{i}.blocks.{j}") for j in range(cfg.blocks_per_level)
            )
            level.tup = TemporalUp2x(width, kt, f"levels.{i}.tup") if i in cfg.temporal_up_levels else None
            level.sup = SpatialUp2x(width, widths[i + 1]) if i + 1 < len(widths) else None
            self.levels.append(level)
        self.norm_out = ChannelRMSNorm(widths[-1])
        self.conv_out = CausalConv3d(widths[-1], cfg.out_channels, kt, "conv_out")

    def new_cache(self) -> DecoderCache:
        return DecoderCache()

    def check_latents(self, latents: torch.Tensor) -> None:
        """Raise LatentShapeError unless latents are [B, C, T, h, w] with this preset's C, h, w."""
        cfg = self.cfg
        expected = (cfg.latent_channels, cfg.latent_h, cfg.latent_w)
        got = tuple(latents.shape)
        if latents.dim() != 5 or (got[1], got[3], got[4]) != expected:
            raise LatentShapeError(
                f"latents: expected shape [B, {expected[0]}, T, {expected[1]}, {expected[2]}] "
                f"(VAE preset {cfg.name!r}), got {list(got)}"
            )

    def check_chunk_latents(self, latents: torch.Tensor) -> torch.Tensor:
        """One chunk's latents, [C, h, w] or [C, 1, h, w], returned as [C, 1, h, w]; LatentShapeError otherwise."""
        cfg = self.cfg
        expected = (cfg.latent_channels, 1, cfg.latent_h, cfg.latent_w)
        shaped = latents.unsqueeze(1) if latents.dim() == 3 else latents
        if tuple(shaped.shape) != expected:
            raise LatentShapeError(
                f"chunk latents: expected shape {[expected[0], expected[2], expected[3]]} (or {list(expected)}) "
                f"for VAE preset {cfg.name!r}, got {list(latents.shape)}"
            )
        return shaped

    def forward(self, latents: torch.Tensor, cache: DecoderCache | None = None) -> torch.Tensor:
        self.check_latents(latents)
        cache = cache if cache is not None else DecoderCache()
        x = self.conv_in(latents, cache)
        for level in self.levels:
            for block in level.blocks:
                x = block(x, cache)
            if level.tup is not None:
                x = level.tup(x, cache)
            if level.sup is not None:
                x = level.sup(x)
        x = self.conv_out(F.silu(self.norm_out(x)), cache)
        cache.chunks += latents.shape[2]
        return torch.tanh(x)

    @torch.inference_mode()
    def decode_chunk(self, latents: torch.Tensor, cache: DecoderCache) -> torch.Tensor:
        """One chunk's latents [C, h, w] (or [C, 1, h, w]) -> uint8 frames [temporal_factor, H, W, 3].

        The result stays on the decoder's device; the caller moves it when it needs host memory."""
        latents = self.check_chunk_latents(latents)
        p = next(self.parameters())
        x = latents.to(device=p.device, dtype=p.dtype).unsqueeze(0)
        frames = self.forward(x, cache)[0]  # [3, Tf, H, W]
        return frames_to_uint8(frames)


def frames_to_uint8(frames: torch.Tensor) -> torch.Tensor:
    """[3, T, H, W] in [-1, 1] -> [T, H, W, 3] uint8."""
    return ((frames.float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(1, 2, 3, 0).contiguous()


def build_vae_decoder(
    cfg: VAEConfig | str, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32, seed: int = 0
) -> VAEDecoder:
    """A decoder with random weights of the preset's exact shapes (benchmarks, tests, demo)."""
    cfg = VAEConfig.from_name(cfg) if isinstance(cfg, str) else cfg
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = VAEDecoder(cfg)
    return model.to(device=device, dtype=dtype).eval().requires_grad_(False)


def save_vae_decoder(model: VAEDecoder, path: str | Path) -> None:
    from safetensors.torch import save_file

    save_file({k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}, str(path))


def load_vae_decoder(
    cfg: VAEConfig | str, path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
) -> VAEDecoder:
    """Load a decoder from a safetensors file, checking every tensor's name and shape first.

    Raises CheckpointMismatchError naming each missing or unexpected tensor, and each tensor whose
    shape differs with both shapes; nothing is loaded unless everything matches."""
    from safetensors import safe_open

    cfg = VAEConfig.from_name(cfg) if isinstance(cfg, str) else cfg
    with torch.device("meta"):
        expected = {k: tuple(v.shape) for k, v in VAEDecoder(cfg).state_dict().items()}
    tensors: dict[str, torch.Tensor] = {}
    with safe_open(str(path), framework="pt") as f:
        for key in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
            tensors[key] = f.get_tensor(key)
    problems = []
    for key, shape in expected.items():
        if key not in tensors:
            problems.append(f"missing tensor {key!r} (expected shape {list(shape)})")
        elif tuple(tensors[key].shape) != shape:
            problems.append(
                f"tensor {key!r}: expected shape {list(shape)}, got {list(tensors[key].shape)} in the checkpoint"
            )
    problems += [f"unexpected tensor {key!r} with shape {list(t.shape)}" for key, t in tensors.items() if key not in expected]
    if problems:
        raise CheckpointMismatchError(
            f"VAE checkpoint {str(path)!r} does not match preset {cfg.name!r}: " + "; ".join(problems)
        )
    model = VAEDecoder(cfg)
    model.load_state_dict(tensors, strict=True)
    return model.to(device=device, dtype=dtype).eval().requires_grad_(False)


def load_ref_decoder(weights_dir: str | Path | None = None, device: str = "cpu") -> tuple[ModelConfig, VAEDecoder]:
    """The trained `ref` character's decoder (weights/ref/, see vivant.worker.model.ref_model) and its
    model config; a ValueError names a missing file."""
    cfg = ModelConfig.from_name("ref")
    _, vae = ref_paths(weights_dir)
    return cfg, load_vae_decoder(VAEConfig.for_model(cfg), vae, device=device)
