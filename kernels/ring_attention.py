"""Attention that reads the ring KV cache as it is.

q [N, H, D] (bf16/fp32, already rotated); the ring: k, v [S, H, D] (bf16 served: the rotated keys and the
values, written by kernels/qkv_ring.py); valid [S] bool/uint8 (which slots hold attendable keys). Out [N, H, D]
in q's dtype.

Backends (one signature):
- "image": torch's scaled_dot_product_attention over the ring (cuDNN / flash when every slot is valid, a
  boolean mask otherwise), or, with `kv_splits` > 1 and every slot valid, split-KV attention
  (vivant.kernels.split_kv). The ring must be in q's dtype (a bf16 ring for bf16 queries).
- "torch": the float32 reference (masked softmax in float32), the baseline of tests and the CPU engine.
FLOPs per call 4·N·S·D·H; bytes ≈ S·H·D·4 (bf16 K+V) + N·H·D·4 (q, out in bf16).
"""

from __future__ import annotations

import logging
import math

import torch
import torch.nn.functional as F
from vivant.kernels.split_kv import split_kv_sdpa

BACKENDS = ("image", "torch")
log = logging.getLogger(__name__)
_logged_split: set[str] = set()


def ring_attention_ref(q, k, v, valid, sm_scale: float | None = None) -> torch.Tensor:
    sm = sm_scale if sm_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    logits = torch.einsum("nhd,shd->hns", q.float(), k.float()) * sm
    logits = logits.masked_fill(~valid.bool()[None, None, :], float("-inf"))
    p = torch.softmax(logits, dim=-1)
    return torch.einsum("hns,shd->nhd", p, v.float())


def _sdpa_dense(q, k, v, valid, sm_scale=None, all_valid: bool | None = None):
    k, v = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
    mask = None if all_valid else valid.bool()[None, None, None, :]
    out = F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), k, v, attn_mask=mask, scale=sm_scale)
    return out.squeeze(0).transpose(0, 1)


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor, *,
                   sm_scale: float | None = None, backend: str = "image", all_valid: bool | None = None,
                   kv_splits: int = 1) -> torch.Tensor:
    """Block-causal attention of the chunk's queries over the ring. `all_valid` (host-side knowledge that
    every slot is attendable) lets the image backend drop the mask and take its fastest kernel. `kv_splits` > 1
    (image backend, every slot valid, S divisible by it): the slots in that many parts batched into one SDPA call
    and combined by log-sum-exp (vivant.kernels.split_kv); otherwise one call, and the reason is logged once."""
    if backend not in BACKENDS:
        raise ValueError(f"ring_attention: backend must be one of {BACKENDS}, got {backend!r}")
    N, H, D = q.shape
    if k.shape[1:] != (H, D) or v.shape != k.shape:
        raise ValueError(f"ring_attention: shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not "
                         f"fit [S, {H}, {D}]")
    if valid.shape != (k.shape[0],):
        raise ValueError(f"ring_attention: valid must have shape ({k.shape[0]},), got {tuple(valid.shape)}")
    if backend == "torch":
        return ring_attention_ref(q, k, v, valid, sm_scale).to(q.dtype)
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"ring_attention: backend='image' reads the ring in q's dtype {q.dtype}, got k {k.dtype}, "
                         f"v {v.dtype}")
    if isinstance(kv_splits, bool) or not isinstance(kv_splits, int) or kv_splits < 1:
        raise ValueError(f"ring_attention: kv_splits must be an int >= 1, got {kv_splits!r}")
    if kv_splits > 1:
        why = ("not every slot is valid (a mask needs the single call)" if not all_valid else
               f"{kv_splits} does not divide the {k.shape[0]} slots" if k.shape[0] % kv_splits else None)
        if why is None:
            return split_kv_sdpa(q, k, v, kv_splits, sm_scale)
        if why not in _logged_split:
            _logged_split.add(why)
            log.info("ring_attention: kv_splits=%d not taken: %s", kv_splits, why)
    return _sdpa_dense(q, k, v, valid, sm_scale, all_valid)
