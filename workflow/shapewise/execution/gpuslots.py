"""GPU slots for local runs: a job that times holds one physical GPU alone; jobs that time nothing may share one.

The pool is the GPUs `nvidia-smi -L` lists, narrowed to those in CUDA_VISIBLE_DEVICES when the user set it,
then to the config knob `gpus` (all | a count | a list of GPU ids). The Snakefile resolves it once as it reads
the workflow (workflow/rules/gpus.smk): Snakemake's global `gpu` resource becomes the pool's size (unless
`--resources gpu=K` was given); when the run starts, the pool's indices go to every job in
SHAPEWISE_PIPELINE_GPUS (shapewise.execution.runs.begin).

A job (shapewise.cli.run_job, before anything imports torch) takes a slot of one GPU under LOCK_ROOT/<host>/, locked
with flock, in the mode of its step (GPU_USE): exclusive for the steps that time (timing, ablation, microbench),
shared for the others (preflight, warm-up, accuracy, profile, the environment fingerprint), at most SHARED_PER_GPU
at once and never beside an exclusive holder; an exclusive job waiting for a GPU's sharers to finish keeps new ones
out (see the lock layout above `Slot`). With config gpu_prepare_shared (PREPARE_VAR) a job of a step that prepares
(PREPARING: timing, ablation) whose row's estimate takes one part shares its GPU while it builds its models and
makes their first calls, then holds it alone for what it times (`Slot.upgrade`). Each share is also a part of the GPU's memory: a sharer whose job's memory
estimate needs more than one part holds the GPU alone, or, with config gpu_memory_parts, takes that many shares
(`memory_parts`: official row 14's accuracy three of an H200's six); a job that profiles never shares its GPU with a
job of several parts, whose kernels would stretch the profiled ones. The kernel releases the locks when the process
ends, crashes or is killed, so a lock file left behind never blocks anything. When no slot can be had the job waits,
with a log line. The job then runs with CUDA_VISIBLE_DEVICES set to its GPU (the user's own token for it when the
user set CUDA_VISIBLE_DEVICES, else the GPU's UUID, which names it whatever CUDA_DEVICE_ORDER is) and records the
slot in SHAPEWISE_PIPELINE_GPU_SLOT / SHAPEWISE_PIPELINE_GPU_SLOT_SOURCE and the lock (mode, when, the other
holders) in its result (Slot.record, shapewise.jobs.device.gpu_identity).

A job that SLURM started (SLURM_JOB_ID differs from the one Snakemake itself ran under) uses the GPU SLURM gave
it and locks nothing. A run of Snakemake inside a SLURM allocation (salloc) is a local run: its jobs share the
allocation's GPUs through the slots.

Tests and CPU machines: SHAPEWISE_PIPELINE_FAKE_GPUS=N, set explicitly, stands in for `nvidia-smi -L` with N
GPUs (indices 0..N-1, UUIDs GPU-fake-<i>). Never set it on a machine whose GPUs you mean to measure.
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import re
import socket
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

from shapewise.inputs import paths, steps
from shapewise.inputs.steps import EXCLUSIVE, SHARED

POOL_VAR = "SHAPEWISE_PIPELINE_GPUS"
SLOT_VAR = "SHAPEWISE_PIPELINE_GPU_SLOT"
SOURCE_VAR = "SHAPEWISE_PIPELINE_GPU_SLOT_SOURCE"
# The SLURM job Snakemake itself ran in ("" outside SLURM): a job whose SLURM_JOB_ID differs was placed by SLURM.
RUN_SLURM_VAR = "SHAPEWISE_PIPELINE_SLURM_JOB_ID"
FAKE_VAR = "SHAPEWISE_PIPELINE_FAKE_GPUS"
SOURCES = ("lock", "slurm", "user", "none")

# How a job uses its GPU (shapewise.inputs.steps: exclusive for a job that times, shared for one that times nothing).
MODES = (EXCLUSIVE, SHARED)
# The mode of each step's jobs (shapewise job STEP), as shapewise.inputs.steps gives it.
GPU_USE = {name: step.gpu for name, step in steps.STEPS.items()}
# The steps whose jobs profile: never beside a sharer of several parts.
PROFILING = frozenset(name for name, step in steps.STEPS.items() if step.profiles)
# The steps whose jobs prepare sharing their GPU, then time holding it alone (Slot.upgrade).
PREPARING = frozenset(name for name, step in steps.STEPS.items() if step.prepares)
# At most this many jobs share one GPU (the measurement behind it: docs/decisions.md).
SHARED_PER_GPU = 6
# A sharing job takes parts for its estimated peak times this: the caching allocator reserves beyond what it
# allocates (official row 14's accuracy reserved 84.2 GB against its 62.5 GB estimate: docs/decisions.md#memory-parts).
ALLOCATOR_HEADROOM = 1.35
# A job that needs more parts than this holds its GPU alone, uncapped: beside it the others would have too little
# to gain, and its cap too little slack (row 14's accuracy ran out of memory under a cap of 5 parts of an H100's 6).
MAX_SHARED_PARTS = SHARED_PER_GPU // 2
# "exclusive" for a job that runs again holding its GPU alone (shapewise.execution.gpushare: a kernel choice to time).
USE_VAR = "SHAPEWISE_PIPELINE_GPU_USE"
# "0": a sharing job whose memory needs several parts of its GPU holds it alone instead (config gpu_memory_parts
# false, set for the run's jobs by shapewise.execution.runs.begin).
PARTS_VAR = "SHAPEWISE_PIPELINE_MEMORY_PARTS"

# "1": a job of a PREPARING step whose row's estimate takes one part builds its models sharing its GPU (config
# gpu_prepare_shared, set for the run's jobs by shapewise.execution.runs.begin); else it holds the GPU alone throughout.
PREPARE_VAR = "SHAPEWISE_PIPELINE_PREPARE_SHARED"

# Per checkout (the .snakemake/ directory is git-ignored) and per host: a checkout on a shared file system
# used from several nodes never makes one node's jobs wait for another node's GPU 0.
LOCK_ROOT = paths.ROOT / ".snakemake" / "shapewise-gpu-slots"

_GPU_LINE = re.compile(r"^GPU (\d+): (.*?) \(UUID: ([^)]+)\)\s*$")
_HELD = []  # the slot this process holds; its open files keep the locks until the process ends


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


# ---- the lock of one GPU: shared by jobs that time nothing, exclusive for a job that times ------------------
#
# Per GPU <i> of the pool, under lock_dir():
#   gpu-<i>.lock          flock LOCK_SH by each job that shares the GPU, LOCK_EX by the one job that holds it alone
#                         (whose note, JSON, is the file's content)
#   gpu-<i>.gate          flock LOCK_EX by an exclusive holder, and by an exclusive job waiting for the GPU's sharers
#                         to finish: a job that would share checks it on the way in (LOCK_SH, non-blocking) and
#                         stays out, so sharers never starve a job that times
#   gpu-<i>.share-<k>.lock  k < SHARED_PER_GPU: one per part of the GPU a sharing job takes (`memory_parts`), the
#                         bound on how many share the GPU and on the memory they take
#   gpu-<i>.wide          flock LOCK_EX by a sharer of several parts, LOCK_SH by each profiling sharer of one part:
#                         never both at once
#   gpu-<i>.wide-gate     flock LOCK_EX by a sharer of several parts from the moment it waits until it holds `wide`:
#                         a profiling sharer checks it on the way in (LOCK_SH, non-blocking) and stays out
#   gpu-<i>.holders/<pid>.json  one note per holder, either mode, removed on release: who held the GPU when
#                         (a note whose process is gone is ignored)
#   gpu-<i>.waiting/<pid>.json  one note per sharer that let go of its GPU lock to hold the GPU alone (Slot.upgrade)
#                         while it waits for that, keeping its shares (its memory stays counted): it runs nothing
#                         there, and a job timing meanwhile tells its idle process on the GPU from contention by this
#                         note
# An exclusive lock is only ever taken with the gate held, and a job enters as a sharer only with the gate free,
# so no job shares the GPU with an exclusive holder. The kernel drops every flock of a process that exits,
# crashes or is killed: nothing left behind blocks anything.

def _open(path):
    return os.open(path, os.O_RDWR | os.O_CREAT, 0o666)  # not inherited by child processes


def _try_lock(fd, how):
    try:
        fcntl.flock(fd, how | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


def _close(*fds):
    for fd in fds:
        if fd is not None:
            os.close(fd)  # closing the file drops its flock


def _lock_file(directory, gpu):
    return Path(directory) / f"gpu-{gpu['index']}.lock"


def _gate_file(directory, gpu):
    return Path(directory) / f"gpu-{gpu['index']}.gate"


def _share_file(directory, gpu, k):
    return Path(directory) / f"gpu-{gpu['index']}.share-{k}.lock"


def _wide_file(directory, gpu):
    return Path(directory) / f"gpu-{gpu['index']}.wide"


def _wide_gate_file(directory, gpu):
    return Path(directory) / f"gpu-{gpu['index']}.wide-gate"


def _notes_dir(directory, gpu):
    return Path(directory) / f"gpu-{gpu['index']}.holders"


def _waiting_dir(directory, gpu):
    return Path(directory) / f"gpu-{gpu['index']}.waiting"


def _start_ticks(pid):
    """The start time of process `pid` (clock ticks since boot, /proc/<pid>/stat field 22), or None when it is
    gone or a zombie: with the pid it names one process, whatever pid reuse."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) "; comm may hold spaces
    return None if fields[0] in ("Z", "X") else int(fields[19])


def _holder(path):
    try:
        return json.loads(Path(path).read_text() or "{}")
    except (OSError, ValueError):
        return {}


def holders(directory, gpu, exclude_pid=None, notes=_notes_dir):
    """The live holders of `gpu` (its notes whose process still runs), oldest first, without `exclude_pid`;
    `notes=_waiting_dir`: the sharers waiting to hold it alone instead."""
    found = []
    for path in sorted(notes(directory, gpu).glob("*.json")):
        note = _holder(path)
        pid = note.get("pid")
        if pid is None or pid == exclude_pid or _start_ticks(pid) != note.get("start_ticks"):
            continue
        found.append(note)
    return sorted(found, key=lambda n: n.get("since", ""))


class Slot:
    """One GPU held by this process, shared or alone, through flocks on its lock files."""

    def __init__(self, gpu, directory, mode, fd, gate=None, shares=(), share_indices=(), wide=None, label="",
                 waited_s=0.0, why=None, memory_cap=False):
        self.gpu, self.directory, self.mode, self.fd = gpu, Path(directory), mode, fd
        # why a job of a sharing step holds its GPU alone, or takes several parts of it (None: its step's mode)
        self.why = why
        self.path = _lock_file(directory, gpu)
        self.gate, self.shares, self.share_indices, self.wide = gate, list(shares), list(share_indices), wide
        self.label = label
        self.memory_cap = memory_cap  # its shares came from its row's memory estimate: it keeps to them
        self.waited_s, self.alone_waited_s = waited_s, None
        self.acquired = now_ms()
        self.note = {"pid": os.getpid(), "start_ticks": _start_ticks(os.getpid()), "host": socket.gethostname(),
                     "job": label, "mode": mode, "since": self.acquired}
        self.others_at_start = holders(directory, gpu, exclude_pid=os.getpid())
        self._write_note()
        if mode == EXCLUSIVE:
            os.ftruncate(fd, 0)
            os.pwrite(fd, (json.dumps(self.note) + "\n").encode(), 0)

    def _note_path(self):
        return _notes_dir(self.directory, self.gpu) / f"{os.getpid()}.json"

    def _write_note(self):
        path = self._note_path()
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(self.note) + "\n")
        os.replace(tmp, path)

    def downgrade(self):
        """Hold the GPU shared from now on (an exclusive holder whose timed part is over), or stay alone where
        every share is held (by jobs waiting to hold the GPU alone, `upgrade`). The gate stays held while the lock
        turns from exclusive to shared, so no other exclusive job can come in between."""
        if self.mode != EXCLUSIVE:
            return
        for k in range(SHARED_PER_GPU):
            share = _open(_share_file(self.directory, self.gpu, k))
            if _try_lock(share, fcntl.LOCK_EX):
                break
            _close(share)
        else:  # jobs waiting to hold the GPU alone keep their shares (upgrade): this one stays alone
            _log(f"GPU {self.gpu['index']}: every share is held (by jobs waiting to hold it alone): this job keeps "
                 "holding it alone")
            return
        fcntl.flock(self.fd, fcntl.LOCK_SH)
        _close(self.gate)
        self.gate, self.shares, self.share_indices, self.mode = None, [share], [k], SHARED
        self.note = dict(self.note, mode=SHARED, shared_since=now_ms())
        self._write_note()

    def upgrade(self, reserved_bytes=None, peak_allocated_bytes=None, poll_s=0.1, log_every_s=60.0, log=None):
        """Hold the GPU alone from now on (a sharer whose untimed part is over: a job of a PREPARING step). It
        lets go of the GPU's lock (and the wide lock) first, so that no other sharer waiting to hold the GPU alone
        waits for it, then takes the gate and the lock as an exclusive acquirer does, on this GPU only (its
        process's CUDA state is there). It keeps its shares until then: the memory it still holds stays counted
        against new sharers (an exclusive acquirer never looks at the shares). While it waits it has a note in the
        GPU's waiting notes (with `reserved_bytes`, its allocator's memory): the caller has synchronized its device,
        so it runs nothing there meanwhile. `peak_allocated_bytes`: its allocator's peak while it shared, recorded."""
        if self.mode == EXCLUSIVE:
            return
        log = log or _log
        released = now_ms()
        # the waiting note before the locks go: whoever holds the GPU alone next finds this process noted
        waiting = _waiting_dir(self.directory, self.gpu) / f"{os.getpid()}.json"
        waiting.parent.mkdir(parents=True, exist_ok=True)
        tmp = waiting.with_name(waiting.name + ".tmp")
        tmp.write_text(json.dumps(dict(self.note, since=released, reserved_bytes=reserved_bytes)) + "\n")
        os.replace(tmp, waiting)
        try:
            self._note_path().unlink()
        except OSError:
            pass
        _close(self.wide, self.fd)
        self.wide, self.fd = None, None
        t0 = time.monotonic()
        pending = [None, None]
        try:
            got, _ = _wait_for(lambda: _try_exclusive(self.directory, [self.gpu], pending),
                               lambda: f"waiting to hold GPU {self.gpu['index']} alone: "
                                       + _describe_holders(self.directory, [self.gpu], pending),
                               poll_s, log_every_s, log)
        finally:
            waiting.unlink(missing_ok=True)
        _, self.fd, self.gate = got
        _close(*self.shares)  # alone now: its shares count nothing any more
        self.shares, self.share_indices = [], []
        self.mode, self.alone_waited_s = EXCLUSIVE, time.monotonic() - t0
        self.note = dict(self.note, mode=EXCLUSIVE, shared_until=released,
                         alone_since=now_ms(),
                         shared_peak_allocated_bytes=peak_allocated_bytes)
        self._write_note()
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, (json.dumps(self.note) + "\n").encode(), 0)
        log(f"holding GPU {self.gpu['index']} alone after waiting {self.alone_waited_s:.1f} s for it")

    def waiting_now(self):
        """The run's other jobs waiting to hold this GPU alone (their waiting notes): idle processes on it."""
        return holders(self.directory, self.gpu, exclude_pid=os.getpid(), notes=_waiting_dir)

    def memory_fraction(self):
        """The part of the GPU's memory this holder's allocator may use (shapewise.jobs.device.setup), or None for
        no cap: its shares' parts for a sharer whose shares came from its row's memory estimate (`memory_parts`);
        none for a holder alone or a sharer without an estimate (the preflight, which measures the GPU for the jobs
        after it, a candidate's job)."""
        return len(self.shares) / SHARED_PER_GPU if self.mode == SHARED and self.memory_cap else None

    def record(self):
        """What a result records of the lock: mode, GPU, when taken, how long the job waited, and the other jobs
        that held the GPU when it was taken (none for an exclusive holder)."""
        out = {"mode": self.mode, "gpu": self.gpu["index"], "lock": str(self.path), "acquired": self.acquired,
               "waited_s": round(self.waited_s, 3), "others_at_start": self.others_at_start}
        if self.share_indices:
            out["share_slot"] = self.share_indices[0]
        if len(self.share_indices) > 1:
            out["share_slots"] = list(self.share_indices)
        if self.note.get("shared_since"):
            out["shared_since"] = self.note["shared_since"]
        if self.note.get("alone_since"):
            out.update(shared_until=self.note["shared_until"], alone_since=self.note["alone_since"],
                       alone_waited_s=round(self.alone_waited_s, 3),
                       shared_peak_allocated_bytes=self.note.get("shared_peak_allocated_bytes"))
        if self.why:
            out["alone_because" if self.mode == EXCLUSIVE else "parts_because"] = self.why
        if self.memory_fraction() is not None:
            out["memory_fraction"] = round(self.memory_fraction(), 6)
        return out

    def others_now(self):
        """The run's other jobs holding this GPU now (their notes)."""
        return holders(self.directory, self.gpu, exclude_pid=os.getpid())

    def release(self):
        if self.fd is not None:
            try:
                self._note_path().unlink()
            except OSError:
                pass
            _close(*self.shares, self.wide, self.fd, self.gate)
            self.fd = self.gate = self.wide = None
            self.shares = []
        if self in _HELD:
            _HELD.remove(self)


def held():
    """The slot this process holds (or holds through its parent, `take_over`), or None."""
    return _HELD[0] if _HELD else None


class Inherited:
    """The slot of the job process that started this one (a candidate job's child, which does the job's GPU work
    while its parent holds the lock): what the job's result records of the lock, and the run's other jobs on the
    GPU, as the parent would see them."""

    def __init__(self, handed):
        self.gpu, self.directory, self.holder_pid = handed["gpu"], Path(handed["directory"]), handed["pid"]
        self.mode, self._record = handed["record"]["mode"], dict(handed["record"])

    def record(self):
        return dict(self._record)

    def others_now(self):
        return holders(self.directory, self.gpu, exclude_pid=self.holder_pid)

    def release(self):  # the lock is the parent's: nothing to let go here
        if self in _HELD:
            _HELD.remove(self)


def hand_over():
    """What a job process passes to the child that does its GPU work (take_over there), or None without a slot."""
    slot = held()
    if slot is None:
        return None
    return {"record": slot.record(), "directory": str(slot.directory), "gpu": slot.gpu, "pid": os.getpid()}


def take_over(handed):
    """In that child: hold the parent's slot as Inherited, so results and contention checks see the job's lock."""
    if handed is not None and not _HELD:
        _HELD.append(Inherited(handed))


def _try_exclusive(directory, pool, pending):
    """One non-blocking round for an exclusive slot. `pending` is [gpu, gate fd] of the GPU whose gate this
    acquirer already holds while that GPU's sharers finish (or [None, None]). A GPU nobody holds wins over
    waiting; otherwise the acquirer keeps (or takes) the gate of the first GPU that only sharers hold."""
    for gpu in pool:
        if pending[0] is not None and gpu["index"] == pending[0]["index"]:
            gate = pending[1]
        else:
            gate = _open(_gate_file(directory, gpu))
            if not _try_lock(gate, fcntl.LOCK_EX):
                _close(gate)
                continue
        fd = _open(_lock_file(directory, gpu))
        if _try_lock(fd, fcntl.LOCK_EX):
            if pending[1] is not None and pending[1] != gate:
                _close(pending[1])
            pending[:] = [None, None]
            return gpu, fd, gate
        _close(fd)
        if pending[0] is None:
            pending[:] = [gpu, gate]  # sharers are on it: keep its gate, so none join, and wait for them
        elif gate != pending[1]:
            _close(gate)
    return None


def _take_wide(directory, gpu, parts, profiling):
    """The `wide` flock a sharer needs on `gpu` (see the lock layout), True where it needs none, or None when it
    cannot have it now: LOCK_EX for a sharer of several parts (which holds the wide gate already, _try_shared),
    LOCK_SH for a profiling sharer, which enters only while the gate is free."""
    if parts > 1:
        how = fcntl.LOCK_EX
    elif profiling:
        gate = _open(_wide_gate_file(directory, gpu))
        free = _try_lock(gate, fcntl.LOCK_SH)
        _close(gate)  # checked on the way in only
        if not free:
            return None
        how = fcntl.LOCK_SH
    else:
        return True
    wide = _open(_wide_file(directory, gpu))
    if _try_lock(wide, how):
        return wide
    _close(wide)
    return None


def _drop(waiting, keep_gate=True):
    """Let go of what a sharer of several parts gathered while it waited (its GPU lock and shares), and of its wide
    gate unless `keep_gate`."""
    _close(waiting.pop("lock", None), *(fd for fd, _ in waiting.pop("shares", [])))
    if not keep_gate:
        _close(waiting.pop("gate", None))
        waiting.pop("gpu", None)


def _try_shared(directory, pool, parts=1, profiling=False, waiting=None):
    """One non-blocking round for `parts` shares of a GPU: the GPU with the most live sharers that has room (so
    whole GPUs stay free for jobs that time), then the others in pool order. `profiling`: the job profiles (no
    sharer of several parts beside it). A sharer of several parts keeps, in `waiting`, from one round to the next,
    the wide gate of one GPU and the shares it gathered there: only one such job gathers on a GPU at a time (the
    gate), and one-part sharers never wait holding anything, so it gets its parts as they free up instead of
    waiting for that many to be free at once; it lets its shares go while a job that times waits for the GPU."""
    if waiting is None:  # a single round: nothing is kept for a next one
        waiting = {}
        try:
            return _try_shared(directory, pool, parts, profiling, waiting)
        finally:
            _drop(waiting, keep_gate=False)

    def sharers(gpu):
        return sum(1 for note in holders(directory, gpu) if note.get("mode") == SHARED)

    candidates = sorted(pool, key=lambda g: -sharers(g))
    if parts > 1 and "gpu" in waiting:
        candidates = [waiting["gpu"]]  # it gathers where it holds the wide gate
    for gpu in candidates:
        gate = _open(_gate_file(directory, gpu))
        if not _try_lock(gate, fcntl.LOCK_SH):  # an exclusive holder or waiter: let it have the GPU
            _close(gate)
            _drop(waiting)
            continue
        if parts > 1 and "gpu" not in waiting:
            wide_gate = _open(_wide_gate_file(directory, gpu))
            if not _try_lock(wide_gate, fcntl.LOCK_EX):  # another sharer of several parts gathers here
                _close(wide_gate, gate)
                continue
            waiting.update(gpu=gpu, gate=wide_gate)
        if "lock" not in waiting:
            fd = _open(_lock_file(directory, gpu))
            if not _try_lock(fd, fcntl.LOCK_SH):
                _close(fd, gate)
                continue
            waiting["lock"] = fd
        shares = waiting.setdefault("shares", [])
        held = {k for _, k in shares}
        for k in range(SHARED_PER_GPU):
            if len(shares) == parts:
                break
            if k in held:
                continue
            share = _open(_share_file(directory, gpu, k))
            if _try_lock(share, fcntl.LOCK_EX):
                shares.append((share, k))
            else:
                _close(share)
        wide = _take_wide(directory, gpu, parts, profiling) if len(shares) == parts else None
        if wide is not None:
            _close(gate, waiting.pop("gate", None))  # checked on the way in only; the wide lock, if any, is held
            fd, shares = waiting.pop("lock"), waiting.pop("shares")
            waiting.pop("gpu", None)
            return gpu, fd, [f for f, _ in shares], sorted(k for _, k in shares), None if wide is True else wide
        _close(gate)
        if parts == 1:
            _drop(waiting)  # a one-part sharer never waits holding anything
    return None


def acquire(pool, directory=None, label="", poll_s=0.1, log_every_s=60.0, log=_log, mode=None, why=None, parts=1,
            profiling=False, memory_cap=False):
    """Lock a GPU of `pool` and return its Slot; wait while none can be had. `mode` EXCLUSIVE (the default): the
    first GPU of the pool that nobody holds, else the first that only sharers hold, once they are done; SHARED:
    `parts` of the SHARED_PER_GPU shares of a GPU no exclusive job holds or waits for (`profiling`: nor a sharer of
    several parts, and a job of several parts none that profiles). The lock lives as long as the returned Slot's
    files are open (at most as long as the process). `why`: the reason a job of a sharing step takes it EXCLUSIVE,
    or several parts of it, recorded with the lock; `memory_cap`: the shares came from a memory estimate
    (Slot.memory_fraction)."""
    mode = mode or EXCLUSIVE
    if mode not in MODES:
        raise GpuError(f"GPU lock mode {mode!r}: expected one of {MODES}")
    if not pool:
        raise GpuError("no GPU to take a slot from")
    if not (isinstance(parts, int) and 1 <= parts <= SHARED_PER_GPU):
        raise GpuError(f"GPU lock parts {parts!r}: expected a whole number from 1 to {SHARED_PER_GPU}")
    directory = Path(directory or lock_dir())
    directory.mkdir(parents=True, exist_ok=True)
    pending, waiting = [None, None], {}
    what = mode if parts == 1 else f"{mode}, {parts} parts"
    t0 = time.monotonic()
    got, waited_s = _wait_for(
        lambda: _try_exclusive(directory, pool, pending) if mode == EXCLUSIVE else
        _try_shared(directory, pool, parts, profiling, waiting),
        lambda: f"waiting for a free GPU ({what}): " + _describe_holders(directory, pool, pending),
        poll_s, log_every_s, log)
    if mode == EXCLUSIVE:
        gpu, fd, gate = got
        slot = Slot(gpu, directory, mode, fd, gate=gate, label=label, waited_s=time.monotonic() - t0, why=why)
    else:
        gpu, fd, shares, indices, wide = got
        slot = Slot(gpu, directory, mode, fd, shares=shares, share_indices=indices, wide=wide, label=label,
                    waited_s=time.monotonic() - t0, why=why, memory_cap=memory_cap)
    _HELD.append(slot)
    waited = "" if waited_s is None else f" after waiting {waited_s:.1f} s"
    how = "holding" if mode == EXCLUSIVE else "sharing"
    log(f"{how} GPU {gpu['index']} ({gpu.get('name')}, {gpu.get('uuid')}){waited}; lock {slot.path}")
    return slot


def _wait_for(attempt, waiting_message, poll_s, log_every_s, log):
    """`attempt()` (one non-blocking round for a lock) until it gives something, sleeping `poll_s` between rounds
    and logging `waiting_message()` at the first miss and every `log_every_s` after. Returns (what it gave, seconds
    from the first miss, None where there was none)."""
    waited_since = last_log = None
    while (got := attempt()) is None:
        now = time.monotonic()
        if waited_since is None:
            waited_since = now
        if last_log is None or now - last_log >= log_every_s:
            log(waiting_message())
            last_log = now
        time.sleep(poll_s)
    return got, None if waited_since is None else time.monotonic() - waited_since


def _describe_holders(directory, pool, pending):
    parts = []
    for gpu in pool:
        notes = holders(directory, gpu, exclude_pid=os.getpid())
        who = ", ".join(f"pid {n.get('pid')} ({n.get('mode')})" for n in notes) or \
            f"pid {_holder(_lock_file(directory, gpu)).get('pid', '?')}"
        mine = " (this job waits for it)" if pending[0] is not None and pending[0]["index"] == gpu["index"] else ""
        parts.append(f"GPU {gpu['index']} by {who}{mine}")
    return f"all {len(pool)} of the pool are held ({'; '.join(parts)})"


def memory_parts_on(environ=None):
    """Whether a sharing job may take several parts of its GPU (PARTS_VAR in `environ`, os.environ; unset: yes)."""
    return (os.environ if environ is None else environ).get(PARTS_VAR, "1") != "0"


def prepare_shared_on(environ=None):
    """Whether a job of a PREPARING step may build its models sharing its GPU (PREPARE_VAR in `environ`,
    os.environ; unset: no)."""
    return (os.environ if environ is None else environ).get(PREPARE_VAR, "0") == "1"


def memory_parts(preflight_path, step, environ=None):
    """(parts, why) for a job of the sharing step `step`: how many of its GPU's SHARED_PER_GPU parts (the GPU's
    memory / SHARED_PER_GPU each) the job takes, from its row's preflight (a result file): its `job_bytes[step]`,
    the job's estimated peak (shapewise.jobs.preflight.job_bytes). parts None: more than all of them, the job holds
    its GPU alone. A preflight without that estimate (made before it existed) counts its models' estimates, and a
    model that does not fit in one pass as all of the GPU; each estimate times ALLOCATOR_HEADROOM, and beyond
    MAX_SHARED_PARTS parts the job holds the GPU alone. (1, None) where the preflight is not a CUDA one or cannot
    be read (the job itself then says so); `why` says where more than one part comes from. With PARTS_VAR "0" in
    `environ` (os.environ) a job of several parts holds its GPU alone."""
    try:
        preflight = json.loads(Path(preflight_path).read_text())
    except (OSError, TypeError, ValueError):
        return 1, None
    if not isinstance(preflight, dict):
        return 1, None
    total = preflight.get("total_bytes")
    if preflight.get("device") != "cuda" or not isinstance(total, (int, float)) or total <= 0:
        return 1, None
    part = total / SHARED_PER_GPU
    source = f"total {total / 1e9:.1f} GB / {SHARED_PER_GPU}; preflight {preflight_path}"
    estimate = (preflight.get("job_bytes") or {}).get(step)
    if isinstance(estimate, (int, float)) and not isinstance(estimate, bool):
        what = f"its {step} job may take {estimate / 1e9:.1f} GB"
    else:
        estimate, what = 0, None
        for name, model in sorted((preflight.get("models") or {}).items()):
            if not isinstance(model, dict):
                continue
            if model.get("fits") is False:
                return None, f"its row's {name} model does not fit in one pass (preflight {preflight_path})"
            value = model.get("estimate_bytes")
            if isinstance(value, (int, float)) and value > estimate:
                estimate, what = value, f"its row's {name} model may take {value / 1e9:.1f} GB"
    parts = max(1, math.ceil(estimate * ALLOCATOR_HEADROOM / part))
    if parts > MAX_SHARED_PARTS:
        return None, (f"{what}, {ALLOCATOR_HEADROOM} x that above {MAX_SHARED_PARTS} of the GPU's "
                      f"{SHARED_PER_GPU} parts ({source})")
    if parts > 1 and not memory_parts_on(environ):
        return None, f"{what}, above one part of the GPU, and config gpu_memory_parts is off ({source})"
    return parts, (None if parts == 1 else f"{what} ({ALLOCATOR_HEADROOM} x that): {parts} parts of "
                                           f"{part / 1e9:.1f} GB ({source})")


def _cuda_available():
    import torch  # deferred: torch, once a job asks for a GPU (never in Snakemake's process)

    return torch.cuda.is_available()


def job_mode(step, environ=None):
    """The lock mode of a job of `step` (GPU_USE), EXCLUSIVE where USE_VAR says so (a job run again to hold
    its GPU alone)."""
    env = os.environ if environ is None else environ
    forced = env.get(USE_VAR)
    if forced:
        if forced != EXCLUSIVE:
            raise GpuError(f"{USE_VAR}={forced!r}: the only mode a job can be made to take is {EXCLUSIVE!r}")
        return EXCLUSIVE
    if step not in GPU_USE:
        raise GpuError(f"step {step!r} has no GPU mode; the steps are {sorted(GPU_USE)}")
    return GPU_USE[step]


def enter_job(device, needs_gpu=True, environ=None, cuda_available=None, directory=None, label="",
              on_slot=None, mode=None, why=None, parts=1, profiling=False, memory_cap=False):
    """Give this job process its GPU before anything imports torch; return the device it runs on
    (`auto` resolved). Sets CUDA_VISIBLE_DEVICES, SHAPEWISE_PIPELINE_GPU_SLOT and ..._SLOT_SOURCE in
    `environ` (os.environ). `needs_gpu` False: a job that declares no GPU (gpu=0) takes no slot. `mode`: the
    lock's mode (EXCLUSIVE, the default, or SHARED; see job_mode); `why`: why a job of a sharing step takes it
    EXCLUSIVE, or `parts` shares of it (recorded with the lock); `profiling`: a sharer that profiles, `memory_cap`:
    one whose shares came from its row's memory estimate (acquire).
    `on_slot()` runs once those are set and before `auto` is resolved (which imports torch): the place to pin
    the job's CPU cores (shapewise.execution.cpus.pin_job)."""
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
                slot, source = acquire(pool, directory, label, mode=mode, why=why, parts=parts,
                                       profiling=profiling, memory_cap=memory_cap), "lock"
        elif env.get("CUDA_VISIBLE_DEVICES"):  # a job run by hand on the GPU(s) the user chose
            source = "user"
        else:  # a job run by hand: take a slot of every GPU here
            pool = resolve_pool("all", env)
            if pool:
                slot, source = acquire(pool, directory, label, mode=mode, why=why, parts=parts,
                                       profiling=profiling, memory_cap=memory_cap), "lock"
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

def now_ms():
    """Now in local time with its zone, to the millisecond: how a lock record stamps a moment (`acquired`,
    `shared_since`, `alone_since`, `ended`), fine enough to order jobs that follow one another within a second."""
    return datetime.now().astimezone().isoformat(timespec="milliseconds")


def _parse_time(text):
    stamp = datetime.fromisoformat(str(text).replace("Z", "+00:00"))
    if stamp.tzinfo is None:
        raise ValueError(f"time {text!r} has no time zone")
    return stamp


def job_intervals(results_dir):
    """One record per GPU job result under `results_dir`: {"file", "host", "gpu", "source", "mode", "start",
    "end"}. The GPU is the UUID of the result's `gpu` block or, for a result without one, the slot it held (the
    block's `slot` or the environment's SHAPEWISE_PIPELINE_GPU_SLOT, a GPU index), turned into a UUID where
    another result of the same host names that slot's UUID. The mode is the one its lock record names (a result
    without one held its GPU alone: every job did before GPUs were shared); a job that held its GPU alone, then
    shared it (`shared_since`), or shared it, then held it alone (`alone_since`), gives one record of each. The start is the lock's `acquired` where recorded, else
    `started`; the end the lock's `ended` (milliseconds) where recorded, else `finished`. Results that ran on no GPU are left out."""
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
        lock = gpu_block.get("lock") or {}
        # on the GPU from the lock's acquisition (milliseconds; `started` may be whole seconds, which would put the
        # start of a job that took its lock just after another's `shared_since` before that moment)
        start = _parse_time(lock["acquired"]) if lock.get("acquired") else _parse_time(data["started"])
        if lock.get("mode"):
            mode, mode_from = lock["mode"], "lock"
        elif source == "lock":  # under the lock, but its result does not say how (a candidate's, before its child
            mode, mode_from = GPU_USE.get(data.get("step"), EXCLUSIVE), "step"  # recorded it): as its step's jobs do
        else:  # no lock (SLURM, a GPU chosen by hand): counted as alone, the strict reading
            mode, mode_from = EXCLUSIVE, "none"
        record = {"file": str(path), "host": env.get("host"), "gpu": str(gpu), "source": source,
                  "mode": mode, "mode_from": mode_from, "step": data.get("step"),
                  "start": start, "end": max(start, _parse_time(lock.get("ended") or data["finished"]))}
        since = _parse_time(lock["shared_since"]) if lock.get("shared_since") else None
        if since is not None and record["start"] < since < record["end"]:
            # held alone until `shared_since` (Slot.downgrade), shared from then on: two intervals
            records.append(dict(record, mode=EXCLUSIVE, end=since))
            record["start"] = since
        alone = _parse_time(lock["alone_since"]) if lock.get("alone_since") else None
        if alone is not None and record["start"] < alone:
            # shared until `shared_until`, alone from `alone_since` on (Slot.upgrade): two intervals, none between;
            # a whole-second `finished` may fall before `alone_since`, but the job ended after it
            record["end"] = max(record["end"], alone)
            until = _parse_time(lock.get("shared_until") or lock["alone_since"])
            records.append(dict(record, mode=SHARED, end=min(until, record["end"])))
            record.update(mode=EXCLUSIVE, start=alone)
        records.append(record)
    for rec in records:
        rec["gpu"] = uuids.get((rec["host"], rec["gpu"]), rec["gpu"])
    return records


def check_intervals(records, min_gpus=2):
    """Did GPU jobs run on at least `min_gpus` GPUs, at overlapping times, and never a job that held its GPU alone
    beside another job on that GPU? Returns {"gpus": {gpu: job count}, "shared": [overlaps involving an exclusive
    holder], "sharing_pairs": n (pairs of sharing jobs at once on one GPU: allowed), "concurrent_pairs": n,
    "problems": [...]}. Intervals are closed-open: one job ending in the second the next one starts is not an
    overlap."""
    by_gpu = {}
    for rec in records:
        by_gpu.setdefault((rec["host"], rec["gpu"]), []).append(rec)
    shared, sharing = [], 0
    for (host, gpu), recs in sorted(by_gpu.items(), key=lambda kv: str(kv[0])):
        recs.sort(key=lambda r: r["start"])
        for i, a in enumerate(recs):
            for b in recs[i + 1:]:
                if b["start"] >= a["end"]:
                    break
                if a.get("mode") == SHARED and b.get("mode") == SHARED:
                    sharing += 1
                    continue
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
            "jobs": len(records), "shared": shared, "sharing_pairs": sharing, "concurrent_pairs": concurrent,
            "problems": problems}


def check_main(results_dir, min_gpus=2):
    """`shapewise gpus check DIR`: print the check of DIR's result files; 0 when it passes, 1 when not, 2 when DIR
    is not a directory."""
    if not Path(results_dir).is_dir():
        what = "does not exist" if not Path(results_dir).exists() else "is not a directory"
        print(f"gpus check: {results_dir} {what}; give the results directory of a run (default: results)",
              file=sys.stderr)
        return 2
    records = job_intervals(results_dir)
    summary = check_intervals(records, min_gpus)
    print(f"{summary['jobs']} GPU job results under {results_dir}")
    for gpu, count in summary["gpus"].items():
        print(f"  GPU {gpu}: {count} jobs")
    print(f"pairs of jobs running at the same time on different GPUs: {summary['concurrent_pairs']}")
    print(f"pairs of jobs that time nothing sharing a GPU at the same time: {summary['sharing_pairs']}")
    unrecorded = [r for r in records if r["mode_from"] == "step"]
    if unrecorded:
        print(f"{len(unrecorded)} results under the lock record no lock mode: each held its GPU as its step's jobs "
              f"do ({', '.join(sorted({r['step'] or '?' for r in unrecorded}))})")
    for problem in summary["problems"]:
        print(f"FAIL: {problem}")
    if not summary["problems"]:
        alone = "never a job that times beside another job on its GPU"
        if min_gpus > 1:
            print(f"OK: jobs ran on several GPUs at overlapping times and {alone}")
        elif summary["sharing_pairs"]:
            print(f"OK: {alone} ({len(summary['gpus'])} GPU(s) used)")
        else:
            print(f"OK: never two jobs at once on one GPU ({len(summary['gpus'])} GPU(s) used)")
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
