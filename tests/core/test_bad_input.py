"""Bad input gets a clear error naming the field and what was expected, and loses nothing."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from vivant.worker.model.audio_features import AudioError
from vivant.worker.model.config import ConfigError, ModelConfig
from vivant.worker.model.generator import ChunkGenerator
from vivant.worker.model.model import VideoDiT, init_random_
from vivant.worker.model.weights import CheckpointError, load_weights, save_weights


def test_unknown_preset_lists_the_known_ones():
    with pytest.raises(ConfigError, match=r"unknown preset 'huge'; expected one of: 57b, ref, tiny"):
        ModelConfig.from_name("huge")


@pytest.mark.parametrize(
    "override,field,expected",
    [
        ({"latent_h": 9}, "latent_h", "a multiple of patch"),
        ({"latent_w": 13}, "latent_w", "a multiple of patch"),
        ({"d_model": 60}, "d_model", "n_heads × head_dim"),
        ({"rope_dims": (4, 4, 6)}, "rope_dims", "summing to head_dim"),
        ({"rope_dims": (5, 5, 6)}, "rope_dims", "three even"),
        ({"sink_tokens": 1000}, "sink_tokens", "≤ tokens_per_chunk"),
        ({"sigmas": (0.5, 0.75)}, "sigmas", "strictly decreasing"),
        ({"t_limit": 3}, "t_limit", "> window_chunks"),
        ({"n_layers": 0}, "n_layers", "positive integer"),
    ],
)
def test_shapes_that_do_not_divide_or_fit_name_the_field(override, field, expected):
    with pytest.raises(ConfigError) as err:
        ModelConfig.from_name("tiny", **override)
    assert field in str(err.value) and expected in str(err.value), str(err.value)


def test_unknown_override_field_is_refused():
    with pytest.raises(ConfigError, match="no_such_field"):
        ModelConfig.from_name("tiny", no_such_field=1)


def test_checkpoint_shape_mismatch_names_tensor_and_both_shapes(tmp_path):
    cfg = ModelConfig.from_name("tiny")
    other = init_random_(VideoDiT(ModelConfig.from_name("tiny", d_ff=96)), seed=1)
    path = tmp_path / "other.safetensors"
    save_weights(other, path)
    model = init_random_(VideoDiT(cfg), seed=2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointError) as err:
        load_weights(model, path)
    msg = str(err.value)
    assert "tensor 'blocks.0.mlp.gate_up.weight': checkpoint shape (192, 64) != model shape (256, 64)" in msg, msg
    # nothing was half-loaded
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), f"{k} changed although the checkpoint was refused"


def test_checkpoint_missing_and_unexpected_tensors(tmp_path):
    cfg = ModelConfig.from_name("tiny")
    model = init_random_(VideoDiT(cfg), seed=2)
    sd = {k: v.contiguous() for k, v in model.state_dict().items() if k != "out.bias"}
    sd["extra.weight"] = torch.zeros(2)
    save_file(sd, str(tmp_path / "c.safetensors"))
    with pytest.raises(CheckpointError) as err:
        load_weights(model, tmp_path / "c.safetensors")
    assert "missing tensor 'out.bias'" in str(err.value) and "unexpected tensor 'extra.weight'" in str(err.value)


def test_checkpoint_round_trip_and_unreadable_file(tmp_path):
    cfg = ModelConfig.from_name("tiny")
    a = init_random_(VideoDiT(cfg), seed=1)
    save_weights(a, tmp_path / "a.safetensors")
    b = init_random_(VideoDiT(cfg), seed=2)
    load_weights(b, tmp_path / "a.safetensors")
    for k, v in a.state_dict().items():
        assert torch.equal(v, b.state_dict()[k]), k
    (tmp_path / "junk.safetensors").write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match="not a readable safetensors file"):
        load_weights(b, tmp_path / "junk.safetensors")
    with pytest.raises(CheckpointError, match="does not exist"):
        load_weights(b, tmp_path / "nope.safetensors")


def test_generator_loads_weights_from_a_checkpoint(tmp_path):
    cfg = ModelConfig.from_name("tiny")
    src = init_random_(VideoDiT(cfg), seed=9)
    save_weights(src, tmp_path / "w.safetensors")
    gen = ChunkGenerator(cfg, weights=tmp_path / "w.safetensors")
    for k, v in src.state_dict().items():
        assert torch.equal(gen.engine.model.state_dict()[k], v), k


def test_audio_of_the_wrong_sample_rate_is_refused_and_the_session_keeps_going():
    cfg = ModelConfig.from_name("tiny")
    gen = ChunkGenerator(cfg)
    a, b = cfg.chunk_sample_range(0)
    with pytest.raises(AudioError, match="sample_rate = 44100 Hz; expected 16000 Hz"):
        gen.generate_chunk(np.zeros(b - a, np.float32), 44100)
    with pytest.raises(AudioError, match="mono 1-D"):
        gen.generate_chunk(np.zeros((2, b - a), np.float32), 16000)
    with pytest.raises(AudioError, match="NaN"):
        gen.generate_chunk(np.full(b - a, np.nan, np.float32), 16000)
    assert gen.chunk == 0, "a refused chunk must not advance the session"
    out = gen.generate_chunk(np.zeros(b - a, np.float32), 16000)
    assert out.index == 0 and torch.isfinite(out.latents).all()


def test_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="mode = 'fast'"):
        ChunkGenerator(ModelConfig.from_name("tiny"), mode="fast")
