"""A job's result file and log: the header every result starts with, sealed atomic writes, reads."""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from shapewise.execution import gpuslots, jobprocess
from shapewise.jobs.device import gpu_identity, job_cpu_affinity
from shapewise.provenance import provenance
from shapewise.provenance.identity import identity
from shapewise.provenance.inventory import job_environment


def log(message):
    stamp = datetime.now().strftime("%H:%M:%S")
    print(f"[{stamp}] {message}", flush=True)


def now_iso():
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def header(step, row, device, args=None):
    """The fields every result file starts with: what it measured (`identity`: the row and the implementation
    and environment digests the job was given as --impl-digest / --env-digest), where (`environment`, `gpu`)
    on which CPU cores (`cpu_affinity`) and when (`started`; `finished` is added by write_result)."""
    return {
        "step": step,
        "shape": row["id"] if row else None,
        "row": row,
        "identity": identity(row, getattr(args, "impl_digest", None), getattr(args, "env_digest", None)),
        "device": device,
        "environment": job_environment(device, jobprocess.process_record()),
        "gpu": gpu_identity(device),
        "cpu_affinity": job_cpu_affinity(getattr(args, "threads", None)),
        "started": now_iso(),
        "_t0": time.perf_counter(),
    }


def partial_path(path):
    """Where write_result writes `path` before moving it into place: beside it, under a name of fixed length,
    so the longest file name of a row does not grow with it (shapewise.inputs.manifest.id_length_limit)."""
    path = Path(path)
    return path.with_name(f".{hashlib.sha256(path.name.encode()).hexdigest()[:16]}.partial")


def write_result(path, result):
    """Write `result` as JSON, sealed with the digest of its content (shapewise.provenance.provenance.seal),
    atomically."""
    t0 = result.pop("_t0", None)
    result["finished"] = now_iso()
    slot = gpuslots.held()
    if slot is not None and isinstance(result.get("gpu"), dict) and "lock" in result["gpu"]:
        result["gpu"]["lock"] = slot.record()  # as held at the end: a job that stopped holding its GPU alone says when
        # its GPU work's end in milliseconds (`finished` has whole seconds: a job whose alone part began and ended
        # within one second would seem to end before it began, beside the job that shared the GPU until then)
        result["gpu"]["lock"]["ended"] = gpuslots.now_ms()
    if isinstance(result.get("gpu"), dict) and torch.cuda.is_initialized():
        # what this job's allocator held at its peak: the measure of the estimate its lock's parts came from
        result["gpu"]["peak_reserved_bytes"] = torch.cuda.max_memory_reserved()
        result["gpu"]["peak_allocated_bytes"] = torch.cuda.max_memory_allocated()
    if t0 is not None:
        result["duration_s"] = round(time.perf_counter() - t0, 3)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    content = json.loads(json.dumps(result, default=_json_default))  # what a reader gets back, then its digest
    tmp = partial_path(path)
    tmp.write_text(json.dumps(provenance.seal(content), indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)
    log(f"wrote {path}")


def _json_default(obj):
    if isinstance(obj, (torch.dtype, torch.device)):
        return str(obj)
    if isinstance(obj, tuple):
        return list(obj)
    raise TypeError(f"not JSON serializable: {type(obj).__name__}")


def read_json(path):
    """An earlier job's result; a damaged one (not JSON, or edited after its job sealed it:
    shapewise.provenance.provenance.result_file_problem) stops this job naming the file and the command that redoes it.
    A result without a digest is taken as it is."""
    problem = provenance.result_file_problem(path)
    if problem:
        row = Path(path).stem
        raise SystemExit(f"{path} {problem}; regenerate it with `snakemake --cores all --forcerun {path}` (a row's "
                         f"results: `snakemake --cores all --forcerun $(shapewise targets {row})`)")
    with open(path) as fh:
        return json.load(fh)


def resource_skip_reason(preflight, which):
    """Why the preflight result says `which` model does not fit, in its own words where it gave some."""
    model = preflight["models"][which]
    if model.get("reason"):
        return f"resource skip: {model['reason']}"
    budget = model.get("budget_bytes", preflight.get("budget_bytes"))
    return f"resource skip: estimated {model['estimate_bytes']} bytes > budget {budget} bytes"


def fail(message):
    print(f"error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(1)
