"""Model configuration: one typed object, named presets (`ModelConfig.from_name`).

The `57b` preset carries the shapes of the reference system (docs/ARCHITECTURE.md):
60 layers, d_model 8192, 64 heads × 128, SwiGLU d_ff 27648 (≈57B parameters); a 4-frame chunk is
one latent frame of 16 × 44 × 68 (16×16 spatial / 4× temporal VAE on 704×1088), patchified 2×2 into
22 × 34 = 748 video tokens, plus 9 audio tokens = 757 new tokens; the KV cache is 489 sink slots +
7 chunks × 757 = 5,788 slots (the 7 window chunks include the chunk being generated).
`tiny` is the same code, small enough for 2 CPU cores.

Units: sample rates in Hz, frame rates in frames/s, durations derive from them; token counts per chunk.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace


class ConfigError(ValueError):
    """A configuration that cannot work; the message names the field and what was expected."""


@dataclass(frozen=True)
class ModelConfig:
    name: str
    # transformer
    n_layers: int
    d_model: int
    n_heads: int
    head_dim: int
    d_ff: int  # SwiGLU hidden size (gate and up are each d_model × d_ff)
    # latent video: one latent frame per chunk
    latent_channels: int = 16
    latent_h: int = 44
    latent_w: int = 68
    patch: int = 2
    # audio
    audio_tokens: int = 9
    audio_feature_dim: int = 64
    audio_sample_rate: int = 16_000
    # timing
    fps: int = 24
    frames_per_chunk: int = 4
    vae_spatial: int = 16
    vae_temporal: int = 4
    # cache
    sink_tokens: int = 489
    window_chunks: int = 7
    # RoPE bands (t, h, w) of head_dim and position reset
    rope_dims: tuple[int, int, int] = (44, 42, 42)
    rope_theta: float = 10_000.0
    t_limit: int = 1024  # when a chunk's temporal index reaches this, positions shift back
    # sampler: flow matching, sigma goes 1 → 0 over `passes` Euler steps
    sigmas: tuple[float, ...] = (1.0, 0.75, 0.5, 0.25)
    norm_eps: float = 1e-6
    extra: dict = field(default_factory=dict, compare=False)

    # ---- derived shapes -------------------------------------------------------------------------
    @property
    def passes(self) -> int:
        return len(self.sigmas)

    @property
    def grid_h(self) -> int:
        return self.latent_h // self.patch

    @property
    def grid_w(self) -> int:
        return self.latent_w // self.patch

    @property
    def video_tokens(self) -> int:
        return self.grid_h * self.grid_w

    @property
    def tokens_per_chunk(self) -> int:
        return self.video_tokens + self.audio_tokens

    @property
    def window_slots(self) -> int:
        return self.window_chunks * self.tokens_per_chunk

    @property
    def cache_slots(self) -> int:
        return self.sink_tokens + self.window_slots

    @property
    def patch_dim(self) -> int:
        return self.latent_channels * self.patch * self.patch

    @property
    def height(self) -> int:
        return self.latent_h * self.vae_spatial

    @property
    def width(self) -> int:
        return self.latent_w * self.vae_spatial

    @property
    def chunk_seconds(self) -> float:
        return self.frames_per_chunk / self.fps

    def chunk_sample_range(self, n: int) -> tuple[int, int]:
        """Audio samples [start, stop) of chunk n at `audio_sample_rate` (exact integer arithmetic)."""
        num = self.audio_sample_rate * self.frames_per_chunk
        return (n * num) // self.fps, ((n + 1) * num) // self.fps

    def param_count(self) -> int:
        d, f = self.d_model, self.d_ff
        per_layer = 3 * d * d + d * d + 3 * d * f + 2 * self.head_dim + 6 * d + 2 * d
        embed = self.patch_dim * d + self.audio_feature_dim * d + 256 * d + d * 6 * d + d * self.patch_dim
        return self.n_layers * per_layer + embed

    # ---- construction ---------------------------------------------------------------------------
    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        def need(ok: bool, fieldname: str, expected: str) -> None:
            if not ok:
                raise ConfigError(f"ModelConfig {self.name!r}: {fieldname} = {getattr(self, fieldname, '?')!r}; expected {expected}")

        for f in ("n_layers", "d_model", "n_heads", "head_dim", "d_ff", "latent_channels", "latent_h",
                  "latent_w", "patch", "audio_feature_dim", "audio_sample_rate", "fps", "frames_per_chunk",
                  "window_chunks"):
            need(int(getattr(self, f)) > 0, f, "a positive integer")
        need(self.audio_tokens >= 0, "audio_tokens", "≥ 0")
        need(self.sink_tokens >= 0, "sink_tokens", "≥ 0")
        need(self.d_model == self.n_heads * self.head_dim, "d_model", f"n_heads × head_dim = {self.n_heads * self.head_dim}")
        need(self.head_dim % 2 == 0, "head_dim", "an even number (RoPE rotates pairs)")
        need(len(self.rope_dims) == 3 and all(d % 2 == 0 and d >= 0 for d in self.rope_dims),
             "rope_dims", "three even non-negative band sizes (t, h, w)")
        need(sum(self.rope_dims) == self.head_dim, "rope_dims", f"bands summing to head_dim = {self.head_dim}")
        need(self.latent_h % self.patch == 0, "latent_h", f"a multiple of patch = {self.patch}")
        need(self.latent_w % self.patch == 0, "latent_w", f"a multiple of patch = {self.patch}")
        need(self.sink_tokens <= self.tokens_per_chunk, "sink_tokens",
             f"≤ tokens_per_chunk = {self.tokens_per_chunk} (the sink keeps the first tokens of chunk 0)")
        need(self.t_limit > self.window_chunks + 1, "t_limit", f"> window_chunks + 1 = {self.window_chunks + 1}")
        need(len(self.sigmas) >= 1 and all(0 < s <= 1 for s in self.sigmas)
             and all(a > b for a, b in zip(self.sigmas, self.sigmas[1:], strict=False)),
             "sigmas", "a strictly decreasing sequence in (0, 1]")

    @classmethod
    def from_name(cls, name: str, **overrides) -> ModelConfig:
        if name not in PRESETS:
            raise ConfigError(f"unknown preset {name!r}; expected one of: {', '.join(sorted(PRESETS))}")
        base = PRESETS[name]
        try:
            return replace(base, **overrides) if overrides else base
        except TypeError as exc:  # unknown override field
            raise ConfigError(f"preset {name!r}: {exc}") from None

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("extra", None)
        return d

    def shard_heads(self, world_size: int) -> int:
        """Heads per tensor-parallel rank; errors name the field when they do not divide."""
        if world_size < 1 or self.n_heads % world_size:
            raise ConfigError(f"ModelConfig {self.name!r}: n_heads = {self.n_heads} does not divide by tp = {world_size}")
        if self.d_ff % world_size:
            raise ConfigError(f"ModelConfig {self.name!r}: d_ff = {self.d_ff} does not divide by tp = {world_size}")
        return self.n_heads // world_size


def _tiny() -> ModelConfig:
    return ModelConfig(
        name="tiny", n_layers=2, d_model=64, n_heads=4, head_dim=16, d_ff=128,
        latent_channels=16, latent_h=8, latent_w=12, patch=2, audio_tokens=3, audio_feature_dim=32,
        sink_tokens=10, window_chunks=3, rope_dims=(4, 6, 6), t_limit=12,
    )


def _ref() -> ModelConfig:
    """The trained reference character (worker/train, docs/reference_model.md): 96×96 frames, 8 × 12 × 12
    latents (8× spatial, 4× temporal VAE), 36 video + 4 audio tokens per chunk (one audio token per frame),
    5 layers of d_model 192. t_limit 16 makes position resets frequent (every 10 chunks after the first),
    so every session exercises the delta rotation; RoPE makes scores depend on t differences only."""
    return ModelConfig(
        name="ref", n_layers=5, d_model=192, n_heads=6, head_dim=32, d_ff=512,
        latent_channels=8, latent_h=12, latent_w=12, patch=2, audio_tokens=4, audio_feature_dim=32,
        vae_spatial=8, vae_temporal=4, sink_tokens=36, window_chunks=6, rope_dims=(12, 10, 10), t_limit=16,
    )


def _57b() -> ModelConfig:
    return ModelConfig(
        name="57b", n_layers=60, d_model=8192, n_heads=64, head_dim=128, d_ff=27648,
        latent_channels=16, latent_h=44, latent_w=68, patch=2, audio_tokens=9, audio_feature_dim=64,
        sink_tokens=489, window_chunks=7, rope_dims=(44, 42, 42), t_limit=1024,
    )


PRESETS: dict[str, ModelConfig] = {"tiny": _tiny(), "ref": _ref(), "57b": _57b()}

assert PRESETS["57b"].tokens_per_chunk == 757 and PRESETS["57b"].cache_slots == 5788
assert math.isclose(PRESETS["57b"].chunk_seconds * 1000, 166.666, rel_tol=1e-4)
