"""GPU slots for local runs: each GPU job holds one physical GPU of its own for its whole run.

The pool is the GPUs `nvidia-smi -L` lists, narrowed to those in CUDA_VISIBLE_DEVICES when the user set it,
then to the config knob `gpus` (all | a count | a list of GPU ids). The Snakefile resolves it once at parse
time (workflow/rules/gpus.smk): Snakemake's global `gpu` resource becomes the pool's size (unless
`--resources gpu=K` was given) and the pool's indices go to every job in SHAPEWISE_PIPELINE_GPUS.

A job (shapewise.cli.run_job, before anything imports torch) takes a free slot: one file per GPU under
LOCK_ROOT/<host>/, locked with flock. The kernel releases the lock when the process ends, crashes or is killed,
so a lock file left behind never blocks anything. When every slot is held the job waits, with a log line; two
jobs never share a GPU. The job then runs with CUDA_VISIBLE_DEVICES set to its GPU (the user's own token for
it when the user set CUDA_VISIBLE_DEVICES, else the GPU's UUID, which names it whatever CUDA_DEVICE_ORDER
is) and records the slot in SHAPEWISE_PIPELINE_GPU_SLOT / SHAPEWISE_PIPELINE_GPU_SLOT_SOURCE.

A job that SLURM started (SLURM_JOB_ID differs from the one Snakemake itself ran under) uses the GPU SLURM gave
it and locks nothing. A run of Snakemake inside a SLURM allocation (salloc) is a local run: its jobs share the
allocation's GPUs through the slots.

Tests and CPU machines: SHAPEWISE_PIPELINE_FAKE_GPUS=N, set explicitly, stands in for `nvidia-smi -L` with N
GPUs (indices 0..N-1, UUIDs GPU-fake-<i>). Never set it on a machine whose GPUs you mean to measure.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import socket
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

from shapewise import paths

POOL_VAR = "SHAPEWISE_PIPELINE_GPUS"
SLOT_VAR = "SHAPEWISE_PIPELINE_GPU_SLOT"
SOURCE_VAR = "SHAPEWISE_PIPELINE_GPU_SLOT_SOURCE"
# The SLURM job Snakemake itself ran in ("" outside SLURM): a job whose SLURM_JOB_ID differs was placed by SLURM.
RUN_SLURM_VAR = "SHAPEWISE_PIPELINE_SLURM_JOB_ID"
FAKE_VAR = "SHAPEWISE_PIPELINE_FAKE_GPUS"
SOURCES = ("lock", "slurm", "user", "none")

# Per checkout (the .snakemake/ directory is git-ignored) and per host: a checkout on a shared file system
# used from several nodes never makes one node's jobs wait for another node's GPU 0.
LOCK_ROOT = paths.ROOT / ".snakemake" / "shapewise-gpu-slots"

_GPU_LINE = re.compile(r"^GPU (\d+): (.*?) \(UUID: ([^)]+)\)\s*$")
_HELD = []  # the slot this process holds; its open file keeps the lock until the process ends


class GpuError(ValueError):
    """A GPU pool that cannot be built: the message names the value and the GPUs that exist."""


def lock_dir():
    return LOCK_ROOT / socket.gethostname()


def list_gpus(environ=None):
    """The machine's GPUs as `nvidia-smi -L` lists them: [{"index", "uuid", "name"}], index a string.
    [] without nvidia-smi or a GPU. MIG instances are not slots (their lines are skipped)."""
    env = os.environ if environ is None else environ
    fake = env.get(FAKE_VAR)
    if fake is not None:
        if not fake.isdigit():
            raise GpuError(f"{FAKE_VAR}={fake!r} must be a number of fake GPUs")
        return [{"index": str(i), "uuid": f"GPU-fake-{i}", "name": "fake GPU"} for i in range(int(fake))]
    try:
        done = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.SubprocessError):
        return []
    if done.returncode != 0:
        return []
    gpus = []
    for line in done.stdout.splitlines():
        match = _GPU_LINE.match(line.strip())
        if match:
            gpus.append({"index": match.group(1), "name": match.group(2), "uuid": match.group(3)})
    return gpus


def _describe(gpus):
    if not gpus:
        return "none (nvidia-smi -L lists no GPU)"
    return ", ".join(f"{g['index']} ({g['uuid']})" for g in gpus)


def _match(token, gpus, what):
    """The GPU of `gpus` a token names: its index, its UUID or a unique prefix of the UUID (as CUDA takes)."""
    token = token.strip()
    if token.isdigit():
        found = [g for g in gpus if int(g["index"]) == int(token)]
    else:
        found = [g for g in gpus if g["uuid"] == token] or [g for g in gpus if g["uuid"].startswith(token)]
    if len(found) != 1:
        problem = "is ambiguous" if found else "names no GPU"
        raise GpuError(f"{what}: {token!r} {problem}; the GPUs here are {_describe(gpus)}")
    return found[0]


def _tokens(text, what, gpus):
    tokens = [t.strip() for t in str(text).split(",")]
    if any(not t for t in tokens):
        raise GpuError(f"{what}: {text!r} has an empty GPU id; the GPUs here are {_describe(gpus)}")
    return tokens


def visible_gpus(gpus, cuda_visible_devices=None):
    """The GPUs this process may use: all of `gpus`, or those CUDA_VISIBLE_DEVICES names, in its order,
    each carrying the token to set CUDA_VISIBLE_DEVICES to (the user's own token, else the UUID)."""
    if cuda_visible_devices is None:
        return [dict(g, token=g["uuid"]) for g in gpus]
    if cuda_visible_devices.strip() == "":
        return []
    what = f"CUDA_VISIBLE_DEVICES={cuda_visible_devices}"
    chosen = []
    for token in _tokens(cuda_visible_devices, what, gpus):
        gpu = _match(token, gpus, what)
        if any(c["index"] == gpu["index"] for c in chosen):
            raise GpuError(f"{what}: GPU {gpu['index']} is named twice; the GPUs here are {_describe(gpus)}")
        chosen.append(dict(gpu, token=token))
    return chosen


def choose(visible, spec):
    """The pool: `visible` narrowed by the knob `gpus` (None or "all", a count, or GPU ids as a list or as
    a comma-separated string). A bad value raises GpuError naming it and the GPUs that exist."""
    what = f"config gpus={spec!r}"
    if spec is None or spec == "all":
        return list(visible)
    if isinstance(spec, bool):
        raise GpuError(f"{what} must be all, a number of GPUs or a list of GPU ids")
    if isinstance(spec, int) or (isinstance(spec, str) and spec.strip().isdigit()):
        count = int(spec)
        if count < 1:
            raise GpuError(f"{what}: 0 GPUs; use all, a number from 1 to {len(visible)}, or GPU ids "
                           f"({_describe(visible)})")
        if count > len(visible):
            raise GpuError(f"{what}: asks for {count} GPUs but {len(visible)} are visible: {_describe(visible)}")
        return list(visible[:count])
    if isinstance(spec, str) and "," in spec:
        ids = _tokens(spec, what, visible)
    elif isinstance(spec, (list, tuple)) and spec:
        ids = [str(i) for i in spec]
    else:
        raise GpuError(f"{what} must be all, a number of GPUs or a list of GPU ids; the GPUs here are "
                       f"{_describe(visible)}")
    chosen = []
    for token in ids:
        gpu = _match(token, visible, what)
        if any(c["index"] == gpu["index"] for c in chosen):
            raise GpuError(f"{what}: GPU {gpu['index']} is listed twice; the GPUs here are {_describe(visible)}")
        chosen.append(gpu)
    return chosen


def resolve_pool(spec="all", environ=None, gpus=None):
    """The GPU pool of a run: list_gpus() narrowed by CUDA_VISIBLE_DEVICES and then by `spec`."""
    env = os.environ if environ is None else environ
    if gpus is None:
        gpus = list_gpus(env)
    return choose(visible_gpus(gpus, env.get("CUDA_VISIBLE_DEVICES")), spec)


def pool_value(pool):
    """The pool as SHAPEWISE_PIPELINE_GPUS carries it: GPU indices, comma-separated ("" = no GPU)."""
    return ",".join(g["index"] for g in pool)


def _log(message):
    print(f"[{datetime.now().strftime('%H:%M:%S')}] gpu slot: {message}", file=sys.stderr, flush=True)


class Slot:
    """One GPU held by this process through an flock on its lock file."""

    def __init__(self, gpu, fd, path):
        self.gpu, self.fd, self.path = gpu, fd, path

    def release(self):
        if self.fd is not None:
            os.close(self.fd)  # closing the file drops the flock
            self.fd = None
        if self in _HELD:
            _HELD.remove(self)


def _holder(path):
    try:
        return json.loads(Path(path).read_text() or "{}")
    except (OSError, ValueError):
        return {}


def _lock_file(directory, gpu):
    return Path(directory) / f"gpu-{gpu['index']}.lock"


def acquire(pool, directory=None, label="", poll_s=0.5, log_every_s=60.0, log=_log):
    """Lock a free GPU of `pool` (the first free one in pool order) and return its Slot; wait while all
    are held. The lock lives as long as the returned Slot's file is open (at most as long as the process)."""
    if not pool:
        raise GpuError("no GPU to take a slot from")
    directory = Path(directory or lock_dir())
    directory.mkdir(parents=True, exist_ok=True)
    waited_since, last_log = None, None
    while True:
        for gpu in pool:
            path = _lock_file(directory, gpu)
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)  # not inherited by child processes
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            note = {"pid": os.getpid(), "host": socket.gethostname(), "job": label,
                    "since": datetime.now().astimezone().isoformat(timespec="milliseconds")}
            os.ftruncate(fd, 0)
            os.pwrite(fd, (json.dumps(note) + "\n").encode(), 0)
            slot = Slot(gpu, fd, path)
            _HELD.append(slot)
            waited = "" if waited_since is None else f" after waiting {time.monotonic() - waited_since:.1f} s"
            log(f"holding GPU {gpu['index']} ({gpu.get('name')}, {gpu.get('uuid')}){waited}; lock {path}")
            return slot
        now = time.monotonic()
        if waited_since is None:
            waited_since = now
        if last_log is None or now - last_log >= log_every_s:
            holders = ", ".join(f"GPU {g['index']} by pid {_holder(_lock_file(directory, g)).get('pid', '?')}"
                                for g in pool)
            log(f"waiting for a free GPU: all {len(pool)} of the pool are held ({holders})")
            last_log = now
        time.sleep(poll_s)


def _cuda_available():
    import torch

    return torch.cuda.is_available()


def enter_job(device, needs_gpu=True, environ=None, cuda_available=None, directory=None, label="",
              on_slot=None):
    """Give this job process its GPU before anything imports torch; return the device it runs on
    (`auto` resolved). Sets CUDA_VISIBLE_DEVICES, SHAPEWISE_PIPELINE_GPU_SLOT and ..._SLOT_SOURCE in
    `environ` (os.environ). `needs_gpu` False: a job that declares no GPU (gpu=0) takes no slot.
    `on_slot()` runs once those are set and before `auto` is resolved (which imports torch): the place to pin
    the job's CPU cores (shapewise.cpus.pin_job)."""
    env = os.environ if environ is None else environ
    cuda_available = cuda_available or _cuda_available
    slot, source = None, "none"
    if device != "cpu" and needs_gpu:
        slurm_job = env.get("SLURM_JOB_ID")
        if slurm_job and slurm_job != env.get(RUN_SLURM_VAR, ""):
            source = "slurm"
        elif POOL_VAR in env:  # a pipeline run on this machine published its pool
            pool = resolve_pool(env[POOL_VAR].split(","), env) if env[POOL_VAR] else []
            if pool:
                slot, source = acquire(pool, directory, label), "lock"
        elif env.get("CUDA_VISIBLE_DEVICES"):  # a job run by hand on the GPU(s) the user chose
            source = "user"
        else:  # a job run by hand: take a slot of every GPU here
            pool = resolve_pool("all", env)
            if pool:
                slot, source = acquire(pool, directory, label), "lock"
    if slot is not None:
        env["CUDA_VISIBLE_DEVICES"] = slot.gpu["token"]
        env[SLOT_VAR] = slot.gpu["index"]
    elif source in ("slurm", "user"):
        given = [t for t in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if t.strip()]
        if len(given) == 1:
            env[SLOT_VAR] = given[0].strip()
        else:
            env.pop(SLOT_VAR, None)
    else:
        env.pop(SLOT_VAR, None)
    env[SOURCE_VAR] = source
    if on_slot is not None:
        on_slot()
    if device == "auto":
        device = "cuda" if cuda_available() else "cpu"
    if device == "cpu" and source != "none":
        if slot is not None:
            slot.release()
            _log(f"released GPU {slot.gpu['index']}: the job runs on the CPU (torch sees no CUDA GPU)")
        env.pop(SLOT_VAR, None)
        source = "none"
    env[SOURCE_VAR] = source
    return device


# ---- evidence: from result files, which GPU ran which job when ----------------------------------------

def _parse_time(text):
    stamp = datetime.fromisoformat(str(text).replace("Z", "+00:00"))
    if stamp.tzinfo is None:
        raise ValueError(f"time {text!r} has no time zone")
    return stamp


def job_intervals(results_dir):
    """One record per GPU job result under `results_dir`: {"file", "host", "gpu", "source", "start", "end"}.
    The GPU is the UUID of the result's `gpu` block or, for a result without one, the slot it held (the
    block's `slot` or the environment's SHAPEWISE_PIPELINE_GPU_SLOT, a GPU index), turned into a UUID where
    another result of the same host names that slot's UUID. Results that ran on no GPU are left out."""
    records, uuids = [], {}
    for path in sorted(Path(results_dir).rglob("*.json")):
        if any(part.startswith("report") for part in path.relative_to(results_dir).parts[:-1]):
            continue  # a report's copies of the results (results/report/data, report-inputs): not jobs of their own
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if not isinstance(data, dict) or "started" not in data or "finished" not in data:
            continue
        env = data.get("environment") or {}
        variables = env.get("shapewise_variables") or {}
        gpu_block = data.get("gpu") or {}
        index = gpu_block.get("slot") or variables.get(SLOT_VAR)  # the block's "index" is torch's (0 in a slot)
        gpu = gpu_block.get("uuid") or index
        source = gpu_block.get("slot_source") or variables.get(SOURCE_VAR)
        if gpu is None or data.get("device") == "cpu":
            continue
        if gpu_block.get("uuid") and index is not None:
            uuids[(env.get("host"), str(index))] = gpu_block["uuid"]
        records.append({"file": str(path), "host": env.get("host"), "gpu": str(gpu), "source": source,
                        "start": _parse_time(data["started"]), "end": _parse_time(data["finished"])})
    for rec in records:
        rec["gpu"] = uuids.get((rec["host"], rec["gpu"]), rec["gpu"])
    return records


def check_intervals(records, min_gpus=2):
    """Did GPU jobs run on at least `min_gpus` GPUs, at overlapping times, and never two on one GPU?
    Returns {"gpus": {gpu: job count}, "shared": [...], "concurrent_pairs": n, "problems": [...]}.
    Intervals are closed-open: one job ending in the second the next one starts is not an overlap."""
    by_gpu = {}
    for rec in records:
        by_gpu.setdefault((rec["host"], rec["gpu"]), []).append(rec)
    shared = []
    for (host, gpu), recs in sorted(by_gpu.items(), key=lambda kv: str(kv[0])):
        recs.sort(key=lambda r: r["start"])
        for i, a in enumerate(recs):
            for b in recs[i + 1:]:
                if b["start"] >= a["end"]:
                    break
                shared.append(f"GPU {gpu} on {host}: {a['file']} ({a['start']:%H:%M:%S}-{a['end']:%H:%M:%S}) "
                              f"overlaps {b['file']} ({b['start']:%H:%M:%S}-{b['end']:%H:%M:%S})")
    concurrent = 0
    for i, a in enumerate(records):
        for b in records[i + 1:]:
            if (a["host"], a["gpu"]) != (b["host"], b["gpu"]) and a["start"] < b["end"] and b["start"] < a["end"]:
                concurrent += 1
    problems = list(shared)
    if len(by_gpu) < min_gpus:
        problems.append(f"GPU jobs ran on {len(by_gpu)} GPU(s), fewer than {min_gpus}")
    if concurrent == 0 and min_gpus > 1:
        problems.append("no two GPU jobs ran at overlapping times on different GPUs")
    unlocked = sorted({r["source"] for r in records} - {"lock"})
    if unlocked:
        problems.append(f"jobs whose slot source is not 'lock': {unlocked}")
    return {"gpus": {f"{gpu} ({host})": len(recs) for (host, gpu), recs in sorted(by_gpu.items(), key=str)},
            "jobs": len(records), "shared": shared, "concurrent_pairs": concurrent, "problems": problems}


def check_main(results_dir, min_gpus=2):
    """`shapewise gpus check DIR`: print the check of DIR's result files; 0 when it passes, 1 when not, 2 when DIR
    is not a directory."""
    if not Path(results_dir).is_dir():
        what = "does not exist" if not Path(results_dir).exists() else "is not a directory"
        print(f"gpus check: {results_dir} {what}; give the results directory of a run (default: results)",
              file=sys.stderr)
        return 2
    summary = check_intervals(job_intervals(results_dir), min_gpus)
    print(f"{summary['jobs']} GPU job results under {results_dir}")
    for gpu, count in summary["gpus"].items():
        print(f"  GPU {gpu}: {count} jobs")
    print(f"pairs of jobs running at the same time on different GPUs: {summary['concurrent_pairs']}")
    for problem in summary["problems"]:
        print(f"FAIL: {problem}")
    if not summary["problems"]:
        print("OK: " + ("jobs ran on several GPUs at overlapping times and never two on one GPU" if min_gpus > 1
                        else f"never two jobs at once on one GPU ({len(summary['gpus'])} GPU(s) used)"))
    return 1 if summary["problems"] else 0


def list_main(spec="all"):
    """`shapewise gpus list [SPEC]`: the pool a run would use here."""
    try:
        pool = resolve_pool(spec)
    except GpuError as exc:
        print(exc, file=sys.stderr)
        return 2
    for gpu in pool:
        print(f"GPU {gpu['index']}: {gpu['name']} ({gpu['uuid']}), CUDA_VISIBLE_DEVICES={gpu['token']}")
    print(f"{len(pool)} GPU(s) in the pool")
    return 0
