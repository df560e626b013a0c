"""The results table of a committed report's README (reports/h200/README.md), printed from its summary.csv.

Usage: python -m benchmarks.results_table [REPORT_DIR]   (default: reports/h200)

Every column but "best public" comes from the report's summary.csv (its columns are described by the report
itself and by workflow/shapewise/report/report_data.py). "Best public" is the strongest public solution's median under
the official script and call (BEST_PUBLIC). A mask cost above the timing job's limit (`mask_cost.limit` in the row's
data/timing/<id>.json) is bold. Rows without a reference median (the reference does not fit in memory) show "does
not fit" and the mask cost of their single round. Lists on stderr
the rows whose median is above the best public one.

A report with candidates (summary.csv's `candidate` column) gets a second table: per row, each model's median with
its interval, its speedup over the reference timed in its own rounds, and its accuracy; the fastest passing model
of the row in bold.
"""
from __future__ import annotations

import argparse
import csv
import json
import sys
from pathlib import Path

from benchmarks.common import ROOT
from shapewise.candidates import SHAPEWISE
from shapewise.report.compare import candidate_of

BEST_PUBLIC = ROOT / "reports" / "benchmarks" / "best-public-2026-11-29.json"


def best_public_ms():
    return {int(n): ms for n, ms in json.loads(BEST_PUBLIC.read_text())["median_ms"].items()}


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


def mask_cost_limit(report_dir, row_id):
    """The mask cost the row's timing job held it to."""
    timing = json.loads((Path(report_dir) / "data" / "timing" / f"{row_id}.json").read_text())
    return timing["mask_cost"]["limit"]


def row_line(r, best, limit):
    n = row_number(r)
    cost = float(r["mask_cost"])
    cost_text = f"**{pct(cost)} %**" if cost > limit else f"{pct(cost)} %"
    if r["reference_median_ms"]:
        ref = sig(float(r["reference_median_ms"]))
        speed = f"{float(r['speedup']):.3g} [{float(r['speedup_ci_low']):.3g}, {float(r['speedup_ci_high']):.3g}]"
        cost_text += f" [{pct(float(r['mask_cost_ci_low']))}, {pct(float(r['mask_cost_ci_high']))}]"
    else:
        ref, speed = "does not fit", "—"
        cost_text += " (1 round)"
    return (f"| {n} | {r['route']} | {sig(float(r['optimized_median_ms']))} | {best[n]:g} | {float(r['target_ms']):g} "
            f"| {ref} | {speed} | {cost_text} | {r['failed_elements']} / {r['total_elements']} "
            f"| {r['strict_failed_elements']} |")


def model_cell(r):
    """`0.0813 [0.081, 0.082]` ms, `20.7×` speedup, `pass` or `fail 3431 / 5242880`, or why it was not timed."""
    if not r["optimized_median_ms"]:
        return "not timed", "—", r["status"]
    ci = (f" [{sig(float(r['optimized_ci_low_ms']))}, {sig(float(r['optimized_ci_high_ms']))}]"
          if r["optimized_ci_low_ms"] else "")
    speed = f"{float(r['speedup']):.3g}×" if r["speedup"] else "—"
    accuracy = "pass" if r["status"] == "pass" else f"fail {r['failed_elements']} / {r['total_elements']}"
    return f"{sig(float(r['optimized_median_ms']))}{ci}", speed, accuracy


def candidates_table(rows):
    """Lines of the side-by-side table, or [] without candidates."""
    names = list(dict.fromkeys(candidate_of(r) for r in rows))
    if names == [SHAPEWISE]:
        return []
    by = {(r["id"], candidate_of(r)): r for r in rows}
    ids = list(dict.fromkeys(r["id"] for r in rows))
    lines = ["| row | " + " | ".join(f"{n} ms [95 % interval] | {n} speedup | {n} accuracy" for n in names) + " |",
             "|---|" + "---|---|---|" * len(names)]
    for row_id in ids:
        timed = [by[(row_id, n)] for n in names if (row_id, n) in by and by[(row_id, n)]["status"] == "pass"
                 and by[(row_id, n)]["optimized_median_ms"]]
        fastest = candidate_of(min(timed, key=lambda r: float(r["optimized_median_ms"]))) if timed else None
        cells = []
        for n in names:
            median, speed, accuracy = model_cell(by[(row_id, n)]) if (row_id, n) in by else ("—", "—", "—")
            cells += [f"**{median}**" if n == fastest else median, speed, accuracy]
        lines.append(f"| {row_number({'id': row_id})} | " + " | ".join(cells) + " |")
    return lines


def main():
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument("report_dir", nargs="?", default="reports/h200")
    args = p.parse_args()
    with open(Path(args.report_dir) / "summary.csv", newline="") as f:
        every = list(csv.DictReader(f))
    rows = [r for r in every if candidate_of(r) == SHAPEWISE]
    best = best_public_ms()
    print("| row | route | optimized ms | best public ms | target ms | reference ms | speedup [95 % interval] | "
          "mask cost [95 % interval] | failed / compared (official) | strict failed |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(row_line(r, best, mask_cost_limit(args.report_dir, r["id"])))
    behind = [row_number(r) for r in rows if float(r["optimized_median_ms"]) > best[row_number(r)]]
    print(f"\nrows above the best public median: {behind or 'none'}", file=sys.stderr)
    side_by_side = candidates_table(every)
    if side_by_side:
        print()
        print("\n".join(side_by_side))


if __name__ == "__main__":
    main()
