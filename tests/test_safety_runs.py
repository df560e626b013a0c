"""A run and its jobs as a user meets them: a passed variable's value holding `{...}` reaches the jobs as written
(Snakemake would read it as a wildcard); a second run begun beside a live one in the same checkout (after
`snakemake --unlock`) is refused naming it; a job's log keeps its first and last bytes whatever its processes print;
the run's first line on a machine without a GPU says so and what runs; its last names the report, or the jobs that
failed or did not finish with their logs."""

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from checkout import copy_checkout
from shapewise import cli
from shapewise.execution import gpuslots, jobserver, runs
from shapewise.inputs import paths

# ---- pass_env: a value with braces ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def checkout(tmp_path_factory):
    return copy_checkout(tmp_path_factory.mktemp("checkout"))


def dry_run(workdir, *args, env=None):
    env = dict(os.environ if env is None else env, SHAPEWISE_DEVICE="cpu")
    env.pop(gpuslots.FAKE_VAR, None)
    done = subprocess.run([sys.executable, "-m", "snakemake", "-n", "--cores", "2", "-p", *args], cwd=workdir,
                          env=env, capture_output=True, text=True, timeout=300)
    return done.returncode, done.stdout + done.stderr


def test_a_passed_value_with_braces_reaches_the_jobs_as_written(checkout):
    env = dict(os.environ, SHAPEWISE_ROUTE="a{b}c {shape} {{x}}")
    rc, text = dry_run(checkout, "--config", "shapes=smoke", "pass_env=SHAPEWISE_ROUTE", env=env)
    assert rc == 0, text[-3000:]
    assert "WildcardError" not in text
    assert text.count("--env 'SHAPEWISE_ROUTE=a{b}c {shape} {{x}}'") >= 5, text[-3000:]


# ---- one run at a time in a checkout -----------------------------------------------------------------------------

@pytest.fixture
def other_run(tmp_path):
    """A live process standing for another run's main Snakemake process, with its marker."""
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    run = f"{socket.gethostname()}:{process.pid}:{gpuslots._start_ticks(process.pid)}"
    runs.write_marker(run, [], tmp_path / "cache", ["snakemake", "--cores", "all"], directory=tmp_path)
    yield process
    process.kill()
    process.wait()


def test_a_run_beside_a_live_one_is_refused_naming_it(tmp_path, other_run):
    with pytest.raises(runs.RunConflict) as info:
        runs.begin([], ["snakemake", "--cores", "2"], environ={}, directory=tmp_path)
    message = str(info.value)
    assert f"(pid {other_run.pid})" in message and "snakemake --cores all" in message
    assert "another pipeline run is going on in this checkout" in message and "nothing was run" in message
    assert len(list(tmp_path.glob("*.json"))) == 1  # the refused run's own marker is gone
    other_run.kill()
    other_run.wait()
    runs.begin([], ["snakemake", "--cores", "2"], environ={}, directory=tmp_path)  # a run that ended: no conflict


def test_markers_of_ended_or_damaged_runs_are_no_conflict(tmp_path):
    runs.write_marker(f"{socket.gethostname()}:999999999:1", [], tmp_path, [], directory=tmp_path)
    (tmp_path / "damaged.json").write_text("{")
    runs.begin([], [], environ={}, directory=tmp_path)
    assert runs.live_runs(tmp_path) and runs.live_runs(tmp_path, but=jobserver.run_id()) == []


# ---- a job's log -----------------------------------------------------------------------------------------------

CHATTY = """
import subprocess, sys
from shapewise.execution import jobserver
jobserver.LOG_DRAIN_S = 1
with jobserver.capped_output(head=1000, tail=600):
    print("the job starts", flush=True)
    subprocess.run([sys.executable, "-c", "import sys\\nfor i in range(50000): print('line', i)\\n"
                    "print('the child ends', file=sys.stderr)"])
    {leftover}
    print("the job ends", file=sys.stderr)
print("after the job")
"""


def run_chatty(tmp_path, leftover="pass"):
    log = tmp_path / "job.log"
    with open(log, "wb") as out:
        started = time.monotonic()
        done = subprocess.run([sys.executable, "-c", CHATTY.format(leftover=leftover)], stdout=out, stderr=out,
                              timeout=120)
    assert done.returncode == 0
    return log.read_bytes().decode(), time.monotonic() - started


def test_a_jobs_log_keeps_its_first_and_last_bytes(tmp_path):
    text, _ = run_chatty(tmp_path)
    assert len(text) < 1000 + 600 + 200, len(text)
    assert text.startswith("the job starts\nline 0\n")
    left_out = len("".join(f"line {i}\n" for i in range(50000))) + len("the job starts\nthe child ends\n"
                                                                         "the job ends\n") - 1000 - 600
    assert (f"[shapewise: {left_out} bytes of this job's output left out here; a job's log keeps its first 1000 "
            f"and last 600 bytes]") in text
    assert text.endswith("line 49999\nthe child ends\nthe job ends\nafter the job\n")


def test_a_process_left_behind_holding_the_log_does_not_hold_the_job(tmp_path):
    """A child in a session of its own outlives the job with the pipe open: the keeper stops LOG_DRAIN_S later
    with what it kept."""
    leftover = ("subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(15)'], "
                "start_new_session=True)")
    text, seconds = run_chatty(tmp_path, leftover)
    assert seconds < 30 and text.endswith("the job ends\nafter the job\n")


def test_a_log_that_is_not_one_file_is_left_alone(tmp_path):
    out, err = tmp_path / "out", tmp_path / "err"
    code = ("from shapewise.execution import jobserver\nwith jobserver.capped_output(head=10, tail=10):\n"
            "    print('x' * 100)\n")
    with open(out, "wb") as o, open(err, "wb") as e:
        subprocess.run([sys.executable, "-c", code], stdout=o, stderr=e, check=True, timeout=60)
    assert out.read_text() == "x" * 100 + "\n"


def test_every_job_runs_inside_the_cap(monkeypatch):
    entered = []

    class Recorder:
        def __enter__(self):
            entered.append("in")

        def __exit__(self, *exc):
            entered.append("out")

    monkeypatch.setattr(cli, "job_environment_variables", lambda passed: None)
    monkeypatch.setattr(jobserver, "capped_output", Recorder)
    monkeypatch.setattr(jobserver, "run", lambda args, argv: entered.append("job") or 0)
    assert cli.run_job(type("Args", (), {"env": []})(), []) == 0
    assert entered == ["in", "job", "out"]


# ---- the run's first and last words ----------------------------------------------------------------------------

def test_a_machine_without_a_gpu_is_told_plainly(checkout):
    if gpuslots.list_gpus(environ={}):
        pytest.skip("this machine has a GPU")
    rc, text = dry_run(checkout)
    assert rc == 0, text[-3000:]
    line = next(line for line in text.splitlines() if line.startswith("GPU pool:"))
    assert line.startswith("GPU pool: none: device cpu (config device or SHAPEWISE_DEVICE); the jobs run the CPU "
                           "smoke test (shapes/smoke.yaml"), line
    rc, text = dry_run(checkout, "--config", "shapes=contract")
    assert "the jobs run shapes/contract.yaml on the CPU, one device job at a time" in text, text[-3000:]
    env = dict(os.environ)
    for name in ("SHAPEWISE_DEVICE", gpuslots.FAKE_VAR):
        env.pop(name, None)
    done = subprocess.run([sys.executable, "-m", "snakemake", "-n", "--cores", "2"], cwd=checkout, env=env,
                          capture_output=True, text=True, timeout=300)
    assert "GPU pool: none: no GPU found (`nvidia-smi -L` lists none); the jobs run the CPU smoke test" in \
        done.stderr, done.stderr[-3000:]


SNAKEMAKE_LOG = """\
[Sun Dec  6 02:35:01 2026]
localrule preflight:
    input: results/fingerprint/environment.json
    output: results/preflight/r1.json
    log: results/logs/preflight/r1.log
    jobid: 10
    reason: Missing output files: results/preflight/r1.json
Shell command: python -m shapewise job preflight > results/logs/preflight/r1.log 2>&1
[Sun Dec  6 02:35:02 2026]
Finished jobid: 10 (Rule: preflight)
[Sun Dec  6 02:35:03 2026]
rule accuracy:
    input: results/preflight/r1.json
    output: results/accuracy/r1.json
    log: results/logs/accuracy/r1.log
    jobid: 6
[Sun Dec  6 02:35:03 2026]
rule timing:
    output: results/timing/r1.json
    log: results/logs/timing/r1.log
    jobid: 7
Error in rule accuracy:
    message: None
    jobid: 6
    input: results/preflight/r1.json
    output: results/accuracy/r1.json
    log: results/logs/accuracy/r1.log (check log file(s) for error details)
    shell:
        python -m shapewise job accuracy
        (command exited with non-zero exit code)
Terminating processes on user request, this might take some time.
"""


def test_a_stopped_run_names_its_failed_and_unfinished_jobs_logs(tmp_path):
    log = tmp_path / "snakemake.log"
    log.write_text(SNAKEMAKE_LOG)
    assert [(j["rule"], j["state"], j["logs"]) for j in runs.stopped_jobs(SNAKEMAKE_LOG)] == [
        ("accuracy", "failed", ["results/logs/accuracy/r1.log"]),
        ("timing", "did not finish", ["results/logs/timing/r1.log"])]
    message = runs.error_message([str(log)])  # what Snakemake hands its onerror handler: a list of its logs
    assert message == runs.error_message(log)
    assert "accuracy (failed)        results/logs/accuracy/r1.log" in message
    assert "timing (did not finish)  results/logs/timing/r1.log" in message
    assert "preflight" not in message
    assert "results/logs/" in runs.error_message(tmp_path / "no-such.log")


def test_a_finished_run_names_its_report(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    marker = runs.write_marker("h:1:1", [], tmp_path, [], directory=tmp_path)
    assert runs.success_message("h:1:1", tmp_path) is None  # no report
    html = Path(paths.REPORT_DIR, paths.REPORT_FILES["html"])
    html.parent.mkdir(parents=True)
    html.write_text("<html>")
    assert runs.success_message("h:1:1", tmp_path).startswith(
        "shapewise: the report is results/report/report.html (report.md and summary.csv beside it)")
    os.utime(html, (1, 1))  # written before the run began: not this run's report
    assert runs.success_message("h:1:1", tmp_path) is None
    assert marker["run"] == "h:1:1"
