"""cuBLASLt's FP8 GEMM with the algorithm chosen by the caller: the product `fp8_gemm.fp8_linear` computes through
`torch._scaled_mm` — y[M, N] = (a[M, K]·sa[M]) @ (w[N, K]·sw[N])ᵀ in bf16, rowwise scales as cuBLASLt's
outer-vector scale mode — with every algorithm cuBLASLt's heuristic offers for the shape listed, not only its first.

Why: torch takes the heuristic's first answer. At the 57b per-rank shapes that is a 128 × 128 tile for every GEMM,
which leaves the QKV GEMM (M = 757, N = 6144: 288 tiles on 132 SMs, 2.18 waves) a third idle in its last wave;
other tiles, cluster shapes or split-K variants may fill the card better. `Fp8Gemm.candidates` lists them; the
caller times them (`tune`) and passes the one it keeps to `Fp8Gemm.__call__`.

The library is the libcublasLt torch itself loaded (found in /proc/self/maps after one `_scaled_mm`), reached
through ctypes: no build step, and the call is captured by CUDA graphs like torch's own (it is issued on torch's
current stream). Problem mapping (cuBLASLt is column-major): D[N, M] = op(A)·B with A = w (K × N, ld K, transposed),
B = a (K × M, ld K), D = y (N × M, ld N) — the "TN" layout Hopper's FP8 kernels require; A's scale is sw (one per
row of op(A)), B's scale is sa.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
from dataclasses import dataclass

import torch
from vivant.kernels.fp8 import quantize_rows_ref

# enum values from cublasLt.h / cublas_api.h / library_types.h (CUDA 13.0)
_CUDA_R_32F, _CUDA_R_16BF, _CUDA_R_8F_E4M3 = 0, 14, 28
_COMPUTE_32F = 68
_OP_N, _OP_T = 0, 1
_DESC_TRANSA, _DESC_TRANSB, _DESC_A_SCALE_PTR, _DESC_B_SCALE_PTR, _DESC_FAST_ACCUM = 3, 4, 17, 18, 25
_DESC_A_SCALE_MODE, _DESC_B_SCALE_MODE = 31, 32
_SCALE_OUTER_VEC_32F = 3
_PREF_MAX_WORKSPACE = 1
_CAP_SPLITK, _CAP_TILE_IDS, _CAP_CUSTOM_MAX, _CAP_STAGES_IDS = 0, 6, 7, 13
_STAGES_AUTO = range(32, 39)  # CUBLASLT_MATMUL_STAGES_{8,16,32,64,128,256,768}xAUTO
_CONFIG_ATTRS = {"id": 0, "tile": 1, "split_k": 2, "reduction": 3, "swizzle": 4, "custom": 5, "stages": 6,
                 "inner_shape": 7, "cluster": 8}
_TILES = {15: "64x64", 17: "64x128", 18: "128x64", 19: "64x256", 20: "128x128", 21: "256x64", 23: "128x256",
          24: "256x128", 26: "64x96", 28: "96x128", 29: "128x160", 30: "160x128", 31: "192x128", 32: "128x192",
          33: "128x96", 116: "64x192", 209: "192x192", 210: "192x256", 232: "256x192", 513: "256x256"}
_CLUSTERS = {2: "1x1", 3: "2x1", 4: "4x1", 5: "1x2", 6: "2x2", 7: "4x2", 8: "1x4", 9: "2x4"}
_DTYPES = {torch.bfloat16: _CUDA_R_16BF, torch.float32: _CUDA_R_32F}


class CublasLtError(RuntimeError):
    pass


class _Algo(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64 * 8)]


class _HeuristicResult(ctypes.Structure):
    _fields_ = [("algo", _Algo), ("workspace", ctypes.c_size_t), ("state", ctypes.c_int), ("waves", ctypes.c_float),
                ("reserved", ctypes.c_int * 4)]


@dataclass(frozen=True)
class Algorithm:
    """One cuBLASLt algorithm for one problem: its 64-byte descriptor, the workspace it needs (bytes), the waves
    cuBLASLt estimates, and its configuration (algorithm id, tile, stages, split-K, cluster, swizzle...) for reading."""

    raw: bytes
    workspace: int
    waves: float
    config: tuple[tuple[str, int], ...]

    def describe(self) -> str:
        c = dict(self.config)
        tile = _TILES.get(c["tile"], f"tile{c['tile']}")
        cluster = _CLUSTERS.get(c["cluster"], f"cl{c['cluster']}")
        return (f"id{c['id']} {tile} cluster {cluster} stages{c['stages']} splitk{c['split_k']} "
                f"swz{c['swizzle']} opt{c['custom']} ws{self.workspace >> 10}K waves{self.waves:.2f}")


def _check(status: int, what: str) -> None:
    if status != 0:
        raise CublasLtError(f"cuBLASLt {what} failed with status {status}")


@functools.cache
def library() -> ctypes.CDLL:
    """The libcublasLt torch loaded in this process (torch loads it lazily: one tiny `_scaled_mm` first)."""
    if not torch.cuda.is_available():
        raise CublasLtError("cuBLASLt needs a CUDA device")
    path = _loaded_path()
    if path is None:
        a = torch.zeros(16, 32, device="cuda").to(torch.float8_e4m3fn)
        one = torch.ones((), device="cuda")
        torch._scaled_mm(a, a.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
        torch.cuda.synchronize()
        path = _loaded_path()
    return ctypes.CDLL(path or "libcublasLt.so.13")


def _loaded_path() -> str | None:
    with open("/proc/self/maps") as f:
        for line in f:
            if "libcublasLt.so" in line:
                return line.split()[-1]
    return None


@functools.cache
def _handle() -> ctypes.c_void_p:
    h = ctypes.c_void_p()
    _check(library().cublasLtCreate(ctypes.byref(h)), "cublasLtCreate")
    return h


def _set(lib_fn, obj, attr: int, value) -> None:
    _check(lib_fn(obj, attr, ctypes.byref(value), ctypes.sizeof(value)), f"set attribute {attr}")


class Fp8Gemm:
    """One FP8 GEMM problem, described to cuBLASLt once: a fp8 [m, k] (rowwise scales sa [m]) times w fp8 [n, k]
    (sw [n]) → [m, n] `out_dtype`, with or without FP8 fast accumulation. `candidates` lists the algorithms the
    heuristic offers; `__call__` runs one of them (the heuristic's first when none is given)."""

    def __init__(self, m: int, n: int, k: int, *, fast_accum: bool, out_dtype: torch.dtype = torch.bfloat16) -> None:
        if out_dtype not in _DTYPES:
            raise ValueError(f"Fp8Gemm out_dtype = {out_dtype}; expected one of {list(_DTYPES)}")
        if min(m, n, k) <= 0 or k % 16 or n % 16:
            raise ValueError(f"Fp8Gemm shape m={m}, n={n}, k={k}: expected positive sizes with n and k multiples of 16")
        self.m, self.n, self.k, self.fast_accum, self.out_dtype = m, n, k, fast_accum, out_dtype
        lib = library()
        self._desc = ctypes.c_void_p()
        _check(lib.cublasLtMatmulDescCreate(ctypes.byref(self._desc), _COMPUTE_32F, _CUDA_R_32F), "MatmulDescCreate")
        for attr, value in ((_DESC_TRANSA, ctypes.c_int32(_OP_T)), (_DESC_TRANSB, ctypes.c_int32(_OP_N)),
                            (_DESC_FAST_ACCUM, ctypes.c_int8(int(fast_accum))),
                            (_DESC_A_SCALE_MODE, ctypes.c_int32(_SCALE_OUTER_VEC_32F)),
                            (_DESC_B_SCALE_MODE, ctypes.c_int32(_SCALE_OUTER_VEC_32F))):
            _set(lib.cublasLtMatmulDescSetAttribute, self._desc, attr, value)
        out = _DTYPES[out_dtype]
        self._layouts = [self._layout(_CUDA_R_8F_E4M3, k, n, k), self._layout(_CUDA_R_8F_E4M3, k, m, k),
                         self._layout(out, n, m, n), self._layout(out, n, m, n)]
        self._alpha, self._beta, self._one = ctypes.c_float(1.0), ctypes.c_float(0.0), ctypes.c_float(1.0)
        # the heuristic reads the scale pointers (their alignment); until a call sets the caller's, these stand in
        self._scales = (torch.ones(n, device="cuda"), torch.ones(m, device="cuda"))
        self._set_scales(*self._scales)
        self._workspace: torch.Tensor | None = None
        self._default: Algorithm | None = None

    def _set_scales(self, a_scale: torch.Tensor, b_scale: torch.Tensor) -> None:
        for attr, t in ((_DESC_A_SCALE_PTR, a_scale), (_DESC_B_SCALE_PTR, b_scale)):
            _set(library().cublasLtMatmulDescSetAttribute, self._desc, attr, ctypes.c_void_p(t.data_ptr()))

    @staticmethod
    def _layout(dtype: int, rows: int, cols: int, ld: int) -> ctypes.c_void_p:
        layout = ctypes.c_void_p()
        _check(library().cublasLtMatrixLayoutCreate(ctypes.byref(layout), dtype, ctypes.c_uint64(rows),
                                                     ctypes.c_uint64(cols), ctypes.c_int64(ld)), "MatrixLayoutCreate")
        return layout

    def candidates(self, *, workspace_bytes: int = 0, count: int = 64) -> list[Algorithm]:
        """The algorithms cuBLASLt's heuristic offers for this problem within `workspace_bytes`, best first by its
        own estimate (at most `count`)."""
        lib = library()
        pref = ctypes.c_void_p()
        _check(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "MatmulPreferenceCreate")
        try:
            _set(lib.cublasLtMatmulPreferenceSetAttribute, pref, _PREF_MAX_WORKSPACE, ctypes.c_uint64(workspace_bytes))
            results = (_HeuristicResult * count)()
            returned = ctypes.c_int(0)
            a, b, c, d = self._layouts
            _check(lib.cublasLtMatmulAlgoGetHeuristic(_handle(), self._desc, a, b, c, d, pref, count, results,
                                                      ctypes.byref(returned)), "MatmulAlgoGetHeuristic")
        finally:
            lib.cublasLtMatmulPreferenceDestroy(pref)
        return [Algorithm(raw=bytes(r.algo), workspace=int(r.workspace), waves=float(r.waves),
                          config=_config(r.algo)) for r in results[:returned.value] if r.state == 0]

    def configurations(self, *, workspace_bytes: int = 0, clusters: tuple[int, ...] = (2, 3, 4, 5, 6, 7, 8, 9),
                       split_k: tuple[int, ...] = (2, 3, 4), limit: int = 2000) -> list[Algorithm]:
        """Every configuration cuBLASLt accepts for this problem (`cublasLtMatmulAlgoCheck`) within
        `workspace_bytes`, beyond the heuristic's one answer: for each algorithm id, each of its tiles (those in
        `_TILES`) × automatic stage counts × custom options × `clusters`; and the heuristic's own configuration with
        each of `split_k`. At most `limit`, deduplicated."""
        lib, h = library(), _handle()
        out = _DTYPES[self.out_dtype]
        types = (_COMPUTE_32F, _CUDA_R_32F, _CUDA_R_8F_E4M3, _CUDA_R_8F_E4M3, out, out)
        ids, n_ids = (ctypes.c_int * 256)(), ctypes.c_int(0)
        _check(lib.cublasLtMatmulAlgoGetIds(h, *types, 256, ids, ctypes.byref(n_ids)), "MatmulAlgoGetIds")
        found: dict[bytes, Algorithm] = {}
        a, b, c, d = self._layouts

        def check(algo: _Algo) -> None:
            result = _HeuristicResult()
            if (len(found) < limit and lib.cublasLtMatmulAlgoCheck(h, self._desc, a, b, c, d, ctypes.byref(algo),
                                                                   ctypes.byref(result)) == 0
                    and result.workspace <= workspace_bytes):
                raw = bytes(algo)
                found.setdefault(raw, Algorithm(raw=raw, workspace=int(result.workspace), waves=float(result.waves),
                                                config=_config(algo)))

        def configured(base: _Algo, **values: int) -> _Algo | None:
            algo = _Algo.from_buffer_copy(bytes(base))
            for name, value in values.items():
                size = 2 if name in ("cluster", "inner_shape") else 4
                buf = (ctypes.c_uint16 if size == 2 else ctypes.c_uint32)(value)
                if lib.cublasLtMatmulAlgoConfigSetAttribute(ctypes.byref(algo), _CONFIG_ATTRS[name], ctypes.byref(buf),
                                                            size) != 0:
                    return None
            return algo

        bases = [_Algo.from_buffer_copy(first.raw) for first in self.candidates(count=1)]
        for algo_id in ids[:n_ids.value]:
            base = _Algo()
            if lib.cublasLtMatmulAlgoInit(h, *types, algo_id, ctypes.byref(base)) == 0:
                bases.append(base)
        for base in bases:  # the heuristic's answer first: its descriptor carries choices the attributes do not name
            tiles = [t for t in _cap_array(base, _CAP_TILE_IDS) if t in _TILES] or [0]
            stages = [s for s in _cap_array(base, _CAP_STAGES_IDS) if s in _STAGES_AUTO] or [0]
            custom_max = _cap_scalar(base, _CAP_CUSTOM_MAX)
            for tile in tiles:
                for stage in stages:
                    for custom in range(custom_max + 1):
                        for cluster in clusters:
                            algo = configured(base, tile=tile, stages=stage, custom=custom, cluster=cluster)
                            if algo is not None:
                                check(algo)
        for first in self.candidates(workspace_bytes=workspace_bytes, count=1):
            base = _Algo.from_buffer_copy(first.raw)
            if _cap_scalar(base, _CAP_SPLITK):
                for splits in split_k:
                    algo = configured(base, split_k=splits)
                    if algo is not None:
                        check(algo)
        return list(found.values())

    def variants(self, *, workspace_bytes: int = 32 << 20, limit: int = 600) -> list[Algorithm]:
        """What tuning times: every configuration (`configurations`) run with no workspace — cuBLASLt then gives it a
        static tile schedule, with no memset of a tile counter before each call (the same tiles, "ssched" in the
        kernel's name, one graph node fewer) — and, where its check asked for more than a tile counter (1 KiB;
        split-K partials), with the workspace it asked for."""
        out = []
        for algo in self.configurations(workspace_bytes=workspace_bytes, limit=limit):
            out.append(dataclasses.replace(algo, workspace=0))
            if algo.workspace > 1024:
                out.append(algo)
        return list({(a.raw, a.workspace): a for a in out}.values())

    def __call__(self, a: torch.Tensor, sa: torch.Tensor, w: torch.Tensor, sw: torch.Tensor,
                 algo: Algorithm | None = None, out: torch.Tensor | None = None,
                 c: torch.Tensor | None = None) -> torch.Tensor:
        """a fp8 [m, k], sa f32 [m], w fp8 [n, k], sw f32 [n] (CUDA, contiguous) → [m, n] `out_dtype`; with `c`
        ([m, n] `out_dtype`, may be `out` itself) the epilogue adds it: out = c + (a·sa) @ (w·sw)ᵀ, rounded once."""
        m, n, k = self.m, self.n, self.k
        checks = [("a", a, (m, k), torch.float8_e4m3fn), ("w", w, (n, k), torch.float8_e4m3fn),
                  ("sa", sa, (m,), torch.float32), ("sw", sw, (n,), torch.float32)]
        if c is not None:
            checks.append(("c", c, (m, n), self.out_dtype))
        for name, t, shape, dtype in checks:
            if tuple(t.shape) != shape or t.dtype != dtype or not t.is_cuda or not t.is_contiguous():
                raise ValueError(f"Fp8Gemm {name}: expected a contiguous CUDA {dtype} tensor of shape {shape}, got "
                                 f"{t.dtype} {tuple(t.shape)} on {t.device}")
        if algo is None:
            if self._default is None:
                found = self.candidates(count=1)
                if not found:
                    raise CublasLtError(f"cuBLASLt offers no algorithm for m={m}, n={n}, k={k}")
                self._default = found[0]
            algo = self._default
        if out is None:
            out = torch.empty(m, n, dtype=self.out_dtype, device=a.device)
        if algo.workspace and (self._workspace is None or self._workspace.numel() < algo.workspace):
            self._workspace = torch.empty(algo.workspace, dtype=torch.uint8, device=a.device)
        lib = library()
        self._set_scales(sw, sa)
        raw = _Algo.from_buffer_copy(algo.raw)
        ws = self._workspace.data_ptr() if algo.workspace else None
        la, lb, lc, ld = self._layouts
        _check(lib.cublasLtMatmul(_handle(), self._desc, ctypes.byref(self._alpha), ctypes.c_void_p(w.data_ptr()), la,
                                  ctypes.c_void_p(a.data_ptr()), lb,
                                  ctypes.byref(self._beta if c is None else self._one),
                                  ctypes.c_void_p((out if c is None else c).data_ptr()), lc,
                                  ctypes.c_void_p(out.data_ptr()), ld,
                                  ctypes.byref(raw), ctypes.c_void_p(ws), ctypes.c_size_t(algo.workspace),
                                  ctypes.c_void_p(torch.cuda.current_stream(a.device).cuda_stream)), "Matmul")
        return out


def _cap_array(algo: _Algo, attr: int) -> list[int]:
    buf, size = (ctypes.c_uint32 * 1024)(), ctypes.c_size_t(0)
    if library().cublasLtMatmulAlgoCapGetAttribute(ctypes.byref(algo), attr, None, ctypes.c_size_t(0),
                                                   ctypes.byref(size)) != 0 or not 0 < size.value <= 4096:
        return []
    if library().cublasLtMatmulAlgoCapGetAttribute(ctypes.byref(algo), attr, buf, size, ctypes.byref(size)) != 0:
        return []
    return list(buf[: size.value // 4])


def _cap_scalar(algo: _Algo, attr: int) -> int:
    value, size = ctypes.c_uint64(0), ctypes.c_size_t(0)
    if library().cublasLtMatmulAlgoCapGetAttribute(ctypes.byref(algo), attr, None, ctypes.c_size_t(0),
                                                   ctypes.byref(size)) != 0 or not 0 < size.value <= 8:
        return 0
    if library().cublasLtMatmulAlgoCapGetAttribute(ctypes.byref(algo), attr, ctypes.byref(value), size,
                                                   ctypes.byref(size)) != 0:
        return 0
    return int(value.value)


def _config(algo: _Algo) -> tuple[tuple[str, int], ...]:
    """The algorithm's configuration attributes (each read at the size cuBLASLt stores it: 2 or 4 bytes)."""
    lib, out = library(), []
    for name, attr in _CONFIG_ATTRS.items():
        size, value = ctypes.c_size_t(0), ctypes.c_uint64(0)
        status = lib.cublasLtMatmulAlgoConfigGetAttribute(ctypes.byref(algo), attr, None, ctypes.c_size_t(0),
                                                          ctypes.byref(size))
        if status == 0 and 0 < size.value <= 8:
            status = lib.cublasLtMatmulAlgoConfigGetAttribute(ctypes.byref(algo), attr, ctypes.byref(value), size,
                                                              ctypes.byref(size))
        out.append((name, int(value.value) if status == 0 else -1))
    return tuple(out)


@dataclass(frozen=True)
class GemmPlan:
    """The algorithm one GEMM shape runs with: `gemm` (rows × n × k, fast accumulation or not) and the `algo` tuning
    chose for it, with the timings that chose it (µs, median of alternated rounds, this GPU)."""

    gemm: Fp8Gemm
    algo: Algorithm
    chosen_us: float
    heuristic_us: float

    @property
    def rows(self) -> int:
        return self.gemm.m

    def __call__(self, a: torch.Tensor, sa: torch.Tensor, w: torch.Tensor, sw: torch.Tensor) -> torch.Tensor:
        return self.gemm(a, sa, w, sw, algo=self.algo)


_TUNED: dict[tuple, GemmPlan | None] = {}


def graph_us(fn, calls: int, reps: int, rounds: int = 1) -> float:
    """µs per call of fn(i), i = 0..calls − 1 (`rounds` times over), replayed in one CUDA graph: the median of
    `reps` replays after a warm-up outside the graph and two untimed replays."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for i in range(calls):
            fn(i)
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(rounds):
            for i in range(calls):
                fn(i)
    for _ in range(2):
        g.replay()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / (calls * rounds))
    del g
    return sorted(times)[len(times) // 2]


def tune(m: int, weights: list[tuple[torch.Tensor, torch.Tensor]], *, fast_accum: bool, margin: float = 0.97,
         finalists: int = 4, rounds: int = 3, limit: int = 600, with_c: bool = False) -> GemmPlan | None:
    """The fastest cuBLASLt configuration for an m-row FP8 GEMM with these weights (w fp8 [n, k], sw [n]; several
    layers' weights, cycled so none is served from L2 by the call before), or None when none beats the heuristic's
    first answer (what torch._scaled_mm runs) by `margin`. Every variant `Fp8Gemm.variants` lists (from at most `limit`
    configurations) is timed once inside a CUDA graph; the `finalists` fastest are timed again
    in `rounds` rounds alternated with the heuristic's. with_c: every call adds its output to itself in place
    (C = D, beta = 1: the O/down GEMMs that add the residual). Cached per process by (device, m, n, k, fast_accum,
    with_c)."""
    w0 = weights[0][0]
    n, k = w0.shape
    key = (torch.cuda.get_device_name(w0.device), m, n, k, fast_accum, with_c)
    if key in _TUNED:
        return _TUNED[key]
    gemm = Fp8Gemm(m, n, k, fast_accum=fast_accum)
    a, sa = quantize_rows_ref(torch.randn(m, k, device=w0.device))
    outs = [torch.zeros(m, n, dtype=gemm.out_dtype, device=w0.device) for _ in weights]

    def timed(algo: Algorithm | None, reps: int) -> float:
        def call(i: int) -> None:
            gemm(a, sa, *weights[i], algo=algo, out=outs[i], c=outs[i] if with_c else None)

        us = graph_us(call, len(weights), reps)
        if with_c:  # every replay added to them: back to zero, outside the timing
            for o in outs:
                o.zero_()
        return us

    def result(algo: Algorithm | None) -> torch.Tensor:
        c = torch.ones(m, n, dtype=gemm.out_dtype, device=w0.device) if with_c else None
        return gemm(a, sa, *weights[0], algo=algo, out=c, c=c).float()

    screened = []
    for algo in gemm.variants(limit=limit):
        try:
            screened.append((timed(algo, 3), algo))
        except (CublasLtError, RuntimeError):  # a configuration cuBLASLt accepts but will not launch here
            continue
    screened.sort(key=lambda p: p[0])
    want = result(None)
    best = []
    for _, algo in screened:  # a configuration that computes something else is never a finalist
        got = result(algo)
        if bool(torch.isfinite(got).all()) and float((got - want).norm() / want.norm()) <= 1e-2:
            best.append(algo)
        if len(best) == finalists:
            break
    heuristic: list[float] = []
    times: list[list[float]] = [[] for _ in best]  # by finalist: one descriptor may run with and without workspace
    for _ in range(rounds):
        heuristic.append(timed(None, 10))
        for t, algo in zip(times, best, strict=True):
            t.append(timed(algo, 10))
    h = sorted(heuristic)[len(heuristic) // 2]
    medians = sorted(((sorted(t)[rounds // 2], algo) for t, algo in zip(times, best, strict=True)),
                     key=lambda p: p[0])
    plan = None
    if medians and medians[0][0] <= margin * h:
        plan = GemmPlan(gemm=gemm, algo=medians[0][1], chosen_us=medians[0][0], heuristic_us=h)
    _TUNED[key] = plan
    return plan
