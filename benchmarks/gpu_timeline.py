"""Where a run's GPU time went: the jobs that held a GPU alone, back to back, and the time only shared jobs held it.

Usage: python -m benchmarks.gpu_timeline RESULTS_DIR [OUT.json] [--gaps SECONDS]

From the results' lock records (`shapewise.execution.gpuslots.job_intervals`, as `shapewise gpus check` reads them), per
GPU: the span from the first job's start to the last one's end, the summed time of the exclusive intervals (the jobs
that time, and jobs choosing a kernel alone), the gaps between consecutive exclusive intervals, and the time before
the first and after the last exclusive interval. On one GPU the exclusive intervals run one by one, so their sum is
the part of the wall time that more sharing cannot shorten. `--gaps S` also lists each gap longer than S seconds: when
it began (seconds from the GPU's first job), the exclusive job after it, and the shared jobs that held the GPU in it.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchmarks.common import write_json
from shapewise.execution import gpuslots


def _name(rec, results_dir):
    """A result's path below the results directory, e.g. "accuracy/official-14.json"."""
    path = Path(rec["file"])
    try:
        return str(path.relative_to(results_dir))
    except ValueError:
        return str(path)


def gap_list(alone, shared, t0, min_gap_s, results_dir):
    """The gaps between consecutive exclusive intervals longer than `min_gap_s`, each with what held the GPU in it."""
    gaps = []
    for a, b in zip(alone, alone[1:]):
        length = (b["start"] - a["end"]).total_seconds()
        if length <= min_gap_s:
            continue
        inside = sorted((r for r in shared if r["start"] < b["start"] and r["end"] > a["end"]), key=lambda r: r["start"])
        gaps.append({"at_s": round((a["end"] - t0).total_seconds(), 1), "gap_s": round(length, 1),
                     "next_exclusive": _name(b, results_dir),
                     "shared_in_gap": [{"job": _name(r, results_dir), "from_s": round((r["start"] - t0).total_seconds(), 1),
                                        "to_s": round((r["end"] - t0).total_seconds(), 1)} for r in inside]})
    return gaps


def timeline(results_dir, min_gap_s=None):
    by_gpu = {}
    for rec in gpuslots.job_intervals(results_dir):
        by_gpu.setdefault(rec["gpu"], []).append(rec)
    out = {}
    for gpu, recs in by_gpu.items():
        t0, t1 = min(r["start"] for r in recs), max(r["end"] for r in recs)
        alone = sorted((r for r in recs if r["mode"] == gpuslots.EXCLUSIVE), key=lambda r: r["start"])
        gaps = [(b["start"] - a["end"]).total_seconds() for a, b in zip(alone, alone[1:])]
        out[gpu] = {"jobs": len({r["file"] for r in recs}), "span_s": round((t1 - t0).total_seconds(), 1),
                    "exclusive_intervals": len(alone),
                    "exclusive_s": round(sum((r["end"] - r["start"]).total_seconds() for r in alone), 1),
                    "gaps_between_exclusive_s": round(sum(gaps), 1),
                    "longest_gap_s": round(max(gaps, default=0.0), 1),
                    "before_first_exclusive_s": round((alone[0]["start"] - t0).total_seconds(), 1) if alone else None,
                    "after_last_exclusive_s": round((t1 - alone[-1]["end"]).total_seconds(), 1) if alone else None}
        if min_gap_s is not None:
            shared = [r for r in recs if r["mode"] != gpuslots.EXCLUSIVE]
            out[gpu]["gaps_over"] = {"min_gap_s": min_gap_s,
                                     "gaps": gap_list(alone, shared, t0, min_gap_s, Path(results_dir))}
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument("results")
    p.add_argument("out", nargs="?", help="JSON file to write (default: print only)")
    p.add_argument("--gaps", type=float, default=None, metavar="SECONDS",
                   help="also list every gap between exclusive jobs longer than SECONDS, with the shared jobs in it")
    args = p.parse_args()
    summary = timeline(args.results, args.gaps)
    print(json.dumps(summary, indent=1))
    if args.out:
        write_json(args.out, {"results": args.results, "gpus": summary})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
