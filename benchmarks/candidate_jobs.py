"""A candidate's accuracy, timing and profile jobs on this machine's device, run as the pipeline runs them.

Usage: python -m benchmarks.candidate_jobs [candidate-jobs.json] [--device cuda] [--candidates reference,inaccurate]

Per candidate of `tests/candidates/` (the reference itself, which must pass, and one that must fail), each job as
`shapewise job candidate-<step>` in a process of its own, on a small causal row (8 x 64 tokens, d_model 64, 2 heads,
ffn 128, 2 layers): the job process builds and runs the reference, the candidate's child imports the candidate,
confined (docs/candidates.md). Writes, per candidate and step, the job's status, failure, containment record, the
official comparison (accuracy) and both models' median ms with the speedup (timing). A short timing protocol
(5 warm-up calls, 3 rounds of 20): a check that the jobs run here, not a measurement of the candidate.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.common import parser, write_json
from shapewise import candidates
from shapewise.inputs.manifest import normalize_row

ROW = {"id": "candidate-jobs", "batch_size": 8, "seq_len": 64, "d_model": 64, "num_heads": 2, "ffn_dim": 128,
       "num_layers": 2, "causal": True}
PROTOCOL = {"warmup": 5, "calls": 20, "min_rounds": 3, "max_rounds": 3, "ci_half_width": 0.05, "gc_off": True,
            "cpus": "inherit"}
CASES = Path("tests/candidates")


def job(step, name, device, scratch):
    """One `shapewise job candidate-<step>` of candidate `name`; (exit status, result or None, its output's end)."""
    path = (CASES / f"{name}.py").resolve()
    out = scratch / f"{step}-{name}.json"
    args = ["job", f"candidate-{step}", "--device", device, "--row", json.dumps(normalize_row(ROW)), "--candidate",
            name, "--candidate-path", str(path), "--time-limit", json.dumps({"cpu": 300, "cuda": 120}),
            "--impl-digest", candidates.digest(path), "--out", str(out)]
    if step == "accuracy":
        args += ["--headroom", "0.85", "--chunked",
                 json.dumps({"batch_samples": 2, "query_block": 1024, "query_samples": "all"})]
    elif step == "timing":
        args += ["--headroom", "0.85", "--protocol", json.dumps({"cpu": PROTOCOL, "cuda": PROTOCOL})]
    else:
        args += ["--capture", json.dumps({"cpu": {"warmup": 1, "calls": 1}, "cuda": {"warmup": 1, "calls": 1}}),
                 "--csv", str(scratch / "kernels.csv"), "--trace", str(scratch / "trace.json")]
    # a job outside a pipeline run: its GPU slot is the pool's one GPU (the run's pool, set once per run otherwise)
    env = dict(os.environ, SHAPEWISE_PIPELINE_GPUS=os.environ.get("SHAPEWISE_PIPELINE_GPUS", "0"))
    done = subprocess.run([sys.executable, "-m", "shapewise", *args], cwd=scratch, env=env, capture_output=True,
                          text=True, timeout=600)
    result = json.loads(out.read_text()) if out.exists() else None
    return done.returncode, result, (done.stdout + done.stderr)[-2000:]


def summary(step, result):
    keep = {k: result.get(k) for k in ("status", "failure", "containment")}
    if step == "accuracy":
        keep["official"] = (result.get("aggregate") or {}).get("official")
    if step == "timing":
        keep["median_ms"] = {m: (result.get(m) or {}).get("median_ms") for m in ("reference", "optimized")}
        keep["speedup"] = result.get("speedup")
    return keep


def main():
    p = parser(__doc__, "candidate-jobs.json")
    p.add_argument("--device", default="cuda", help="cuda or cpu")
    p.add_argument("--candidates", default="reference,inaccurate", help="files of tests/candidates/, without .py")
    args = p.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="shapewise-candidate-jobs-"))
    out = {"device": args.device, "row": ROW, "protocol": PROTOCOL, "jobs": {}}
    for name in args.candidates.split(","):
        for step in ("accuracy", "timing", "profile"):
            status, result, tail = job(step, name, args.device, scratch)
            out["jobs"][f"{name}/{step}"] = {"exit": status, **(summary(step, result) if result else {"log": tail})}
            print(f"{name} {step}: exit {status}, {(result or {}).get('status')}", flush=True)
            write_json(args.out, out)


if __name__ == "__main__":
    main()
