"""GPU smoke check (run first in bench/run_gpu.sh): the tiny preset on CUDA through the served engine (FP8 parts,
image attention, CUDA graphs) vs the float parts in the baseline mode, 30 chunks with resets; prints per-chunk
relative RMS and fails loudly."""

import numpy as np
import torch
from vivant.worker.model.config import ModelConfig
from vivant.worker.model.engine import Engine
from vivant.worker.model.generator import ChunkGenerator
from vivant.worker.model.model import VideoDiT, init_random_
from vivant.worker.model.options import CacheMode, EngineOptions

cfg = ModelConfig.from_name("tiny", d_model=128, n_heads=4, head_dim=32, rope_dims=(12, 10, 10), d_ff=256)
m = init_random_(VideoDiT(cfg), seed=4).cuda().to(torch.bfloat16)
fast = Engine.build(m, EngineOptions.served("cuda"))
g1 = ChunkGenerator(cfg, mode=CacheMode.OPTIMIZED, device="cuda", dtype=torch.bfloat16, engine=fast, seed=2)
g2 = ChunkGenerator(cfg, mode=CacheMode.BASELINE, device="cuda", dtype=torch.bfloat16, model=m, seed=2)
errs = []
for n in range(30):
    a, b = cfg.chunk_sample_range(n)
    au = (0.3 * np.sin(np.arange(a, b) * 0.05)).astype(np.float32)
    o1, o2 = g1.generate_chunk(au, 16000), g2.generate_chunk(au, 16000)
    errs.append(float((o1.latents - o2.latents).norm() / o2.latents.norm()))
print("rel RMS per chunk:", " ".join(f"{e:.2e}" for e in errs))
print("graph replays", fast.graph_replays, "eager", fast.eager_calls)
assert max(errs) < 0.05 and fast.graph_replays > 0, "smoke failed"
print("SMOKE OK")
