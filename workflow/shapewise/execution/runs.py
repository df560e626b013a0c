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

One run at a time in a checkout: a run that begins while another one's main process still lives on this host (its
marker's run, jobserver.run_alive: same pid and start time) is refused before its first job (RunConflict), since
the two runs' jobs would time beside each other on the same cores and GPUs. Snakemake's own lock refuses this too,
until `snakemake --unlock` removes it.
"""

from __future__ import annotations

import json
import os
import re
from datetime import datetime, timezone
from pathlib import Path

from shapewise.execution import gpuslots, jobserver
from shapewise.inputs import paths

MARKERS = paths.ROOT / ".snakemake" / "shapewise-runs"


class RunConflict(RuntimeError):
    """Another run of this checkout is going on (see the module docstring); the message names it."""


def begin(pool, argv, environ=None, directory=None, memory_parts=True, prepare_shared=True):
    """Start a pipeline run in this process, the main Snakemake process: the one place that sets what the run's
    jobs inherit through their environment (`environ`, os.environ), then writes the run's marker. The variables:
    the GPU pool (gpuslots.POOL_VAR: each GPU job locks a GPU of it; not in the shell command, so a different GPU
    count reruns nothing), the SLURM job Snakemake runs in (gpuslots.RUN_SLURM_VAR: a job in another one was
    placed by SLURM), the run's identity (jobserver.RUN_VAR: its jobs fork from its job server) and its Triton
    cache (TRITON_CACHE_DIR: the checkout's, paths.TRITON_CACHE, unless the user set one), and whether a sharing
    job may take several parts of its GPU (gpuslots.PARTS_VAR, config gpu_memory_parts) and whether a job of a
    step that prepares builds its models sharing its GPU (gpuslots.PREPARE_VAR, config gpu_prepare_shared). Returns
    the marker."""
    env = os.environ if environ is None else environ
    env[gpuslots.POOL_VAR] = gpuslots.pool_value(pool)
    env[gpuslots.RUN_SLURM_VAR] = env.get("SLURM_JOB_ID", "")
    env[jobserver.RUN_VAR] = jobserver.run_id()
    env[gpuslots.PARTS_VAR] = "1" if memory_parts else "0"
    env[gpuslots.PREPARE_VAR] = "1" if prepare_shared else "0"
    triton_cache = env.setdefault("TRITON_CACHE_DIR", str(paths.TRITON_CACHE))
    marker = write_marker(env[jobserver.RUN_VAR], pool, triton_cache, argv, directory)
    others = live_runs(directory, but=marker["run"])  # after writing its own: of two beginning at once, both see
    if others:
        marker_path(marker["run"], directory).unlink(missing_ok=True)
        raise RunConflict(conflict_message(others))
    return marker


def live_runs(directory=None, but=None):
    """The markers of runs other than `but` whose main process lives on this host, oldest first."""
    found = []
    for path in sorted(Path(directory or MARKERS).glob("*.json")):
        try:
            marker = json.loads(path.read_text())
            alive = marker["run"] != but and jobserver.run_alive(marker["run"])
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue  # a marker being written or damaged: no live run to name
        if alive:
            found.append(marker)
    return sorted(found, key=lambda m: str(m.get("started")))


def conflict_message(others):
    """Why a run is refused beside `others` (live runs' markers), and what to do."""
    lines = [("another pipeline run is going on in this checkout: its jobs and this run's would run beside each "
              "other and time each other's load (Snakemake's lock, removed with --unlock, keeps one run at a time):")]
    for m in others:
        pid = str(m["run"]).rsplit(":", 2)[1]
        command = " ".join(map(str, m.get("command") or []))
        lines.append(f"  run {m['run']} (pid {pid}), started {m.get('started')}: {command}")
    lines.append("nothing was run: wait for that run to end (or stop it: kill PID), then run again")
    return "\n".join(lines)


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


# ---- what the run's end says (the workflow's onsuccess and onerror handlers) ------------------------------------

_STARTED = re.compile(r"^(?:local)?rule (?P<rule>[\w-]+):$")
_FAILED = re.compile(r"^Error in rule (?P<rule>[\w-]+):$")
_FINISHED = re.compile(r"^Finished jobid: (?P<jobid>\d+)\b")
_FIELD = re.compile(r"^    (?P<key>log|jobid): (?P<value>.*?)(?: \(check log file\(s\) for error details\))?$")


def stopped_jobs(snakemake_log):
    """The jobs of a run that failed or did not finish, from the text of Snakemake's own log of the run: [{"rule",
    "jobid", "logs" [paths], "state" ("failed" or "did not finish")}] in the order they started."""
    jobs, order, block = {}, [], None
    for line in snakemake_log.splitlines():
        started, failed = _STARTED.match(line), _FAILED.match(line)
        if started or failed:
            block = {"rule": (started or failed)["rule"], "failed": bool(failed), "logs": [], "job": None}
            continue
        if (finished := _FINISHED.match(line)) and finished["jobid"] in jobs:
            jobs[finished["jobid"]]["state"] = None
            continue
        field = _FIELD.match(line) if block is not None else None
        if field is None:
            if not line.startswith("    "):
                block = None
            continue
        if field["key"] == "log":
            block["logs"] = [p.strip() for p in field["value"].split(",") if p.strip()]
        else:
            jobid = field["value"].strip()
            if jobid not in jobs:
                jobs[jobid] = {"rule": block["rule"], "jobid": jobid, "logs": [], "state": "did not finish"}
                order.append(jobid)
            block["job"] = jobs[jobid]
            if block["failed"]:
                block["job"]["state"] = "failed"
        if block["job"] is not None and block["logs"]:
            block["job"]["logs"] = block["logs"]
    return [jobs[j] for j in order if jobs[j]["state"]]


def error_message(snakemake_logs):
    """What the end of a run that stopped says: each job that failed or did not finish with its log under
    results/logs/, and where the run goes on from. `snakemake_logs`: Snakemake's log file of the run, or a list of
    them (what Snakemake hands its onerror handler)."""
    logs = [snakemake_logs] if isinstance(snakemake_logs, (str, os.PathLike)) else list(snakemake_logs or [])
    text = ""
    for path in logs:
        try:
            text += Path(path).read_text(encoding="utf-8", errors="replace")
        except (OSError, TypeError):
            pass
    stopped = stopped_jobs(text)
    lines = [("shapewise: the run did not complete; the results written so far are kept, and "
              "`snakemake --cores all` goes on from them.")]
    if stopped:
        lines.append("Jobs that failed or did not finish (the end of each log says why):")
        width = max(len(f"{j['rule']} ({j['state']})") for j in stopped)
        lines += [f"  {(j['rule'] + ' (' + j['state'] + ')'):<{width}}  {', '.join(j['logs']) or '(no log)'}"
                  for j in stopped]
    else:
        lines.append(f"Each job's log is under {paths.RESULTS}/logs/; Snakemake's own: {', '.join(map(str, logs))}")
    return "\n".join(lines)


def success_message(run=None, directory=None):
    """What the end of a run that finished says: where its report is, when the run (default: this process's,
    jobserver.RUN_VAR) wrote it; None when it did not."""
    html = Path(paths.REPORT_DIR) / paths.REPORT_FILES["html"]
    marker = read_marker(run or os.environ.get(jobserver.RUN_VAR, ""), directory)
    started = _time(marker.get("started")) if marker else None
    if started is None or not html.is_file() or html.stat().st_mtime < started.timestamp():
        return None
    return (f"shapewise: the report is {html} (report.md and summary.csv beside it); "
            f"`shapewise verify {paths.REPORT_DIR}` checks it against its provenance.json")
