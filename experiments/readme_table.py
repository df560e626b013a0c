"""The README's results table, from a report's summary.csv.

Usage: python -m experiments.readme_table [reports/h200]

BEST_PUBLIC_MS is the "best public solution" column of issue #12 (the strongest public solution's median under the
official script and call, one H200); everything else comes from summary.csv. Mask cost is bold above +3 %
(issue #12 item 2). Row 14 has no reference median (the reference does not fit in memory) and one round.
"""
from __future__ import annotations

import csv
import sys
from pathlib import Path

BEST_PUBLIC_MS = {1: 0.129, 2: 0.077, 3: 0.075, 4: 0.082, 5: 0.201, 6: 10.871, 7: 0.107, 8: 1.086, 9: 0.139,
                  10: 0.118, 11: 0.168, 12: 0.090, 13: 0.945, 14: 4261.8}


def sig(x, digits=3):
    """x with `digits` significant digits, at most 3 decimals from 1 up (1.037, 8.985, 3113)."""
    if x >= 1000:
        return f"{x:.0f}"
    if x >= 1:
        return f"{x:.3f}".rstrip("0").rstrip(".") if x < 10 else f"{x:.4g}"
    return f"{x:.{digits}g}"


def pct(x):
    return f"{x * 100:+.1f}".replace("-", "−")


def row_number(r):
    """The official row number of a summary.csv row (official-07 -> 7)."""
    return int(r["id"].rsplit("-", 1)[1])


def row_line(r):
    n = row_number(r)
    opt = float(r["optimized_median_ms"])
    cost = float(r["mask_cost"])
    cost_text = f"**{pct(cost)} %**" if cost > 0.03 else f"{pct(cost)} %"
    if r["reference_median_ms"]:
        ref = sig(float(r["reference_median_ms"]))
        speed = (f"{float(r['speedup']):.3g} [{float(r['speedup_ci_low']):.3g}, "
                 f"{float(r['speedup_ci_high']):.3g}]")
        cost_text += f" [{pct(float(r['mask_cost_ci_low']))}, {pct(float(r['mask_cost_ci_high']))}]"
    else:
        ref, speed = "does not fit", "—"
        cost_text += " (1 round)"
    route = r["route"] if n != 14 else "triton + SDPA, streamed 32×1"
    return (f"| {n} | {route} | {sig(opt)} | {BEST_PUBLIC_MS[n]:g} | {float(r['target_ms']):g} | {ref} | {speed} | "
            f"{cost_text} | {r['failed_elements']} / {r['total_elements']} | {r['strict_failed_elements']} |")


def main(report_dir="reports/h200"):
    rows = list(csv.DictReader(open(Path(report_dir) / "summary.csv")))
    print("| row | route | optimized ms | best public ms | target ms | reference ms | speedup [95 % interval] | "
          "mask cost [95 % interval] | failed / compared (official) | strict failed |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(row_line(r))
    behind = [row_number(r) for r in rows if float(r["optimized_median_ms"]) > BEST_PUBLIC_MS[row_number(r)]]
    print(f"\nrows above the best public median: {behind or 'none'}", file=sys.stderr)


if __name__ == "__main__":
    main(*sys.argv[1:])
