"""Write docs/BENCHMARKS.md from the committed JSON under bench/results/ (so every figure in the doc is one
of those files' numbers). Usage: python bench/benchmarks_md.py > docs/BENCHMARKS.md

The sections live in bench/benchmarks_doc/, one module per group of sections; this script puts them in page order,
one blank line apart."""

from vivant.bench.benchmarks_doc import (
    cudnn_probes,
    earlier_scaling,
    earlier_step,
    fleet,
    gemm_tuning,
    head,
    quality,
    residual_fold,
    row_kernels,
    served,
    turn,
)

SECTIONS = (
    head.section,  # sources, GPU, the ablation table
    residual_fold.section,  # the residual in the O/down GEMMs' epilogue, the step on it
    gemm_tuning.section,  # tuned cuBLASLt algorithms, the step on them
    row_kernels.section,  # the step's row kernels and host path
    cudnn_probes.fp8_attention_section,  # FP8 attention with cuDNN (probe)
    cudnn_probes.plans_and_rows_section,  # cuDNN plans and GEMMs, persistent row kernels (probes)
    served.section,  # the unified engine: 57b step, a 60 s served session
    quality.section,  # the quality gate on `ref`, which FP8 rounding moves it
    earlier_step.section,  # 2026-11-29: the 57b per-rank step and its history
    earlier_scaling.section,  # 2026-11-29: TP = 1, the VAE decoder, TP = 2, the CPU harness
    turn.section,  # turn latency by stage
    fleet.section,  # the control plane at fleet scale (CPU)
)


def page() -> str:
    return "\n".join(section() for section in SECTIONS)


if __name__ == "__main__":
    print(page())
