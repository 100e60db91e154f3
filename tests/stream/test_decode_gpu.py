"""GPU checks of the decoder (run on a GPU machine with `make test-gpu`): chunked = one pass in bf16,
the decoder stage's CUDA hand-over, and `vivant bench decode --preset 57b --device cuda`."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from vivant.cli import main
from vivant.worker.stream.decoder_stage import DecoderStage, LatentChunk
from vivant.worker.stream.vae import build_vae_decoder

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@torch.inference_mode()
def test_chunked_equals_one_pass_on_cuda_bf16():
    vae = build_vae_decoder("tiny", device="cuda", dtype=torch.bfloat16)
    lat = torch.randn(1, 16, 5, 8, 12, device="cuda", dtype=torch.bfloat16)
    whole = vae(lat).float()
    cache = vae.new_cache()
    parts = torch.cat([vae(lat[:, :, n:n + 1], cache) for n in range(5)], dim=2).float()
    err = (parts - whole).abs().max().item()
    assert err < 0.05, f"bf16 chunked vs one pass differ by up to {err:.3f} (output range [-1, 1])"


def test_decoder_stage_hands_over_cuda_latents_in_order():
    devices = [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    vae = build_vae_decoder("tiny", device=devices[-1], dtype=torch.bfloat16)
    out = []
    stage = DecoderStage(vae, out.append).start()
    lat = [torch.randn(16, 8, 12, device=devices[0]) for _ in range(6)]
    for n, x in enumerate(lat):
        stage.submit(LatentChunk(n, x * 1.0, np.zeros(2666 + (n % 3 == 2), np.float32)))
    stage.close()
    assert [c.index for c in out] == list(range(6))
    ref_cache = vae.new_cache()
    for n, chunk in enumerate(out):
        ref = vae.decode_chunk(lat[n].to(devices[-1]), ref_cache).cpu().numpy()
        assert np.abs(chunk.frames.astype(int) - ref.astype(int)).max() <= 1, f"chunk {n} differs"


def test_decoder_stage_holds_a_non_finite_chunk_on_cuda():
    """The CUDA branch: a NaN chunk flagged by the generator and handed over from its GPU is not decoded (its frames
    hold the last one; its copy is waited for), and the chunks after it equal a fresh decoder's."""
    devices = [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    vae = build_vae_decoder("tiny", device=devices[-1], dtype=torch.bfloat16)
    lat = [torch.randn(16, 8, 12, device=devices[0]) for _ in range(5)]
    lat[2][0, 0, 0] = float("nan")
    out = []
    stage = DecoderStage(vae, out.append).start()
    for n, x in enumerate(lat):
        stage.submit(LatentChunk(n, x * 1.0, np.zeros(2666 + (n % 3 == 2), np.float32), finite=n != 2))
    stage.close()
    assert [c.index for c in out] == list(range(5)) and stage.nonfinite_chunks == [2], stage.nonfinite_chunks
    assert all(np.array_equal(f, out[1].frames[-1]) for f in out[2].frames), "the faulted chunk did not hold"
    fresh = vae.new_cache()
    for n in (3, 4):
        ref = vae.decode_chunk(lat[n].to(devices[-1]), fresh).cpu().numpy()
        assert np.abs(out[n].frames.astype(int) - ref.astype(int)).max() <= 1, f"chunk {n} differs from a fresh decode"


def test_bench_decode_57b_on_cuda(capsys):
    assert main(["bench", "decode", "--preset", "57b", "--device", "cuda", "--chunks", "10", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["out_hw"] == [704, 1088] and doc["decode_ms"]["median"] > 0
