"""Comparison helpers for the kernel tests (Triton vs torch reference, docs/ARCHITECTURE.md).

Every comparison fails on NaN in either operand and puts the relative RMS error and the max abs
error in its failure message. FP8 rows are compared as codes (e4m3 ulps) plus scales.
"""

from __future__ import annotations

import os

import pytest
import torch

FP8 = torch.float8_e4m3fn

# A kernel test runs Triton either interpreted on CPU (TRITON_INTERPRET=1, as `make test` sets it)
# or compiled on CUDA; without either, only the reference checks run.
needs_triton_cpu = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET", "0") in ("", "0"),
    reason="Triton on CPU needs TRITON_INTERPRET=1 (make test sets it)",
)
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def error_stats(actual: torch.Tensor, expected: torch.Tensor) -> tuple[float, float]:
    """(relative RMS error, max abs error) of float32 views of two same-shape tensors."""
    a = actual.double()
    e = expected.double()
    diff = a - e
    rms_e = e.pow(2).mean().sqrt().item()
    rel_rms = diff.pow(2).mean().sqrt().item() / max(rms_e, 1e-30)
    return rel_rms, diff.abs().max().item() if diff.numel() else 0.0


def assert_close(actual, expected, *, rel_rms: float, max_abs: float, what: str) -> None:
    """Fail unless shapes match, neither side has NaN, and both error measures are within bounds."""
    assert tuple(actual.shape) == tuple(expected.shape), f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    a = actual.float()
    e = expected.float()
    n_nan_a, n_nan_e = int(a.isnan().sum()), int(e.isnan().sum())
    assert n_nan_a == 0 and n_nan_e == 0, f"{what}: NaN in actual ({n_nan_a}) / expected ({n_nan_e})"
    r, m = error_stats(a, e)
    assert r <= rel_rms and m <= max_abs, (
        f"{what}: relative RMS error {r:.3e} (limit {rel_rms:.1e}), max abs error {m:.3e} (limit {max_abs:.1e})"
    )


def fp8_ordinal(q: torch.Tensor) -> torch.Tensor:
    """Map float8_e4m3fn codes to integers ordered like their values (adjacent values differ by 1)."""
    b = q.view(torch.uint8).to(torch.int32)
    mag = b & 0x7F
    return torch.where(b >= 0x80, -mag, mag)


def assert_fp8_rows_match(
    q_actual: torch.Tensor,
    s_actual: torch.Tensor,
    q_expected: torch.Tensor,
    s_expected: torch.Tensor,
    *,
    max_ulp_fraction: float,
    what: str,
) -> None:
    """Compare FP8 rows: scales to 1e-6 relative; codes equal except at most one e4m3 ulp on a fraction.

    Why one ulp is allowed at all: the Triton kernel and torch compute cos/sin (and, compiled,
    may fuse multiply-adds) differently in the last float32 bit; a pre-quantization value sitting
    within that bit of a rounding midpoint then lands on the neighbouring e4m3 code. Such values
    are rare (a fraction ~1e-3 or less); anything beyond one ulp is a real error.
    """
    assert q_actual.dtype == FP8 and q_expected.dtype == FP8, f"{what}: expected float8_e4m3fn codes"
    assert_close(s_actual, s_expected, rel_rms=1e-6, max_abs=float("inf"), what=f"{what} scales")
    rel = ((s_actual.double() - s_expected.double()).abs() / s_expected.double().abs()).max().item()
    assert rel <= 1e-6, f"{what}: scales differ by {rel:.3e} relative (limit 1e-6)"
    assert not q_actual.float().isnan().any(), f"{what}: NaN codes in the actual cache rows"
    assert not q_expected.float().isnan().any(), f"{what}: NaN codes in the expected cache rows"
    d = (fp8_ordinal(q_actual) - fp8_ordinal(q_expected)).abs()
    n_off = int((d > 0).sum())
    worst = int(d.max()) if d.numel() else 0
    deq_a = q_actual.float() * s_actual.float().unsqueeze(-1)
    deq_e = q_expected.float() * s_expected.float().unsqueeze(-1)
    r, m = error_stats(deq_a, deq_e)
    assert worst <= 1 and n_off <= max_ulp_fraction * d.numel(), (
        f"{what}: {n_off} of {d.numel()} codes differ (allowed {max_ulp_fraction:.1e} of them), "
        f"worst by {worst} e4m3 ulps (allowed 1); dequantized relative RMS error {r:.3e}, max abs error {m:.3e}"
    )


def poison_cache(shape: tuple[int, ...], dtype: torch.dtype, device="cpu") -> torch.Tensor:
    """A cache filled with NaN (for FP8, the e4m3fn NaN byte 0x7F) so an unwritten slot is visible."""
    if dtype == FP8:
        return torch.full(shape, 0x7F, dtype=torch.uint8, device=device).view(FP8)
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def raw_bytes(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes per leading row (for NaN-proof, bitwise equality of untouched rows)."""
    return t.contiguous().view(torch.uint8).reshape(t.shape[0], -1)


def assert_only_rows_changed(before: torch.Tensor, after: torch.Tensor, rows: torch.Tensor, *, what: str) -> None:
    """Rows outside ``rows`` are bitwise unchanged; every row in ``rows`` holds no NaN."""
    keep = torch.ones(before.shape[0], dtype=torch.bool)
    keep[rows.cpu()] = False
    b, a = raw_bytes(before.cpu()), raw_bytes(after.cpu())
    changed = (b[keep] != a[keep]).any(dim=1)
    assert not changed.any(), (
        f"{what}: {int(changed.sum())} rows outside the target slots changed, e.g. slot "
        f"{int(torch.nonzero(keep)[changed.nonzero()[0]].item())}"
    )
    target = after.cpu()[rows.cpu()].float()
    nan_rows = target.reshape(target.shape[0], -1).isnan().any(dim=1)
    assert not nan_rows.any(), (
        f"{what}: {int(nan_rows.sum())} target slots still hold the poison (not written), e.g. slot "
        f"{int(rows.cpu()[nan_rows][0])}"
    )
