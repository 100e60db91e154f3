"""The page's head: where every figure comes from (the commands, the committed JSON, the GPU and software it ran
on, how timings are taken, the GPU test runs), then the ablation table, which opens the figures because it is the
served engine's current cost of each choice (bench/ablation_md.py builds it)."""

from __future__ import annotations

from vivant.bench.ablation_md import head_section as ablation_head_section
from vivant.bench.benchmarks_doc.results import RESULTS, load


def section() -> str:
    run = load("step_57b_tp4_rank0_h200_2026-12-01_unified-1.json")  # names the torch and triton of the GPU runs
    return f"""# Benchmarks

Every figure here comes from a command in `bench/`, run as written, with its JSON committed under
`bench/results/` (this page is generated from those files by `python bench/benchmarks_md.py`). The last section, the
control plane at fleet scale, runs on CPU only (a local cluster on the shared 2-core development machine).
GPU: one NVIDIA H200 (driver 580.159.04, clocks as found, never changed), torch {run['torch']}, triton {run['triton']},
Python 3.12. Random weights of the exact shapes for the 57b figures (docs/ARCHITECTURE.md); the trained `ref`
character for the session and quality figures. Timings are CUDA-event medians after warm-up; kernel timings are
replays of CUDA graphs (the way the engine runs them); per-kernel profiles are torch.profiler CUDA activity over
two graph-replayed chunks.

The GPU runs are made with `bash bench/run_gpu.sh $OUT` on the GPU machine: it assembles the `vivant` namespace
from symlinks (nothing installs there), installs the wheels carried in `.whl/` (redis, pydantic, av at
requirements/worker.txt's pins) and unpacks a Debian `redis-server` carried in `.deb/`, then runs the steps
`STEPS` names. The GPU tests (`pytest -m gpu tests/kernels tests/stream/test_decode_gpu.py tests/core/test_warm_up.py`)
passed: 50 of 50 on 2026-12-01, and 51 of 51 (with the warm-up test) twice on 2026-12-02. Later on 2026-12-02, with
the bf16 ring: 52 of 52 (the bf16-ring kernel test added); then with the ablation's and the rewind's GPU tests
(`tests/core/test_ablation_parts_gpu.py`, `tests/core/test_rewind.py`) 60 of 61 — the memory-report test expected a
separate read image, which the bf16 ring no longer has; fixed, it passed alone on the next lease
(`bench/results/gpu_run_log_2026-12-02_*.txt`). With the new row kernels: 62 of 62 (call 2 of
`gpu_run_log_2026-12-02_row-kernels.txt`), and 62 of 62 again on the final code (call 5: + SwiGLU at 8 warps and
the undo log's word copies). On 2026-12-03 (`gpu_run_log_2026-12-03_residual-in-gemm.txt`): 77 of 77 before the
residual fold (the fault paths' CUDA tests among them, run for the first time), then 90 of 90 twice with it (the
epilogue's C at every GEMM shape, the `residual_in_gemm = False` engine under CUDA graphs).

{ablation_head_section(RESULTS)}"""
