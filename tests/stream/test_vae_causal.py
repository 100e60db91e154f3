"""The causal VAE decoder: chunk-by-chunk equals one pass, causality, presets, checkpoint checks.

The equivalence and causality tests use a small config (same code, 4x6 latents → 64x96) to stay fast
on 2 shared cores; the preset tests use `tiny` and `57b` (the latter on the meta device: shapes only)."""

from __future__ import annotations

import pytest
import torch
from vivant.worker.model.config import ModelConfig
from vivant.worker.stream.vae import (
    CheckpointMismatchError,
    LatentShapeError,
    VAEConfig,
    VAEDecoder,
    build_vae_decoder,
    conv_frames,
    load_vae_decoder,
    save_vae_decoder,
)

SMALL = VAEConfig(name="small-test", latent_h=4, latent_w=6, widths=(16, 16, 8, 8, 8))


@pytest.fixture(scope="module")
def small():
    return build_vae_decoder(SMALL, seed=1)


@pytest.fixture(scope="module")
def tiny():
    return build_vae_decoder("tiny", seed=1)


def latents(chunks: int, seed: int = 0, cfg: VAEConfig = SMALL) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, cfg.latent_channels, chunks, cfg.latent_h, cfg.latent_w, generator=g)


@torch.inference_mode()
def test_chunk_by_chunk_equals_one_pass(small):
    tiny = small
    lat = latents(6)
    whole = tiny(lat)  # [1, 3, 24, 64, 96]
    assert whole.shape == (1, 3, 24, 64, 96)
    cache = tiny.new_cache()
    parts = torch.cat([tiny(lat[:, :, n:n + 1], cache) for n in range(6)], dim=2)
    err = (parts - whole).abs().max().item()
    assert err < 1e-4, f"chunked vs one-pass frames differ by up to {err:.2e}"
    # The temporal cache matters: without it, later chunks differ from the one-pass frames.
    fresh = torch.cat([tiny(lat[:, :, n:n + 1]) for n in range(6)], dim=2)
    assert (fresh[:, :, 4:] - whole[:, :, 4:]).abs().max().item() > 1e-2, "the cache should carry information"
    # decode_chunk (uint8, [4, H, W, 3]) on the same cache path gives the same pixels (±1 from rounding).
    cache = tiny.new_cache()
    frames = torch.cat([tiny.decode_chunk(lat[0, :, n], cache) for n in range(6)])
    expected = ((whole[0].clamp(-1, 1) + 1) * 127.5).round().permute(1, 2, 3, 0)
    assert frames.shape == (24, 64, 96, 3) and frames.dtype == torch.uint8
    assert (frames.float() - expected).abs().max().item() <= 1


@torch.inference_mode()
def test_decoder_is_causal_and_sessions_are_independent(small):
    tiny = small
    a, b = latents(5, seed=2), latents(5, seed=3)
    changed = a.clone()
    changed[:, :, 3] += 1.0
    ya, yc = tiny(a), tiny(changed)
    assert torch.equal(ya[:, :, :12], yc[:, :, :12]), "frames of chunks 0..2 must not depend on chunk 3"
    assert not torch.allclose(ya[:, :, 12:16], yc[:, :, 12:16])
    # Two sessions interleaved on one decoder, each with its own cache, match their solo runs.
    ca, cb = tiny.new_cache(), tiny.new_cache()
    out_a, out_b = [], []
    for n in range(5):
        out_a.append(tiny(a[:, :, n:n + 1], ca))
        out_b.append(tiny(b[:, :, n:n + 1], cb))
    assert (torch.cat(out_a, 2) - ya).abs().max() < 1e-4
    assert (torch.cat(out_b, 2) - tiny(b)).abs().max() < 1e-4


@pytest.mark.parametrize("kt", [1, 2, 3])
def test_cpu_conv_over_frames_equals_the_conv3d(kt):
    """The decoder's CPU form of its (kt, 3, 3) convolutions (one conv2d over frames, taps stacked on channels) is
    the conv3d up to float32 summation order, for the spatial-only (kt = 1) and the causal (kt > 1) layers."""
    torch.manual_seed(kt)
    conv = torch.nn.Conv3d(5, 7, kernel_size=(kt, 3, 3), padding=(0, 1, 1))
    x = torch.randn(2, 5, 6, 9, 11)
    with torch.no_grad():
        got, want = conv_frames(conv, x), conv(x)
    assert got.shape == want.shape == (2, 7, 7 - kt, 9, 11)
    err = float((got - want).abs().max())
    assert err < 1e-5, f"kt={kt}: max abs difference {err:.2e} from conv3d"


def test_presets_match_the_model_presets_and_57b_decodes_to_704x1088():
    for name in ("tiny", "57b"):
        model_cfg = ModelConfig.from_name(name)
        vae = VAEConfig.for_model(model_cfg)
        assert (vae.out_h, vae.out_w) == (model_cfg.height, model_cfg.width)
        assert (vae.spatial_factor, vae.temporal_factor) == (16, 4)
    # Shapes of the 57b decoder without computing it: run it on the meta device.
    with torch.device("meta"):
        big = VAEDecoder(VAEConfig.from_name("57b"))
        out = big(torch.empty(1, 16, 1, 44, 68))
    assert tuple(out.shape) == (1, 3, 4, 704, 1088)


def test_wrong_latent_shape_names_both_shapes(tiny):
    with pytest.raises(LatentShapeError, match=r"expected shape \[16, 8, 12\].*got \[16, 44, 68\]"):
        tiny.decode_chunk(torch.zeros(16, 44, 68), tiny.new_cache())
    with pytest.raises(LatentShapeError, match=r"expected shape \[B, 16, T, 8, 12\].*got \[1, 8, 1, 8, 12\]"):
        tiny(torch.zeros(1, 8, 1, 8, 12))


def test_checkpoint_roundtrip_and_mismatch_names_tensor_and_shapes(tiny, tmp_path):
    from safetensors.torch import load_file, save_file

    path = tmp_path / "vae.safetensors"
    save_vae_decoder(tiny, path)
    loaded = load_vae_decoder("tiny", path)
    lat = latents(1, cfg=tiny.cfg)
    with torch.inference_mode():
        assert torch.equal(loaded(lat), tiny(lat))

    tensors = load_file(str(path))
    tensors["levels.1.blocks.0.conv1.conv.weight"] = torch.zeros(16, 32, 3, 3, 3)
    del tensors["conv_out.conv.bias"]
    tensors["extra.weight"] = torch.zeros(2)
    bad = tmp_path / "bad.safetensors"
    save_file(tensors, str(bad))
    with pytest.raises(CheckpointMismatchError) as err:
        load_vae_decoder("tiny", bad)
    msg = str(err.value)
    assert ("tensor 'levels.1.blocks.0.conv1.conv.weight': expected shape [32, 32, 3, 3, 3], "
            "got [16, 32, 3, 3, 3]") in msg, msg
    assert "missing tensor 'conv_out.conv.bias' (expected shape [3])" in msg, msg
    assert "unexpected tensor 'extra.weight' with shape [2]" in msg, msg
    with pytest.raises(CheckpointMismatchError, match="does not match preset '57b'"):
        load_vae_decoder("57b", path)
