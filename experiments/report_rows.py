"""Per-row performance table from a rendered report directory (e.g. reports/h200).

    python -m experiments.report_rows reports/h200

For each row: optimized median, the issue's target, the roofline floor (from the timing job), the GPU time per
forward in the profile capture (sum of device kernel and copy time / captured calls), and the three kernels that
took the most device time per forward. Reads only files listed in the report's provenance.json.
"""

import csv
import json
import sys
from pathlib import Path

# Targets of issue #5 (H200 medians, ms); row 14's is its full-run limit.
TARGET_MS = {1: 0.040, 2: 0.030, 3: 0.030, 4: 0.035, 5: 0.060, 6: 4.0, 7: 0.035, 8: 0.85, 9: 0.045, 10: 0.040,
             11: 0.045, 12: 0.030, 13: 0.40, 14: 3000.0}
HOST_ROWS = ("aten::", "Activity Buffer", "cudaDeviceSynchronize")


def fmt_ms(ms):
    return f"{ms * 1000:.3g} µs" if ms < 1 else f"{ms:.4g} ms"


def main(report_dir):
    report = Path(report_dir)
    summary = {r["id"]: r for r in csv.DictReader(open(report / "summary.csv"))}
    print("| row | route | median | target | floor | median / floor | GPU time per forward (profile) | top kernels per forward |")
    print("|---|---|---|---|---|---|---|---|")
    for shape, row in summary.items():
        n = int(shape.rsplit("-", 1)[1])
        timing = json.loads((report / "data/timing" / f"{shape}.json").read_text())
        profile = json.loads((report / "data/profile" / shape / "kernels.json").read_text())
        calls = profile["capture"]["calls"]
        kernels = [k for k in csv.DictReader(open(report / "data/profile" / shape / "kernels.csv"))
                   if not k["name"].startswith(HOST_ROWS)]
        kernels.sort(key=lambda k: -float(k["total_us"]))
        busy_ms = sum(float(k["total_us"]) for k in kernels) / calls / 1000
        median = timing["optimized"]["median_ms"]
        floor = timing["roofline"]["floor_ms"]
        top = "; ".join(f"`{k['name'][:44]}` {fmt_ms(float(k['total_us']) / calls / 1000)} "
                        f"({int(k['calls']) // calls}×)" for k in kernels[:3])
        route = row["route"].split(" (")[0]
        print(f"| {n} | {route} | {fmt_ms(median)} | {fmt_ms(TARGET_MS[n])} | {fmt_ms(floor)} | "
              f"{median / floor:.1f}× | {fmt_ms(busy_ms)} | {top} |")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "reports/h200")
