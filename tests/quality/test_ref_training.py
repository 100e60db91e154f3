"""Training of the `ref` character: the DiT's training forward IS the generator's cached path (both the
teacher-forced context stream and the target stream), the mask follows the ring's rules, and
`vivant train ref` runs end to end on CPU with a tiny budget, writing loadable weights and a log."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from vivant.cli import main
from vivant.worker.model.config import ModelConfig
from vivant.worker.model.kv_cache import KVCache, StepState
from vivant.worker.model.model import VideoDiT, init_random_
from vivant.worker.model.positions import RingLayout, chunk_positions, sink_positions
from vivant.worker.model.weights import load_weights
from vivant.worker.stream.vae import VAEConfig, load_vae_decoder
from vivant.worker.train.common import _write_safetensors
from vivant.worker.train.train_dit import sequence_velocity, stream_mask, stream_positions


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("mode", ["baseline", "optimized"])
def test_training_forward_equals_the_cached_generator_path(mode):
    """Per chunk j the generator runs a target pass (σ_j) then the last pass (context, σ_ctx) through the
    cache; the two-stream training forward must give the same velocities (FP8 off: float32 rounding)."""
    cfg = ModelConfig.from_name("tiny")  # sink 10, window 3: L = 6 chunks exercises the sink and eviction
    model = init_random_(VideoDiT(cfg), seed=3).eval()
    L = cfg.window_chunks + 3
    g = torch.Generator().manual_seed(0)
    ctx = torch.randn(1, L, cfg.latent_channels, cfg.latent_h, cfg.latent_w, generator=g)
    tgt = torch.randn(1, L, cfg.latent_channels, cfg.latent_h, cfg.latent_w, generator=g)
    feats = torch.randn(1, L, cfg.audio_tokens, cfg.audio_feature_dim, generator=g)
    s_ctx = torch.full((1, L), 0.25)
    s_tgt = torch.tensor([[1.0, 0.75, 0.5, 0.25, 1.0, 0.5][:L]])
    with torch.no_grad():
        seq = sequence_velocity(model, torch.cat([ctx, tgt], 1), torch.cat([s_ctx, s_tgt], 1),
                                torch.cat([feats, feats], 1), stream_mask(cfg, L), stream_positions(cfg, L, 2))
    layout = RingLayout(cfg.sink_tokens, cfg.tokens_per_chunk, cfg.window_chunks)
    cache = KVCache(layers=cfg.n_layers, heads=cfg.n_heads, head_dim=cfg.head_dim, layout=layout,
                    rope_dims=cfg.rope_dims, rope_theta=cfg.rope_theta, mode=mode, fp8=False)
    with torch.no_grad():
        for j in range(L):
            pos = chunk_positions(j, cfg.grid_h, cfg.grid_w, cfg.audio_tokens)
            cache.begin_chunk(StepState(chunk=j, pos=pos, slots=layout.chunk_slots(j), valid=layout.valid_mask(j),
                                        sink_pos=sink_positions(pos, cfg.sink_tokens) if j == 0 else None))
            v_tgt = model(tgt[0, j], float(s_tgt[0, j]), feats[0, j], cache)
            v_ctx = model(ctx[0, j], float(s_ctx[0, j]), feats[0, j], cache)  # the last pass stays in the cache
            cache.end_chunk()
            assert _rel(seq[0, L + j], v_tgt) < 1e-5, f"chunk {j} target stream differs by {_rel(seq[0, L + j], v_tgt):.2e}"
            assert _rel(seq[0, j], v_ctx) < 1e-5, f"chunk {j} context stream differs by {_rel(seq[0, j], v_ctx):.2e}"


def test_mask_follows_the_ring_rules():
    cfg = ModelConfig.from_name("ref")
    T, W, S, L = cfg.tokens_per_chunk, cfg.window_chunks, cfg.sink_tokens, 9
    m = stream_mask(cfg, L)
    ctx_q, tgt_q = (W + 1) * T, (L + W + 1) * T  # first token of chunk W+1 in each stream
    assert m[ctx_q, :S].all() and not m[ctx_q, S:T].any(), "sink = first S tokens of chunk 0 once j ≥ W"
    assert not m[ctx_q, T:2 * T].any() and m[ctx_q, 2 * T:(W + 2) * T].all(), "window = chunks j−W+1..j"
    assert not m[tgt_q, (W + 1) * T:(W + 2) * T].any(), "a target query never sees its own chunk's context tokens"
    assert m[tgt_q, tgt_q:tgt_q + T].all() and not m[tgt_q, L * T:tgt_q].any(), "targets see only their own stream chunk"
    assert not m[:L * T, L * T:].any(), "context never attends target tokens"
    last_with_chunk0 = (W - 1) * T
    assert m[last_with_chunk0, :T].all(), "chunk W−1 still sees all of chunk 0 (window, not sink)"
    assert m[W * T, :S].all() and not m[W * T, S:T].any(), "chunk W: chunk 0 evicted, its first S tokens stay as sink"


def test_train_ref_cli_runs_end_to_end_on_cpu_and_writes_loadable_weights(tmp_path, capsys):
    out = tmp_path / "ref"
    rc = main(["train", "ref", "--device", "cpu", "--minutes", "0.05", "--max-clips", "2", "--window", "4",
               "--seed", "1", "--out", str(out)])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    for needle in ("vae step 1:", "dit step 1:", "wrote"):
        assert needle in printed, f"progress lacks {needle!r}:\n{printed}"
    cfg = ModelConfig.from_name("ref")
    dit = VideoDiT(cfg)
    load_weights(dit, out / "ref_dit.safetensors")
    assert all(torch.isfinite(p).all() for p in dit.parameters())
    load_vae_decoder(VAEConfig.for_model(cfg), out / "ref_vae.safetensors")
    log = json.loads((out / "train_log.json").read_text())
    assert log["seed"] == 1 and log["vae"]["steps"] >= 1 and log["dit"]["steps"] >= 1
    assert log["dataset"]["clips"] == 2 and log["preset"]["name"] == "ref"
    for f in ("ref_dit.safetensors", "ref_vae.safetensors", "ref_vae_encoder.safetensors"):
        assert (out / f).stat().st_size <= 16e6, f"{f} exceeds 16 MB"


def test_train_ref_rejects_bad_budget_and_unavailable_cuda(tmp_path, capsys):
    assert main(["train", "ref", "--minutes", "0", "--out", str(tmp_path)]) == 2
    assert "--minutes = 0.0; expected > 0" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert main(["train", "ref", "--device", "cuda", "--minutes", "1", "--out", str(tmp_path)]) == 2
        assert "CUDA is not available" in capsys.readouterr().err


def test_hand_written_safetensors_reads_back_with_the_library(tmp_path):
    tensors = {"a": torch.randn(3, 5), "b": torch.arange(7, dtype=torch.int64), "c": torch.randn(4).half(),
               "d": torch.randn(2, 2).bfloat16()}
    _write_safetensors(tensors, tmp_path / "x.safetensors", {"preset": "ref"})
    back = load_file(str(tmp_path / "x.safetensors"))
    for k, v in tensors.items():
        assert back[k].dtype == v.dtype and torch.equal(back[k], v), f"tensor {k!r} differs after the round trip"
    assert np.isfinite(back["a"].numpy()).all()
