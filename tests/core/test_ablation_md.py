"""bench/ablation_md.py: the ablation table at the head of docs/BENCHMARKS.md, from a synthetic GPU document (a test
input, never committed under bench/results/) shaped as bench/ablation.py writes it."""

from __future__ import annotations

import json

from vivant.bench.ablation import ROWS
from vivant.bench.ablation_md import LABELS, fair_ratios, head_section, latest, section

MS = {"baseline": 480.0, "optimized": 100.0, "whole_window": 124.0, "bf16_gemm": 151.0, "heuristic_gemm": 104.0,
      "residual_after_gemm": 102.7, "unfused_norm": 112.0,
      "no_cuda_graphs": 170.0, "no_split_kv": 103.0}


def _doc() -> dict:
    rows = []
    for name in ROWS:
        r = {"row": name, "ms": MS[name], "p99_ms": MS[name] * 1.05, "x_optimized": MS[name] / 100.0,
             "numerics": {"chunks": 28, "max_rel_rms": 0.0 if name == "baseline" else 0.031,
                          "median_rel_rms": 0.0 if name == "baseline" else 0.012}}
        rows.append(r)
    rows[2]["note"] = "run without CUDA graphs: under graphs it failed (RuntimeError: x)"
    per = {"graph_us_per_call": 6.5, "do_bench_us_per_call": 9.0, "graph_ms_per_chunk": 1.56, "do_bench_ms_per_chunk": 2.2}
    ww = {"graph_us_per_call": 95.0, "do_bench_us_per_call": 120.0, "graph_ms_per_chunk": 22.8,
          "do_bench_ms_per_chunk": 28.8}
    return {"preset": "57b", "tp": 4, "rank": 0, "date": "2026-12-02", "chunks": 20, "warmup": 8,
            "machine": {"device": "cuda", "gpu": "NVIDIA H200"},
            "command": "vivant bench step --ablation --preset 57b --tp 4",
            "reference": "the baseline row: the float parts; numerics = ...", "rows": rows,
            "ring": "bf16",
            "policy_kernels": {"calls_per_chunk": 240, "shapes": {"tokens": 757, "heads": 16, "head_dim": 128,
                                                                   "slots": 5788},
                               "bf16": {"ring_write": per, "whole_window_call": ww, "whole_window_function": ww},
                               "fp8": {"ring_write": per, "whole_window_call": ww, "whole_window_function": ww}},
            "memory": {"context_bytes": 0.6e9, "weights_bytes": 15.2e9, "ring_bytes": 1.45e9, "read_image_bytes": 2.8e9,
                       "activations_peak_bytes": 0.5e9, "graphs_reserved_bytes": 0.3e9, "served_estimate_bytes": 20.85e9,
                       "process_peak_reserved_bytes": 52e9,
                       "headroom_bytes": {"h100_80gb": 59.15e9, "h200_141gb": 120.15e9}}}


def test_table_has_every_row_with_its_numbers():
    text = section(_doc(), "ablation_57b_tp4_rank0_h200_2026-12-02.json")
    for name in ROWS:
        assert LABELS[name] in text, f"row {name} missing"
    assert "| **optimized (served)** | **100.0** | 105.0 | 1.00× | 3.10 % max, 1.20 % median (28 chunks) |" in text
    assert "| 124.0 | 130.2 | 1.24× |" in text
    assert "run without CUDA graphs" in text
    assert "| eager baseline (float parts, per-call whole-cache work) | 480.0 | 504.0 | 4.80× | reference |" in text
    assert "bench/results/ablation_57b_tp4_rank0_h200_2026-12-02.json" in text
    assert "bf16 ring (served): the ring write 6.5 µs (1.6 ms per chunk), the whole-window call 95.0 µs " \
           "(22.8 ms per chunk), of which the compiled re-rotation of the window 95.0 µs" in text
    assert "; fp8 ring: the ring write 6.5 µs" in text and "compiled re-rotation + re-quantization" in text
    assert "20.9 GB served per rank, leaving 59.1 GB on an 80 GB H100 and 120.2 GB on a 141 GB H200" in text


def test_fair_ratios_quote_each_choice_and_set_the_baseline_apart():
    s = fair_ratios(_doc())
    assert ("the ring 1.24×, FP8 GEMMs 1.51×, the tuned GEMM algorithms 1.04×, the residual in the GEMM epilogue 1.03×, the fused kernels 1.12×, CUDA graphs "
            "1.70×, split-KV attention 1.03×" in s), s
    assert "optimized 100.0 ms per chunk" in s and "The eager baseline is 4.80×" in s


def test_a_failed_row_is_shown_not_dropped():
    doc = _doc()
    doc["rows"][3] = {"row": "bf16_gemm", "error": "OutOfMemoryError: CUDA out of memory"}
    text = section(doc, "a.json")
    assert "| bf16 GEMMs instead of FP8 | failed: OutOfMemoryError: CUDA out of memory |" in text
    assert "FP8 GEMMs" not in fair_ratios(doc), "a failed row has no ratio to quote"


def test_head_section_takes_the_newest_file_or_says_none(tmp_path):
    assert "No ablation run is committed yet" in head_section(tmp_path)
    old, new = _doc(), _doc()
    new["date"] = "2026-12-03"
    (tmp_path / "ablation_57b_tp4_rank0_h200_2026-12-02.json").write_text(json.dumps(old))
    (tmp_path / "ablation_57b_tp4_rank0_h200_2026-12-03.json").write_text(json.dumps(new))
    assert latest(tmp_path).name.endswith("2026-12-03.json")
    assert "(the ablation, 2026-12-03)" in head_section(tmp_path)


def test_cpu_document_without_gpu_parts_renders():
    doc = _doc()
    doc.pop("policy_kernels")
    doc["memory"] = None
    doc["machine"] = {"device": "cpu"}
    text = section(doc, "cpu.json")
    assert "µs" not in text and "H100" not in text and "cpu, optimized 100.0 ms" in text
