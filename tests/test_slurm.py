"""The pipeline on a real single-node SLURM, through `--profile profiles/slurm`.

The module fixture installs and starts SLURM with .ci/slurm/start.sh (root and
apt-get needed; skipped elsewhere, but with the env var CI set it fails
instead, so CI cannot silently skip it) and stops it afterwards if it started
it. Each case copies the pipeline into a temporary directory and runs
Snakemake there with the SLURM profile, unchanged except for faster status
polling (a local cluster answers at once; the profile's defaults are meant
for real clusters).

    sudo -E python -m pytest -m slurm tests/test_slurm.py -v     # about 6 minutes on 2 cores
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from checkout import copy_checkout

pytestmark = pytest.mark.slurm

REPO = Path(__file__).resolve().parents[1]
START = REPO / ".ci" / "slurm" / "start.sh"
STOP = REPO / ".ci" / "slurm" / "stop.sh"
STATE = Path(os.environ.get("SHAPEWISE_SLURM_STATE", "/var/lib/shapewise-slurm"))


# The plugin's log line for every sbatch submission (plugin 2.8.0, run_job()).
SUBMITTED = re.compile(
    r"Job (?P<smk>\d+) has been submitted with SLURM jobid (?P<slurm>\d+) "
    r"\(log: (?P<log>\S+)\)\.")

RUN_TIMEOUT = 420  # seconds for one snakemake run; the whole file stays under ~8 min
FAST_POLLING = ("--slurm-init-seconds-before-status-checks", "2",
                "--seconds-between-status-checks", "2")
# The workflow profile (profiles/default) limits GPU jobs to one at a time for
# local runs; under SLURM, SLURM schedules the GPUs (docs/slurm.md).
GPU_QUEUE = ("--resources", "gpu=50")


# ---------------------------------------------------------------- helpers

def _unavailable_reason():
    if not sys.platform.startswith("linux"):
        return "needs Linux"
    if os.geteuid() != 0:
        return "needs root (.ci/slurm/start.sh installs packages and starts daemons)"
    if shutil.which("slurmctld") is None and shutil.which("apt-get") is None:
        return "needs apt-get to install SLURM (or an installed slurmctld/slurmd/munge)"
    if not (REPO / "Snakefile").is_file():
        return "no Snakefile in the checkout"
    return None


def _skip_or_fail(reason):
    if os.environ.get("CI"):
        pytest.fail(f"CI is set, so the SLURM test must run, but: {reason}")
    pytest.skip(reason)


def _pid_alive(name):
    try:
        pid = int((STATE / f"{name}.pid").read_text().strip())
        os.kill(pid, 0)
        return True
    except (OSError, ValueError):
        return False


def _env():
    env = dict(os.environ)
    # The jobs run `python -m snakemake` with this interpreter; sbatch exports
    # the submitting environment (--export=ALL), so PATH must lead to it.
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    env.pop("SLURM_JOB_ID", None)
    return env


def snakemake(workdir, *args, timeout=RUN_TIMEOUT):
    cmd = [sys.executable, "-m", "snakemake", "--profile", "profiles/slurm", *args]
    try:
        done = subprocess.run(cmd, cwd=workdir, env=_env(), capture_output=True,
                              text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        subprocess.run(["scancel", "--full", "--quiet", "--partition=debug"], check=False)
        out = (exc.stdout or b"").decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        err = (exc.stderr or b"").decode() if isinstance(exc.stderr, bytes) else (exc.stderr or "")
        pytest.fail(f"snakemake {' '.join(args)} ran over {timeout}s\n{out[-4000:]}\n{err[-6000:]}")
    return done.returncode, done.stdout + done.stderr


def copy_pipeline(dest: Path):
    return copy_checkout(dest)


def smoke_rows(n):
    rows = yaml.safe_load((REPO / "shapes" / "smoke.yaml").read_text())
    return [dict(r) for r in rows[:n]]


def write_manifest(workdir: Path, name: str, rows):
    (workdir / "shapes" / f"{name}.yaml").write_text(yaml.safe_dump(rows, sort_keys=False))


def submissions(log: str):
    """[(snakemake jobid, slurm jobid, rule, wildcards dir)] from the plugin's log lines."""
    out = []
    for m in SUBMITTED.finditer(log):
        parts = Path(m["log"]).parts
        i = parts.index("slurm_logs")
        rule = parts[i + 1].removeprefix("rule_")
        wildcards = parts[i + 2] if len(parts) > i + 3 else ""
        out.append((int(m["smk"]), m["slurm"], rule, wildcards))
    return out


def slurm_job(jobid):
    """scontrol's view of a job as a dict (kept by slurmctld for MinJobAge=600 s)."""
    done = subprocess.run(["scontrol", "show", "job", "-o", str(jobid)],
                          capture_output=True, text=True)
    assert done.returncode == 0, f"scontrol show job {jobid}: {done.stderr}"
    return dict(tok.split("=", 1) for tok in done.stdout.split() if "=" in tok)


def error_blocks(log: str):
    """[(rule, block text)] for every 'Error in rule' report of a run."""
    return re.findall(r"^Error in rule (\w+):\n((?:    .*\n?)*)", log, flags=re.M)


def block_field(block: str, name: str):
    m = re.search(rf"^    {name}: (.*)$", block, flags=re.M)
    return m.group(1) if m else ""


def dry_run_jobs(log: str):
    """{rule: count} from the 'Job stats' table of a dry run."""
    counts = {}
    block = log.split("Job stats:", 1)
    assert len(block) == 2, f"no job stats in dry run output:\n{log[-3000:]}"
    for line in block[1].splitlines()[3:]:
        parts = line.split()
        if not parts or parts[0] == "total":
            break
        if len(parts) == 2 and parts[1].isdigit():
            counts[parts[0]] = int(parts[1])
    return counts


def dry_run_outputs(log: str):
    """Every output path a dry run says it would produce."""
    outs = []
    for m in re.finditer(r"^\s+output: (.+)$", log, flags=re.M):
        outs += [p.strip() for p in m.group(1).split(",")]
    return outs


# ---------------------------------------------------------------- fixtures

@pytest.fixture(scope="module")
def slurm():
    reason = _unavailable_reason()
    if reason:
        _skip_or_fail(reason)
    was_running = all(_pid_alive(n) for n in ("munged", "slurmctld", "slurmd"))
    done = subprocess.run(["bash", str(START)], capture_output=True, text=True, timeout=600)
    # The machine can run it: a failing start is a failure, never a skip.
    assert done.returncode == 0, f".ci/slurm/start.sh failed:\n{done.stdout}\n{done.stderr}"
    sinfo = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %T %G"], capture_output=True, text=True)
    assert "idle" in sinfo.stdout and "gpu" in sinfo.stdout, sinfo.stdout + sinfo.stderr
    yield
    if not was_running:
        subprocess.run(["bash", str(STOP)], capture_output=True, text=True, timeout=120)


# ---------------------------------------------------------------- cases

def test_pipeline_runs_through_sbatch(slurm, tmp_path):
    """Case A: a 2-row smoke manifest through SLURM; every job is a SLURM job."""
    work = copy_pipeline(tmp_path)
    rows = smoke_rows(2)
    write_manifest(work, "slurm-a", rows)

    rc, log = snakemake(work, "--config", "shapes=slurm-a", *GPU_QUEUE, *FAST_POLLING)
    assert rc == 0, log[-8000:]

    subs = submissions(log)
    assert subs, "no 'submitted with SLURM jobid' line: jobs did not go through sbatch\n" + log[-4000:]
    # Every job Snakemake ran was an sbatch job but the local ones: the target rule and the report's inputs file.
    ran = re.findall(r"^rule (\w+):$", log, flags=re.M)
    local = set(re.findall(r"^localrule (\w+):$", log, flags=re.M))
    assert local <= {"all", "report_inputs"}, local
    assert sorted(ran) == sorted(s[2] for s in subs), log[-6000:]

    # SLURM's own records: every job completed; GPU rules asked for a GPU, others not.
    gpu_rules = set()
    for _, jobid, rule, _ in subs:
        job = slurm_job(jobid)
        assert job["JobState"] == "COMPLETED", (rule, job)
        assert job["NodeList"] == "localhost", job
        if "gpu" in job.get("TresPerJob", ""):
            assert job["TresPerJob"] == "gres:gpu:1", job
            gpu_rules.add(rule)
    assert gpu_rules, "no job requested a GPU (rules with resources: gpu=1 should get --gpus=1)"

    # Per-row results exist; each records the node it ran on (the pipeline's
    # result header: environment.host, plus the GPU name on a CUDA node).
    results = work / "results"
    recorded_hosts = set()
    for row in rows:
        hits = [p for p in results.rglob("*.json") if row["id"] in p.as_posix()]
        assert hits, f"no result JSON for row {row['id']} under {results}"
        for path in hits:
            doc = json.loads(path.read_text())
            env = doc.get("environment") if isinstance(doc, dict) else None
            if isinstance(env, dict):
                assert env.get("host") == socket.gethostname(), (path, env.get("host"))
                assert "gpu_name" in env, (path, sorted(env))
                recorded_hosts.add(env["host"])
    assert recorded_hosts, "no per-row result records the node it ran on (environment.host)"

    report = results / "report"
    assert report.is_dir() and any(report.iterdir()), f"no report under {report}"
    verify = subprocess.run([sys.executable, "-m", "shapewise", "verify", "results/report"],
                            cwd=work, env=_env(), capture_output=True, text=True, timeout=300)
    assert verify.returncode == 0, verify.stdout + verify.stderr


def test_broken_row_fails_alone_and_reruns_alone(slurm, tmp_path):
    """Case B: a row whose forced route cannot serve on this node fails in its job;
    the other row's results survive; after the fix only that row (and the
    report) reruns, and the rerun succeeds."""
    work = copy_pipeline(tmp_path)
    good = smoke_rows(1)
    bad = dict(smoke_rows(2)[1], id="slurm-broken", route="graph")
    write_manifest(work, "slurm-b", good + [bad])

    rc, log = snakemake(work, "--config", "shapes=slurm-b", *GPU_QUEUE, *FAST_POLLING)
    assert rc != 0, "a row forced onto the CUDA-only route must fail on a CPU node\n" + log[-6000:]
    assert submissions(log), "jobs did not go through sbatch\n" + log[-4000:]
    # Snakemake names every failed job: its rule, its outputs (which carry the
    # row id), its SLURM job id and its logs; only the broken row's jobs fail
    # (the report, which needs every row, is never started).
    errors = error_blocks(log)
    assert errors, log[-6000:]
    for rule, block in errors:
        assert "slurm-broken" in block_field(block, "output"), (rule, block)
        assert re.search(r"^    external_jobid: \d+", block, flags=re.M), (rule, block)
    # The job's own error -- the model's RouteUnavailable -- is in the logs
    # the error report points to (the rule's log and the SLURM job log).
    logs = {work / p.strip() for _, b in errors
            for p in block_field(b, "log").split(" (check")[0].split(",") if p.strip()}
    assert any(p.is_file() and "RouteUnavailable" in p.read_text() for p in logs), sorted(map(str, logs))
    # Failed jobs left no output behind.
    for rule, block in errors:
        for out in block_field(block, "output").split(","):
            assert not (work / out.strip()).exists(), f"{rule} left {out.strip()}"

    # The good row's results survive and are complete.
    results = work / "results"
    good_files = sorted(p for p in results.rglob("*") if p.is_file() and good[0]["id"] in p.as_posix())
    assert good_files, f"no results for {good[0]['id']}"
    for p in good_files:
        if p.suffix == ".json":
            json.loads(p.read_text())
    assert not (results / "report" / "report.md").exists(), "a report was built despite a failed row"

    # Fix the row: drop the forced route.
    del bad["route"]
    write_manifest(work, "slurm-b", good + [bad])
    before = {p: p.stat().st_mtime_ns for p in good_files}

    rc, dry = snakemake(work, "--config", "shapes=slurm-b", *GPU_QUEUE, "-n", timeout=180)
    assert rc == 0, dry[-6000:]
    planned = dry_run_outputs(dry)
    assert planned, dry[-4000:]
    assert not [o for o in planned if good[0]["id"] in o], \
        f"the good row would rerun: {[o for o in planned if good[0]['id'] in o]}"
    assert any("slurm-broken" in o for o in planned), planned
    assert any("report" in o for o in planned), planned
    counts = dry_run_jobs(dry)
    assert counts, dry[-3000:]

    rc, log = snakemake(work, "--config", "shapes=slurm-b", *GPU_QUEUE, *FAST_POLLING)
    assert rc == 0, log[-8000:]
    ran = {s[2] for s in submissions(log)}
    assert ran, "the rerun submitted nothing"
    assert {p: p.stat().st_mtime_ns for p in good_files} == before, "the good row was recomputed"
    verify = subprocess.run([sys.executable, "-m", "shapewise", "verify", "results/report"],
                            cwd=work, env=_env(), capture_output=True, text=True, timeout=300)
    assert verify.returncode == 0, verify.stdout + verify.stderr
