"""The stream: latents → the causal VAE decoder stage → the 24 fps pacer → sinks (MP4, LiveKit tracks), audio in
on the chunk grid, and `vivant demo`. May import `vivant.worker.model`; never `.serving`, `.quality` or `.train`.
See docs/ARCHITECTURE.md."""
