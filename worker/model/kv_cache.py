"""The KV cache and the attention call, in two modes that share the model's code.

optimized (the ring): K/V of a chunk are written once per pass into the chunk's ring slots, K rotated by RoPE at
its absolute position, both rounded once to the ring's dtype (bf16 for the FP8 parts, the served format; float32
for the float parts on a CPU, the reference). Attention reads the ring as it is (it is bf16, what cuDNN's SDPA
reads); at a position reset the cached window keys are delta-rotated once (`vivant.kernels.delta_rotate`).

baseline (the original step): the cache holds K/V unrotated in full precision, chunk by chunk; every
attention call concatenates the cached chunks with the new tokens, rotates every cached key with its
current position and (`fp8`) quantizes the whole K/V set to FP8 and back — the per-call whole-cache work the ring
removes.

Both modes attend the same key set (sink when valid, resident window chunks, the chunk itself), so a float32
ring and the baseline without `fp8` agree to float32 rounding. Shapes per layer: ring K/V `[S, H_local, D]`;
queries `[N, H_local, D]` with N = tokens per chunk.

Writing the ring: the FP8 parts through `write_qkv`, one fused kernel from the QKV rows to the ring
(kernels/qkv_ring.py) — for every chunk, chunk 0's sink tokens included (the same kernel at the sink's slots and
positions); the float parts through `attend` (the model's q/k norms, then RoPE and the store as torch ops: the
definition the kernel's float32 twin follows). Both write the same layout. The chunk's rotary angles, slots and
valid mask live in `step`, buffers allocated once and refilled by `begin_chunk`, so a captured CUDA graph reads
them at fixed addresses.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from vivant.kernels.delta_rotate import delta_rotate
from vivant.kernels.fp8 import dequantize_rows, quantize_rows_ref
from vivant.kernels.qkv_ring import qkv_ring_write
from vivant.kernels.rope import apply_rope_ref, rope_angles
from vivant.worker.model.options import CacheMode, parse_choice
from vivant.worker.model.positions import RingLayout
from vivant.worker.model.ring_undo import RingUndoLog

log = logging.getLogger(__name__)


@dataclass
class StepState:
    """What one chunk's passes share: its index, its token positions, its ring slots."""

    chunk: int
    pos: torch.Tensor  # int64 [T, 3] in the current frame
    slots: torch.Tensor  # int64 [T]
    valid: torch.Tensor  # bool [S]
    sink_pos: torch.Tensor | None  # int64 [sink, 3] (only set while chunk 0 is generated)
    # float32 [T, D/2]: rope_angles(pos) as cos and sin, when the caller computed them on the host ahead of the chunk
    # (ChunkGenerator.host_inputs); None: begin_chunk computes them on the cache's device
    cos: torch.Tensor | None = None
    sin: torch.Tensor | None = None


@dataclass
class StepBuffers:
    """The chunk's positions in the form the fused ring write and attention read them, on the cache's device,
    allocated once per cache (fixed addresses for CUDA graphs) and refilled by `KVCache.begin_chunk`.
    T tokens per chunk, D head_dim, S slots, n_sink sink tokens."""

    cos: torch.Tensor  # float32 [T, D/2]: rotary angles of the chunk's positions
    sin: torch.Tensor
    slots: torch.Tensor  # int64 [T]
    valid: torch.Tensor  # bool [S]
    sink_cos: torch.Tensor  # float32 [n_sink, D/2]: the sink tokens' angles (chunk 0 only)
    sink_sin: torch.Tensor
    sink_slots: torch.Tensor  # int64 [n_sink]
    all_valid: bool = False  # every slot attendable (host-side: no device read)
    writes_sink: bool = False  # this chunk also writes the sink (chunk 0)


@dataclass
class _BaselineChunk:
    chunk: int
    k: list[torch.Tensor] = field(default_factory=list)  # per layer [T, H, D] unrotated, full precision
    v: list[torch.Tensor] = field(default_factory=list)


class KVCache:
    """Per-session cache for all layers of one tensor-parallel rank.

    Rewind (`rewind`): the last `rewind_chunks` chunks can be undone, so the cache returns to its state right after
    an earlier chunk (docs/ARCHITECTURE.md, "Rewind at a turn start"). The ring keeps an undo log
    (worker/model/ring_undo.py, memory stated there); the baseline keeps `rewind_chunks` more chunks in its list
    and drops the undone ones. 0 turns rewinding off (nothing allocated).

    ring_dtype: the optimized ring's K/V dtype — torch.bfloat16 for the FP8 parts (what ChunkGenerator builds for
    them: the served format), torch.float32 for the float parts (the reference; the default). fp8: the baseline
    cache's per-call FP8 quantization of K/V (the original step); the ring ignores it."""

    def __init__(self, *, layers: int, heads: int, head_dim: int, layout: RingLayout,
                 rope_dims: tuple[int, int, int], rope_theta: float, mode: CacheMode | str = CacheMode.OPTIMIZED,
                 fp8: bool = True, device: str | torch.device = "cpu", ring_dtype: torch.dtype = torch.float32,
                 kernel_backend: str = "auto", rewind_chunks: int = 4):
        mode = parse_choice(CacheMode, mode, "mode")
        if isinstance(rewind_chunks, bool) or not isinstance(rewind_chunks, int) or rewind_chunks < 0:
            raise ValueError(f"KVCache rewind_chunks = {rewind_chunks!r}; expected an integer ≥ 0 (0: no rewind)")
        self.rewind_chunks = rewind_chunks
        self.undo = RingUndoLog(rewind_chunks)
        self.next_chunk = 0  # the chunk after the last one ended (what a rewind returns from)
        self._reset: tuple[int, int] | None = None  # (chunk that began with the latest reset, its Δ)
        self._reset_pending: int | None = None  # Δ of a reset applied since the last begin_chunk
        self.layers, self.heads, self.head_dim = layers, heads, head_dim
        self.layout, self.mode, self.fp8 = layout, mode, fp8
        self.rope_dims, self.rope_theta = tuple(rope_dims), float(rope_theta)
        self.device = torch.device(device)
        self.ring_dtype = ring_dtype
        self.backend = kernel_backend
        self.state: StepState | None = None
        S = layout.slots
        self.step: StepBuffers | None = None  # optimized mode: allocated at the first begin_chunk
        if mode is CacheMode.OPTIMIZED:
            if ring_dtype not in (torch.bfloat16, torch.float32):
                raise ValueError(f"KVCache ring_dtype = {ring_dtype}; expected torch.bfloat16 (served) or "
                                 "torch.float32 (the float parts' reference)")
            self.k = torch.zeros(layers, S, heads, head_dim, dtype=ring_dtype, device=self.device)
            self.v = torch.zeros(layers, S, heads, head_dim, dtype=ring_dtype, device=self.device)
        else:
            self._chunks: list[_BaselineChunk] = []
            self._sink_k: list[torch.Tensor | None] = [None] * layers
            self._sink_v: list[torch.Tensor | None] = [None] * layers
            self._pending = _BaselineChunk(chunk=-1, k=[None] * layers, v=[None] * layers)
        self._offset_chunks = 0  # position frame offset, mirrored for baseline positions

    @property
    def position_shift(self) -> int:
        """The sum of the position shifts applied since the session began (host-side, no device access)."""
        return self._offset_chunks

    def clear(self) -> None:
        """Forget the session (a warm worker reuses the preallocated ring; CUDA graphs keep its addresses)."""
        self.state = None
        self._offset_chunks = 0
        self.next_chunk = 0
        self._reset = self._reset_pending = None
        self.undo.clear()
        if self.mode is CacheMode.OPTIMIZED:
            for t in (self.k, self.v):
                t.zero_()
        else:
            self._chunks = []
            self._sink_k = [None] * self.layers
            self._sink_v = [None] * self.layers

    # ---- rewind -------------------------------------------------------------------------------------------
    def oldest_rewind(self) -> int:
        """The earliest chunk `rewind` can return to now (0 while the session is within `rewind_chunks` of its
        start: rewinding to 0 is a session reset)."""
        if self.next_chunk <= self.rewind_chunks:
            return 0
        if self.mode is CacheMode.BASELINE:
            return self.next_chunk - self.rewind_chunks
        return self.undo.oldest(self.next_chunk)

    def rewind(self, to_chunk: int) -> None:
        """Return to the state right after chunk `to_chunk` − 1 ended (the next chunk written is `to_chunk`).
        ValueError naming `to_chunk` outside [oldest_rewind(), next_chunk]. Between chunks only."""
        lo, hi = self.oldest_rewind(), self.next_chunk
        if isinstance(to_chunk, bool) or not isinstance(to_chunk, int) or not lo <= to_chunk <= hi:
            raise ValueError(f"rewind to_chunk = {to_chunk!r}: expected an integer in [{lo}, {hi}] (the next chunk "
                             f"is {hi}; the undo log holds the last rewind_chunks = {self.rewind_chunks} chunks)")
        if self.state is not None:
            raise RuntimeError("KVCache.rewind called inside a chunk (between begin_chunk and end_chunk)")
        if to_chunk == hi:
            return
        if to_chunk == 0:
            self.clear()
            return
        if self.mode is CacheMode.OPTIMIZED:
            self.undo.restore(self, to_chunk, hi)
        else:
            self._chunks = [c for c in self._chunks if c.chunk < to_chunk]
            self._pending = _BaselineChunk(chunk=-1, k=[None] * self.layers, v=[None] * self.layers)
        if self._reset is not None and self._reset[0] >= to_chunk:
            self._offset_chunks -= self._reset[1]
            self._reset = None
        self.next_chunk = to_chunk

    # ---- chunk boundaries --------------------------------------------------------------------------
    def begin_chunk(self, state: StepState) -> None:
        self.state = state
        if self._reset_pending is not None:
            self._reset = (state.chunk, self._reset_pending)
            self._reset_pending = None
        if self.mode is CacheMode.BASELINE:
            self._pending = _BaselineChunk(chunk=state.chunk, k=[None] * self.layers, v=[None] * self.layers)
        else:
            self.undo.save_chunk(self, state.chunk)
            self._fill_step(state)

    def _fill_step(self, st: StepState) -> None:
        n_sink = self.layout.sink
        if self.step is None:
            t, half, dev = st.pos.shape[0], self.head_dim // 2, self.device
            self.step = StepBuffers(
                cos=torch.empty(t, half, device=dev), sin=torch.empty(t, half, device=dev),
                slots=torch.empty(t, dtype=torch.int64, device=dev),
                valid=torch.empty(self.layout.slots, dtype=torch.bool, device=dev),
                sink_cos=torch.empty(n_sink, half, device=dev), sink_sin=torch.empty(n_sink, half, device=dev),
                sink_slots=self.layout.sink_slots().to(dev))
        b = self.step
        # host tensors in pinned memory (ChunkGenerator.host_inputs) are copied without making the host wait
        pos = st.pos.to(self.device, non_blocking=True)
        if st.cos is not None and st.sin is not None:
            b.cos.copy_(st.cos, non_blocking=True)
            b.sin.copy_(st.sin, non_blocking=True)
        else:
            ang = rope_angles(pos, self.rope_dims, self.rope_theta)
            b.cos.copy_(ang.cos())
            b.sin.copy_(ang.sin())
        b.slots.copy_(st.slots, non_blocking=True)
        b.valid.copy_(st.valid, non_blocking=True)
        b.all_valid = bool(st.valid.all())  # the layout's mask is a host tensor
        b.writes_sink = st.sink_pos is not None
        if b.writes_sink:
            sink = rope_angles(st.sink_pos.to(self.device), self.rope_dims, self.rope_theta)
            b.sink_cos.copy_(sink.cos())
            b.sink_sin.copy_(sink.sin())

    def write_qkv(self, layer: int, qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                  eps: float) -> torch.Tensor:
        """The FP8 parts' ring write: the chunk's QKV rows [T, 3·H·D] → q/k RMSNorm, RoPE of q and k at the
        chunk's positions, k and v into the (bf16) ring at the chunk's slots; while chunk 0 runs, the same kernel
        writes its first tokens into the sink at the sink's positions. Returns q_rot [T, H, D] in qkv's dtype.
        Needs begin_chunk (optimized mode)."""
        b = self.step
        if self.state is None or b is None:
            raise RuntimeError("KVCache.write_qkv called outside begin_chunk/end_chunk (optimized mode)")
        ring = (self.k[layer], self.v[layer])
        q_rot = qkv_ring_write(qkv, q_weight, k_weight, b.cos, b.sin, b.slots, *ring, self.heads, eps=eps,
                               backend=self.backend)
        if b.writes_sink:
            n = b.sink_slots.shape[0]
            qkv_ring_write(qkv[:n], q_weight, k_weight, b.sink_cos, b.sink_sin, b.sink_slots, *ring, self.heads,
                           eps=eps, backend=self.backend)
        return q_rot

    def end_chunk(self) -> None:
        """After the last pass: the baseline commits the chunk's raw K/V (the ring already holds them)."""
        st = self.state
        if self.mode is CacheMode.BASELINE and st is not None:
            self._chunks.append(self._pending)
            # the next chunk (st.chunk + 1) sees chunks ≥ st.chunk + 2 − W besides itself; a rewind by up to
            # rewind_chunks needs as many more
            keep = st.chunk + 2 - self.layout.window_chunks - self.rewind_chunks
            self._chunks = [c for c in self._chunks if c.chunk >= keep]
        if st is not None:
            self.next_chunk = st.chunk + 1
        self.state = None

    def shift_positions(self, delta: int, resident_slots: torch.Tensor) -> None:
        """Position reset by Δ: rotate cached window keys by −Δ once (ring); the baseline just re-derives."""
        self._offset_chunks += delta
        self._reset_pending = delta
        if self.mode is CacheMode.OPTIMIZED and resident_slots.numel():
            self.undo.save_reset(self, self.next_chunk)
            slots = resident_slots.to(self.device)
            for layer in range(self.layers):
                delta_rotate(self.k[layer], slots, -delta, rope_dims=self.rope_dims, theta=self.rope_theta,
                             backend=self.backend)

    # ---- the attention call -------------------------------------------------------------------------
    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q, k, v: [N, H, D] of the new tokens (q/k normalized, not rotated). Returns [N, H, D]."""
        st = self.state
        if st is None:
            raise RuntimeError("KVCache.attend called outside begin_chunk/end_chunk")
        q_rot = apply_rope_ref(q, st.pos, self.rope_dims, self.rope_theta).to(q.dtype)
        if self.mode is CacheMode.OPTIMIZED:
            keys, values, mask = self._ring_read(layer, k, v, st)
        else:
            keys, values, mask = self._baseline_read(layer, k, v, st)
        dt = q.dtype  # attention runs in the model's dtype (float32 on CPU, bf16 on GPUs)
        out = F.scaled_dot_product_attention(
            q_rot.transpose(0, 1).unsqueeze(0).to(dt),
            keys.transpose(0, 1).unsqueeze(0).to(dt),
            values.transpose(0, 1).unsqueeze(0).to(dt),
            attn_mask=mask,
        )
        return out.squeeze(0).transpose(0, 1).to(q.dtype)

    def write_chunk(self, layer: int, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor,
                    sink_pos: torch.Tensor | None = None, sink_slots: torch.Tensor | None = None) -> None:
        """The float parts' ring write: a chunk's K (normalized, not rotated) and V [N, H, D] into the ring at
        `slots`, K rotated at `pos`, both rounded once to the ring's dtype; while chunk 0 runs, its first tokens
        also into the sink slots at `sink_pos`. (The FP8 parts write through `write_qkv`.)"""
        rows = [(k, v, pos, slots)]
        if sink_pos is not None:
            n = sink_pos.shape[0]
            if sink_slots is None:
                sink_slots = self.layout.sink_slots().to(self.device)
            rows.append((k[:n], v[:n], sink_pos, sink_slots))
        for kk, vv, p, s in rows:
            self.k[layer][s] = apply_rope_ref(kk, p, self.rope_dims, self.rope_theta).to(self.ring_dtype)
            self.v[layer][s] = vv.to(self.ring_dtype)

    def _ring_read(self, layer, k, v, st):
        self.write_chunk(layer, k, v, st.pos, st.slots.to(self.device), st.sink_pos)
        return self.k[layer].float(), self.v[layer].float(), st.valid.to(self.device)[None, :]

    def _baseline_read(self, layer, k, v, st):
        self._pending.k[layer] = k.detach().float().clone()
        self._pending.v[layer] = v.detach().float().clone()
        if st.sink_pos is not None:
            n = st.sink_pos.shape[0]
            self._sink_k[layer] = k[:n].detach().float().clone()
            self._sink_v[layer] = v[:n].detach().float().clone()
            self._sink_pos = st.sink_pos.clone()
        ks, vs, ps = [], [], []
        if self.layout.sink_valid(st.chunk) and self._sink_k[layer] is not None:
            ks.append(self._sink_k[layer])
            vs.append(self._sink_v[layer])
            ps.append(self._sink_pos)
        t_new = int(st.pos[0, 0])
        for c in self._chunks:
            if c.chunk >= st.chunk - self.layout.window_chunks + 1:
                ks.append(c.k[layer])
                vs.append(c.v[layer])
                pos = st.pos.clone()
                pos[:, 0] = t_new - (st.chunk - c.chunk)
                ps.append(pos)
        ks.append(k.float())
        vs.append(v.float())
        ps.append(st.pos)
        # the per-call whole-cache work: concatenate, rotate every key, quantize everything
        keys = apply_rope_ref(torch.cat(ks), torch.cat(ps), self.rope_dims, self.rope_theta)
        values = torch.cat(vs)
        if self.fp8:
            keys = dequantize_rows(*quantize_rows_ref(keys))
            values = dequantize_rows(*quantize_rows_ref(values))
        return keys.to(self.device), values.to(self.device), None
