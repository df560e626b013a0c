"""Per-row profile table of a committed report: median, target, floor, GPU time, top kernels per forward, slow rounds.

Usage: python -m benchmarks.report_rows [REPORT_DIR]   (default: reports/h200)

For each row: the optimized median and the row's target (summary.csv), the roofline floor (the timing job's), the
GPU time per forward in the profile capture (device kernel and copy time / captured calls), and the three kernels
that took the most device time per forward; the timing rounds whose optimized median lies more than SLOW_ROUND
times above the fastest round's (a disturbed host shows there first). Reads only the report's own files
(summary.csv, data/timing, data/profile).
"""
from __future__ import annotations

import argparse
import csv
import json
from pathlib import Path

from shapewise.candidates import SHAPEWISE
from shapewise.report.compare import candidate_of

HOST_ROWS = ("aten::", "Activity Buffer", "cudaDeviceSynchronize")
SLOW_ROUND = 1.2


def fmt_ms(ms):
    return f"{ms * 1000:.3g} µs" if ms < 1 else f"{ms:.4g} ms"


def main():
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument("report_dir", nargs="?", default="reports/h200")
    report = Path(p.parse_args().report_dir)
    with open(report / "summary.csv", newline="") as f:
        # shapewise's own rows (a report with candidates has theirs too, summary.csv's `candidate` column)
        summary = {r["id"]: r for r in csv.DictReader(f) if candidate_of(r) == SHAPEWISE}
    print("| row | route | median | target | floor | median / floor | GPU time per forward (profile) "
          f"| top kernels per forward | rounds > {SLOW_ROUND}× the fastest (fastest) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for shape, row in summary.items():
        n = int(shape.rsplit("-", 1)[1])
        timing = json.loads((report / "data/timing" / f"{shape}.json").read_text())
        profile = json.loads((report / "data/profile" / shape / "kernels.json").read_text())
        calls = profile["capture"]["calls"]
        with open(report / "data/profile" / shape / "kernels.csv", newline="") as f:
            kernels = [k for k in csv.DictReader(f) if not k["name"].startswith(HOST_ROWS)]
        kernels.sort(key=lambda k: -float(k["total_us"]))
        busy_ms = sum(float(k["total_us"]) for k in kernels) / calls / 1000
        median = timing["optimized"]["median_ms"]
        floor = timing["roofline"]["floor_ms"]
        top = "; ".join(f"`{k['name'][:44]}` {fmt_ms(float(k['total_us']) / calls / 1000)} "
                        f"({int(k['calls']) // calls}×)" for k in kernels[:3])
        rounds = timing["optimized"].get("round_medians_ms") or []
        slow = (f"{sum(r > SLOW_ROUND * min(rounds) for r in rounds)} of {len(rounds)} ({fmt_ms(min(rounds))})"
                if rounds else "n/a")
        route = row["route"].split(" (")[0]
        print(f"| {n} | {route} | {fmt_ms(median)} | {fmt_ms(float(row['target_ms']))} | {fmt_ms(floor)} | "
              f"{median / floor:.1f}× | {fmt_ms(busy_ms)} | {top} | {slow} |")


if __name__ == "__main__":
    main()
