"""The pipeline's runs: a marker per run, and what a report says of the runs that made its results.

The main Snakemake process starts a run once per invocation, before its first job (`begin`, the workflow's onstart
handler in workflow/rules/gpus.smk): it sets the variables its jobs inherit and writes the marker, with the run's
identity (SHAPEWISE_PIPELINE_RUN: host, pid, start), when it started, its GPU pool, its Triton cache directory
and how many compiled kernels that held (0: cold). Every job records the run it belongs to (its environment's
`shapewise_variables`), so a report can say, per run behind its results, how many jobs it ran, on which GPUs, how
they held them, whether the jobs forked from the run's job server, and its wall time: from the marker's start to
the report job's own start when the report is that run's last job, else to the run's last result. Results of
several runs (a partial rerun) are listed run by run; a run whose marker is not here (results made in another
checkout or on another machine) is reported from its results alone.
"""

from __future__ import annotations

import json
import os
from datetime import datetime, timezone
from pathlib import Path

from shapewise import gpuslots, jobserver, paths

MARKERS = paths.ROOT / ".snakemake" / "shapewise-runs"


def begin(pool, argv, environ=None, directory=None):
    """Start a pipeline run in this process, the main Snakemake process: the one place that sets what the run's
    jobs inherit through their environment (`environ`, os.environ), then writes the run's marker. The variables:
    the GPU pool (gpuslots.POOL_VAR: each GPU job locks a GPU of it; not in the shell command, so a different GPU
    count reruns nothing), the SLURM job Snakemake runs in (gpuslots.RUN_SLURM_VAR: a job in another one was
    placed by SLURM), the run's identity (jobserver.RUN_VAR: its jobs fork from its job server) and its Triton
    cache (TRITON_CACHE_DIR: the checkout's, paths.TRITON_CACHE, unless the user set one). Returns the marker."""
    env = os.environ if environ is None else environ
    env[gpuslots.POOL_VAR] = gpuslots.pool_value(pool)
    env[gpuslots.RUN_SLURM_VAR] = env.get("SLURM_JOB_ID", "")
    env[jobserver.RUN_VAR] = jobserver.run_id()
    triton_cache = env.setdefault("TRITON_CACHE_DIR", str(paths.TRITON_CACHE))
    return write_marker(env[jobserver.RUN_VAR], pool, triton_cache, argv, directory)


def marker_path(run, directory=None):
    return Path(directory or MARKERS) / (run.replace(":", "-") + ".json")


def cache_entries(directory):
    """Compiled kernels in a Triton cache directory (one subdirectory each); 0 when it does not exist."""
    try:
        return sum(1 for entry in os.scandir(directory) if entry.is_dir())
    except OSError:
        return 0


def write_marker(run, pool, triton_cache_dir, argv, directory=None, now=None):
    marker = {
        "run": run,
        "host": run.rsplit(":", 2)[0],
        "started": (now or datetime.now(timezone.utc)).isoformat(timespec="milliseconds"),
        "gpus": [{"index": g["index"], "uuid": g.get("uuid"), "name": g.get("name")} for g in pool],
        "triton_cache": {"dir": str(triton_cache_dir), "entries_at_start": cache_entries(triton_cache_dir)},
        "command": list(argv),
    }
    path = marker_path(run, directory)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(marker, indent=1) + "\n")
    os.replace(tmp, path)
    return marker


def read_marker(run, directory=None):
    try:
        return json.loads(marker_path(run, directory).read_text())
    except (OSError, ValueError):
        return None


def _time(text):
    try:
        stamp = datetime.fromisoformat(str(text).replace("Z", "+00:00"))
    except (TypeError, ValueError):
        return None
    return stamp if stamp.tzinfo else None


def summarize(results, report_run=None, report_started=None, directory=None):
    """One record per run behind `results` (result dicts), in the order the runs started: {"run", "jobs",
    "steps" {step: n}, "gpus" [uuid], "lock_modes" {mode: n}, "forked", "fresh", "first_started",
    "last_finished", "marker" (or None), "wall_s", "wall_to", "triton_cache"}. `report_run`/`report_started`: the
    run and start time of the report job, which ends the wall time of its own run. Results that name no run are
    gathered under run None."""
    by_run = {}
    for data in results:
        if not isinstance(data, dict):
            continue
        env = data.get("environment") or {}
        run = (env.get("shapewise_variables") or {}).get(jobserver.RUN_VAR)
        entry = by_run.setdefault(run, {"run": run, "jobs": 0, "steps": {}, "gpus": set(), "lock_modes": {},
                                        "forked": 0, "fresh": 0, "first_started": None, "last_finished": None})
        entry["jobs"] += 1
        step = data.get("step") or "fingerprint"
        entry["steps"][step] = entry["steps"].get(step, 0) + 1
        gpu = data.get("gpu") or {}
        if gpu.get("uuid"):
            entry["gpus"].add(gpu["uuid"])
        mode = (gpu.get("lock") or {}).get("mode")
        if mode:
            entry["lock_modes"][mode] = entry["lock_modes"].get(mode, 0) + 1
        process = env.get("job_process") or {}
        if process.get("started_as") == "fork of the job server":
            entry["forked"] += 1
        elif process:
            entry["fresh"] += 1
        for key, field, pick in (("first_started", "started", min), ("last_finished", "finished", max)):
            stamp = _time(data.get(field))
            if stamp is not None:
                entry[key] = stamp if entry[key] is None else pick(entry[key], stamp)
    out = []
    for run, entry in by_run.items():
        marker = read_marker(run, directory) if run else None
        started = _time(marker["started"]) if marker else entry["first_started"]
        if run is not None and run == report_run and report_started is not None:
            end, wall_to = report_started, "the report job's start"
        else:
            end, wall_to = entry["last_finished"], "its last result"
        entry.update(
            gpus=sorted(entry["gpus"]), marker=marker, wall_to=wall_to,
            wall_s=round((end - started).total_seconds(), 1) if started and end else None,
            started=started.isoformat(timespec="seconds") if started else None,
            triton_cache=(marker or {}).get("triton_cache"),
            first_started=entry["first_started"].isoformat(timespec="seconds") if entry["first_started"] else None,
            last_finished=entry["last_finished"].isoformat(timespec="seconds") if entry["last_finished"] else None)
        out.append(entry)
    return sorted(out, key=lambda e: e["started"] or "")
