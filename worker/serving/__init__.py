"""The serving runtime: the `vivant worker` process and its ranks (rank 0 owns the session: Redis lease,
heartbeats, inbox, flags, audio in; DiT ranks; the decoder rank with the pacer and the outgoing sinks), the
session-runner protocol, the LiveKit avatar and the worker's metrics. May import `vivant.worker.model` and
`.stream`. See docs/ARCHITECTURE.md and docs/multi_gpu.md."""
