"""The job server (shapewise.execution.jobserver): jobs of a run start as forks of one process that imported their
code."""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from shapewise.execution import gpuslots, jobprocess, jobserver
from shapewise.inputs import paths

ROOT = Path(__file__).resolve().parent.parent
WORKFLOW = ROOT / "workflow"
CHUNKED = json.dumps({"batch_samples": 1, "query_block": 64, "query_samples": "all"})  # the chunked check's settings
ROW = {"batch_size": 2, "causal": False, "d_model": 32, "dtype": "float32", "ffn_dim": 64, "id": "smoke-noncausal",
       "input_scale": 1.0, "mask": "none", "num_heads": 2, "num_layers": 1, "padding_ratio": 0.0, "pass_mask": True,
       "route": "auto", "seq_len": 7, "trials": 2}
LONG_MICROBENCH = json.dumps({"cpu": {"copy_mib": 64, "gemm_n": 1024, "repeats": 500, "launches": 0}})


def _ticks(pid):
    return gpuslots._start_ticks(pid)


@pytest.fixture(scope="module")
def run():
    """A stand-in for a run's main Snakemake process: its identity, as shapewise.execution.runs.begin publishes it."""
    proc = subprocess.Popen(["sleep", "600"])
    name = f"{socket.gethostname()}:{proc.pid}:{_ticks(proc.pid)}"
    yield name
    proc.kill()
    proc.wait()


def _env(run_name=None, **extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHAPEWISE_")}
    env.update(PYTHONPATH=str(WORKFLOW), SHAPEWISE_PIPELINE_GPUS="")
    if run_name:
        env[jobserver.RUN_VAR] = run_name
    env.update(extra)
    return env


def _preflight(tmp_path, name, env, row=None):
    out = tmp_path / f"{name}.json"
    done = subprocess.run([sys.executable, "-m", "shapewise", "job", "preflight", "--device", "auto", "--row",
                           json.dumps(row or ROW), "--headroom", "0.85", "--chunked", CHUNKED, "--out", out.name],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    return done, (json.loads(out.read_text()) if out.is_file() else None)


def _server_pids(run_name):
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            args = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"shapewise.execution.jobserver" in args and run_name.encode() in args:
            found.append(int(proc.name))
    return found


def _pid_in_log(text):
    match = re.search(r"job process: pid (\d+), forked", text)
    assert match, text
    return int(match.group(1))


def _gone(pid, ticks, seconds):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if _ticks(pid) != ticks:
            return True
        time.sleep(0.05)
    return False


def test_a_forked_job_writes_what_a_fresh_one_writes(run, tmp_path):
    fresh_run, fresh = _preflight(tmp_path, "fresh", _env(OMP_NUM_THREADS="1"))
    assert fresh_run.returncode == 0, fresh_run.stderr
    # the server is started by a job with 2 threads; a job with 1 still runs with 1, as a fresh process would
    first_run, first = _preflight(tmp_path, "first", _env(run, OMP_NUM_THREADS="2"))
    forked_run, forked = _preflight(tmp_path, "forked", _env(run, OMP_NUM_THREADS="1"))
    assert first_run.returncode == 0 and forked_run.returncode == 0, first_run.stderr + forked_run.stderr
    assert fresh["environment"]["job_process"]["started_as"] == "fresh process"
    process = forked["environment"]["job_process"]
    assert process["started_as"] == "fork of the job server" and process["mode"] == "cpu"
    assert process["server_pid"] == first["environment"]["job_process"]["server_pid"]  # one server for the run
    assert "forked from the job server" in forked_run.stderr
    assert forked["cpu_affinity"] == fresh["cpu_affinity"] and forked["cpu_affinity"]["torch_threads"] == 1
    assert first["cpu_affinity"]["torch_threads"] == 2
    for field in ("identity", "row", "device", "gpu", "io_bytes", "headroom"):
        assert forked[field] == fresh[field], field
    assert forked["models"]["optimized"]["plan"] == fresh["models"]["optimized"]["plan"]
    same_env = {k: v for k, v in fresh["environment"].items() if k not in ("job_process", "shapewise_variables")}
    assert {k: forked["environment"][k] for k in same_env} == same_env
    assert forked["environment"]["shapewise_variables"][jobserver.RUN_VAR] == run


def test_a_crashing_job_fails_alone(run, tmp_path):
    crashed, _ = _preflight(tmp_path, "crash", _env(run), row={"id": "broken"})
    assert crashed.returncode == 1 and "Traceback" in crashed.stderr and "KeyError" in crashed.stderr
    done, result = _preflight(tmp_path, "after", _env(run))
    assert done.returncode == 0, done.stderr
    assert result["environment"]["job_process"]["server_pid"] in _server_pids(run)


def _long_job(tmp_path, env):
    log = open(tmp_path / "long.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "shapewise", "job", "microbench", "--device", "cpu", "--settings",
                             LONG_MICROBENCH, "--out", str(tmp_path / "long.json")], env=env, cwd=tmp_path,
                            stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while "forked" not in (tmp_path / "long.log").read_text():
        assert time.monotonic() < deadline and proc.poll() is None, (tmp_path / "long.log").read_text()
        time.sleep(0.1)
    child = _pid_in_log((tmp_path / "long.log").read_text())
    return proc, child, _ticks(child)


@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGTERM])
def test_the_job_ends_with_its_client(run, tmp_path, signum):
    proc, child, ticks = _long_job(tmp_path, _env(run))
    assert ticks is not None
    os.kill(proc.pid, signum)  # SIGKILL: the job sees its client gone; SIGTERM: the client passes it on
    proc.wait(timeout=60)
    assert proc.returncode != 0
    assert _gone(child, ticks, 30), "the job outlived its client"
    assert not (tmp_path / "long.json").exists()


def test_the_server_stops_when_its_run_is_gone(tmp_path):
    sleeper = subprocess.Popen(["sleep", "600"])
    name = f"{socket.gethostname()}:{sleeper.pid}:{_ticks(sleeper.pid)}"
    try:
        done, result = _preflight(tmp_path, "one", _env(name))
        assert done.returncode == 0, done.stderr
        (server,) = _server_pids(name)
    finally:
        sleeper.kill()
        sleeper.wait()
    assert _gone(server, _ticks(server), 30)


def test_jobs_start_fresh_and_say_why(run, tmp_path):
    done, result = _preflight(tmp_path, "off", _env(run, **{jobserver.OFF_VAR: "off"}))
    assert done.returncode == 0, done.stderr
    assert result["environment"]["job_process"] == {"started_as": "fresh process",
                                                    "reason": f"{jobserver.OFF_VAR}=off"}
    done, result = _preflight(tmp_path, "slurm", _env(run, SLURM_JOB_ID="77"))
    assert result["environment"]["job_process"]["reason"] == "placed by SLURM"
    done, result = _preflight(tmp_path, "hand", _env())
    assert "no SHAPEWISE_PIPELINE_RUN" in result["environment"]["job_process"]["reason"]


def test_a_server_that_could_not_start_is_written_down(tmp_path):
    sleeper = subprocess.Popen(["sleep", "600"])
    name = f"{socket.gethostname()}:{sleeper.pid}:{_ticks(sleeper.pid)}"
    try:
        env = _env(name)
        key = jobserver.server_key("cpu", {k: v for k, v in env.items()}, cwd=str(tmp_path))
        # the job's state directory is the run's: under the working directory it runs in
        failed = tmp_path / jobserver._state_paths(name, key)["failed"].relative_to(paths.ROOT)
        failed.parent.mkdir(parents=True, exist_ok=True)
        failed.write_text("the job server did not start: refused: 2 threads after importing\n")
        done, result = _preflight(tmp_path, "failed", env)
        assert done.returncode == 0, done.stderr
        assert result["environment"]["job_process"] == {
            "started_as": "fresh process", "reason": "the job server did not start: refused: 2 threads after importing"}
        assert "starting fresh: the job server did not start" in done.stderr
        assert _server_pids(name) == []
    finally:
        sleeper.kill()
        sleeper.wait()


def test_the_server_key_ignores_what_snakemake_sets_per_job():
    base = {"PATH": "/usr/bin", "PYTHONPATH": "/x", "OMP_NUM_THREADS": "1", "TMPDIR": "/tmp", "SHAPEWISE_DISABLE": "a"}
    key = jobserver.server_key("cuda", base, cwd="/w")
    assert jobserver.server_key("cuda", dict(base, OMP_NUM_THREADS="8", MKL_NUM_THREADS="8", SHAPEWISE_DISABLE="b",
                                             TMPDIR="/scratch"), cwd="/w") == key
    for other in (dict(base, PYTHONPATH="/y"), dict(base, TRITON_INTERPRET="1"), dict(base, CUDA_VISIBLE_DEVICES="1")):
        assert jobserver.server_key("cuda", other, cwd="/w") != key
    assert jobserver.server_key("cpu", base, cwd="/w") != key
    assert jobserver.server_key("cuda", base, cwd="/v") != key
    assert jobserver.server_mode("auto", {gpuslots.POOL_VAR: ""}) == "cpu"
    assert jobserver.server_mode("auto", {gpuslots.POOL_VAR: "0,1"}) == "cuda"
    assert jobserver.server_mode("cpu", {gpuslots.POOL_VAR: "0"}) == "cpu"


def test_a_state_with_cuda_or_threads_is_not_forked():
    assert jobserver.fork_problems(False, "cpu") == []
    assert jobserver.fork_problems(True, "cpu") == ["torch initialized CUDA while importing"]
    assert jobserver.fork_problems(False, "cuda", probe=lambda: None) == []
    assert jobserver.fork_problems(False, "cuda", probe=lambda: "cuInit returned 3 in a fork") == [
        "cuInit returned 3 in a fork"]
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait)
    thread.start()
    try:
        assert jobserver.fork_problems(False, "cpu") == ["2 threads after importing (a fork keeps only one)"]
    finally:
        stop.set()
        thread.join()
    # this machine has no CUDA driver: none is loaded here, and a fork cannot initialize one
    assert "libcuda.so" not in Path("/proc/self/maps").read_text()
    assert "no CUDA driver to initialize in a fork" in jobserver._cuda_driver_problem()


def test_a_job_whose_device_is_not_the_servers_runs_fresh(tmp_path, monkeypatch):
    monkeypatch.setenv(gpuslots.POOL_VAR, "")
    argv = ["job", "preflight", "--device", "cpu", "--row", json.dumps(ROW), "--headroom", "0.85",
            "--chunked", CHUNKED, "--out", str(tmp_path / "p.json")]
    with pytest.raises(jobserver.RunFresh, match="runs on cpu, the job server serves cuda"):
        jobprocess.run_forked(argv, "cuda")
    assert not (tmp_path / "p.json").exists()


def test_a_loaded_cuda_driver_is_forked_only_while_not_initialized():
    # libraries that link the driver (CUPTI, Triton's driver module) load it without initializing it
    assert jobserver._initialized_driver_problem("libcuda.so.1", jobserver.CUDA_ERROR_NOT_INITIALIZED) is None
    assert "initialized while importing (cuDeviceGetCount returned 0" in jobserver._initialized_driver_problem(
        "libcuda.so.1", 0)
    assert "cannot ask the loaded CUDA driver" in jobserver._initialized_driver_problem("/nonexistent/libcuda.so.1")
