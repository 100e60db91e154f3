"""Write docs/BENCHMARKS.md from the committed JSON under bench/results/ (so every figure in the doc is one
of those files' numbers). Usage: python bench/benchmarks_md.py > docs/BENCHMARKS.md

The sections live in bench/benchmarks_doc/, one module per group of sections; this script puts them in page order,
one blank line apart."""

from vivant.bench.benchmarks_doc import call, fleet, head, served, step, tried, turn

SECTIONS = (
    head.section,  # what the suite is, every benchmark's command, result and figure; the ablation table
    step.section,  # the 57b step as served, the whole model on one GPU, the VAE decoder
    served.section,  # a 60 s served session, the quality gate on `ref`
    turn.section,  # turn latency by stage
    call.section,  # the whole LiveKit call at the receiver
    fleet.section,  # the control plane at fleet scale (CPU)
    tried.section,  # what was tried and not kept, with its archived results
)


def page() -> str:
    return "\n".join(section() for section in SECTIONS)


if __name__ == "__main__":
    print(page())
