"""The KV cache and the attention call, in two modes that share the model's code.

optimized (the ring): K/V of a chunk are written once per pass into the chunk's ring slots with RoPE
applied to K at its absolute position and both quantized to FP8 e4m3 with one float32 scale per
(slot, head) row — `vivant.kernels.cache_write.write_kv`. Attention reads the cache as it is; at a
position reset the cached window keys are delta-rotated once (`vivant.kernels.delta_rotate`).

baseline (the original step): the cache holds K/V unrotated in full precision, chunk by chunk; every
attention call concatenates the cached chunks with the new tokens, rotates every cached key with its
current position and quantizes the whole K/V set — the per-call whole-cache work the ring removes.

Both modes attend the same key set (sink when valid, resident window chunks, the chunk itself), so
with FP8 off they agree to float32 rounding, and with FP8 on they differ only by the re-quantization
of delta-rotated keys. Shapes per layer: ring K/V `[S, H_local, D]`, scales `[S, H_local]`;
queries `[N, H_local, D]` with N = tokens per chunk.

Writing the ring: the float parts write through `attend` → `write_chunk` (kernels/cache_write.py, RoPE at
write); the FP8 parts through `write_qkv`, one fused kernel from the QKV rows to the ring and its read image
(kernels/qkv_ring.py) — for every chunk, chunk 0's sink tokens included (the same kernel at the sink's slots
and positions). Both write the same layout. The chunk's rotary angles, slots and valid mask live in `step`,
buffers allocated once and refilled by `begin_chunk`, so a captured CUDA graph reads them at fixed addresses.

The whole-window policy (EngineOptions.cache_policy, worker/model/whole_window.py) keeps, beside the ring, the
window un-rotated (`enable_whole_window`); the cache tracks every slot's current position (`slot_pos`) for it,
updated at chunk boundaries and position resets.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from vivant.kernels.cache_write import write_kv
from vivant.kernels.delta_rotate import delta_rotate
from vivant.kernels.fp8 import dequantize_rows, quantize_rows_ref
from vivant.kernels.qkv_ring import qkv_ring_write
from vivant.kernels.ring_image import dequant_all, dequant_slots
from vivant.kernels.rope import apply_rope_ref, rope_angles
from vivant.worker.model.options import CacheMode, parse_choice
from vivant.worker.model.positions import RingLayout
from vivant.worker.model.ring_undo import RingUndoLog
from vivant.worker.model.whole_window import WindowStore

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
    and drops the undone ones. 0 turns rewinding off (nothing allocated)."""

    def __init__(self, *, layers: int, heads: int, head_dim: int, layout: RingLayout,
                 rope_dims: tuple[int, int, int], rope_theta: float, mode: CacheMode | str = CacheMode.OPTIMIZED,
                 fp8: bool = True, device: str | torch.device = "cpu", store_dtype: torch.dtype = torch.float32,
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
        self.store_dtype = store_dtype
        self.backend = kernel_backend
        self.state: StepState | None = None
        S = layout.slots
        self.step: StepBuffers | None = None  # optimized mode: allocated at the first begin_chunk
        if mode is CacheMode.OPTIMIZED:
            cdt = torch.float8_e4m3fn if fp8 else store_dtype
            self.k = torch.zeros(layers, S, heads, head_dim, dtype=cdt, device=self.device)
            self.v = torch.zeros(layers, S, heads, head_dim, dtype=cdt, device=self.device)
            self.k_scale = torch.ones(layers, S, heads, dtype=torch.float32, device=self.device)
            self.v_scale = torch.ones(layers, S, heads, dtype=torch.float32, device=self.device)
        else:
            self._chunks: list[_BaselineChunk] = []
            self._sink_k: list[torch.Tensor | None] = [None] * layers
            self._sink_v: list[torch.Tensor | None] = [None] * layers
            self._pending = _BaselineChunk(chunk=-1, k=[None] * layers, v=[None] * layers)
        self._offset_chunks = 0  # position frame offset, mirrored for baseline positions
        self.k_image: torch.Tensor | None = None  # the ring's read image (enable_read_image)
        self.v_image: torch.Tensor | None = None
        # each slot's current position [S, 3] (device: updated without a host sync), which the whole window reads
        self.slot_pos = torch.zeros(S, 3, dtype=torch.int64, device=self.device)
        self.window: WindowStore | None = None  # the whole-window policy's store (enable_whole_window)

    # ---- the read image (attention backend "image") --------------------------------------------------
    def enable_read_image(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Allocate (once) the ring's read image [L, S, H, D] in `dtype`, filled from the ring as it is now;
        from then on every write, delta rotation and clear refreshes it where the ring changes
        (vivant.kernels.ring_image). A ring stored in `dtype` itself (a bf16 ring) is its own image: the image
        tensors are the ring's, and nothing is refreshed. Returns (k_image, v_image)."""
        if self.mode is not CacheMode.OPTIMIZED:
            raise ValueError("KVCache: the read image mirrors the ring (mode='optimized'), not the baseline cache")
        if self.k_image is None and self.k.dtype == dtype:
            self.k_image, self.v_image = self.k, self.v
        elif self.k_image is None:
            self.k_image = torch.empty(self.k.shape, dtype=dtype, device=self.device)
            self.v_image = torch.empty(self.v.shape, dtype=dtype, device=self.device)
            for layer in range(self.layers):
                dequant_all(self.k[layer], self.k_scale[layer], self.k_image[layer], backend=self.backend)
                dequant_all(self.v[layer], self.v_scale[layer], self.v_image[layer], backend=self.backend)
        elif self.k_image.dtype != dtype:
            raise ValueError(f"KVCache: the read image is {self.k_image.dtype}, asked for {dtype}")
        return self.k_image, self.v_image

    def enable_whole_window(self, dtype: torch.dtype) -> WindowStore:
        """Allocate (once) the whole-window policy's store in `dtype`, its angles from the slots' positions now;
        it re-quantizes per call to FP8 when this cache's ring is FP8 (the ring it stands in for), not with a bf16
        ring. Allocate before a CUDA graph is captured (the engine's eager chunk 0 does): addresses stay fixed."""
        if self.mode is not CacheMode.OPTIMIZED:
            raise ValueError("KVCache: the whole-window store sits beside the ring (mode='optimized'), not the baseline")
        if self.window is None:
            self.window = WindowStore(layers=self.layers, slots=self.layout.slots, heads=self.heads,
                                      head_dim=self.head_dim, dtype=dtype, device=self.device,
                                      quantize=self.k.dtype == torch.float8_e4m3fn,
                                      compiled=self.device.type == "cuda")
            self.window.set_angles(self.slot_pos, self.rope_dims, self.rope_theta)
        elif self.window.k.dtype != dtype:
            raise ValueError(f"KVCache: the whole-window store is {self.window.k.dtype}, asked for {dtype}")
        return self.window

    def refresh_image(self, layer: int, slots: torch.Tensor, *, keys_only: bool = False) -> None:
        """Re-derive the read image at `slots` of `layer` from the ring (no-op without an image, or when the ring
        is its own image)."""
        if self.k_image is None or self.k_image is self.k:
            return
        dequant_slots(self.k[layer], self.k_scale[layer], slots, self.k_image[layer], backend=self.backend)
        if not keys_only:
            dequant_slots(self.v[layer], self.v_scale[layer], slots, self.v_image[layer], backend=self.backend)

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
            self.k_scale.fill_(1.0)
            self.v_scale.fill_(1.0)
            for t in (self.k_image, self.v_image):
                if t is not None:
                    t.zero_()
            self.slot_pos.zero_()
            if self.window is not None:
                self.window.clear()
                self.window.set_angles(self.slot_pos, self.rope_dims, self.rope_theta)
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
        if self.window is not None:
            raise ValueError("KVCache.rewind: the whole-window policy (an ablation of the engine, "
                             "EngineOptions.cache_policy) keeps no undo log; rewind serves the ring only")
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
        self.slot_pos[b.slots] = pos
        if b.writes_sink:
            self.slot_pos[b.sink_slots] = st.sink_pos.to(self.device)
        if self.window is not None:
            self.window.set_angles(self.slot_pos, self.rope_dims, self.rope_theta)

    def write_qkv(self, layer: int, qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                  eps: float) -> torch.Tensor:
        """The FP8 parts' ring write: the chunk's QKV rows [T, 3·H·D] → q/k RMSNorm, RoPE of q and k at the
        chunk's positions, k and v into the ring at the chunk's slots (FP8, and the read image when enabled);
        while chunk 0 runs, the same kernel writes its first tokens into the sink at the sink's positions.
        Returns q_rot [T, H, D] in qkv's dtype. Needs begin_chunk (optimized mode)."""
        b = self.step
        if self.state is None or b is None:
            raise RuntimeError("KVCache.write_qkv called outside begin_chunk/end_chunk (optimized mode)")
        separate = self.k_image is not None and self.k_image is not self.k
        img = (self.k_image[layer], self.v_image[layer]) if separate else (None, None)
        ring = (self.k[layer], self.v[layer], self.k_scale[layer], self.v_scale[layer])
        q_rot = qkv_ring_write(qkv, q_weight, k_weight, b.cos, b.sin, b.slots, *ring, self.heads, eps=eps,
                               k_image=img[0], v_image=img[1], backend=self.backend)
        if b.writes_sink:
            n = b.sink_slots.shape[0]
            qkv_ring_write(qkv[:n], q_weight, k_weight, b.sink_cos, b.sink_sin, b.sink_slots, *ring, self.heads,
                           eps=eps, k_image=img[0], v_image=img[1], backend=self.backend)
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
        if self.mode is CacheMode.OPTIMIZED:  # the whole window's keys re-rotate from these per call
            self.slot_pos[resident_slots.to(self.device), 0] -= delta
        if self.mode is CacheMode.OPTIMIZED and resident_slots.numel():
            self.undo.save_reset(self, self.next_chunk)
            slots = resident_slots.to(self.device)
            for layer in range(self.layers):
                delta_rotate(self.k[layer], self.k_scale[layer], slots, -delta,
                             rope_dims=self.rope_dims, theta=self.rope_theta, backend=self.backend)
                self.refresh_image(layer, slots, keys_only=True)

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
        """Write a chunk's K (normalized, not rotated) and V [N, H, D] into the ring at `slots` (RoPE at `pos`,
        FP8), plus, while chunk 0 runs, its first tokens into the sink slots at `sink_pos`; the read image, when
        enabled, follows. The float parts' ring write; the FP8 parts write through `write_qkv`."""
        write_kv(k, v, pos, slots, self.k[layer], self.v[layer], self.k_scale[layer], self.v_scale[layer],
                 rope_dims=self.rope_dims, theta=self.rope_theta, backend=self.backend)
        self.refresh_image(layer, slots)
        if sink_pos is not None:
            n = sink_pos.shape[0]
            if sink_slots is None:
                sink_slots = self.layout.sink_slots().to(self.device)
            write_kv(k[:n], v[:n], sink_pos, sink_slots, self.k[layer], self.v[layer], self.k_scale[layer],
                     self.v_scale[layer], rope_dims=self.rope_dims, theta=self.rope_theta, backend=self.backend)
            self.refresh_image(layer, sink_slots)

    def _ring_read(self, layer, k, v, st):
        self.write_chunk(layer, k, v, st.pos, st.slots.to(self.device), st.sink_pos)
        keys = dequantize_rows(self.k[layer], self.k_scale[layer])
        values = dequantize_rows(self.v[layer], self.v_scale[layer])
        return keys, values, st.valid.to(self.device)[None, :]

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
