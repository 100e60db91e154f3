"""Attention that reads the FP8 ring KV cache as it is.

q [N, H, D] (bf16/fp32, already rotated); the ring: k, v [S, H, D] float8_e4m3fn (or float), scales
k_scale, v_scale [S, H] float32; valid [S] bool/uint8 (which slots hold attendable keys). Out [N, H, D].

Backends (one signature):
- "triton": a flash-attention forward that loads FP8 K/V tiles, widens them to bf16 in registers (exact:
  every e4m3 value is a bf16 value), and applies the per-row scales to the logits (K) and to the
  probabilities (V) — no dequantized copy of the cache is ever written. Online softmax in float32, exp2.
- "sdpa": dequantize the cache to q's dtype, then torch's scaled_dot_product_attention (cuDNN / flash when
  every slot is valid, a boolean mask otherwise) — a whole-cache dequantization per call, kept to compare.
- "image": SDPA (cuDNN when every slot is valid) over the ring's read image — the bf16 copy of the dequantized
  ring that vivant.kernels.ring_image refreshes at write time (`k_image`, `v_image` [S, H, D]); the same keys
  and values as "sdpa" with no per-call whole-cache work, at the price of the image's memory.
- "torch": the float32 reference (dequantize, masked softmax), the baseline of tests and benchmarks.
FLOPs per call 4·N·S·D·H; bytes ≈ S·H·D·2 (FP8 K+V) + N·H·D·4 (q, out in bf16) — at 57b TP=4
(N=757, S=5788, H=16, D=128) 35.9 GFLOP and 24 MB.
"""

from __future__ import annotations

import logging
import math

import torch
import torch.nn.functional as F
from vivant.kernels.backend import use_triton
from vivant.kernels.ring_image import dequant_all
from vivant.kernels.split_kv import split_kv_sdpa

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

BACKENDS = ("auto", "triton", "sdpa", "image", "torch")
log = logging.getLogger(__name__)
_logged_split: set[str] = set()


def ring_attention_ref(q, k, v, k_scale, v_scale, valid, sm_scale: float | None = None) -> torch.Tensor:
    D = q.shape[-1]
    sm = sm_scale if sm_scale is not None else 1.0 / math.sqrt(D)
    kf = k.float() * k_scale.float()[..., None]
    vf = v.float() * v_scale.float()[..., None]
    logits = torch.einsum("nhd,shd->hns", q.float(), kf) * sm
    logits = logits.masked_fill(~valid.bool()[None, None, :], float("-inf"))
    p = torch.softmax(logits, dim=-1)
    return torch.einsum("hns,shd->nhd", p, vf)


def _dequant_pair(k, v, k_scale, v_scale, dt):
    """K and V rows × their scales → dt, the whole ring (reads S·H·D·2 bytes, writes 2× that): the same values as
    the read image (vivant.kernels.ring_image), computed per call."""
    kd = torch.empty(k.shape, dtype=dt, device=k.device)
    vd = torch.empty(v.shape, dtype=dt, device=v.device)
    for src, sc, dst in ((k, k_scale, kd), (v, v_scale, vd)):
        dequant_all(src.contiguous(), sc.contiguous(), dst)
    return kd, vd


def _sdpa(q, k, v, k_scale, v_scale, valid, sm_scale=None, all_valid: bool | None = None):
    kd, vd = _dequant_pair(k, v, k_scale, v_scale, q.dtype)
    return _sdpa_dense(q, kd, vd, valid, sm_scale, all_valid)


def _sdpa_dense(q, kd, vd, valid, sm_scale=None, all_valid: bool | None = None):
    kd, vd = kd.transpose(0, 1).unsqueeze(0), vd.transpose(0, 1).unsqueeze(0)
    mask = None if all_valid else valid.bool()[None, None, None, :]
    out = F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), kd, vd, attn_mask=mask, scale=sm_scale)
    return out.squeeze(0).transpose(0, 1)


if triton is not None:

    @triton.jit
    def _ring_attn_kernel(q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, valid_ptr, o_ptr, m_ptr, l_ptr, N, S, S_SPLIT, qk_scale,
                          sq_n, sq_h, sk_n, sk_h, sv_n, sv_h, so_s, so_n, so_h, sks_n, sks_h, svs_n, svs_h,
                          D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_DTYPE: tl.constexpr,
                          PARTIAL: tl.constexpr):
        # grid (query blocks, heads, KV splits); split `sp` covers slots [sp·S_SPLIT, min(S, (sp+1)·S_SPLIT)).
        # PARTIAL: write the unnormalized accumulator and the (max, sum) of the split for a later combine.
        pid_m = tl.program_id(0)
        h = tl.program_id(1)
        sp = tl.program_id(2)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, D)
        mmask = offs_m < N
        q = tl.load(q_ptr + offs_m[:, None] * sq_n + h * sq_h + offs_d[None, :], mask=mmask[:, None], other=0.0)
        q = q.to(DOT_DTYPE)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D], tl.float32)
        lo = sp * S_SPLIT
        hi = tl.minimum(lo + S_SPLIT, S)
        for start in range(lo, hi, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            nmask = offs_n < hi
            valid = (tl.load(valid_ptr + offs_n, mask=nmask, other=0) != 0) & nmask
            kr = tl.load(k_ptr + offs_n[:, None] * sk_n + h * sk_h + offs_d[None, :], mask=nmask[:, None], other=0.0)
            ks = tl.load(ks_ptr + offs_n * sks_n + h * sks_h, mask=nmask, other=0.0)
            qk = tl.dot(q, tl.trans(kr.to(q.dtype))) * (ks * qk_scale)[None, :]
            qk = tl.where(valid[None, :], qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.math.exp2(qk - m_safe[:, None])
            alpha = tl.math.exp2(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            vt = tl.load(v_ptr + offs_n[:, None] * sv_n + h * sv_h + offs_d[None, :], mask=nmask[:, None], other=0.0)
            vs = tl.load(vs_ptr + offs_n * svs_n + h * svs_h, mask=nmask, other=0.0)
            acc = acc * alpha[:, None] + tl.dot((p * vs[None, :]).to(q.dtype), vt.to(q.dtype))
            m_i = m_new
        if PARTIAL:
            base = sp * so_s + offs_m * so_n + h * so_h
            tl.store(o_ptr + base[:, None] + offs_d[None, :], acc, mask=mmask[:, None])
            ml = (sp * N + offs_m) * (so_n // D) + h  # m, l are contiguous [splits, N, H]; so_n = H·D
            tl.store(m_ptr + ml, m_i, mask=mmask)
            tl.store(l_ptr + ml, l_i, mask=mmask)
        else:
            out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
            tl.store(o_ptr + offs_m[:, None] * so_n + h * so_h + offs_d[None, :], out.to(o_ptr.dtype.element_ty),
                     mask=mmask[:, None])


# (BLOCK_M, BLOCK_N, num_warps, num_stages, KV splits) candidates; the launcher times them once per shape on CUDA
# (triton's autotuner needs a GPU driver, so it cannot run under the CPU interpreter). Splitting the 5,788 slots
# multiplies the programs: 16 heads × ⌈757/64⌉ = 192 programs alone under-fill 132 SMs.
CONFIGS = [(64, 64, 4, 3, 1), (64, 128, 4, 3, 1), (128, 64, 8, 3, 1), (128, 128, 8, 2, 1), (64, 64, 4, 3, 2),
           (64, 128, 4, 3, 2), (128, 64, 8, 3, 2), (128, 128, 8, 2, 2), (64, 64, 4, 3, 4), (64, 128, 4, 3, 4),
           (128, 64, 8, 3, 4), (128, 128, 8, 2, 4), (128, 128, 8, 3, 3), (64, 128, 8, 3, 3)]
_best: dict[tuple, tuple[int, int, int, int, int]] = {}


def _launch(cfg, q, k, v, k_scale, v_scale, valid_u8, out, sm):
    bm, bn, w, st, splits = cfg
    N, H, D = q.shape
    S = k.shape[0]
    s_split = triton.cdiv(triton.cdiv(S, splits), bn) * bn
    splits = triton.cdiv(S, s_split)
    dot = tl.bfloat16 if q.is_cuda else tl.float32
    common = dict(D=D, BLOCK_M=bm, BLOCK_N=bn, num_warps=w, num_stages=st, DOT_DTYPE=dot)
    kv_strides = (k.stride(0), k.stride(1), v.stride(0), v.stride(1))
    sc_strides = (k_scale.stride(0), k_scale.stride(1), v_scale.stride(0), v_scale.stride(1))
    if splits == 1:
        _ring_attn_kernel[(triton.cdiv(N, bm), H, 1)](
            q, k, v, k_scale, v_scale, valid_u8, out, out, out, N, S, s_split, sm * 1.4426950408889634,
            q.stride(0), q.stride(1), *kv_strides, 0, out.stride(0), out.stride(1), *sc_strides, PARTIAL=False,
            **common)
        return
    acc = torch.empty(splits, N, H, D, dtype=torch.float32, device=q.device)
    m = torch.empty(splits, N, H, dtype=torch.float32, device=q.device)
    l_ = torch.empty(splits, N, H, dtype=torch.float32, device=q.device)
    _ring_attn_kernel[(triton.cdiv(N, bm), H, splits)](
        q, k, v, k_scale, v_scale, valid_u8, acc, m, l_, N, S, s_split, sm * 1.4426950408889634,
        q.stride(0), q.stride(1), *kv_strides, acc.stride(0), acc.stride(1), acc.stride(2), *sc_strides,
        PARTIAL=True, **common)
    # combine the splits (log2 domain): out = Σ 2^(m_s − M)·acc_s / Σ 2^(m_s − M)·l_s
    mx = m.amax(0)
    mx = torch.where(torch.isinf(mx), torch.zeros_like(mx), mx)
    w_ = torch.exp2(m - mx)
    den = (w_ * l_).sum(0)
    num = (w_[..., None] * acc).sum(0)
    out.copy_(num / torch.where(den == 0, torch.ones_like(den), den)[..., None])


def _pick_config(key, args) -> tuple[int, int, int, int, int]:
    if key in _best:
        return _best[key]
    if not args[0].is_cuda:
        _best[key] = (32, 32, 4, 1, 2 if key[1] > 64 else 1)  # split on CPU too, so tests exercise the combine
        return _best[key]
    from triton.testing import do_bench

    times = {}
    for cfg in CONFIGS:
        try:
            times[cfg] = do_bench(lambda cfg=cfg: _launch(cfg, *args), warmup=5, rep=20, return_mode="median")
        except Exception:  # a config that does not fit (shared memory) is skipped
            continue
    _best[key] = min(times, key=times.get)
    return _best[key]


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_scale: torch.Tensor, v_scale: torch.Tensor,
                   valid: torch.Tensor, *, sm_scale: float | None = None, backend: str = "auto",
                   all_valid: bool | None = None, k_image: torch.Tensor | None = None,
                   v_image: torch.Tensor | None = None, kv_splits: int = 1) -> torch.Tensor:
    """Block-causal attention of the chunk's queries over the ring. `all_valid` (host-side knowledge that
    every slot is attendable) lets the sdpa/image backends drop the mask and take their fastest kernel.
    `k_image`/`v_image`: the ring's read image, needed by (and only by) backend="image". `kv_splits` > 1 (image
    backend, every slot valid, S divisible by it): the slots in that many parts batched into one SDPA call and
    combined by log-sum-exp (vivant.kernels.split_kv); otherwise one call, and the reason is logged once."""
    if backend not in BACKENDS:
        raise ValueError(f"ring_attention: backend must be one of {BACKENDS}, got {backend!r}")
    N, H, D = q.shape
    if k.shape[1:] != (H, D) or v.shape != k.shape or k_scale.shape != k.shape[:2] or v_scale.shape != k.shape[:2]:
        raise ValueError(f"ring_attention: shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, "
                         f"k_scale {tuple(k_scale.shape)}, v_scale {tuple(v_scale.shape)} do not fit [S, {H}, {D}]")
    if valid.shape != (k.shape[0],):
        raise ValueError(f"ring_attention: valid must have shape ({k.shape[0]},), got {tuple(valid.shape)}")
    if backend == "torch":
        return ring_attention_ref(q, k, v, k_scale, v_scale, valid, sm_scale).to(q.dtype)
    if backend == "sdpa":
        return _sdpa(q, k, v, k_scale, v_scale, valid, sm_scale, all_valid)
    if backend == "image":
        if k_image is None or v_image is None:
            raise ValueError("ring_attention: backend='image' needs k_image and v_image (the ring's read image)")
        for name, t in (("k_image", k_image), ("v_image", v_image)):
            if t.shape != k.shape or t.dtype != q.dtype:
                raise ValueError(f"ring_attention: {name} must be {q.dtype} {tuple(k.shape)} (the ring's shape in "
                                 f"q's dtype), got {t.dtype} {tuple(t.shape)}")
        if isinstance(kv_splits, bool) or not isinstance(kv_splits, int) or kv_splits < 1:
            raise ValueError(f"ring_attention: kv_splits must be an int >= 1, got {kv_splits!r}")
        if kv_splits > 1:
            why = ("not every slot is valid (a mask needs the single call)" if not all_valid else
                   f"{kv_splits} does not divide the {k.shape[0]} slots" if k.shape[0] % kv_splits else None)
            if why is None:
                return split_kv_sdpa(q, k_image, v_image, kv_splits, sm_scale)
            if why not in _logged_split:
                _logged_split.add(why)
                log.info("ring_attention: kv_splits=%d not taken: %s", kv_splits, why)
        return _sdpa_dense(q, k_image, v_image, valid, sm_scale, all_valid)
    if not use_triton("ring_attention", "triton" if backend == "triton" else "auto", q.device):
        return ring_attention_ref(q, k, v, k_scale, v_scale, valid, sm_scale).to(q.dtype)
    if D not in (16, 32, 64, 128, 256):
        raise ValueError(f"ring_attention: head_dim {D} must be a power of two in [16, 256] for the Triton path")
    if k.stride(2) != 1 or q.stride(2) != 1 or v.stride(2) != 1:
        raise ValueError("ring_attention: q, k and v need a contiguous head_dim")
    sm = sm_scale if sm_scale is not None else 1.0 / math.sqrt(D)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    valid_u8 = valid.to(torch.uint8) if valid.dtype == torch.bool else valid
    args = (q, k, v, k_scale, v_scale, valid_u8, out, sm)
    cfg = _pick_config((N, k.shape[0], H, D, q.dtype, k.dtype, str(q.device)), args)
    _launch(cfg, *args)
    return out
