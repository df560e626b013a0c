"""Accuracy table (markdown) from the log of `pytest -m gpu -s tests/test_gpu_official.py`.

Usage: python -m experiments.gpu_log_table GPU_TESTS.log
One line per (tolerance, row, route): the route taken, trials seen, failed/total elements summed over the
trials (and sampled batch elements for row 14), and the largest absolute error. Only what the log printed
is counted: a case cut off by a time limit shows fewer trials.
"""
from __future__ import annotations

import re
import sys
from collections import defaultdict

LINE = re.compile(r"\[(?P<tol>\w+)\s*\] row=\s*(?P<row>\d+) route=(?P<route>\S+)\s+took=(?P<took>\S+)\s+"
                  r"trial=(?P<trial>\d+) (?P<label>\S+)\s+failed=(?P<failed>\d+)/(?P<total>\d+) "
                  r"max_abs=(?P<max_abs>\S+)")


def main():
    cases = defaultdict(lambda: {"trials": set(), "failed": 0, "total": 0, "max_abs": 0.0, "took": set()})
    for line in open(sys.argv[1]):
        m = LINE.search(line)
        if not m:
            continue
        c = cases[(m["tol"], int(m["row"]), m["route"])]
        c["trials"].add(int(m["trial"]))
        c["failed"] += int(m["failed"])
        c["total"] += int(m["total"])
        c["max_abs"] = max(c["max_abs"], float(m["max_abs"]))
        c["took"].add(m["took"])
    print("| tolerance | row | route | took | trials | failed / total elements | max abs error |")
    print("|---|---|---|---|---|---|---|")
    for (tol, row, route), c in sorted(cases.items()):
        print(f"| {tol} | {row} | {route} | {', '.join(sorted(c['took']))} | {len(c['trials'])} | "
              f"{c['failed']} / {c['total']} | {c['max_abs']:.2e} |")


if __name__ == "__main__":
    main()
