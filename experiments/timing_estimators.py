"""How far each model's figure moves between two timing runs under several estimators (issue #14).

Usage: python -m experiments.timing_estimators OLD NEW
OLD and NEW are results directories (their timing/*.json), e.g. the two runs in
experiments/h200/session6/repro-timing-runs.tgz (`tar xzf` it: run1 and results). For each estimator, it prints
the number of official rows 1-13 whose reference moved at most 5 % and whose optimized model moved at most 3 %,
and each row's reference change.
"""
from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import numpy as np

ESTIMATORS = {
    "median of all calls": lambda m: m["median_ms"],
    "minimum round median": lambda m: min(m["round_medians_ms"]),
    "25th percentile of round medians": lambda m: float(np.percentile(m["round_medians_ms"], 25)),
    "10th percentile of calls": lambda m: float(np.percentile(m["times_ms"], 10)),
    "25th percentile of calls": lambda m: float(np.percentile(m["times_ms"], 25)),
    "median of the faster half of rounds":
        lambda m: statistics.median(sorted(m["round_medians_ms"])[:len(m["round_medians_ms"]) // 2]),
}
ROWS = [f"official-{i:02d}" for i in range(1, 14)]


def load(results_dir, row):
    return json.loads((Path(results_dir) / "timing" / f"{row}.json").read_text())


def main(old, new):
    for name, estimate in ESTIMATORS.items():
        changes = {}
        for model in ("reference", "optimized"):
            changes[model] = [estimate(load(new, r)[model]) / estimate(load(old, r)[model]) - 1 for r in ROWS]
        ref_ok = sum(abs(c) <= 0.05 for c in changes["reference"])
        opt_ok = sum(abs(c) <= 0.03 for c in changes["optimized"])
        print(f"{name:38s} reference within 5 %: {ref_ok}/13, optimized within 3 %: {opt_ok}/13; reference: "
              + " ".join(f"{c * 100:+.1f}" for c in changes["reference"]))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
