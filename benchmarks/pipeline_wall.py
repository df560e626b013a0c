"""The pipeline's wall time here: `snakemake --cores all` in this checkout, timed, in one part or several.

Usage: python -m benchmarks.pipeline_wall OUT_DIR [--fresh] [--budget S] [--shapes official,contract] [--commit SHA]
       [--set KEY=VALUE ...] [--reruns ROW:FIELD=VALUE [--reruns-only]] [-- SNAKEMAKE ARGS...]

Runs Snakemake once, stopping it cleanly (SIGINT, then SIGKILL 30 s later) when `--budget` seconds have passed, and
writes to OUT_DIR (at most eight files, ten with `--reruns`): pipeline-wall.json (this part and every earlier one:
start, end, wall time, exit status, whether the DAG is complete; per step the jobs of the results and the sum of
their own `duration_s`; the runs behind the results, shapewise.execution.runs.summarize), the part's Snakemake log,
`shapewise gpus check --min-gpus 1` of the results, and once the report exists its report.md and summary.csv,
`shapewise compare` of reports/h200 against it, results.tgz (results/ without the profiler traces) and traces.tgz
(the traces: a profile job whose trace is missing runs again). The parts are kept in results/pipeline-wall.json, so a
run in two parts carries them with results/ (both archives unpacked) into the second.

`--reruns ROW:FIELD=VALUE` (a complete run only): then Snakemake twice more, each timed with the jobs it ran
(`reruns` in pipeline-wall.json, their logs beside it): with nothing changed, and with that field of that row of its
manifest set to VALUE (a YAML scalar), the manifest's bytes restored afterwards. With `--reruns-only` the run is not
made again: the two reruns start from the complete run that results/ holds (this machine's, whose last part is in
results/pipeline-wall.json), and OUT_DIR gets pipeline-wall-reruns.json and their logs.

A first part starts from what the checkout holds: `--fresh` removes results/ and .snakemake/ first, so the run
starts cold (its Triton cache is .snakemake/triton-cache unless TRITON_CACHE_DIR is set). Nothing here installs
anything: Snakemake must be importable.
"""
from __future__ import annotations

import argparse
import collections
import json
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from datetime import datetime, timezone
from pathlib import Path

import yaml

from shapewise.inputs import paths
from shapewise.inputs.manifest import load_manifest

ROOT = Path(__file__).resolve().parent.parent
PARTS = ROOT / "results" / "pipeline-wall.json"
KILL_AFTER_S = 30


def _now():
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def run_snakemake(args, extra, log_path):
    command = [sys.executable, "-m", "snakemake", "--cores", "all", "--config", f"shapes={args.shapes}"]
    if args.commit:
        command.append(f"commit={args.commit}")
    command += args.set + extra
    started, t0 = _now(), time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        stopped = False
        try:
            status = proc.wait(timeout=args.budget)
        except subprocess.TimeoutExpired:
            stopped = True
            proc.send_signal(signal.SIGINT)
            try:
                status = proc.wait(timeout=KILL_AFTER_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                status = proc.wait()
    return {"command": command, "started": started, "finished": _now(), "wall_s": round(time.monotonic() - t0, 1),
            "exit_status": status, "stopped_at_budget": stopped, "budget_s": args.budget}


JOB_LINE = re.compile(r"^(?:local)?rule (\w+):$", re.MULTILINE)


def jobs_run(log_path):
    """{rule: jobs} that a Snakemake log shows started."""
    return dict(collections.Counter(JOB_LINE.findall(Path(log_path).read_text(errors="replace"))))


def edited_manifest(text, row_id, field, value):
    """The manifest YAML `text` (a list of rows) with `field` of row `row_id` set to `value` (parsed as YAML),
    re-dumped: the other rows as written, not normalized."""
    data = yaml.safe_load(text)
    matches = [row for row in data if row.get("id") == row_id]
    if len(matches) != 1:
        raise SystemExit(f"pipeline_wall: --reruns names row {row_id!r}, which the manifest has "
                         f"{len(matches)} times")
    matches[0][field] = yaml.safe_load(value)
    return yaml.safe_dump(data, sort_keys=False)


def _rerun(args, extra, out, what, log_name):
    """One more Snakemake run: its wall time, exit status and the jobs it started."""
    part = run_snakemake(args, extra, out / log_name)
    return {"what": what, "wall_s": part["wall_s"], "exit_status": part["exit_status"],
            "jobs": jobs_run(out / log_name)}


def reruns(args, extra, out, edit):
    """The two reruns of a complete run: nothing changed, then one row's field edited (restored after)."""
    row_id, _, assignment = edit.partition(":")
    field, _, value = assignment.partition("=")
    if not (row_id and field and value):
        raise SystemExit(f"pipeline_wall: --reruns takes ROW:FIELD=VALUE, got {edit!r}")
    holders = [ROOT / paths.manifest(name) for name in args.shapes.split(",")  # the selected manifest with the row
               if row_id in {row["id"] for row in load_manifest(ROOT / paths.manifest(name))}]
    if not holders:
        raise SystemExit(f"pipeline_wall: --reruns names row {row_id!r}, in none of {args.shapes}")
    unchanged = _rerun(args, extra, out, "nothing changed", "snakemake-rerun.log")
    original = holders[0].read_bytes()
    holders[0].write_text(edited_manifest(original.decode(), row_id, field, value))
    try:
        edited = _rerun(args, extra, out, f"{row_id} {field}={value}", "snakemake-rerun-edited.log")
    finally:
        holders[0].write_bytes(original)
    return [unchanged, edited]


def job_times(results):
    """{step: {"jobs", "own_s"}} of the result files under results/ (the report's copies left out)."""
    steps = {}
    for path in sorted(results.rglob("*.json")):
        if any(part.startswith("report") for part in path.relative_to(results).parts[:-1]):
            continue
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if not isinstance(data, dict) or "duration_s" not in data:
            continue
        step = steps.setdefault(data.get("step") or "fingerprint", {"jobs": 0, "own_s": 0.0})
        step["jobs"] += 1
        step["own_s"] = round(step["own_s"] + (data["duration_s"] or 0.0), 1)
    return steps


def all_results(results):
    found = []
    for path in sorted(results.rglob("*.json")):
        if any(part.startswith("report") for part in path.relative_to(results).parts[:-1]):
            continue
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(data, dict) and "started" in data:
            found.append(data)
    return found


def recorded_parts():
    """The parts of the run results/ holds, as results/pipeline-wall.json records them (none: [])."""
    return json.loads(PARTS.read_text())["parts"] if PARTS.is_file() else []


def reruns_only(args, extra, out):
    """The two reruns after the complete run whose parts results/pipeline-wall.json records."""
    if not args.reruns or args.fresh:
        raise SystemExit("pipeline_wall: --reruns-only takes --reruns ROW:FIELD=VALUE and no --fresh")
    parts = recorded_parts()
    if not parts or not parts[-1].get("complete"):
        raise SystemExit(f"pipeline_wall: --reruns-only needs a complete run in results/ ({PARTS} says none)")
    done = {"after": parts[-1], "reruns": reruns(args, extra, out, args.reruns)}
    (out / "pipeline-wall-reruns.json").write_text(json.dumps(done, indent=1, default=str) + "\n")
    for rerun in done["reruns"]:
        print(f"rerun, {rerun['what']}: {rerun['wall_s']} s, exit status {rerun['exit_status']}, jobs {rerun['jobs']}")
    return 0 if all(r["exit_status"] == 0 for r in done["reruns"]) else 1


def shell(command, out_path):
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    Path(out_path).write_text(done.stdout + done.stderr + f"\nexit status {done.returncode}\n")
    return done.returncode


def main():
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument("out_dir")
    p.add_argument("--budget", type=float, default=540.0, help="seconds before Snakemake is stopped (default 540)")
    p.add_argument("--shapes", default="official,contract", help="config shapes (default: the GPU default)")
    p.add_argument("--commit", default=None, help="the commit of the tree, for the report (no .git here)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="one more config value of the run (repeatable), e.g. --set gpu_memory_parts=True")
    p.add_argument("--reruns", metavar="ROW:FIELD=VALUE", default=None,
                   help="after a complete run, time a rerun with nothing changed and one with this field edited")
    p.add_argument("--reruns-only", action="store_true",
                   help="only the two reruns of --reruns, after the complete run that results/ already holds")
    p.add_argument("--fresh", action="store_true",
                   help="start cold: remove results/ and .snakemake/ (the run's Triton cache with it) first")
    args, extra = p.parse_known_args()
    extra = [a for a in extra if a != "--"]
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    from shapewise.execution import runs

    if args.reruns_only:
        return reruns_only(args, extra, out)
    if args.fresh:
        for name in ("results", ".snakemake"):
            shutil.rmtree(ROOT / name, ignore_errors=True)
    parts = recorded_parts()
    number = len(parts) + 1
    part = run_snakemake(args, extra, out / f"snakemake-part{number}.log")
    results = ROOT / "results"
    report = results / "report"
    part["complete"] = part["exit_status"] == 0 and (report / "report.md").is_file()
    parts.append(part)
    PARTS.parent.mkdir(parents=True, exist_ok=True)
    PARTS.write_text(json.dumps({"parts": parts}, indent=1) + "\n")
    summary = {"parts": parts, "wall_s_all_parts": round(sum(x["wall_s"] for x in parts), 1),
               "steps": job_times(results), "runs": runs.summarize(all_results(results))}
    for entry in summary["runs"]:
        entry.pop("marker", None)
    if args.reruns and part["complete"]:
        summary["reruns"] = reruns(args, extra, out, args.reruns)
    (out / "pipeline-wall.json").write_text(json.dumps(summary, indent=1, default=str) + "\n")
    shell([sys.executable, "-m", "shapewise", "gpus", "check", "--min-gpus", "1", "results"], out / "gpus-check.txt")
    if (report / "report.md").is_file():
        for name in ("report.md", "summary.csv"):
            (out / name).write_bytes((report / name).read_bytes())
        shell([sys.executable, "-m", "shapewise", "compare", "reports/h200", "results/report"], out / "compare.txt")
    with tarfile.open(out / "results.tgz", "w:gz") as tar:
        tar.add(results, arcname="results", filter=lambda info: None if info.name.endswith("trace.json") else info)
    with tarfile.open(out / "traces.tgz", "w:gz") as tar:  # apart: the part after this one needs them carried too
        for trace in sorted(results.rglob("trace.json")):
            tar.add(trace, arcname=str(trace.relative_to(ROOT)))
    print(f"part {number}: snakemake exit status {part['exit_status']} after {part['wall_s']} s"
          f"{' (stopped at the budget)' if part['stopped_at_budget'] else ''}; all parts {summary['wall_s_all_parts']} s; "
          f"{'complete' if part['complete'] else 'not complete: run again with results/ carried'}")
    for step, times in sorted(summary["steps"].items()):
        print(f"  {step}: {times['jobs']} jobs, {times['own_s']} s of their own work")
    for rerun in summary.get("reruns", []):
        print(f"rerun, {rerun['what']}: {rerun['wall_s']} s, exit status {rerun['exit_status']}, jobs {rerun['jobs']}")
    return 0 if part["complete"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
