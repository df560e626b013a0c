"""GPU slots for local runs (shapewise.execution.gpuslots, workflow/rules/gpus.smk), on the CPU with fake GPUs."""

import itertools
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from datetime import datetime, timezone
from pathlib import Path

import pytest
from shapewise.execution import gpuslots
from shapewise.inputs import paths

ROOT = Path(__file__).resolve().parent.parent
WORKFLOW = ROOT / "workflow"
FAKE2 = [{"index": "0", "uuid": "GPU-aaaa-0000", "name": "NVIDIA H200"},
         {"index": "1", "uuid": "GPU-bbbb-1111", "name": "NVIDIA H200"}]


@pytest.fixture(autouse=True)
def _release_held():
    yield
    for slot in list(gpuslots._HELD):
        slot.release()


def _env(**extra):
    env = dict(os.environ)
    for name in [n for n in env if n.startswith("SHAPEWISE_") or n in ("CUDA_VISIBLE_DEVICES", "SLURM_JOB_ID")]:
        del env[name]
    env["PYTHONPATH"] = str(WORKFLOW)
    env.update(extra)
    return env


# ---- the pool ---------------------------------------------------------------------------------------

def test_nvidia_smi_lines_are_parsed(monkeypatch):
    out = ("GPU 0: NVIDIA H200 (UUID: GPU-aaaa-0000)\n"
           "GPU 1: NVIDIA H200 (UUID: GPU-bbbb-1111)\n"
           "  MIG 1g.18gb     Device  0: (UUID: MIG-cccc)\n")
    monkeypatch.setattr(gpuslots.subprocess, "run",
                        lambda *a, **k: subprocess.CompletedProcess(a, 0, stdout=out, stderr=""))
    assert gpuslots.list_gpus({}) == FAKE2
    assert gpuslots.list_gpus({gpuslots.FAKE_VAR: "3"})[2] == {"index": "2", "uuid": "GPU-fake-2",
                                                               "name": "fake GPU"}


def test_pool_follows_cuda_visible_devices_and_knob():
    assert [g["index"] for g in gpuslots.resolve_pool("all", {}, FAKE2)] == ["0", "1"]
    # the user's own token is what the job's CUDA_VISIBLE_DEVICES gets: index, UUID or UUID prefix
    for cvd, token in (("1", "1"), ("GPU-bbbb-1111", "GPU-bbbb-1111"), ("GPU-bb", "GPU-bb")):
        (gpu,) = gpuslots.resolve_pool("all", {"CUDA_VISIBLE_DEVICES": cvd}, FAKE2)
        assert (gpu["index"], gpu["token"]) == ("1", token)
    # no CUDA_VISIBLE_DEVICES: the UUID, which names the GPU whatever CUDA's device order
    assert gpuslots.resolve_pool("all", {}, FAKE2)[0]["token"] == "GPU-aaaa-0000"
    assert gpuslots.resolve_pool("all", {"CUDA_VISIBLE_DEVICES": ""}, FAKE2) == []
    assert [g["index"] for g in gpuslots.resolve_pool("1,0", {}, FAKE2)] == ["1", "0"]
    assert [g["index"] for g in gpuslots.resolve_pool([1], {}, FAKE2)] == ["1"]
    assert [g["index"] for g in gpuslots.resolve_pool(1, {}, FAKE2)] == ["0"]
    assert [g["index"] for g in gpuslots.resolve_pool("1", {"CUDA_VISIBLE_DEVICES": "1"}, FAKE2)] == ["1"]


@pytest.mark.parametrize("spec, env, words", [
    (0, {}, ["gpus=0", "0 GPUs"]),
    ("0", {}, ["0 GPUs"]),
    (3, {}, ["3 GPUs", "2 are visible"]),
    ("two", {}, ["'two'", "must be all, a number"]),
    (True, {}, ["True"]),
    ([], {}, ["[]"]),
    ("0,0", {}, ["'0,0'", "GPU 0 is listed twice"]),
    ("0,5", {}, ["'5' names no GPU"]),
    ("0,", {}, ["empty GPU id"]),
    ([0, "GPU-zz"], {}, ["'GPU-zz' names no GPU"]),
    ("0", {"CUDA_VISIBLE_DEVICES": "7"}, ["CUDA_VISIBLE_DEVICES=7", "'7' names no GPU"]),
    ("all", {"CUDA_VISIBLE_DEVICES": "1,1"}, ["named twice"]),
    ("0,1", {"CUDA_VISIBLE_DEVICES": "1"}, ["'0' names no GPU", "1 (GPU-bbbb-1111)"]),
])
def test_bad_knob_is_a_clear_error(spec, env, words):
    with pytest.raises(gpuslots.GpuError) as info:
        gpuslots.resolve_pool(spec, env, FAKE2)
    message = str(info.value)
    for word in words:
        assert word in message
    assert "GPU" in message


# ---- slots held by processes --------------------------------------------------------------------------

HOLDER = textwrap.dedent("""
    import json, sys, time
    from shapewise.execution import gpuslots
    lock_dir, start_at, hold_s, out = sys.argv[1], float(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
    pool = gpuslots.list_gpus()
    time.sleep(max(0.0, start_at - time.time()))
    asked = time.time()
    slot = gpuslots.acquire(pool, lock_dir, label=out, poll_s=0.05)
    got = time.time()
    print("held", flush=True)
    time.sleep(hold_s)
    end = time.time()
    json.dump({"slot": slot.gpu["index"], "asked": asked, "start": got, "end": end}, open(out, "w"))
""")


def test_concurrent_jobs_never_share_a_slot(tmp_path):
    script = tmp_path / "holder.py"
    script.write_text(HOLDER)
    start_at = time.time() + 2.0  # every process asks at the same moment
    procs = []
    for i in range(5):
        out = tmp_path / f"job{i}.json"
        procs.append((out, subprocess.Popen(
            [sys.executable, str(script), str(tmp_path / "locks"), str(start_at), "0.8", str(out)],
            env=_env(**{gpuslots.FAKE_VAR: "2"}), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)))
    logs = []
    for out, proc in procs:
        _, stderr = proc.communicate(timeout=60)
        assert proc.returncode == 0, stderr
        logs.append(stderr)
    jobs = [json.loads(out.read_text()) for out, _ in procs]
    assert {j["slot"] for j in jobs} == {"0", "1"}
    for slot in ("0", "1"):
        held = sorted((j["start"], j["end"]) for j in jobs if j["slot"] == slot)
        for (_, end), (start, _) in itertools.pairwise(held):
            assert start >= end, f"slot {slot} held twice at once: {held}"
    # 5 jobs, 2 slots: at least 3 waited, and said so in their log
    assert sum(j["start"] - j["asked"] > 0.5 for j in jobs) >= 3
    assert sum("waiting for a free GPU" in log for log in logs) >= 3


def test_killed_job_frees_its_slot(tmp_path):
    script = tmp_path / "holder.py"
    script.write_text(HOLDER)
    lock_dir = tmp_path / "locks"
    proc = subprocess.Popen([sys.executable, str(script), str(lock_dir), "0", "600", str(tmp_path / "x.json")],
                            env=_env(**{gpuslots.FAKE_VAR: "1"}), stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "held"
        pool = gpuslots.list_gpus({gpuslots.FAKE_VAR: "1"})
        # held: a waiting acquire does not get it
        with pytest.raises(TimeoutError):
            _acquire_within(pool, lock_dir, 1.0)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    lock_file = lock_dir / "gpu-0.lock"
    assert json.loads(lock_file.read_text())["pid"] == proc.pid  # the dead holder's note stays behind
    slot = _acquire_within(pool, lock_dir, 5.0)
    assert slot.gpu["index"] == "0"
    assert json.loads(lock_file.read_text())["pid"] == os.getpid()


def _acquire_within(pool, lock_dir, seconds):
    deadline = time.monotonic() + seconds

    def give_up(message):
        if "waiting" in message and time.monotonic() > deadline:
            raise TimeoutError(message)

    return gpuslots.acquire(pool, lock_dir, poll_s=0.05, log_every_s=0.0, log=give_up)


# ---- shared and exclusive holders ---------------------------------------------------------------------

MODE_HOLDER = textwrap.dedent("""
    import json, sys, time
    from shapewise.execution import gpuslots
    lock_dir, mode, hold_s, out = sys.argv[1], sys.argv[2], float(sys.argv[3]), sys.argv[4]
    asked = time.time()
    slot = gpuslots.acquire(gpuslots.list_gpus(), lock_dir, label=out, poll_s=0.02, mode=mode)
    got = time.time()
    print("held", slot.gpu["index"], flush=True)
    time.sleep(hold_s)
    record = slot.record()
    record["others_at_end"] = slot.others_now()
    end = time.time()
    slot.release()
    json.dump({"gpu": slot.gpu["index"], "mode": mode, "asked": asked, "start": got, "end": end,
               "record": record}, open(out, "w"))
""")


class Holders:
    """Holder processes of one lock directory, each started at a time of the test's choosing."""

    def __init__(self, tmp_path, gpus=1):
        self.tmp, self.gpus, self.procs = tmp_path, gpus, []
        (tmp_path / "holder.py").write_text(MODE_HOLDER)

    def start(self, mode, hold_s):
        out = self.tmp / f"holder{len(self.procs)}.json"
        proc = subprocess.Popen([sys.executable, str(self.tmp / "holder.py"), str(self.tmp / "locks"), mode,
                                 str(hold_s), str(out)], env=_env(**{gpuslots.FAKE_VAR: str(self.gpus)}),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.procs.append((out, proc))
        return proc

    def wait_held(self, proc):
        line = proc.stdout.readline().split()
        assert line[:1] == ["held"], proc.stderr.read()
        return line[1]

    def results(self):
        done = []
        for out, proc in self.procs:
            _, stderr = proc.communicate(timeout=60)
            assert proc.returncode == 0, stderr
            done.append(json.loads(out.read_text()))
        return done


def _overlap(a, b):
    return a["start"] < b["end"] and b["start"] < a["end"]


def test_shared_holders_share_and_an_exclusive_one_waits_for_them(tmp_path):
    h = Holders(tmp_path)
    first = h.start(gpuslots.SHARED, 1.5)
    h.wait_held(first)
    second = h.start(gpuslots.SHARED, 1.0)
    h.wait_held(second)  # two sharers at once
    h.start(gpuslots.EXCLUSIVE, 0.3)
    a, b, c = h.results()
    assert _overlap(a, b)
    assert c["start"] >= max(a["end"], b["end"]) and c["start"] - c["asked"] > 0.5
    assert {n["pid"] for n in b["record"]["others_at_start"]} == {first.pid}
    assert c["record"]["mode"] == "exclusive" and c["record"]["others_at_start"] == []
    assert c["record"]["others_at_end"] == []


def test_a_sharer_waits_while_an_exclusive_job_holds_the_gpu(tmp_path):
    h = Holders(tmp_path)
    alone = h.start(gpuslots.EXCLUSIVE, 1.0)
    h.wait_held(alone)
    h.start(gpuslots.SHARED, 0.2)
    h.start(gpuslots.EXCLUSIVE, 0.2)
    a, b, c = h.results()
    assert b["start"] >= a["end"] and c["start"] >= a["end"]
    assert not _overlap(b, c)  # a sharer and an exclusive holder never at once


def test_two_exclusive_holders_take_turns(tmp_path):
    h = Holders(tmp_path)
    h.start(gpuslots.EXCLUSIVE, 0.6)
    h.start(gpuslots.EXCLUSIVE, 0.6)
    a, b = h.results()
    assert not _overlap(a, b)


def test_a_waiting_exclusive_job_keeps_new_sharers_out(tmp_path):
    h = Holders(tmp_path)
    sharer = h.start(gpuslots.SHARED, 1.2)
    h.wait_held(sharer)
    h.start(gpuslots.EXCLUSIVE, 0.8)
    time.sleep(0.5)  # the exclusive job waits for the sharer, holding the gate
    h.start(gpuslots.SHARED, 0.2)
    a, b, c = h.results()
    assert b["start"] >= a["end"]
    assert c["start"] >= b["end"], "a sharer came in ahead of the exclusive job waiting for the GPU"


def test_at_most_shared_per_gpu_share_one_gpu(tmp_path):
    h = Holders(tmp_path)
    for _ in range(gpuslots.SHARED_PER_GPU + 1):
        h.start(gpuslots.SHARED, 1.0)
    jobs = h.results()
    starts = sorted(j["start"] for j in jobs)
    for t in starts:
        assert sum(j["start"] <= t < j["end"] for j in jobs) <= gpuslots.SHARED_PER_GPU
    assert sum(j["start"] - j["asked"] > 0.5 for j in jobs) >= 1
    assert sorted({j["record"]["share_slot"] for j in jobs}) == list(range(gpuslots.SHARED_PER_GPU))


def test_killed_holders_of_either_mode_free_the_gpu(tmp_path):
    lock_dir = tmp_path / "locks"
    pool = gpuslots.list_gpus({gpuslots.FAKE_VAR: "1"})
    for mode in (gpuslots.SHARED, gpuslots.EXCLUSIVE):
        h = Holders(tmp_path)
        proc = h.start(mode, 600)
        h.wait_held(proc)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        assert list((lock_dir / "gpu-0.holders").glob("*.json"))  # its note stays behind, and is ignored
        assert gpuslots.holders(lock_dir, pool[0]) == []
        slot = _acquire_within(pool, lock_dir, 5.0)
        assert slot.mode == gpuslots.EXCLUSIVE and slot.others_at_start == []
        slot.release()


def test_sharers_pack_onto_one_gpu_and_exclusive_jobs_take_a_free_one(tmp_path):
    h = Holders(tmp_path, gpus=2)
    first = h.start(gpuslots.SHARED, 1.2)
    assert h.wait_held(first) == "0"
    second = h.start(gpuslots.SHARED, 1.0)
    assert h.wait_held(second) == "0"  # beside the first, leaving GPU 1 free
    alone = h.start(gpuslots.EXCLUSIVE, 0.5)
    assert h.wait_held(alone) == "1"
    a, b, c = h.results()
    assert c["start"] < a["end"], "the exclusive job waited although a GPU was free"


def test_downgrade_lets_sharers_in_and_keeps_exclusive_jobs_out_until_then(tmp_path):
    lock_dir = tmp_path / "locks"
    pool = gpuslots.list_gpus({gpuslots.FAKE_VAR: "1"})
    slot = gpuslots.acquire(pool, lock_dir, mode=gpuslots.EXCLUSIVE)
    try:
        h = Holders(tmp_path)
        sharer = h.start(gpuslots.SHARED, 0.2)
        time.sleep(0.5)
        assert sharer.poll() is None and not list((lock_dir / "gpu-0.holders").glob(f"{sharer.pid}.json"))
        slot.downgrade()
        assert slot.mode == gpuslots.SHARED and slot.record()["share_slot"] == 0
        assert h.wait_held(sharer) == "0"
        (result,) = h.results()
        assert {n["pid"] for n in result["record"]["others_at_start"]} == {os.getpid()}
    finally:
        slot.release()


PREPARER = textwrap.dedent("""
    import json, sys, time
    from shapewise.execution import gpuslots
    lock_dir, prepare_s, time_s, out = sys.argv[1], float(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
    slot = gpuslots.acquire(gpuslots.list_gpus(), lock_dir, label=out, poll_s=0.02, mode=gpuslots.SHARED)
    start = time.time()
    print("held", slot.gpu["index"], flush=True)
    time.sleep(prepare_s)
    released = time.time()
    slot.upgrade(reserved_bytes=123, poll_s=0.02)
    alone = time.time()
    others = slot.others_now()
    time.sleep(time_s)
    end = time.time()
    record = slot.record()
    slot.release()
    json.dump({"start": start, "released": released, "alone": alone, "end": end, "others_alone": others,
               "record": record}, open(out, "w"))
""")


def test_preparing_sharers_hold_the_gpu_alone_one_after_another(tmp_path):
    """Three jobs that prepare sharing the GPU, then upgrade: each waits for the others' shares without holding
    one itself (no deadlock), holds the GPU alone with nobody beside it, and records when it shared and when it
    held it alone; a sharer that comes meanwhile waits for them."""
    (tmp_path / "prep.py").write_text(PREPARER)
    env = _env(**{gpuslots.FAKE_VAR: "1"})
    procs = []
    for k, prepare_s in enumerate((0.2, 0.6, 0.4)):
        out = tmp_path / f"p{k}.json"
        procs.append((out, subprocess.Popen([sys.executable, str(tmp_path / "prep.py"), str(tmp_path / "locks"),
                                             str(prepare_s), "0.4", str(out)], env=env, stdout=subprocess.PIPE,
                                            stderr=subprocess.PIPE, text=True)))
    for _, proc in procs:
        assert proc.stdout.readline().split()[:1] == ["held"], proc.stderr.read()
    results = []
    for out, proc in procs:
        _, stderr = proc.communicate(timeout=60)
        assert proc.returncode == 0, stderr
        results.append(json.loads(out.read_text()))
    alone = sorted((r["alone"], r["end"]) for r in results)
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(alone, alone[1:])), alone
    assert max(r["released"] for r in results) <= alone[0][0]  # the first alone once every share was let go
    for r in results:
        assert r["others_alone"] == []
        rec = r["record"]
        assert rec["mode"] == gpuslots.EXCLUSIVE and "share_slot" not in rec
        assert rec["shared_until"] <= rec["alone_since"] and rec["alone_waited_s"] >= 0
    assert not list((tmp_path / "locks").glob("gpu-0.waiting/*.json"))


def test_a_preparer_waiting_to_hold_the_gpu_alone_is_listed_as_waiting_not_as_a_holder(tmp_path):
    """While it waits for this process's share to go, the preparer holds nothing: its note is a waiting one (with its
    allocator's memory), which the contention check of a job timing meanwhile reads."""
    pool = gpuslots.list_gpus({gpuslots.FAKE_VAR: "1"})
    slot = gpuslots.acquire(pool, tmp_path / "locks", mode=gpuslots.SHARED)
    (tmp_path / "prep.py").write_text(PREPARER)
    proc = subprocess.Popen([sys.executable, str(tmp_path / "prep.py"), str(tmp_path / "locks"), "0", "0",
                             str(tmp_path / "p.json")], env=_env(**{gpuslots.FAKE_VAR: "1"}),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().split()[:1] == ["held"], proc.stderr.read()
        deadline = time.time() + 20
        while not slot.waiting_now() and time.time() < deadline:
            time.sleep(0.02)
        (waiting,) = slot.waiting_now()
        assert waiting["pid"] == proc.pid and waiting["reserved_bytes"] == 123
        assert slot.others_now() == [] and proc.poll() is None  # no holder note: it holds nothing, and waits
    finally:
        slot.release()
    proc.communicate(timeout=60)
    assert proc.returncode == 0
    assert json.loads((tmp_path / "p.json").read_text())["record"]["alone_waited_s"] > 0


def test_a_holder_alone_stays_alone_where_waiting_jobs_keep_every_share(tmp_path):
    """Jobs waiting to hold the GPU alone keep their shares (their memory stays counted): a holder that would share
    the GPU after its kernel choice then keeps holding it alone instead of failing."""
    import fcntl

    pool = gpuslots.list_gpus({gpuslots.FAKE_VAR: "1"})
    lock_dir = tmp_path / "locks"
    slot = gpuslots.acquire(pool, lock_dir, mode=gpuslots.EXCLUSIVE)
    shares = [gpuslots._open(gpuslots._share_file(lock_dir, pool[0], k)) for k in range(gpuslots.SHARED_PER_GPU)]
    try:
        for fd in shares:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        slot.downgrade()
        assert slot.mode == gpuslots.EXCLUSIVE and slot.record()["mode"] == gpuslots.EXCLUSIVE
    finally:
        gpuslots._close(*shares)
    slot.downgrade()
    assert slot.mode == gpuslots.SHARED


# ---- what a job process gets ------------------------------------------------------------------------

def _job(tmp_path, device="cuda", cuda=True, **env):
    environ = {gpuslots.FAKE_VAR: "2", **env}
    device = gpuslots.enter_job(device, environ=environ, cuda_available=lambda: cuda, directory=tmp_path)
    return device, environ


def test_pipeline_jobs_lock_different_gpus(tmp_path):
    _, first = _job(tmp_path, SHAPEWISE_PIPELINE_GPUS="0,1")
    _, second = _job(tmp_path, SHAPEWISE_PIPELINE_GPUS="0,1")
    assert (first["CUDA_VISIBLE_DEVICES"], first[gpuslots.SLOT_VAR]) == ("GPU-fake-0", "0")
    assert (second["CUDA_VISIBLE_DEVICES"], second[gpuslots.SLOT_VAR]) == ("GPU-fake-1", "1")
    assert first[gpuslots.SOURCE_VAR] == second[gpuslots.SOURCE_VAR] == "lock"


def test_user_cuda_visible_devices_is_honoured(tmp_path):
    # the run's pool is the user's GPU 1 (named by UUID): the job gets exactly that token
    _, env = _job(tmp_path, SHAPEWISE_PIPELINE_GPUS="1", CUDA_VISIBLE_DEVICES="GPU-fake-1")
    assert (env["CUDA_VISIBLE_DEVICES"], env[gpuslots.SLOT_VAR], env[gpuslots.SOURCE_VAR]) == (
        "GPU-fake-1", "1", "lock")
    _, env = _job(tmp_path, SHAPEWISE_PIPELINE_GPUS="0,1", CUDA_VISIBLE_DEVICES="1,0")
    assert (env["CUDA_VISIBLE_DEVICES"], env[gpuslots.SLOT_VAR]) == ("0", "0")  # GPU 1 is held above
    # a job run by hand, outside a pipeline, on the GPU the user chose: no locking
    _, env = _job(tmp_path, CUDA_VISIBLE_DEVICES="1")
    assert (env["CUDA_VISIBLE_DEVICES"], env[gpuslots.SLOT_VAR], env[gpuslots.SOURCE_VAR]) == ("1", "1", "user")


def test_slurm_gpu_is_used_without_locking(tmp_path):
    _, env = _job(tmp_path, SHAPEWISE_PIPELINE_GPUS="0,1", SHAPEWISE_PIPELINE_SLURM_JOB_ID="",
                  SLURM_JOB_ID="4242", CUDA_VISIBLE_DEVICES="1")
    assert (env["CUDA_VISIBLE_DEVICES"], env[gpuslots.SLOT_VAR], env[gpuslots.SOURCE_VAR]) == ("1", "1", "slurm")
    assert not list(tmp_path.glob("gpu-*.lock"))
    # Snakemake itself running inside the allocation (salloc): a local run, its jobs share the GPUs by slots
    _, env = _job(tmp_path, SHAPEWISE_PIPELINE_GPUS="0,1", SHAPEWISE_PIPELINE_SLURM_JOB_ID="4242",
                  SLURM_JOB_ID="4242")
    assert (env[gpuslots.SLOT_VAR], env[gpuslots.SOURCE_VAR]) == ("0", "lock")


def test_cpu_jobs_take_no_slot(tmp_path):
    device, env = _job(tmp_path, device="cpu", SHAPEWISE_PIPELINE_GPUS="0,1")
    assert (device, env[gpuslots.SOURCE_VAR], "CUDA_VISIBLE_DEVICES" in env) == ("cpu", "none", False)
    device, env = _job(tmp_path, device="auto", cuda=False, SHAPEWISE_PIPELINE_GPUS="")
    assert (device, env[gpuslots.SOURCE_VAR], gpuslots.SLOT_VAR in env) == ("cpu", "none", False)
    # auto on a machine whose torch sees no GPU: the slot taken first is given back
    device, env = _job(tmp_path, device="auto", cuda=False, SHAPEWISE_PIPELINE_GPUS="0")
    assert (device, env[gpuslots.SOURCE_VAR]) == ("cpu", "none")
    assert not gpuslots._HELD
    device = gpuslots.enter_job("auto", needs_gpu=False, environ={gpuslots.FAKE_VAR: "2"},
                                cuda_available=lambda: True, directory=tmp_path)
    assert device == "cuda" and not gpuslots._HELD


def _job_lock_dir(tmp_path):
    """The lock directory of a job that runs in tmp_path: a run's GPU locks live under its working directory."""
    return tmp_path / gpuslots.lock_dir().relative_to(paths.ROOT)


def _job_on_one_fake_gpu(tmp_path, step, *args):
    """`shapewise job STEP --device cuda ARGS` started on a fake 1-GPU pipeline pool, its output read line by line."""
    return subprocess.Popen([sys.executable, "-m", "shapewise", "job", step, "--device", "cuda", *args],
                            env=_env(**{gpuslots.FAKE_VAR: "1", gpuslots.POOL_VAR: "0"}),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path)


def test_cli_job_takes_its_slot_before_torch(tmp_path):
    """`shapewise job` on a fake 1-GPU pool whose GPU is held: the job waits, before importing torch."""
    pool = gpuslots.list_gpus({gpuslots.FAKE_VAR: "1"})
    held = gpuslots.acquire(pool, _job_lock_dir(tmp_path))
    try:
        proc = _job_on_one_fake_gpu(tmp_path, "fingerprint", "--kind", "environment", "--dag-digest", "x",
                                    "--root", str(ROOT), "--out", str(tmp_path / "fp.json"))
        try:
            line = proc.stdout.readline()
            assert "waiting for a free GPU" in line, line
        finally:
            proc.kill()
            proc.wait(timeout=30)
    finally:
        held.release()


def _preflight(path, job_bytes=None, **models):
    content = {"device": "cuda", "total_bytes": 150e9, "models": models}
    if job_bytes is not None:
        content["job_bytes"] = job_bytes
    path.write_text(json.dumps(content))
    return path


@pytest.mark.parametrize("job_bytes, models, parts, why", [
    # within one part of an H200's 25 GB with the allocator's headroom (15 GB x 1.35 = 20.3 GB); official row 6's
    # accuracy (21 GB, 28.4 GB with it) two
    ({"accuracy": 15.0e9}, {"reference": {"fits": True, "estimate_bytes": 19.7e9}}, 1, None),
    ({"accuracy": 21.0e9}, {"reference": {"fits": True, "estimate_bytes": 19.7e9}}, 2,
     "its accuracy job may take 21.0 GB (1.35 x that): 2 parts"),
    # a job of 3 parts of an H200's 6 with the allocator's headroom: 55 GB x 1.35 = 74.3 GB
    ({"accuracy": 55.0e9, "profile": 28.4e9}, {"reference": {"fits": False, "estimate_bytes": 1e14}}, 3,
     "its accuracy job may take 55.0 GB (1.35 x that): 3 parts of 25.0 GB"),
    # official row 14's on an H200: the chunked reference beside input and output, 62 GB: 84 GB with the headroom,
    # above half of the GPU, alone
    ({"accuracy": 62.4e9, "profile": 28.4e9}, {"reference": {"fits": False, "estimate_bytes": 1e14}}, None,
     "its accuracy job may take 62.4 GB, 1.35 x that above 3 of the GPU's 6 parts"),
    ({"accuracy": 151e9}, {}, None, "its accuracy job may take 151.0 GB, 1.35 x that above 3"),
    # a preflight without job estimates: its models', a model that does not fit taking the whole GPU
    (None, {"optimized": {"fits": True, "estimate_bytes": 1.3e9}, "reference": {"fits": True,
                                                                                "estimate_bytes": 15.7e9}}, 1, None),
    (None, {"optimized": {"fits": True, "estimate_bytes": 28.7e9}}, 2,
     "optimized model may take 28.7 GB (1.35 x that): 2 parts"),
    (None, {"optimized": {"fits": True, "estimate_bytes": 1e9}, "reference": {"fits": False, "estimate_bytes": 1e14}},
     None, "reference model does not fit in one pass"),
])
def test_a_sharing_job_takes_the_parts_of_the_gpu_its_memory_needs(tmp_path, job_bytes, models, parts, why):
    got_parts, got_why = gpuslots.memory_parts(_preflight(tmp_path / "preflight.json", job_bytes, **models),
                                               "accuracy")
    assert got_parts == parts
    assert (got_why is None) if why is None else (why in got_why and "preflight.json" in got_why)


def test_with_memory_parts_off_a_job_of_several_parts_holds_the_gpu_alone(tmp_path):
    preflight = _preflight(tmp_path / "preflight.json", {"accuracy": 55.0e9, "warmup": 1e9})
    off = {gpuslots.PARTS_VAR: "0"}
    parts, why = gpuslots.memory_parts(preflight, "accuracy", off)
    assert parts is None and "gpu_memory_parts is off" in why
    assert gpuslots.memory_parts(preflight, "warmup", off) == (1, None)
    assert gpuslots.memory_parts(preflight, "accuracy", {gpuslots.PARTS_VAR: "1"})[0] == 3


def test_no_memory_verdict_without_a_cuda_preflight(tmp_path):
    assert gpuslots.memory_parts(None, "accuracy") == (1, None)
    assert gpuslots.memory_parts(tmp_path / "missing.json", "accuracy") == (1, None)
    (tmp_path / "cpu.json").write_text(json.dumps({"device": "cpu", "total_bytes": 1e9,
                                                   "models": {"reference": {"fits": False}}}))
    assert gpuslots.memory_parts(tmp_path / "cpu.json", "accuracy") == (1, None)
    (tmp_path / "list.json").write_text("[1, 2]")
    assert gpuslots.memory_parts(tmp_path / "list.json", "accuracy") == (1, None)


def test_a_sharer_of_several_parts_takes_that_many_shares(tmp_path):
    pool = gpuslots.list_gpus({gpuslots.FAKE_VAR: "1"})
    n = gpuslots.SHARED_PER_GPU
    wide = gpuslots.acquire(pool, tmp_path, mode=gpuslots.SHARED, parts=n - 2, why="its accuracy job")
    record = wide.record()
    assert record["share_slots"] == list(range(n - 2)) and record["parts_because"] == "its accuracy job"
    assert gpuslots._try_shared(tmp_path, pool, parts=3) is None  # two shares left: nothing taken
    small = [gpuslots.acquire(pool, tmp_path, mode=gpuslots.SHARED, poll_s=0.01) for _ in range(2)]
    assert gpuslots._try_shared(tmp_path, pool) is None
    wide.release()
    again = gpuslots.acquire(pool, tmp_path, mode=gpuslots.SHARED, parts=n - 2, poll_s=0.01)
    assert sorted(again.share_indices + [i for s in small for i in s.share_indices]) == list(range(n))
    for slot in (again, *small):
        slot.release()
    with pytest.raises(gpuslots.GpuError, match="parts"):
        gpuslots.acquire(pool, tmp_path, mode=gpuslots.SHARED, parts=n + 1)


def test_only_a_sharer_whose_parts_came_from_an_estimate_keeps_its_allocator_to_them(tmp_path):
    from shapewise.jobs.device import memory_fraction

    pool = gpuslots.list_gpus({gpuslots.FAKE_VAR: "1"})
    capped = gpuslots.acquire(pool, tmp_path, mode=gpuslots.SHARED, parts=3, memory_cap=True)
    assert memory_fraction(capped) == 0.5 and capped.record()["memory_fraction"] == 0.5
    free = gpuslots.acquire(pool, tmp_path, mode=gpuslots.SHARED)  # a preflight's, a candidate's: no estimate
    assert memory_fraction(free) is None and "memory_fraction" not in free.record()
    assert memory_fraction(None) is None
    capped.release()
    free.release()
    alone = gpuslots.acquire(pool, tmp_path, mode=gpuslots.EXCLUSIVE)
    assert memory_fraction(alone) is None
    alone.release()


def test_a_profiling_sharer_never_runs_beside_a_sharer_of_several_parts(tmp_path):
    pool = gpuslots.list_gpus({gpuslots.FAKE_VAR: "1"})
    wide = gpuslots.acquire(pool, tmp_path, mode=gpuslots.SHARED, parts=2)
    assert gpuslots._try_shared(tmp_path, pool, profiling=True) is None
    plain = gpuslots.acquire(pool, tmp_path, mode=gpuslots.SHARED, poll_s=0.01)  # one that does not profile
    wide.release()
    profiling = gpuslots.acquire(pool, tmp_path, mode=gpuslots.SHARED, profiling=True, poll_s=0.01)
    also = gpuslots.acquire(pool, tmp_path, mode=gpuslots.SHARED, profiling=True, poll_s=0.01)  # profilers share
    # a sharer of several parts waits for the profilers, and keeps new ones out while it waits
    waiting = {}
    assert gpuslots._try_shared(tmp_path, pool, parts=2, waiting=waiting) is None and "gate" in waiting
    assert gpuslots._try_shared(tmp_path, pool, profiling=True) is None
    for slot in (profiling, also):
        slot.release()
    got = gpuslots._try_shared(tmp_path, pool, parts=2, waiting=waiting)
    assert got is not None and not waiting
    gpuslots._close(got[1], *got[2], got[4])
    plain.release()


def test_a_sharer_of_several_parts_gathers_them_as_they_free_up(tmp_path):
    """It keeps the shares it got from one round to the next, so one-part sharers coming and going never starve it;
    and it lets them go while a job that times waits for the GPU."""
    pool = gpuslots.list_gpus({gpuslots.FAKE_VAR: "1"})
    n = gpuslots.SHARED_PER_GPU
    small = [gpuslots.acquire(pool, tmp_path, mode=gpuslots.SHARED) for _ in range(n - 1)]
    waiting = {}
    assert gpuslots._try_shared(tmp_path, pool, parts=3, waiting=waiting) is None
    assert len(waiting["shares"]) == 1
    assert gpuslots._try_shared(tmp_path, pool) is None  # the free share is the gathering job's
    small.pop().release()
    assert gpuslots._try_shared(tmp_path, pool, parts=3, waiting=waiting) is None and len(waiting["shares"]) == 2
    # a job that times comes: the gatherer lets its shares go (keeping its wide gate), and takes them again after
    alone = []
    import threading
    t = threading.Thread(target=lambda: alone.append(gpuslots.acquire(pool, tmp_path, poll_s=0.01)))
    t.start()
    time.sleep(0.3)  # the exclusive job holds the gate, waiting for the sharers
    assert gpuslots._try_shared(tmp_path, pool, parts=3, waiting=waiting) is None
    assert not waiting.get("shares") and "gate" in waiting
    for slot in small:
        slot.release()
    t.join(timeout=10)
    assert alone and alone[0].mode == gpuslots.EXCLUSIVE
    alone[0].release()
    got = gpuslots._try_shared(tmp_path, pool, parts=3, waiting=waiting)
    assert got is not None and got[3] == [0, 1, 2] and not waiting
    gpuslots._close(got[1], *got[2], got[4])


def test_a_sharing_job_of_a_heavy_row_takes_its_gpu_alone_and_says_why(tmp_path):
    """`shapewise job accuracy` whose row's preflight leaves too little memory for sharers: on a fake 1-GPU pool
    that another job shares, it asks for the GPU alone (and waits for the sharer), before importing torch."""
    pool = gpuslots.list_gpus({gpuslots.FAKE_VAR: "1"})
    preflight = _preflight(tmp_path / "preflight.json", reference={"fits": False, "estimate_bytes": 1e14})
    sharer = gpuslots.acquire(pool, _job_lock_dir(tmp_path), mode=gpuslots.SHARED)
    try:
        proc = _job_on_one_fake_gpu(tmp_path, "accuracy", "--row", "{}", "--preflight", str(preflight),
                                    "--chunked", "{}", "--out", str(tmp_path / "acc.json"))
        try:
            first, second = proc.stdout.readline(), proc.stdout.readline()
            assert "holds its GPU alone" in first and "does not fit in one pass" in first, first
            assert "waiting for a free GPU (exclusive)" in second, second
        finally:
            proc.kill()
            proc.wait(timeout=30)
    finally:
        sharer.release()


def test_a_sharing_job_of_a_wide_row_takes_several_parts_and_says_why(tmp_path):
    pool = gpuslots.list_gpus({gpuslots.FAKE_VAR: "1"})
    preflight = _preflight(tmp_path / "preflight.json", {"accuracy": 55.0e9})
    sharers = [gpuslots.acquire(pool, _job_lock_dir(tmp_path), mode=gpuslots.SHARED) for _ in range(4)]
    try:
        proc = _job_on_one_fake_gpu(tmp_path, "accuracy", "--row", "{}", "--preflight", str(preflight),
                                    "--chunked", "{}", "--out", str(tmp_path / "acc.json"))
        try:
            first, second = proc.stdout.readline(), proc.stdout.readline()
            assert "takes 3 parts of its GPU" in first and "55.0 GB" in first, first
            assert "waiting for a free GPU (shared, 3 parts)" in second, second
        finally:
            proc.kill()
            proc.wait(timeout=30)
    finally:
        for slot in sharers:
            slot.release()


@pytest.mark.parametrize("estimate, first", [
    (5.0e9, "prepares sharing its GPU, then holds it alone for what it times"),
    (55.0e9, "holds its GPU alone from the start: its timing job may take 55.0 GB (1.35 x that): 3 parts"),
])
def test_with_prepare_shared_a_timing_job_shares_its_gpu_while_its_estimate_takes_one_part(tmp_path, estimate,
                                                                                           first):
    pool = gpuslots.list_gpus({gpuslots.FAKE_VAR: "1"})
    preflight = _preflight(tmp_path / "preflight.json", {"timing": estimate})
    sharer = gpuslots.acquire(pool, _job_lock_dir(tmp_path), mode=gpuslots.SHARED)
    args = ("--row", "{}", "--preflight", str(preflight), "--microbench", "m.json", "--protocol", "{}", "--out",
            str(tmp_path / "t.json"))
    try:
        proc = subprocess.Popen([sys.executable, "-m", "shapewise", "job", "timing", "--device", "cuda", *args],
                                env=_env(**{gpuslots.FAKE_VAR: "1", gpuslots.POOL_VAR: "0",
                                            gpuslots.PREPARE_VAR: "1"}),
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path)
        try:
            line = proc.stdout.readline()
            assert first in line, line
            if estimate > 10e9:  # alone: it waits for the sharer
                assert "waiting for a free GPU (exclusive)" in proc.stdout.readline()
            else:  # a sharer beside the other: it gets in
                assert "sharing GPU 0" in proc.stdout.readline()
        finally:
            proc.kill()
            proc.wait(timeout=30)
    finally:
        sharer.release()


def test_the_lock_records_why_a_job_of_a_sharing_step_holds_it_alone(tmp_path):
    pool = gpuslots.list_gpus({gpuslots.FAKE_VAR: "1"})
    slot = gpuslots.acquire(pool, tmp_path, mode=gpuslots.EXCLUSIVE, why="its row's memory")
    assert slot.record()["alone_because"] == "its row's memory"
    slot.release()
    assert "alone_because" not in gpuslots.acquire(pool, tmp_path, mode=gpuslots.EXCLUSIVE).record()


# ---- Snakemake: the gpu resource is the pool's size ----------------------------------------------------

def _snakemake(*args, env=None, cwd=ROOT, timeout=300):
    return subprocess.run([sys.executable, "-m", "snakemake", *args], cwd=cwd, env=env or _env(),
                          capture_output=True, text=True, timeout=timeout, check=False)


def test_dry_run_takes_the_gpu_count_from_the_pool():
    env = _env(**{gpuslots.FAKE_VAR: "2"})
    done = _snakemake("-n", "--cores", "all", "--config", "shapes=smoke", env=env)
    assert done.returncode == 0, done.stderr
    assert "GPU pool: 0,1; at most 2 GPU job(s) at once (gpu resource, from this machine's GPU pool)" in done.stderr
    assert f"(gpu_share resource {2 * gpuslots.SHARED_PER_GPU})" in done.stderr
    done = _snakemake("-n", "--cores", "all", "--config", "shapes=smoke", "--resources", "gpu=1", env=env)  # wins
    assert "at most 1 GPU job(s) at once (gpu resource, from --resources)" in done.stderr
    assert f"(gpu_share resource {gpuslots.SHARED_PER_GPU})" in done.stderr  # the shares follow it
    # device cpu: no pool, the device jobs one at a time as before
    cpu_line = ("GPU pool: none: device cpu (config device or SHAPEWISE_DEVICE); the jobs run shapes/smoke.yaml on the "
                "CPU, one device job at a time")
    done = _snakemake("-n", "--cores", "all", "--config", "shapes=smoke", "device=cpu", env=env)
    assert cpu_line in done.stderr, done.stderr
    done = _snakemake("-n", "--cores", "all", "--config", "shapes=smoke", "gpus=0,3", env=env)
    assert done.returncode != 0
    assert ("config gpus='0,3': '3' names no GPU; the GPUs here are 0 (GPU-fake-0), 1 (GPU-fake-1)"
            in done.stdout + done.stderr)


MINI = """
import sys
sys.path.insert(0, {workflow!r})
DEVICE_ARG = "auto"
config.setdefault("gpus", "all")
config.setdefault("gpu_memory_parts", True)
config.setdefault("gpu_prepare_shared", False)
include: {gpus_smk!r}

rule all:
    input: expand("out/{{i}}.json", i=range(4))

rule job:
    output: "out/{{i}}.json"
    log: "logs/{{i}}.log"
    resources: gpu=1
    shell: "PYTHONPATH={workflow} {python} {job} {{output}} locks > {{log}} 2>&1"
"""

MINI_JOB = """
import json, os, sys, time
from shapewise.execution import gpuslots
device = gpuslots.enter_job("cuda", directory=sys.argv[2])
start = time.time()
time.sleep(1.5)
json.dump({"slot": os.environ[gpuslots.SLOT_VAR], "cvd": os.environ["CUDA_VISIBLE_DEVICES"],
           "source": os.environ[gpuslots.SOURCE_VAR], "start": start, "end": time.time()}, open(sys.argv[1], "w"))
"""


def _mini_run(tmp_path, *args):
    (tmp_path / "job.py").write_text(MINI_JOB)
    (tmp_path / "Snakefile").write_text(MINI.format(workflow=str(WORKFLOW), python=sys.executable,
                                                    gpus_smk=str(WORKFLOW / "rules" / "gpus.smk"),
                                                    job=tmp_path / "job.py"))
    done = _snakemake("--cores", "4", "--workflow-profile", "none", *args,
                      env=_env(**{gpuslots.FAKE_VAR: "2"}), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    jobs = [json.loads((tmp_path / "out" / f"{i}.json").read_text()) for i in range(4)]
    logs = [(tmp_path / "logs" / f"{i}.log").read_text() for i in range(4)]
    overlaps = [(a, b) for i, a in enumerate(jobs) for b in jobs[i + 1:]
                if a["start"] < b["end"] and b["start"] < a["end"]]
    return jobs, logs, overlaps


def test_snakemake_runs_one_job_per_fake_gpu(tmp_path):
    jobs, logs, overlaps = _mini_run(tmp_path)
    assert {j["slot"] for j in jobs} == {"0", "1"}
    assert {j["source"] for j in jobs} == {"lock"}
    assert overlaps, "two fake GPUs but no two jobs ran at once"
    assert all(a["slot"] != b["slot"] for a, b in overlaps)
    # Snakemake itself kept it to 2 at once: no job had to wait for a slot
    assert not any("waiting for a free GPU" in log for log in logs)


def test_resources_on_the_command_line_win(tmp_path):
    _, _, overlaps = _mini_run(tmp_path, "--resources", "gpu=1")
    assert not overlaps


MIXED = """
import sys
sys.path.insert(0, {workflow!r})
DEVICE_ARG = "auto"
config.setdefault("gpus", "all")
config.setdefault("gpu_memory_parts", True)
config.setdefault("gpu_prepare_shared", False)
include: {gpus_smk!r}

rule all:
    input: expand("out/shared{{i}}.json", i=range(6)), expand("out/alone{{i}}.json", i=range(3))

rule shared:
    output: "out/shared{{i}}.json"
    log: "logs/shared{{i}}.log"
    resources: **gpu_resources("accuracy")
    shell: "PYTHONPATH={workflow} {python} {job} {{output}} locks shared > {{log}} 2>&1"

rule alone:
    output: "out/alone{{i}}.json"
    log: "logs/alone{{i}}.log"
    resources: **gpu_resources("timing")
    shell: "PYTHONPATH={workflow} {python} {job} {{output}} locks exclusive > {{log}} 2>&1"
"""

MIXED_JOB = """
import json, os, sys, time
from shapewise.execution import gpuslots
device = gpuslots.enter_job("cuda", directory=sys.argv[2], mode=sys.argv[3])
start = time.time()
time.sleep(1.0)
json.dump({"slot": os.environ[gpuslots.SLOT_VAR], "mode": sys.argv[3], "start": start, "end": time.time()},
          open(sys.argv[1], "w"))
"""


PREPARING_JOB = """
import json, os, sys, time
from shapewise.execution import gpuslots
mode = sys.argv[3]
device = gpuslots.enter_job("cuda", directory=sys.argv[2], mode=gpuslots.SHARED if mode == "prepare" else mode)
start = time.time()
intervals = []
if mode == "prepare":  # builds sharing the GPU, then times holding it alone
    time.sleep(0.6)
    intervals.append({{"mode": "shared", "start": start, "end": time.time()}})
    gpuslots.held().upgrade(poll_s=0.02)
    start = time.time()
time.sleep(0.6)
intervals.append({{"mode": "exclusive" if mode != "shared" else "shared", "start": start, "end": time.time()}})
json.dump({{"slot": os.environ[gpuslots.SLOT_VAR], "intervals": intervals}}, open(sys.argv[1], "w"))
"""


def test_with_prepare_shared_jobs_that_time_build_beside_sharers_and_time_alone(tmp_path):
    """config gpu_prepare_shared: Snakemake starts the jobs of a preparing step as sharers; each builds beside the
    others, then holds the GPU alone, never beside another job."""
    (tmp_path / "job.py").write_text(PREPARING_JOB.format())
    snakefile = MIXED.format(workflow=str(WORKFLOW), python=sys.executable, gpus_smk=str(WORKFLOW / "rules" / "gpus.smk"),
                             job=tmp_path / "job.py").replace("locks exclusive", "locks prepare")
    (tmp_path / "Snakefile").write_text(snakefile.replace('config.setdefault("gpu_prepare_shared", False)',
                                                          'config.setdefault("gpu_prepare_shared", True)'))
    done = _snakemake("--cores", "8", "--workflow-profile", "none", env=_env(**{gpuslots.FAKE_VAR: "1"}),
                      cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    spans = [dict(i, job=p.stem) for p in sorted((tmp_path / "out").glob("*.json"))
             for i in json.loads(p.read_text())["intervals"]]
    pairs = [(a, b) for i, a in enumerate(spans) for b in spans[i + 1:] if a["job"] != b["job"] and _overlap(a, b)]
    assert all(a["mode"] == b["mode"] == "shared" for a, b in pairs), "a job timed beside another"
    preparing = [s for s in spans if s["job"].startswith("alone") and s["mode"] == "shared"]
    assert len(preparing) == 3 and any(_overlap(p, s) for p in preparing for s in spans if s is not p)


@pytest.mark.parametrize("gpus", [1, 2])
def test_snakemake_shares_gpus_among_jobs_that_time_nothing_only(tmp_path, gpus):
    (tmp_path / "job.py").write_text(MIXED_JOB)
    (tmp_path / "Snakefile").write_text(MIXED.format(workflow=str(WORKFLOW), python=sys.executable,
                                                     gpus_smk=str(WORKFLOW / "rules" / "gpus.smk"),
                                                     job=tmp_path / "job.py"))
    done = _snakemake("--cores", "8", "--workflow-profile", "none", env=_env(**{gpuslots.FAKE_VAR: str(gpus)}),
                      cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    jobs = [json.loads(p.read_text()) for p in sorted((tmp_path / "out").glob("*.json"))]
    pairs = [(a, b) for i, a in enumerate(jobs) for b in jobs[i + 1:] if _overlap(a, b)]
    same_gpu = [(a, b) for a, b in pairs if a["slot"] == b["slot"]]
    assert same_gpu and all(a["mode"] == b["mode"] == "shared" for a, b in same_gpu)
    for t in sorted(j["start"] for j in jobs):  # at most SHARED_PER_GPU sharers on a GPU at any time
        for slot in {j["slot"] for j in jobs}:
            assert sum(j["start"] <= t < j["end"] and j["slot"] == slot for j in jobs) <= gpuslots.SHARED_PER_GPU
    if gpus == 1:  # Snakemake itself starts nothing beside a job that times: no job waited for the lock
        logs = [p.read_text() for p in (tmp_path / "logs").glob("*.log")]
        assert not any("waiting for a free GPU" in log for log in logs)
    else:
        assert any(a["slot"] != b["slot"] for a, b in pairs)


# ---- evidence from result files ------------------------------------------------------------------------

def _result(path, gpu, start, end, host="node1", block=True, source="lock"):
    data = {"step": "timing", "device": "cuda", "started": f"2026-11-30T10:{start}+00:00",
            "finished": f"2026-11-30T10:{end}+00:00",
            "environment": {"host": host, "shapewise_variables": {gpuslots.SLOT_VAR: gpu,
                                                                  gpuslots.SOURCE_VAR: source}}}
    if block:
        data["gpu"] = {"index": 0, "uuid": f"GPU-{gpu}", "slot": gpu, "slot_source": source,
                       "cuda_visible_devices": f"GPU-{gpu}"}  # index: torch's, among the visible GPUs
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))


def test_check_passes_two_gpus_overlapping(tmp_path, capsys):
    _result(tmp_path / "timing" / "a.json", "0", "00:00", "01:00")
    _result(tmp_path / "timing" / "b.json", "1", "00:30", "01:30")
    _result(tmp_path / "accuracy" / "c.json", "0", "01:00", "02:00", block=False)  # starts as a ends
    (tmp_path / "report").mkdir()
    (tmp_path / "report" / "other.json").write_text("[1, 2]")
    # the report's copies of the results are the same jobs, not jobs of their own on the same GPU
    _result(tmp_path / "report" / "data" / "timing" / "a.json", "0", "00:00", "01:00")
    _result(tmp_path / "report-run1" / "data" / "timing" / "a.json", "0", "00:00", "01:00")
    assert gpuslots.check_main(tmp_path) == 0
    out = capsys.readouterr().out
    # c.json names only its slot (0): the same GPU as a.json's GPU-0
    assert "3 GPU job results" in out and "GPU GPU-0 (node1): 2 jobs" in out and "GPU GPU-1 (node1): 1 jobs" in out


def test_check_fails_on_shared_gpu_or_one_gpu(tmp_path, capsys):
    _result(tmp_path / "timing" / "a.json", "0", "00:00", "01:00")
    _result(tmp_path / "timing" / "b.json", "0", "00:59", "01:30")
    summary = gpuslots.check_intervals(gpuslots.job_intervals(tmp_path))
    assert len(summary["shared"]) == 1 and "a.json" in summary["shared"][0] and "b.json" in summary["shared"][0]
    assert any("fewer than 2" in p for p in summary["problems"])
    assert gpuslots.check_main(tmp_path) == 1
    # two GPUs, but one after the other: no evidence of running at once
    other = tmp_path / "seq"
    _result(other / "a.json", "0", "00:00", "01:00")
    _result(other / "b.json", "1", "01:00", "02:00")
    problems = gpuslots.check_intervals(gpuslots.job_intervals(other))["problems"]
    assert problems == ["no two GPU jobs ran at overlapping times on different GPUs"]
    # the same index on two hosts is two GPUs
    hosts = tmp_path / "hosts"
    _result(hosts / "a.json", "0", "00:00", "01:00", host="n1")
    _result(hosts / "b.json", "0", "00:30", "01:30", host="n2", source="slurm")
    summary = gpuslots.check_intervals(gpuslots.job_intervals(hosts))
    assert summary["shared"] == [] and summary["concurrent_pairs"] == 1
    assert summary["problems"] == ["jobs whose slot source is not 'lock': ['slurm']"]


def test_gpus_check_command(tmp_path, capsys):
    from shapewise.cli import main

    _result(tmp_path / "timing" / "a.json", "0", "00:00", "01:00")
    _result(tmp_path / "timing" / "b.json", "1", "00:30", "01:30")
    assert main(["gpus", "check", str(tmp_path)]) == 0
    assert main(["gpus", "check", str(tmp_path), "--min-gpus", "3"]) == 1
    assert "FAIL: GPU jobs ran on 2 GPU(s), fewer than 3" in capsys.readouterr().out


def test_check_of_a_one_gpu_run_says_what_it_checked(tmp_path, capsys):
    _result(tmp_path / "timing" / "a.json", "0", "00:00", "01:00")
    _result(tmp_path / "accuracy" / "b.json", "0", "01:00", "02:00")
    assert gpuslots.check_main(tmp_path, min_gpus=1) == 0
    out = capsys.readouterr().out
    assert "OK: never two jobs at once on one GPU (1 GPU(s) used)" in out and "several GPUs" not in out
    _result(tmp_path / "timing" / "c.json", "0", "01:30", "02:30")  # overlaps b on the same GPU
    assert gpuslots.check_main(tmp_path, min_gpus=1) == 1


def test_check_lets_jobs_that_time_nothing_share_a_gpu_and_no_one_else(tmp_path, capsys):
    def shared(path, start, end, mode=gpuslots.SHARED):
        _result(path, "0", start, end)
        data = json.loads(path.read_text())
        data["gpu"]["lock"] = {"mode": mode, "gpu": "0"}
        path.write_text(json.dumps(data))

    shared(tmp_path / "accuracy" / "a.json", "00:00", "01:00")
    shared(tmp_path / "profile" / "a.json", "00:30", "01:30")
    _result(tmp_path / "timing" / "a.json", "0", "01:30", "02:30")  # after both: alone
    summary = gpuslots.check_intervals(gpuslots.job_intervals(tmp_path), min_gpus=1)
    assert summary["problems"] == [] and summary["sharing_pairs"] == 1
    assert gpuslots.check_main(tmp_path, min_gpus=1) == 0
    assert "OK: never a job that times beside another job on its GPU (1 GPU(s) used)" in capsys.readouterr().out
    shared(tmp_path / "ablation" / "a.json", "01:00", "01:45", mode=gpuslots.EXCLUSIVE)  # beside a sharer, and timing
    summary = gpuslots.check_intervals(gpuslots.job_intervals(tmp_path), min_gpus=1)
    assert len(summary["shared"]) == 2 and all("ablation" in line for line in summary["shared"])
    assert gpuslots.check_main(tmp_path, min_gpus=1) == 1


def _held(path, start, end, **lock):
    """A result on GPU 0 whose lock record is `lock`."""
    _result(path, "0", start, end)
    data = json.loads(path.read_text())
    data["gpu"]["lock"] = dict(lock, gpu="0")
    path.write_text(json.dumps(data))


def test_a_holder_that_shared_its_gpu_from_some_time_on_is_alone_only_until_then(tmp_path):
    # a profile that chose a kernel alone until 00:20, then shared; a warm-up sharing from 00:30 on
    _held(tmp_path / "profile" / "a.json", "00:00", "01:00", mode=gpuslots.SHARED,
         shared_since="2026-11-30T10:00:20.000+00:00")
    _held(tmp_path / "warmup" / "a.json", "00:30", "01:30", mode=gpuslots.SHARED)
    summary = gpuslots.check_intervals(gpuslots.job_intervals(tmp_path), min_gpus=1)
    assert summary["problems"] == [] and summary["sharing_pairs"] == 1
    _held(tmp_path / "accuracy" / "a.json", "00:10", "00:25", mode=gpuslots.SHARED)  # while the profile was alone
    summary = gpuslots.check_intervals(gpuslots.job_intervals(tmp_path), min_gpus=1)
    assert len(summary["shared"]) == 1 and "profile" in summary["shared"][0] and "accuracy" in summary["shared"][0]


def test_a_job_that_prepared_sharing_is_alone_only_from_when_it_held_the_gpu_alone(tmp_path):
    # a timing job that shared until 00:20, waited, and held the GPU alone from 00:25; an accuracy job sharing
    # 00:10-00:24 beside its preparation, one 00:21-00:26 that overlaps its time alone
    _held(tmp_path / "timing" / "a.json", "00:00", "01:00", mode=gpuslots.EXCLUSIVE,
         acquired="2026-11-30T10:00:00.500+00:00", shared_until="2026-11-30T10:00:20.000+00:00",
         alone_since="2026-11-30T10:00:25.000+00:00")
    _held(tmp_path / "accuracy" / "a.json", "00:10", "00:24", mode=gpuslots.SHARED)
    records = gpuslots.job_intervals(tmp_path)
    timing = sorted((r for r in records if "timing" in r["file"]), key=lambda r: r["start"])
    assert [(r["mode"], f"{r['start']:%M:%S}", f"{r['end']:%M:%S}") for r in timing] == [
        (gpuslots.SHARED, "00:00", "00:20"), (gpuslots.EXCLUSIVE, "00:25", "01:00")]
    summary = gpuslots.check_intervals(records, min_gpus=1)
    assert summary["problems"] == [] and summary["sharing_pairs"] == 1
    _held(tmp_path / "profile" / "a.json", "00:21", "00:26", mode=gpuslots.SHARED)
    summary = gpuslots.check_intervals(gpuslots.job_intervals(tmp_path), min_gpus=1)
    assert len(summary["shared"]) == 1 and "timing" in summary["shared"][0] and "profile" in summary["shared"][0]


def test_a_job_alone_for_less_than_a_second_ends_when_its_lock_record_says(tmp_path):
    # two ablations preparing side by side: a shares until 00:55.133 then waits; b, alone from 00:55.278, ends
    # within that second. Its whole-second `finished` (00:55) falls before its `alone_since`: its lock's `ended`
    # (milliseconds) gives the end, and without it the end is taken as no earlier than `alone_since`, never as a
    # time alone that began at 00:55.000, inside a's shared interval.
    ms = "2026-11-30T10:{}+00:00".format
    _held(tmp_path / "ablation" / "a.json", "00:50", "01:06", mode=gpuslots.EXCLUSIVE, acquired=ms("00:50.412"),
          shared_until=ms("00:55.133"), alone_since=ms("01:06.164"), ended=ms("01:06.900"))
    _held(tmp_path / "ablation" / "b.json", "00:50", "00:55", mode=gpuslots.EXCLUSIVE, acquired=ms("00:50.421"),
          shared_until=ms("00:54.674"), alone_since=ms("00:55.278"), ended=ms("00:55.903"))
    records = gpuslots.job_intervals(tmp_path)
    b = sorted((r for r in records if r["file"].endswith("b.json")), key=lambda r: r["start"])
    assert [(r["mode"], f"{r['start']:%S.%f}"[:6], f"{r['end']:%S.%f}"[:6]) for r in b] == [
        (gpuslots.SHARED, "50.421", "54.674"), (gpuslots.EXCLUSIVE, "55.278", "55.903")]
    assert gpuslots.check_intervals(records, min_gpus=1)["problems"] == []
    for path in (tmp_path / "ablation").glob("*.json"):  # results without `ended`: the whole-second reading
        data = json.loads(path.read_text())
        del data["gpu"]["lock"]["ended"]
        path.write_text(json.dumps(data))
    records = gpuslots.job_intervals(tmp_path)
    b = sorted((r for r in records if r["file"].endswith("b.json")), key=lambda r: r["start"])
    assert [(r["mode"], f"{r['start']:%S.%f}"[:6], f"{r['end']:%S.%f}"[:6]) for r in b] == [
        (gpuslots.SHARED, "50.421", "54.674"), (gpuslots.EXCLUSIVE, "55.278", "55.278")]
    assert gpuslots.check_intervals(records, min_gpus=1)["problems"] == []
    _held(tmp_path / "profile" / "a.json", "00:55", "00:58", mode=gpuslots.SHARED,
          acquired=ms("00:55.200"))  # beside b's time alone, which began at 00:55.278: found
    assert gpuslots.check_intervals(gpuslots.job_intervals(tmp_path), min_gpus=1)["shared"]


def test_a_result_under_the_lock_without_its_mode_held_the_gpu_as_its_step_does(tmp_path, capsys):
    # candidate results written before their child process recorded the job's lock
    _result(tmp_path / "candidates" / "c" / "accuracy" / "a.json", "0", "00:00", "01:00")
    _result(tmp_path / "candidates" / "c" / "timing" / "a.json", "0", "02:00", "03:00")
    for name, step in (("accuracy", "candidate-accuracy"), ("timing", "candidate-timing")):
        path = tmp_path / "candidates" / "c" / name / "a.json"
        path.write_text(json.dumps(dict(json.loads(path.read_text()), step=step)))
    _held(tmp_path / "accuracy" / "a.json", "00:30", "01:30", mode=gpuslots.SHARED)
    assert gpuslots.check_main(tmp_path, min_gpus=1) == 0
    assert "2 results under the lock record no lock mode" in capsys.readouterr().out
    _held(tmp_path / "profile" / "a.json", "02:30", "02:40", mode=gpuslots.SHARED)  # beside a timing job
    assert gpuslots.check_main(tmp_path, min_gpus=1) == 1
    assert "timing/a.json" in capsys.readouterr().out


def test_a_job_is_on_its_gpu_from_its_lock_acquisition_not_its_whole_second_start(tmp_path):
    """A profile alone until 00:14.314, then shared; a warm-up whose result says it started at 00:14 (whole
    seconds) but took its shared lock at 00:14.386: no overlap with the profile's time alone (the H200 run of
    2026-12-02 had this pair)."""
    _held(tmp_path / "profile" / "a.json", "00:12", "00:19", mode=gpuslots.SHARED,
         acquired="2026-11-30T10:00:12.466+00:00", shared_since="2026-11-30T10:00:14.314+00:00")
    _held(tmp_path / "warmup" / "a.json", "00:14", "00:40", mode=gpuslots.SHARED,
         acquired="2026-11-30T10:00:14.386+00:00")
    summary = gpuslots.check_intervals(gpuslots.job_intervals(tmp_path), min_gpus=1)
    assert summary["problems"] == [] and summary["shared"] == [] and summary["sharing_pairs"] == 1
    _held(tmp_path / "accuracy" / "a.json", "00:13", "00:16", mode=gpuslots.SHARED,
         acquired="2026-11-30T10:00:13.900+00:00")  # took its lock while the profile was alone: reported
    summary = gpuslots.check_intervals(gpuslots.job_intervals(tmp_path), min_gpus=1)
    assert len(summary["shared"]) == 1 and "accuracy" in summary["shared"][0]


def test_a_result_records_its_lock_as_held_when_written(tmp_path, monkeypatch):
    from shapewise.jobs import io

    class Slot:
        def record(self):
            return {"mode": gpuslots.SHARED, "shared_since": "2026-11-30T10:00:20.000+00:00"}

    monkeypatch.setattr(gpuslots, "held", lambda: Slot())
    out = tmp_path / "r.json"
    io.write_result(out, {"step": "profile", "gpu": {"uuid": "GPU-0", "lock": {"mode": gpuslots.EXCLUSIVE}}})
    lock = json.loads(out.read_text())["gpu"]["lock"]
    assert lock["shared_since"] == "2026-11-30T10:00:20.000+00:00"
    ended = gpuslots._parse_time(lock["ended"])  # milliseconds, with its zone: the end job_intervals reads
    assert len(lock["ended"].split("T")[1].split(".")[1]) == 3 + 6 and ended <= datetime.now(timezone.utc)
    io.write_result(out, {"step": "accuracy", "gpu": None})  # a CPU job: nothing to record
    assert json.loads(out.read_text())["gpu"] is None


CHILD_OF_A_JOB = textwrap.dedent("""
    import json, sys
    from shapewise.execution import gpuslots
    gpuslots.take_over(json.loads(sys.stdin.read()))
    slot = gpuslots.held()
    print(json.dumps({"record": slot.record(), "others": [n["job"] for n in slot.others_now()]}))
""")


def test_a_child_of_a_job_records_the_jobs_lock_and_sees_the_other_holders_not_its_parent(tmp_path):
    # a candidate's child does the job's GPU work: its result must say how the job holds the GPU
    h = Holders(tmp_path)
    other = h.start(gpuslots.SHARED, 3.0)
    h.wait_held(other)
    slot = gpuslots.acquire(gpuslots.list_gpus({gpuslots.FAKE_VAR: "1"}), tmp_path / "locks", label="parent job",
                            mode=gpuslots.SHARED)
    handed = gpuslots.hand_over()
    assert handed["pid"] == os.getpid() and handed["record"]["mode"] == gpuslots.SHARED
    done = subprocess.run([sys.executable, "-c", CHILD_OF_A_JOB], input=json.dumps(handed), env=_env(),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    assert seen["record"] == slot.record()
    assert seen["others"] == [str(tmp_path / "holder0.json")]  # the other sharer; the parent is not "another job"
    slot.release()
    h.results()
    gpuslots.take_over(None)  # a job without a slot hands over nothing: the child holds nothing either
    assert gpuslots.held() is None


def test_on_slot_runs_with_the_slot_set_and_before_auto_is_resolved(tmp_path):
    # `auto` imports torch to ask for CUDA: the CPU pinning (on_slot) must come first, with the slot known
    order = []
    environ = {gpuslots.FAKE_VAR: "2", gpuslots.POOL_VAR: "0,1"}
    device = gpuslots.enter_job(
        "auto", environ=environ, directory=tmp_path,
        cuda_available=lambda: order.append("cuda check") or True,
        on_slot=lambda: order.append(("on_slot", environ[gpuslots.SOURCE_VAR], environ[gpuslots.SLOT_VAR])))
    assert device == "cuda" and order == [("on_slot", "lock", "0"), "cuda check"]


# ---- the run: what its jobs inherit, set once per invocation (shapewise.execution.runs.begin) ---------------

def test_a_run_begins_with_its_pool_identity_and_triton_cache_for_its_jobs(tmp_path):
    from shapewise.execution import jobserver, runs

    pool = gpuslots.resolve_pool("all", {gpuslots.FAKE_VAR: "2"})
    environ = {"SLURM_JOB_ID": "77"}
    marker = runs.begin(pool, ["snakemake", "--cores", "all"], environ=environ, directory=tmp_path)
    assert environ[gpuslots.POOL_VAR] == "0,1" and environ[gpuslots.RUN_SLURM_VAR] == "77"
    assert environ[jobserver.RUN_VAR] == jobserver.run_id() and jobserver.run_alive(environ[jobserver.RUN_VAR])
    assert environ["TRITON_CACHE_DIR"] == str(paths.TRITON_CACHE) and environ[gpuslots.PARTS_VAR] == "1"
    assert runs.read_marker(environ[jobserver.RUN_VAR], tmp_path) == marker
    assert [g["uuid"] for g in marker["gpus"]] == ["GPU-fake-0", "GPU-fake-1"]
    assert marker["command"] == ["snakemake", "--cores", "all"]
    # the user's own Triton cache is kept; no pool (a CPU run) is an empty one
    environ = {"TRITON_CACHE_DIR": str(tmp_path / "mine")}
    marker = runs.begin([], [], environ=environ, directory=tmp_path)
    assert environ[gpuslots.POOL_VAR] == "" and environ[gpuslots.RUN_SLURM_VAR] == ""
    assert marker["triton_cache"] == {"dir": str(tmp_path / "mine"), "entries_at_start": 0}
