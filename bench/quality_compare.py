"""Two `vivant eval quality --json` reports side by side: a candidate `ref` checkpoint against the shipped one.

    python3 bench/quality_compare.py SHIPPED.json CANDIDATE.json [--out FILE]

Why: a checkpoint changed to suit the served engine (e.g. `vivant train fp8-qat`, worker/train/fp8_qat.py) must not
lose the float32 model's own quality. Each report carries that quality against the ground truth (the reference
path's lip-sync correlation with the audio, PSNR/SSIM against the procedural character drawn from the same audio), so
the comparison needs no new run. Checked: the candidate's float32 lip-sync is at most the gate's relative drop
(`max_lipsync_drop`, 1 %) below the shipped one's — the same allowance `vivant eval quality` gives the served path.
Reported beside it: the PSNR/SSIM change against the ground truth, and the served-vs-float32 figures issue #19's goals
name (docs/reference_model.md, the quality gate): latent relative RMS max ≤ 10 %, frames ≥ 38 dB, lip-sync drop
≤ 1 %, no growth from the first to the last quarter. Exit 1 when the float32 lip-sync falls by more than allowed.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

LATENT_MAX_GOAL = 0.10
PSNR_GOAL_DB = 38.0


def _field(report: dict, key: str, name: str):
    if key not in report:
        raise ValueError(f"{name}: no {key!r}; expected a `vivant eval quality --json` report")
    return report[key]


def _path_reference(report: dict, key: str, name: str) -> float:
    """report[key]["reference"]: the float32 path's figure of a per-path field."""
    value = _field(report, key, name)
    if not isinstance(value, dict) or "reference" not in value:
        raise ValueError(f"{name}: {key!r} has no 'reference' entry; expected a `vivant eval quality --json` report")
    return float(value["reference"])


def served_goals(report: dict, name: str) -> dict:
    """Issue #19's served-engine goals on one report: each figure and whether it holds."""
    latent_max = float(_field(report, "latent_rel_rms_max", name))
    psnr = float(_field(report, "psnr_reference_vs_optimized_db", name))
    drop = float(_field(report, "lip_sync_relative_drop", name))
    first = float(_field(report, "latent_rel_rms_first_quarter", name))
    last = float(_field(report, "latent_rel_rms_last_quarter", name))
    max_drop = float(_field(report, "gate", name).get("max_lipsync_drop", 0.01))
    return {"latent_rel_rms_max": latent_max, "latent_max_ok": latent_max <= LATENT_MAX_GOAL,
            "psnr_db": psnr, "psnr_ok": psnr >= PSNR_GOAL_DB,
            "lip_sync_relative_drop": drop, "lip_sync_ok": drop <= max_drop,
            "latent_rel_rms_quarters": [first, last], "no_quarter_growth": last <= first,
            "gate_passed": bool(report["gate"].get("passed"))}


def compare(shipped: dict, candidate: dict) -> dict:
    """The float32 model's ground-truth figures of both reports, the candidate's change, the verdict on lip-sync,
    and each report's served-engine goals."""
    max_drop = float(_field(shipped, "gate", "shipped").get("max_lipsync_drop", 0.01))
    ls_old = float(_field(shipped, "lip_sync_reference", "shipped"))
    ls_new = float(_field(candidate, "lip_sync_reference", "candidate"))
    ps_old = _path_reference(shipped, "psnr_vs_procedural_db", "shipped")
    ps_new = _path_reference(candidate, "psnr_vs_procedural_db", "candidate")
    ss_old = _path_reference(shipped, "ssim_vs_procedural", "shipped")
    ss_new = _path_reference(candidate, "ssim_vs_procedural", "candidate")
    drop = (ls_old - ls_new) / abs(ls_old)
    return {
        "float32_ground_truth": {
            "lip_sync": {"shipped": ls_old, "candidate": ls_new, "relative_drop": round(drop, 5),
                         "max_relative_drop": max_drop, "ok": drop <= max_drop},
            "psnr_vs_procedural_db": {"shipped": ps_old, "candidate": ps_new, "change": round(ps_new - ps_old, 3)},
            "ssim_vs_procedural": {"shipped": ss_old, "candidate": ss_new, "change": round(ss_new - ss_old, 4)},
        },
        "served_vs_float32": {"shipped": served_goals(shipped, "shipped"),
                              "candidate": served_goals(candidate, "candidate")},
    }


def format_comparison(r: dict) -> str:
    """A few lines for a console (the GPU run shows a step's last lines): shipped → candidate."""
    gt = r["float32_ground_truth"]
    ls, ps, ss = gt["lip_sync"], gt["psnr_vs_procedural_db"], gt["ssim_vs_procedural"]
    a, b = r["served_vs_float32"]["shipped"], r["served_vs_float32"]["candidate"]

    def pct(x: float) -> str:
        return f"{100 * x:.1f} %"

    return "\n".join([
        "float32 model vs ground truth, shipped -> candidate:",
        f"  lip-sync r {ls['shipped']:.4f} -> {ls['candidate']:.4f} (drop {100 * ls['relative_drop']:.2f} %, "
        f"allowed {100 * ls['max_relative_drop']:.0f} %): {'ok' if ls['ok'] else 'WORSE'}",
        f"  PSNR vs procedural {ps['shipped']:.2f} -> {ps['candidate']:.2f} dB ({ps['change']:+.2f}); "
        f"SSIM {ss['shipped']:.4f} -> {ss['candidate']:.4f}",
        "served engine vs float32, shipped -> candidate (issue #19 goals):",
        f"  latent rel RMS max {pct(a['latent_rel_rms_max'])} -> {pct(b['latent_rel_rms_max'])} (<= 10 %: "
        f"{b['latent_max_ok']}); PSNR {a['psnr_db']:.1f} -> {b['psnr_db']:.1f} dB (>= 38: {b['psnr_ok']})",
        f"  lip-sync drop {100 * a['lip_sync_relative_drop']:.2f} -> {100 * b['lip_sync_relative_drop']:.2f} % "
        f"(<= 1 %: {b['lip_sync_ok']}); quarters {pct(a['latent_rel_rms_quarters'][0])} -> "
        f"{pct(a['latent_rel_rms_quarters'][1])} | {pct(b['latent_rel_rms_quarters'][0])} -> "
        f"{pct(b['latent_rel_rms_quarters'][1])} (no growth: {b['no_quarter_growth']}); gate passed "
        f"{a['gate_passed']} -> {b['gate_passed']}",
    ])


def _read(path: str, name: str) -> dict:
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"{name} {path!r}: no such file; expected a `vivant eval quality --json` report")
    try:
        return json.loads(p.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{name} {path!r}: not JSON ({exc}); expected a `vivant eval quality --json` report") from None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("shipped", help="eval quality JSON of the shipped checkpoint")
    p.add_argument("candidate", help="eval quality JSON of the candidate checkpoint")
    p.add_argument("--out", default=None, help="also write the comparison here (JSON)")
    args = p.parse_args(argv)
    try:
        result = compare(_read(args.shipped, "shipped"), _read(args.candidate, "candidate"))
    except ValueError as exc:
        print(f"quality_compare: {exc}", file=sys.stderr)
        return 2
    print(format_comparison(result))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0 if result["float32_ground_truth"]["lip_sync"]["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
