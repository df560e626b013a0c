"""How the jobs that shared a GPU used its memory: each one's parts, estimate and measured peak, and the worst moment.

Usage: python -m benchmarks.memory_parts RESULTS_DIR [OUT.json]

Per result of a job that shared its GPU (its lock's `mode` shared, or a job that prepared sharing it until
`shared_until`, then held it alone: config gpu_prepare_shared): the step, the row, the shares it held
(`share_slots`, else one), the estimate they came from (its row's preflight `job_bytes[step]`,
shapewise.execution.gpuslots.memory_parts) and its allocator's peaks (`gpu.peak_allocated_bytes`, what its tensors
took, the estimate's measure; `gpu.peak_reserved_bytes`, what it held with its cache; neither counts the CUDA
context), with the jobs whose allocated peak went above their estimate. Then, per GPU, the moment the jobs holding
it at once had the largest summed estimate, and the largest summed reserved peak of jobs holding it at once (peaks
need not coincide: an upper bound of what was held together), against the GPU's memory.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchmarks.common import write_json
from shapewise.execution import gpuslots


def _load(path):
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def sharers(results_dir):
    """One entry per result of a job that shared its GPU, and {row id: preflight} of the run."""
    results_dir = Path(results_dir)
    preflights, jobs = {}, []
    for path in sorted(results_dir.rglob("*.json")):
        if any(part.startswith("report") for part in path.relative_to(results_dir).parts[:-1]):
            continue
        data = _load(path)
        if not data or "step" not in data:
            continue
        if data["step"] == "preflight":
            preflights[(data.get("row") or {}).get("id")] = data
        lock = (data.get("gpu") or {}).get("lock") or {}
        if (lock.get("mode") == gpuslots.SHARED and not lock.get("shared_since")) or lock.get("alone_since"):
            jobs.append((path, data))
    out = []
    for path, data in jobs:
        row = (data.get("row") or {}).get("id")
        lock = data["gpu"]["lock"]
        estimate = ((preflights.get(row) or {}).get("job_bytes") or {}).get(data["step"])
        # a job that prepared sharing: its peak until then (its result's own is its last timed round's)
        peak = lock["shared_peak_allocated_bytes"] if lock.get("alone_since") else data["gpu"].get("peak_allocated_bytes")
        out.append({"job": str(path.relative_to(results_dir)), "step": data["step"], "row": row,
                    "gpu": data["gpu"].get("uuid"), "parts": len(lock.get("share_slots") or [0]),
                    "parts_because": lock.get("parts_because"), "estimate_bytes": estimate,
                    "peak_allocated_bytes": peak, "peak_reserved_bytes": data["gpu"].get("peak_reserved_bytes"),
                    "peak_over_estimate": None if not estimate or peak is None else round(peak / estimate, 3),
                    "start": gpuslots._parse_time(lock["acquired"]),
                    "end": gpuslots._parse_time(lock.get("shared_until") or data["finished"])})
    totals = {p.get("environment", {}).get("cuda_visible_devices"): p.get("total_bytes") for p in preflights.values()}
    return out, preflights, totals


def worst_moments(jobs):
    """Per GPU: the largest summed estimate and the largest summed peak over the jobs holding it at one moment."""
    by_gpu = {}
    for job in jobs:
        by_gpu.setdefault(job["gpu"], []).append(job)
    out = {}
    for gpu, recs in by_gpu.items():
        best = {"estimate_bytes": (0, []), "peak_reserved_bytes": (0, [])}
        for t in sorted({r["start"] for r in recs}):
            now = [r for r in recs if r["start"] <= t < r["end"]]
            for key in best:
                total = sum(r[key] or 0 for r in now)
                if total > best[key][0]:
                    best[key] = (total, sorted(r["job"] for r in now))
        out[gpu] = {f"most_{key}": value for key, (value, _) in best.items()}
        out[gpu].update({f"jobs_at_most_{key}": names for key, (_, names) in best.items()})
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument("results")
    p.add_argument("out", nargs="?", help="JSON file to write (default: print only)")
    args = p.parse_args()
    jobs, _, totals = sharers(args.results)
    summary = {"results": args.results, "gpu_total_bytes": totals,
               "jobs": len(jobs), "jobs_of_several_parts": sum(j["parts"] > 1 for j in jobs),
               "peak_above_estimate": [j["job"] for j in jobs if (j["peak_over_estimate"] or 0) > 1],
               "largest_peak_over_estimate": max((j["peak_over_estimate"] or 0 for j in jobs), default=None),
               "worst_moments": worst_moments(jobs),
               "per_job": [{k: v for k, v in j.items() if k not in ("start", "end", "gpu")} for j in jobs]}
    print(json.dumps({k: v for k, v in summary.items() if k != "per_job"}, indent=1))
    if args.out:
        write_json(args.out, summary)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
