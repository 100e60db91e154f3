"""The worker's tp + 1 process layout (worker/serving/tp_layout.py) at small scale on CPU: gloo, spawned processes,
the tiny preset. 2 DiT ranks + 1 decoder rank run a 4-chunk session with the fused flag switched on at
chunk 2 by rank 0; the latents rank 0 sends arrive at the decoder rank bit for bit, the decoder's frames
come out to the sink and equal a local decode of the same latents, and the latents equal the unsharded
model's. The same code at tp = 1 (1 DiT rank + 1 decoder rank), with a model factory passed in. Bad layouts fail with errors naming
the field, before any collective could hang."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch
from torch.multiprocessing import ProcessRaisedException
from vivant.worker.model.config import ConfigError, ModelConfig
from vivant.worker.model.generator import ChunkGenerator
from vivant.worker.model.model import VideoDiT, init_random_
from vivant.worker.model.tp import apply_tensor_parallel
from vivant.worker.serving.tp_layout import (
    FlagsAt,
    RankRole,
    SaveChunksSink,
    TPRunConfig,
    WorkerLayout,
    launch,
)
from vivant.worker.stream.vae import VAEConfig, build_vae_decoder

CHUNKS = 4


@dataclass(frozen=True)
class ToneAudio:
    """A different tone per chunk (so the audio tokens matter), exact sample counts."""

    def __call__(self, n: int) -> np.ndarray:
        a, b = ModelConfig.from_name("tiny").chunk_sample_range(n)
        return (0.2 * np.sin(np.arange(a, b) * 0.05 + n)).astype(np.float32)


@dataclass(frozen=True)
class SaveSinkFactory:
    out_dir: str

    def __call__(self, run: TPRunConfig) -> SaveChunksSink:
        return SaveChunksSink(out_dir=self.out_dir)


@dataclass(frozen=True)
class ShortAudioAtChunk1:
    def __call__(self, n: int) -> np.ndarray:
        return np.zeros(10, dtype=np.float32) if n == 1 else ToneAudio()(n)


@dataclass(frozen=True)
class ShardWithSeed:
    """A model factory of its own (as a 57b deployment passes a per-shard builder): other random weights."""

    weights_seed: int

    def __call__(self, run: TPRunConfig, rank: int, tp_group) -> VideoDiT:
        return apply_tensor_parallel(init_random_(VideoDiT(run.model_config()), seed=self.weights_seed), rank,
                                     run.layout.tp, group=tp_group)


def tp1_latents(chunks: int, weights_seed: int = 11) -> torch.Tensor:
    cfg = ModelConfig.from_name("tiny")
    gen = ChunkGenerator(cfg, mode="optimized", seed=0, model=init_random_(VideoDiT(cfg), seed=weights_seed))
    return torch.stack([gen.generate_chunk(ToneAudio()(n), cfg.audio_sample_rate).latents for n in range(chunks)])


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.fixture(scope="module")
def session_2_plus_1(tmp_path_factory):
    frames_dir = tmp_path_factory.mktemp("frames")
    run = TPRunConfig(WorkerLayout(tp=2, backend="gloo"), chunks=CHUNKS, keep_latents=True)
    reports = launch(run, audio_source=ToneAudio(), flag_schedule=FlagsAt(fused_from=2),
                     sink_factory=SaveSinkFactory(str(frames_dir)))
    return run, reports, frames_dir


def test_ranks_have_their_roles_and_devices(session_2_plus_1):
    _, reports, _ = session_2_plus_1
    assert [(r.rank, r.role, r.device) for r in reports] == [
        (0, RankRole.DIT, "cpu"), (1, RankRole.DIT, "cpu"), (2, RankRole.DECODER, "cpu")]
    assert [r.chunks for r in reports] == [CHUNKS] * 3, "every rank saw every chunk"


def test_flag_from_rank0_switches_all_dit_ranks_at_the_same_boundary(session_2_plus_1):
    _, reports, _ = session_2_plus_1
    expected = ["gemm_then_all_reduce"] * 2 + ["fused_gemm_all_reduce"] * 2
    for r in reports[:2]:
        assert r.paths == expected, f"rank {r.rank} ran {r.paths}"


def test_latents_arrive_at_the_decoder_rank_bitwise(session_2_plus_1):
    _, reports, _ = session_2_plus_1
    sent, received = reports[0].latents, reports[2].latents
    assert sent.shape == (CHUNKS, 16, 8, 12), f"sent {tuple(sent.shape)}"
    assert received.dtype == sent.dtype == torch.float32
    diff = (sent != received).sum().item()
    assert diff == 0, f"{diff} latent values changed between rank 0 and the decoder rank"


def test_layout_latents_equal_the_unsharded_model(session_2_plus_1):
    _, reports, _ = session_2_plus_1
    err = rel(reports[0].latents, tp1_latents(CHUNKS))
    assert err < 1e-4, f"tp = 2 layout (fused from chunk 2) vs TP = 1: relative error {err:.3e}"


def test_frames_come_out_of_the_decoder_rank_and_match_a_local_decode(session_2_plus_1):
    run, reports, frames_dir = session_2_plus_1
    cfg = ModelConfig.from_name("tiny")
    sink = reports[2].sink
    a_total = sum(np.diff(cfg.chunk_sample_range(n))[0] for n in range(CHUNKS))
    assert sink["frames"] == CHUNKS * cfg.frames_per_chunk and sink["frame_shape"] == [128, 192, 3], sink
    assert sink["audio_samples"] == a_total, f"audio carried with the frames: {sink['audio_samples']} vs {a_total}"
    vae = build_vae_decoder(VAEConfig.for_model(cfg), seed=run.vae_seed)
    cache = vae.new_cache()
    for n in range(CHUNKS):
        got = np.load(frames_dir / f"frames_{n:05d}.npy")
        want = vae.decode_chunk(reports[0].latents[n], cache).numpy()
        assert got.shape == want.shape and got.dtype == np.uint8
        off = np.abs(got.astype(int) - want.astype(int))
        # the decoder rank runs one thread, this process may run more: at most a rounding step apart
        assert off.max() <= 1 and (off > 0).mean() < 1e-3, \
            f"chunk {n}: {(off > 0).sum()} pixels differ from a local decode, max {off.max()}"
    assert len(reports[2].chunk_ms) == CHUNKS


def test_same_code_at_tp1_with_a_model_factory_of_its_own():
    reports = launch(TPRunConfig(WorkerLayout(tp=1, backend="gloo"), chunks=2, keep_latents=True),
                     audio_source=ToneAudio(), flag_schedule=FlagsAt(fused_from=0), model_factory=ShardWithSeed(3))
    assert [r.role for r in reports] == [RankRole.DIT, RankRole.DECODER]
    assert reports[0].paths == ["no_tp", "no_tp"], "nothing to fuse at TP = 1"
    assert torch.equal(reports[0].latents, reports[1].latents)
    err = rel(reports[0].latents, tp1_latents(2, weights_seed=3))
    assert err < 1e-5, f"tp = 1 layout vs in-process generator: relative error {err:.3e}"
    assert reports[1].sink["frames"] == 8


def test_heads_not_divisible_by_tp_are_refused_before_spawning():
    with pytest.raises(ConfigError, match="n_heads = 4 does not divide by tp = 3"):
        TPRunConfig(WorkerLayout(tp=3, backend="gloo"))


def test_layout_fields_are_checked():
    with pytest.raises(ConfigError, match="decoder_ranks = 0; expected 1"):
        WorkerLayout(tp=2, decoder_ranks=0, backend="gloo")
    with pytest.raises(ConfigError, match="tp = 0; expected a positive integer"):
        WorkerLayout(tp=0)
    with pytest.raises(ConfigError, match=r"backend = 'mpi'; expected one of \('gloo', 'nccl'\)"):
        WorkerLayout(backend="mpi")
    with pytest.raises(ConfigError, match="chunks = 0; expected a positive integer"):
        TPRunConfig(WorkerLayout(tp=2, backend="gloo"), chunks=0)
    with pytest.raises(ConfigError, match="rank = 5; expected 0 ≤ rank < world_size = 5"):
        WorkerLayout(tp=4).device(5)


def test_launch_without_a_decoder_rank_fails_in_every_rank_with_the_count_needed():
    run = TPRunConfig(WorkerLayout(tp=2, backend="gloo"), chunks=1)
    with pytest.raises(ProcessRaisedException, match=r"world_size = 2 leaves no decoder rank.*= 3 processes"):
        launch(run, nprocs=2)


def test_bad_audio_from_the_room_names_the_chunk_and_stops_every_rank_in_order(tmp_path):
    run = TPRunConfig(WorkerLayout(tp=2, backend="gloo"), chunks=3)
    with pytest.raises(ProcessRaisedException, match=r"(?s)Process 0 .*audio for chunk 1: expected float32 \[2667\] "
                                                     r"samples, got \[10\]"):
        launch(run, audio_source=ShortAudioAtChunk1(), sink_factory=SaveSinkFactory(str(tmp_path)))
    saved = sorted(p.name for p in tmp_path.iterdir())
    assert saved == ["frames_00000.npy"], f"chunk 0 (sent before the bad input) should be decoded, got {saved}"
