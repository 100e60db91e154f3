"""Numerical guard rails of the worker, on the real tiny generator (CPU) and real safetensors files.

Facts 8 and 9 of issue 15: finite but huge audio (1e30, float32's max) turned every later chunk of a
session into NaN; a checkpoint whose tensor data was corrupt (1% non-finite) loaded silently and the
worker went warm and streamed NaN. Here: loud audio is clipped to full scale; a chunk that does go
non-finite resets the session's state so the next chunks are clean; a checkpoint with NaN/Inf, or whose
data no longer matches the checksum recorded when it was written, is refused before the worker is warm.
"""

from __future__ import annotations

import struct
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from vivant.sessions.flags import FlagStore
from vivant.sessions.models import WorkerInfo
from vivant.sessions.registry import Registry
from vivant.worker.model.config import ModelConfig
from vivant.worker.model.generator import ChunkGenerator, build_generator
from vivant.worker.model.model import VideoDiT, init_random_
from vivant.worker.model.weights import CHECKSUM_KEY, CheckpointError, load_weights, save_weights
from vivant.worker.serving.service import WorkerService

CFG = ModelConfig.from_name("tiny")


def finite(out) -> bool:  # noqa: ANN001
    return bool(torch.isfinite(out.latents).all())


def speech(n: int, scale: float) -> np.ndarray:
    start, stop = CFG.chunk_sample_range(n)
    t = np.arange(start, stop) / CFG.audio_sample_rate
    return (scale * np.sin(2 * np.pi * 220 * t)).astype(np.float32)


@pytest.mark.parametrize("scale", [1e30, float(np.finfo(np.float32).max)])
def test_huge_audio_is_clipped_and_never_poisons_the_session(scale: float) -> None:
    gen = ChunkGenerator(CFG, seed=3)
    outs = [gen.generate_chunk(speech(n, scale if n in (1, 2) else 0.1), CFG.audio_sample_rate) for n in range(5)]
    assert all(finite(o) for o in outs), [finite(o) for o in outs]
    # clipped, not silenced: the loud chunk is the full-scale version of the same speech
    ref = ChunkGenerator(CFG, seed=3)
    full = [ref.generate_chunk(np.clip(speech(n, scale if n in (1, 2) else 0.1), -1, 1), CFG.audio_sample_rate)
            for n in range(3)]
    assert torch.equal(outs[1].latents, full[1].latents)


def test_a_non_finite_chunk_resets_the_session_state_instead_of_poisoning_it() -> None:
    gen = ChunkGenerator(CFG, seed=3)
    featurize = gen.featurize

    def poisoned_once(audio, rate):  # noqa: ANN001, ANN202 (stands in for any NaN source inside a chunk)
        feats = featurize(audio, rate)
        return feats * float("inf") if gen.chunk == 2 and not poisoned_once.done else feats

    poisoned_once.done = False
    gen.featurize = poisoned_once
    outs = []
    for n in range(6):
        outs.append(gen.generate_chunk(speech(n, 0.1), CFG.audio_sample_rate))
        poisoned_once.done = poisoned_once.done or not finite(outs[-1])
    assert [finite(o) for o in outs] == [True, True, False, True, True, True], [finite(o) for o in outs]
    assert [o.finite for o in outs] == [finite(o) for o in outs], "ChunkOutput.finite disagrees with the latents"
    # the model restarted from a clean state: the chunk after the fault is chunk 0 of a fresh session
    fresh = ChunkGenerator(CFG, seed=3).generate_chunk(speech(3, 0.1), CFG.audio_sample_rate)
    assert torch.equal(outs[3].latents, fresh.latents)
    # while the session's chunk count goes on (the audio, the decoder and the pacer count the session's chunks: a
    # count back at 0 sent chunk 0 again and the decoder refused its audio)
    assert [o.index for o in outs] == list(range(6)) and gen.chunk == 6 and gen.origin == 3, [o.index for o in outs]
    # a rewind reaches back to the restart, not before it (the state before the fault is what went wrong); the
    # runtime and the pipeline ask the generator how far (a cache's undo depth alone would say chunk 2)
    assert gen.oldest_rewind() == 3 and gen.cache.oldest_rewind() == 0
    with pytest.raises(ValueError, match=r"to_chunk = 2: expected an integer in \[3, 6\]"):
        gen.rewind(2)
    gen.rewind(4)
    again = gen.generate_chunk(speech(4, 0.1), CFG.audio_sample_rate)
    assert again.index == 4 and torch.equal(again.latents, outs[4].latents)
    gen.rewind(3)  # to the restart itself: the model's state afresh, as after the fault
    assert gen.chunk == 3 and torch.equal(gen.generate_chunk(speech(3, 0.1), CFG.audio_sample_rate).latents,
                                          fresh.latents)


def checkpoint(tmp_path: Path) -> Path:
    path = tmp_path / "tiny.safetensors"
    save_weights(init_random_(VideoDiT(CFG), seed=1), path)
    return path


def corrupt(path: Path, fraction: float, value: float) -> int:
    """Overwrite `fraction` of one large tensor's values in place in the file (its header and recorded
    checksum untouched, as a bad disk or a truncated copy would). Returns how many values."""
    with safe_open(str(path), "pt") as f:
        name = max(f.keys(), key=lambda k: f.get_slice(k).get_shape() and np.prod(f.get_slice(k).get_shape()))
    raw = bytearray(path.read_bytes())
    header_len = struct.unpack("<Q", raw[:8])[0]
    import json

    meta = json.loads(raw[8:8 + header_len])[name]
    assert meta["dtype"] == "F32", meta
    start, stop = (8 + header_len + o for o in meta["data_offsets"])
    count = (stop - start) // 4
    idx = np.random.default_rng(0).choice(count, size=max(1, int(count * fraction)), replace=False)
    for i in idx:
        raw[start + 4 * i:start + 4 * i + 4] = struct.pack("<f", value)
    path.write_bytes(bytes(raw))
    return len(idx)


def test_checkpoint_with_non_finite_values_is_refused_naming_the_tensor(tmp_path: Path) -> None:
    path = checkpoint(tmp_path)
    bad = corrupt(path, 0.01, float("nan"))
    model = init_random_(VideoDiT(CFG), seed=2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointError) as err:
        load_weights(model, path)
    assert f"{bad} of" in str(err.value) and "NaN or Inf" in str(err.value), err.value
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items()), "half-loaded"


def test_checkpoint_altered_after_it_was_written_is_refused_by_its_checksum(tmp_path: Path) -> None:
    path = checkpoint(tmp_path)
    corrupt(path, 0.001, 0.5)  # finite values: only the checksum can tell
    with pytest.raises(CheckpointError, match="does not match the checksum recorded"):
        load_weights(init_random_(VideoDiT(CFG), seed=2), path)
    unrecorded = tmp_path / "unrecorded.safetensors"
    save_file(load_file(str(checkpoint(tmp_path))), str(unrecorded))  # no metadata at all
    with pytest.raises(CheckpointError, match=f"no checksum recorded \\({CHECKSUM_KEY}"):
        load_weights(init_random_(VideoDiT(CFG), seed=2), unrecorded)


def test_worker_never_goes_warm_on_a_corrupt_checkpoint(tmp_path: Path, redis_url: str) -> None:
    path = checkpoint(tmp_path)
    corrupt(path, 0.01, float("inf"))
    registry = Registry(redis_url, heartbeat_ttl_s=5)
    info = WorkerInfo(worker_id="w-bad", pool="ns/p", warm=False)
    # the loader does what a DiT rank does first (worker/serving/ranks.py build_dit): the engine from the checkpoint
    svc = WorkerService(registry, FlagStore(registry.redis), info, lambda: build_generator(CFG, weights=path))
    failure: list[BaseException] = []
    t = threading.Thread(target=lambda: _run(svc, failure))
    t.start()
    t.join(120)
    assert failure and isinstance(failure[0], CheckpointError), failure
    assert registry.idle_workers("ns/p") == [] and "w-bad" not in registry.workers("ns/p"), "went warm / left behind"


def _run(svc: WorkerService, failure: list[BaseException]) -> None:
    try:
        svc.run()
    except BaseException as exc:  # noqa: BLE001 (the test inspects it)
        failure.append(exc)
