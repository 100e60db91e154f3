"""Compile the cache kernels ahead of time for an H100/H200 (sm_90) target, with no GPU present.

Run as a script WITHOUT ``TRITON_INTERPRET`` (the interpreter replaces ``triton.jit`` functions at
import time). Triton lowers each kernel to PTX and assembles it with the ``ptxas`` its wheel
carries, so compile-only failures (unsupported ops, type errors that the interpreter tolerates)
show on CPU CI. Prints one JSON object: variant name -> counts of the PTX instructions we rely on.
"""

from __future__ import annotations

import json
import re
import sys
from collections import Counter

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from vivant.kernels import delta_rotate, fused_quant, qkv_ring, split_kv

TARGET = GPUTarget("cuda", 90, 32)
# The 57b head: D=128, rope_dims (44, 42, 42) -> 64 pairs, 22 t-band pairs.
ROTATE_CONST = {"HALF": 64, "DT2": 22, "BLOCK_M": 16, "BLOCK_P": 64}
INSTRUCTIONS = re.compile(r"^\s*((?:div|cvt|sin|cos)\.[\w.]+)", re.M)


def compile_kernel(fn, pointers: dict[str, str], scalars: dict[str, str], const: dict) -> str:
    sig = dict(pointers)
    sig.update(scalars)
    for name in fn.arg_names:
        if name.startswith("s_"):
            sig[name] = "i32"
    for name in const:
        sig[name] = "constexpr"
    missing = [n for n in fn.arg_names if n not in sig]
    if missing:
        raise SystemExit(f"signature misses kernel arguments {missing}")
    sig = {n: sig[n] for n in fn.arg_names}
    src = ASTSource(fn=fn, signature=sig, constexprs={(fn.arg_names.index(k),): v for k, v in const.items()})
    compiled = triton.compile(src, target=TARGET)
    if not compiled.asm.get("cubin"):
        raise SystemExit("ptxas produced no cubin")
    return compiled.asm["ptx"]


def pdl_report(fn, types: dict[str, str], const: dict) -> dict[str, int]:
    """Compile with PDL=True; where the grid-dependency wait sits relative to the first global access."""
    sig = {n: ("constexpr" if n in const else types[n]) for n in fn.arg_names}
    src = ASTSource(fn=fn, signature=sig, constexprs={(fn.arg_names.index(k),): v for k, v in const.items()})
    ptx = triton.compile(src, target=TARGET).asm["ptx"]
    lines = [ln.strip() for ln in ptx.splitlines()]
    first = {op: next((i for i, ln in enumerate(lines) if re.match(r"(@!?%\w+\s+)?" + re.escape(op), ln)), -1)
             for op in ("griddepcontrol.wait", "ld.global", "st.global")}
    return {f"line_of_first_{k}": v for k, v in first.items()}


def main() -> int:
    report = {}
    row_types = {"x_ptr": "*bf16", "y_ptr": "*bf16", "gate_ptr": "*bf16", "shift_ptr": "*bf16", "scale_ptr": "*bf16",
                 "xo_ptr": "*bf16", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32", "M": "i32", "K": "i32",
                 "stride_x": "i32", "stride_y": "i32", "eps": "fp32"}
    report["pdl residual_ln_mod_quant"] = pdl_report(
        fused_quant._residual_ln_mod_quant_kernel, row_types,
        {"ROWS": 1, "BLOCK_K": 8192, "ONE_TILE": True, "HW_CAST": True, "PDL": True})
    ring_types = {"qkv_ptr": "*bf16", "qw_ptr": "*bf16", "kw_ptr": "*bf16", "cos_ptr": "*fp32", "sin_ptr": "*fp32",
                  "slot_ptr": "*i64", "q_out": "*bf16", "kc_ptr": "*bf16", "vc_ptr": "*bf16", "stride_tok": "i32",
                  "H": "i32", "eps": "fp32"}
    combine_types = {"o_ptr": "*bf16", "lse_ptr": "*fp32", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32", "H": "i32",
                     "so_p": "i32", "so_h": "i32", "so_n": "i32", "sl_p": "i32", "sl_h": "i32"}
    report["pdl combine_quant"] = pdl_report(
        split_kv._combine_quant_kernel, combine_types,
        {"SPLITS": 4, "BLOCK_H": 16, "D": 128, "OUT_DTYPE": triton.language.bfloat16, "HW_CAST": True, "PDL": True})
    report["pdl qkv_ring"] = pdl_report(qkv_ring._qkv_ring_kernel, ring_types,
                                        {"D": 128, "BLOCK_H": 16, "HW_CAST": True, "PDL": True})
    ptx = compile_kernel(qkv_ring._qkv_ring_kernel, {k: v for k, v in ring_types.items() if k not in ("H", "eps")},
                         {"H": "i32", "eps": "fp32"}, {"D": 128, "BLOCK_H": 16, "HW_CAST": True, "PDL": False})
    report["qkv_ring bf16"] = Counter(INSTRUCTIONS.findall(ptx))
    for cache in ("*bf16", "*fp32"):
        ptx = compile_kernel(
            delta_rotate._delta_rotate_kernel,
            {"kc_ptr": cache, "slot_ptr": "*i64", "inv_t_ptr": "*fp32"},
            {"delta": "fp32", "M": "i32"},
            {**ROTATE_CONST, "ROUND_BF16": cache == "*bf16"},
        )
        report[f"delta_rotate {cache[1:]}"] = Counter(INSTRUCTIONS.findall(ptx))
    json.dump(report, sys.stdout)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
