"""The model and its cache: the DiT (`model.py`, the one definition of the forward), its swappable fast parts
and the engine options that pick them, the ring KV cache, tensor parallelism, the chunk generator, weights.
Imports nothing of `vivant.worker.stream`, `.serving`, `.quality` or `.train` (tools/check_imports.py).
See docs/ARCHITECTURE.md."""
