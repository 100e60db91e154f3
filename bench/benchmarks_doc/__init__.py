"""docs/BENCHMARKS.md's sections, one module per group of sections, each built from the committed JSON under
bench/results/ so that every figure on the page is one of those files' numbers. bench/benchmarks_md.py assembles
them in page order (`python bench/benchmarks_md.py > docs/BENCHMARKS.md`)."""
