"""Activation quantization fused into the op that precedes each FP8 GEMM.

Row widths K: 8192 before QKV and gate/up, 2048 before O, 6912 before down at the 57b TP=4 shard.
Each kernel computes a row in float32, takes the row's absolute max, and writes FP8 e4m3 values
plus one float32 scale per row — exactly the per-row (rowwise) activation scales `torch._scaled_mm`
takes. Bytes per row from DRAM: 2K in, K + 4 out (vs. 2K in, 2K out, then 2K in, K out for an
unfused norm + quantize).

Tiling. Each program handles ROWS rows as [ROWS, BLOCK_K] tiles. With BLOCK_K >= K (one tile) a
kernel loads the whole rows once, reduces and stores, with every value held in registers. That
is what bounds speed at large K: whole 8192-wide rows in registers leave room for few programs per
SM, so a 757-row launch runs as a few latency-bound waves. The LayerNorm kernels therefore load
shift/scale only after the row statistics (they are not held across the reductions), and every row
scale is one NaN-propagating max reduction (a NaN row gets a NaN scale without a second reduction
counting NaNs). With BLOCK_K < K a kernel loops over K in passes: row statistics
(LayerNorm kernels only), then the row absmax (NaN kept) of the recomputed output, then quantize
and store, recomputing each tile. It re-reads the row up to three times (mostly from L1/L2, not
DRAM) but needs only a tile's registers, so many rows are in flight. residual_ln_mod_quant stores
x + g·y in its first pass and re-reads that stored (rounded) residual in the later passes.
shift/scale/gate tiles are loaded once per tile and broadcast over the ROWS rows. Both forms give
the twins' semantics; only the float32 summation order of the statistics differs.

Each launcher takes `config=(rows_per_program, block_k, num_warps)` (keyword only);
None uses DEFAULT_CONFIGS[<kernel name>]. rows_per_program is a power of two; block_k is a power of
two >= 16, or 0 for the whole row (next_pow2(K)); a block_k above next_pow2(K) is capped there.
num_warps 0 means the default rule (max(1, min(16, rows_per_program·block_k // 512))). Anything else
raises ValueError naming `config`. `pdl=True` launches with programmatic dependent launch on a Hopper GPU
(vivant.kernels.backend.pdl_launch): the programs wait for the preceding kernel before their first access,
so only the launch overlaps that kernel's tail; elsewhere it is ignored.

  ln_mod_quant(x, shift, scale)  LayerNorm (no affine) → y·(1 + scale) + shift → FP8 rows
  swiglu_quant(gu)               gu = [gate | up] (2F wide) → silu(gate)·up → FP8 rows
  quant_rows(x)                  plain rowwise FP8 quantization
  residual_ln_mod_quant(x, y, g, shift, scale)  x + g·y (written back), then ln_mod_quant of it

Scales follow vivant.kernels.fp8: s = max(amax, 1e-8) / 448, q = RNE_e4m3(y / s). Compiled on a GPU the
kernels compute y·(1/s) and use the hardware e4m3 conversion (a few instructions per element instead of an
IEEE division and ~15 integer operations of grid rounding — these kernels were issue-bound at 757 rows); a
code then differs from the twin's by one e4m3 step only where the two products straddle a rounding
midpoint. `exact_rounding=True` selects the twin's arithmetic on the GPU (the interpreter always uses it).
Each has a float32 torch twin (`*_ref`) and a `backend` switch ("auto" | "triton" | "torch").
"""

from __future__ import annotations

import torch
from vivant.kernels.backend import interpreter_enabled, pdl_launch, use_triton
from vivant.kernels.fp8 import quantize_rows_ref

try:
    import triton
    import triton.language as tl
    from triton.language.extra.cuda import gdc_wait
    from vivant.kernels.fp8 import e4m3_grid_tl
except ImportError:  # pragma: no cover - triton is a dependency of the kernels extra
    triton = None


# ---- references ------------------------------------------------------------------------------------
def ln_mod_quant_ref(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, eps: float = 1e-6):
    xf = x.float()
    y = torch.nn.functional.layer_norm(xf, (xf.shape[-1],), eps=eps) * (1 + scale.float()) + shift.float()
    return quantize_rows_ref(y)


def residual_ln_mod_quant_ref(
    x: torch.Tensor,
    y: torch.Tensor,
    gate: torch.Tensor,
    shift: torch.Tensor,
    scale: torch.Tensor,
    eps: float = 1e-6,
):
    """x_new = x + gate·y (in x's dtype), then ln_mod_quant(x_new): returns (x_new, fp8 rows, scales)."""
    x_new = (x.float() + gate.float() * y.float()).to(x.dtype)
    q, s = ln_mod_quant_ref(x_new, shift, scale, eps)
    return x_new, q, s


def swiglu_quant_ref(gu: torch.Tensor):
    gate, up = gu.float().chunk(2, dim=-1)
    return quantize_rows_ref(torch.nn.functional.silu(gate) * up)


def quant_rows_ref(x: torch.Tensor):
    return quantize_rows_ref(x.float())


# ---- Triton -------------------------------------------------------------------------------------------
# Every kernel below works on [ROWS, BLOCK_K] tiles: program p owns rows p·ROWS … p·ROWS + ROWS − 1 (rows ≥ M
# are masked off) and walks the row width in BLOCK_K-wide tiles. ONE_TILE (BLOCK_K ≥ K, set by the launcher)
# keeps the one-pass form: load everything, reduce, store. Otherwise the kernel loops over K in passes
# (statistics → absmax, NaN kept → quantize + store), recomputing the row's values per tile; per-row
# accumulators stay elementwise ([ROWS, BLOCK_K]) inside a loop and are reduced once after it.
if triton is not None:

    @triton.jit
    def _tile(row0, k0, M, K, ROWS: tl.constexpr, BLOCK_K: tl.constexpr):
        """Row indices [ROWS], column indices [BLOCK_K], column mask [BLOCK_K], element mask [ROWS, BLOCK_K]."""
        rows = row0 + tl.arange(0, ROWS)
        cols = k0 + tl.arange(0, BLOCK_K)
        cmask = cols < K
        mask = (rows < M)[:, None] & cmask[None, :]
        return rows, cols, cmask, mask

    # the row scale's form (`_row_scale`): read by the jitted code as a global constant
    ONE_REDUCTION = tl.constexpr(not interpreter_enabled())

    @triton.jit
    def _nan_max(a, b):
        """max that returns NaN when either side is NaN (the row reductions' combine: tl.max drops NaN)."""
        return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)

    @triton.jit
    def _absmax(y, mask):
        """Elementwise contributions to the row absmax, NaN kept (reduce along axis 1 with `_row_scale`)."""
        return tl.where(mask, tl.abs(y), 0.0)

    @triton.jit
    def _row_scale(amax_tile):
        """Per-row FP8 scale from an elementwise absmax tile [ROWS, BLOCK_K] (NaN kept): NaN if the row holds a
        NaN (as the reference twin's scale is), else max(amax, 1e-8) / 448. Compiled, one NaN-propagating max
        reduction; in the interpreter (ONE_REDUCTION false), where a custom combine runs element by element in
        Python, a max and a NaN count with the same result."""
        if ONE_REDUCTION:
            amax = tl.reduce(amax_tile, 1, _nan_max)
            return tl.where(amax != amax, amax, tl.maximum(amax, 1e-8) / 448.0)
        amax = tl.max(amax_tile, axis=1)
        nans = tl.sum(tl.where(amax_tile != amax_tile, 1, 0), axis=1)
        return tl.where(nans > 0, float("nan"), tl.maximum(amax, 1e-8) / 448.0)

    @triton.jit
    def _store_fp8_tile(q_ptr, rows, cols, mask, y, s, K, HW_CAST: tl.constexpr):
        """Quantize a [ROWS, BLOCK_K] tile with the per-row scales s [ROWS] and store it.
        HW_CAST (compiled GPU code): y · (1/s) and the hardware's round-to-nearest-even, saturating e4m3
        conversion; otherwise IEEE division and e4m3 grid rounding in float32 bit arithmetic before the cast
        (the interpreter's own cast is wrong for ~2% of values)."""
        if HW_CAST:
            q = y * (1.0 / s)[:, None]
        else:
            q = e4m3_grid_tl(y / s[:, None])
        tl.store(q_ptr + rows[:, None] * K + cols[None, :], q.to(tl.float8e4nv), mask=mask)

    @triton.jit
    def _mod(xhat, sc, sh):
        """Modulation of a normalized tile by per-column vectors broadcast across the tile's rows."""
        return xhat * (1.0 + sc[None, :]) + sh[None, :]

    @triton.jit
    def _ln_stats(sum_tile, sq_tile, K, eps):
        # var = E[x²] − E[x]² in float32, floored at 0: mean and mean-square reduce side by side
        mean = tl.sum(sum_tile, axis=1) / K
        var = tl.maximum(tl.sum(sq_tile, axis=1) / K - mean * mean, 0.0)
        return mean, 1.0 / tl.sqrt(var + eps)

    @triton.jit
    def _ln_mod_quant_tile(x, shift_ptr, scale_ptr, cols, cmask, mask, rows, q_ptr, K, eps, HW_CAST: tl.constexpr):
        """One-tile form: whole rows x [ROWS, BLOCK_K] (zeros where masked) → LayerNorm, modulation, FP8 rows
        stored; returns the per-row scales. shift/scale are loaded after the statistics, so they are not held
        in registers across the row reductions (more rows in flight per SM)."""
        mean, rstd = _ln_stats(x, x * x, K, eps)
        sh = tl.load(shift_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
        sc = tl.load(scale_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
        y = _mod((x - mean[:, None]) * rstd[:, None], sc, sh)
        s = _row_scale(_absmax(y, mask))
        _store_fp8_tile(q_ptr, rows, cols, mask, y, s, K, HW_CAST)
        return s

    @triton.jit
    def _ln_mod_scale_pass(src_ptr, stride, shift_ptr, scale_ptr, row0, M, K, mean, rstd, ROWS: tl.constexpr,
                           BLOCK_K: tl.constexpr):
        """Looped pass 2: re-read the rows, normalize + modulate each tile, return the per-row FP8 scales."""
        amax_t = tl.zeros([ROWS, BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            rows, cols, cmask, mask = _tile(row0, k0, M, K, ROWS, BLOCK_K)
            x = tl.load(src_ptr + rows[:, None] * stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            sh = tl.load(shift_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
            sc = tl.load(scale_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
            amax_t = _nan_max(amax_t, _absmax(_mod((x - mean[:, None]) * rstd[:, None], sc, sh), mask))
        return _row_scale(amax_t)

    @triton.jit
    def _ln_mod_store_pass(src_ptr, stride, shift_ptr, scale_ptr, q_ptr, row0, M, K, mean, rstd, s,
                           ROWS: tl.constexpr, BLOCK_K: tl.constexpr, HW_CAST: tl.constexpr):
        """Looped pass 3: re-read, normalize + modulate, quantize with the row scales s and store."""
        for k0 in range(0, K, BLOCK_K):
            rows, cols, cmask, mask = _tile(row0, k0, M, K, ROWS, BLOCK_K)
            x = tl.load(src_ptr + rows[:, None] * stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            sh = tl.load(shift_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
            sc = tl.load(scale_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
            _store_fp8_tile(q_ptr, rows, cols, mask, _mod((x - mean[:, None]) * rstd[:, None], sc, sh), s, K, HW_CAST)

    @triton.jit
    def _ln_mod_quant_kernel(
        x_ptr,
        shift_ptr,
        scale_ptr,
        q_ptr,
        s_ptr,
        M,
        K,
        stride_x,
        eps,
        ROWS: tl.constexpr,
        BLOCK_K: tl.constexpr,
        ONE_TILE: tl.constexpr,
        HW_CAST: tl.constexpr,
        PDL: tl.constexpr = False,
    ):
        if PDL:  # programmatic dependent launch: nothing is read or written before the predecessor is done
            gdc_wait()
        row0 = tl.program_id(0) * ROWS
        if ONE_TILE:
            rows, cols, cmask, mask = _tile(row0, 0, M, K, ROWS, BLOCK_K)
            x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            s = _ln_mod_quant_tile(x, shift_ptr, scale_ptr, cols, cmask, mask, rows, q_ptr, K, eps, HW_CAST)
        else:
            acc_s = tl.zeros([ROWS, BLOCK_K], dtype=tl.float32)
            acc_q = tl.zeros([ROWS, BLOCK_K], dtype=tl.float32)
            # pass 1: row statistics
            for k0 in range(0, K, BLOCK_K):
                rows, cols, cmask, mask = _tile(row0, k0, M, K, ROWS, BLOCK_K)
                x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(
                    tl.float32
                )
                acc_s += x
                acc_q += x * x
            mean, rstd = _ln_stats(acc_s, acc_q, K, eps)
            # pass 2: row absmax (NaN kept) of the modulated values; pass 3: quantize and store
            s = _ln_mod_scale_pass(x_ptr, stride_x, shift_ptr, scale_ptr, row0, M, K, mean, rstd, ROWS, BLOCK_K)
            _ln_mod_store_pass(x_ptr, stride_x, shift_ptr, scale_ptr, q_ptr, row0, M, K, mean, rstd, s, ROWS, BLOCK_K,
                               HW_CAST)
        rows = row0 + tl.arange(0, ROWS)
        tl.store(s_ptr + rows, s, mask=rows < M)

    @triton.jit
    def _residual_ln_mod_quant_kernel(
        x_ptr,
        y_ptr,
        gate_ptr,
        shift_ptr,
        scale_ptr,
        xo_ptr,
        q_ptr,
        s_ptr,
        M,
        K,
        stride_x,
        stride_y,
        eps,
        ROWS: tl.constexpr,
        BLOCK_K: tl.constexpr,
        ONE_TILE: tl.constexpr,
        HW_CAST: tl.constexpr,
        PDL: tl.constexpr = False,
    ):
        if PDL:  # programmatic dependent launch: nothing is read or written before the predecessor is done
            gdc_wait()
        row0 = tl.program_id(0) * ROWS
        if ONE_TILE:
            rows, cols, cmask, mask = _tile(row0, 0, M, K, ROWS, BLOCK_K)
            x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            y = tl.load(y_ptr + rows[:, None] * stride_y + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            g = tl.load(gate_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
            xn = (x + g[None, :] * y).to(xo_ptr.dtype.element_ty)
            tl.store(xo_ptr + rows[:, None] * K + cols[None, :], xn, mask=mask)
            x = tl.where(mask, xn.to(tl.float32), 0.0)  # normalize what was stored, as the reference does
            s = _ln_mod_quant_tile(x, shift_ptr, scale_ptr, cols, cmask, mask, rows, q_ptr, K, eps, HW_CAST)
        else:
            acc_s = tl.zeros([ROWS, BLOCK_K], dtype=tl.float32)
            acc_q = tl.zeros([ROWS, BLOCK_K], dtype=tl.float32)
            # pass 1: x + g·y rounded to x's dtype, stored, and its statistics
            for k0 in range(0, K, BLOCK_K):
                rows, cols, cmask, mask = _tile(row0, k0, M, K, ROWS, BLOCK_K)
                x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(
                    tl.float32
                )
                y = tl.load(y_ptr + rows[:, None] * stride_y + cols[None, :], mask=mask, other=0.0).to(
                    tl.float32
                )
                g = tl.load(gate_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
                xn = (x + g[None, :] * y).to(xo_ptr.dtype.element_ty)
                tl.store(xo_ptr + rows[:, None] * K + cols[None, :], xn, mask=mask)
                x = tl.where(mask, xn.to(tl.float32), 0.0)
                acc_s += x
                acc_q += x * x
            mean, rstd = _ln_stats(acc_s, acc_q, K, eps)
            # passes 2 and 3 re-read xo, which this program just wrote: make every thread's stores visible first
            tl.debug_barrier()
            # pass 2: row absmax (NaN kept); pass 3: quantize and store
            s = _ln_mod_scale_pass(xo_ptr, K, shift_ptr, scale_ptr, row0, M, K, mean, rstd, ROWS, BLOCK_K)
            _ln_mod_store_pass(xo_ptr, K, shift_ptr, scale_ptr, q_ptr, row0, M, K, mean, rstd, s, ROWS, BLOCK_K,
                               HW_CAST)
        rows = row0 + tl.arange(0, ROWS)
        tl.store(s_ptr + rows, s, mask=rows < M)

    @triton.jit
    def _swiglu_tile(gu_ptr, rows, cols, mask, F, stride_gu):
        g = tl.load(gu_ptr + rows[:, None] * stride_gu + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        u = tl.load(gu_ptr + rows[:, None] * stride_gu + F + cols[None, :], mask=mask, other=0.0).to(
            tl.float32
        )
        return g / (1.0 + tl.exp(-g)) * u

    @triton.jit
    def _swiglu_quant_kernel(
        gu_ptr,
        q_ptr,
        s_ptr,
        M,
        F,
        stride_gu,
        ROWS: tl.constexpr,
        BLOCK_K: tl.constexpr,
        ONE_TILE: tl.constexpr,
        HW_CAST: tl.constexpr,
        PDL: tl.constexpr = False,
    ):
        if PDL:  # programmatic dependent launch: nothing is read or written before the predecessor is done
            gdc_wait()
        row0 = tl.program_id(0) * ROWS
        if ONE_TILE:
            rows, cols, cmask, mask = _tile(row0, 0, M, F, ROWS, BLOCK_K)
            y = _swiglu_tile(gu_ptr, rows, cols, mask, F, stride_gu)
            s = _row_scale(_absmax(y, mask))
            _store_fp8_tile(q_ptr, rows, cols, mask, y, s, F, HW_CAST)
        else:
            amax_t = tl.zeros([ROWS, BLOCK_K], dtype=tl.float32)
            # pass 2 (no statistics pass): row absmax (NaN kept)
            for k0 in range(0, F, BLOCK_K):
                rows, cols, cmask, mask = _tile(row0, k0, M, F, ROWS, BLOCK_K)
                amax_t = _nan_max(amax_t, _absmax(_swiglu_tile(gu_ptr, rows, cols, mask, F, stride_gu), mask))
            s = _row_scale(amax_t)
            # pass 3: quantize and store
            for k0 in range(0, F, BLOCK_K):
                rows, cols, cmask, mask = _tile(row0, k0, M, F, ROWS, BLOCK_K)
                _store_fp8_tile(
                    q_ptr, rows, cols, mask, _swiglu_tile(gu_ptr, rows, cols, mask, F, stride_gu), s, F, HW_CAST)
        rows = row0 + tl.arange(0, ROWS)
        tl.store(s_ptr + rows, s, mask=rows < M)

    @triton.jit
    def _quant_rows_kernel(
        x_ptr, q_ptr, s_ptr, M, K, stride_x, ROWS: tl.constexpr, BLOCK_K: tl.constexpr, ONE_TILE: tl.constexpr,
        HW_CAST: tl.constexpr,
        PDL: tl.constexpr = False,
    ):
        if PDL:  # programmatic dependent launch: nothing is read or written before the predecessor is done
            gdc_wait()
        row0 = tl.program_id(0) * ROWS
        if ONE_TILE:
            rows, cols, cmask, mask = _tile(row0, 0, M, K, ROWS, BLOCK_K)
            y = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            s = _row_scale(_absmax(y, mask))
            _store_fp8_tile(q_ptr, rows, cols, mask, y, s, K, HW_CAST)
        else:
            amax_t = tl.zeros([ROWS, BLOCK_K], dtype=tl.float32)
            # pass 2 (no statistics pass): row absmax (NaN kept)
            for k0 in range(0, K, BLOCK_K):
                rows, cols, cmask, mask = _tile(row0, k0, M, K, ROWS, BLOCK_K)
                y = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(
                    tl.float32
                )
                amax_t = _nan_max(amax_t, _absmax(y, mask))
            s = _row_scale(amax_t)
            # pass 3: quantize and store
            for k0 in range(0, K, BLOCK_K):
                rows, cols, cmask, mask = _tile(row0, k0, M, K, ROWS, BLOCK_K)
                y = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(
                    tl.float32
                )
                _store_fp8_tile(q_ptr, rows, cols, mask, y, s, K, HW_CAST)
        rows = row0 + tl.arange(0, ROWS)
        tl.store(s_ptr + rows, s, mask=rows < M)


# ---- launch configuration ----------------------------------------------------------------------------------
# (rows_per_program, block_k, num_warps) per kernel. block_k 0 = the whole row in one tile (next_pow2(K));
# num_warps 0 = the default rule `_warps(rows_per_program · block_k)`. The values are the fastest correct
# configurations of a sweep at the 57b TP=4 shapes (K = 8192, 2048, 6912; 757 rows), each configuration timed
# inside a CUDA graph (docs/ARCHITECTURE.md, "Row kernels"): one pass over the whole row.
DEFAULT_CONFIGS: dict[str, tuple[int, int, int]] = {
    "ln_mod_quant": (2, 0, 16),
    "residual_ln_mod_quant": (1, 0, 8),
    "swiglu_quant": (1, 0, 8),
    "quant_rows": (1, 0, 4),
}

_WARP_CHOICES = (0, 1, 2, 4, 8, 16, 32)


def _warps(block: int) -> int:
    return max(1, min(16, block // 512))


def _is_pow2(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def _check_config(name: str, config) -> tuple[int, int, int]:
    """Validate a (rows_per_program, block_k, num_warps) launch config; raise ValueError naming `config`."""
    ok = (
        isinstance(config, tuple | list)
        and len(config) == 3
        and all(isinstance(v, int) and not isinstance(v, bool) for v in config)
    )
    if ok:
        rows, block_k, warps = config
        ok = (
            _is_pow2(rows)
            and (block_k == 0 or (_is_pow2(block_k) and block_k >= 16))
            and warps in _WARP_CHOICES
        )
    if not ok:
        raise ValueError(
            f"{name}: config must be (rows_per_program, block_k, num_warps) with rows_per_program a power of two "
            f">= 1, block_k a power of two >= 16 (or 0 = whole row) and num_warps one of {_WARP_CHOICES} "
            f"(0 = default rule), got {config!r}"
        )
    return tuple(config)


def _resolve_config(name: str, config) -> tuple[int, int, int]:
    return _check_config(name, DEFAULT_CONFIGS[name] if config is None else config)


def _launch(config: tuple[int, int, int], M: int, K: int, hw_cast: bool = False, pdl: bool = False):
    """Grid and meta-parameters for a row kernel of width K; block_k is capped at next_pow2(K) (one tile).
    pdl: launch with programmatic dependent launch (vivant.kernels.backend.pdl_launch decided it)."""
    rows, block_k, warps = config
    full = triton.next_power_of_2(K)
    block_k = full if block_k == 0 else min(block_k, full)
    meta = dict(ROWS=rows, BLOCK_K=block_k, ONE_TILE=block_k >= K, HW_CAST=hw_cast,
                num_warps=warps or _warps(rows * block_k))
    if pdl:
        meta.update(PDL=True, launch_pdl=True)
    return (triton.cdiv(M, rows),), meta


def _hw_cast(x: torch.Tensor, exact_rounding: bool) -> bool:
    """Compiled GPU code quantizes with y·(1/s) and the hardware e4m3 conversion (round to nearest even);
    `exact_rounding=True` (and the CPU interpreter, whose own cast is wrong) keeps IEEE y/s and the float32
    grid rounding of the twin. The two differ only where y·(1/s) and y/s straddle an e4m3 rounding midpoint."""
    return x.is_cuda and not exact_rounding


def _check_2d(name: str, x: torch.Tensor) -> None:
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(
            f"{name}: expected a 2-D tensor with contiguous rows, got shape {tuple(x.shape)} "
            f"strides {tuple(x.stride())}"
        )


def ln_mod_quant(
    x: torch.Tensor,
    shift: torch.Tensor,
    scale: torch.Tensor,
    eps: float = 1e-6,
    backend: str = "auto",
    *,
    config: tuple[int, int, int] | None = None,
    exact_rounding: bool = False,
    pdl: bool = False,
):
    """x [M, K]; shift, scale [K] → (fp8 [M, K], float32 scales [M]).
    config: (rows_per_program, block_k, num_warps) for the Triton kernel; None = DEFAULT_CONFIGS["ln_mod_quant"]."""
    _check_2d("ln_mod_quant x", x)
    K = x.shape[1]
    if shift.shape != (K,) or scale.shape != (K,):
        raise ValueError(
            f"ln_mod_quant: shift/scale must have shape ({K},), got {tuple(shift.shape)}/{tuple(scale.shape)}"
        )
    config = _resolve_config("ln_mod_quant", config)
    if not use_triton("ln_mod_quant", backend, x.device):
        return ln_mod_quant_ref(x, shift, scale, eps)
    M = x.shape[0]
    q = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(M, dtype=torch.float32, device=x.device)
    grid, meta = _launch(config, M, K, _hw_cast(x, exact_rounding), pdl_launch(pdl, x.device))
    _ln_mod_quant_kernel[grid](
        x, shift.contiguous(), scale.contiguous(), q, s, M, K, x.stride(0), eps, **meta
    )
    return q, s


def residual_ln_mod_quant(
    x: torch.Tensor,
    y: torch.Tensor,
    gate: torch.Tensor,
    shift: torch.Tensor,
    scale: torch.Tensor,
    eps: float = 1e-6,
    backend: str = "auto",
    *,
    config: tuple[int, int, int] | None = None,
    exact_rounding: bool = False,
    pdl: bool = False,
):
    """x, y [M, K]; gate, shift, scale [K] → (x + gate·y [M, K] in x's dtype, fp8 [M, K], float32 scales [M]).
    The gated residual add of one sub-block fused with the next sub-block's norm, modulation and quantization.
    config: (rows_per_program, block_k, num_warps); None = DEFAULT_CONFIGS["residual_ln_mod_quant"]."""
    _check_2d("residual_ln_mod_quant x", x)
    _check_2d("residual_ln_mod_quant y", y)
    K = x.shape[1]
    if y.shape != x.shape:
        raise ValueError(f"residual_ln_mod_quant: y shape {tuple(y.shape)} != x shape {tuple(x.shape)}")
    for name, t in (("gate", gate), ("shift", shift), ("scale", scale)):
        if t.shape != (K,):
            raise ValueError(f"residual_ln_mod_quant: {name} must have shape ({K},), got {tuple(t.shape)}")
    config = _resolve_config("residual_ln_mod_quant", config)
    if not use_triton("residual_ln_mod_quant", backend, x.device):
        return residual_ln_mod_quant_ref(x, y, gate, shift, scale, eps)
    M = x.shape[0]
    xo = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    q = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(M, dtype=torch.float32, device=x.device)
    grid, meta = _launch(config, M, K, _hw_cast(x, exact_rounding), pdl_launch(pdl, x.device))
    _residual_ln_mod_quant_kernel[grid](
        x,
        y,
        gate.contiguous(),
        shift.contiguous(),
        scale.contiguous(),
        xo,
        q,
        s,
        M,
        K,
        x.stride(0),
        y.stride(0),
        eps,
        **meta,
    )
    return xo, q, s


def swiglu_quant(gu: torch.Tensor, backend: str = "auto", *, config: tuple[int, int, int] | None = None,
                 exact_rounding: bool = False, pdl: bool = False):
    """gu [M, 2F] = [gate | up] → (fp8 [M, F], float32 scales [M]).
    config: (rows_per_program, block_k, num_warps), block_k tiling F; None = DEFAULT_CONFIGS["swiglu_quant"]."""
    _check_2d("swiglu_quant gu", gu)
    if gu.shape[1] % 2:
        raise ValueError(f"swiglu_quant: last dim must be even ([gate | up]), got {gu.shape[1]}")
    config = _resolve_config("swiglu_quant", config)
    if not use_triton("swiglu_quant", backend, gu.device):
        return swiglu_quant_ref(gu)
    M, F = gu.shape[0], gu.shape[1] // 2
    q = torch.empty((M, F), dtype=torch.float8_e4m3fn, device=gu.device)
    s = torch.empty(M, dtype=torch.float32, device=gu.device)
    grid, meta = _launch(config, M, F, _hw_cast(gu, exact_rounding), pdl_launch(pdl, gu.device))
    _swiglu_quant_kernel[grid](gu, q, s, M, F, gu.stride(0), **meta)
    return q, s


def quant_rows(x: torch.Tensor, backend: str = "auto", *, config: tuple[int, int, int] | None = None,
               exact_rounding: bool = False, pdl: bool = False):
    """x [M, K] → (fp8 [M, K], float32 scales [M]).
    config: (rows_per_program, block_k, num_warps); None = DEFAULT_CONFIGS["quant_rows"]."""
    _check_2d("quant_rows x", x)
    config = _resolve_config("quant_rows", config)
    if not use_triton("quant_rows", backend, x.device):
        return quant_rows_ref(x)
    M, K = x.shape
    q = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(M, dtype=torch.float32, device=x.device)
    grid, meta = _launch(config, M, K, _hw_cast(x, exact_rounding), pdl_launch(pdl, x.device))
    _quant_rows_kernel[grid](x, q, s, M, K, x.stride(0), **meta)
    return q, s
