"""docs/BENCHMARKS.md's sections, one module per group of sections, each built from the committed JSON under
bench/results/ so that every figure on the page is one of those files' numbers (the "tried, and why not" table
quotes the results archived at the tag `lab-archive-2026-12-03`). bench/benchmarks_md.py assembles them in page order
(`python bench/benchmarks_md.py > docs/BENCHMARKS.md`)."""
