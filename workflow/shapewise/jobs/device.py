"""The device a job runs on: setup, synchronization, per-call timers, memory readings, which GPU it is, its
clocks, the other processes on it, and the CPU cores the job runs on."""

from __future__ import annotations

import math
import os
import shutil
import statistics
import subprocess
import time
from datetime import datetime, timezone

import torch

from shapewise.execution import cpus, gpushare, gpuslots


def setup(device, threads=None):
    if threads:
        torch.set_num_threads(int(threads))
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("device cuda was chosen but torch sees no CUDA GPU (set SHAPEWISE_DEVICE=cpu?)")
    fraction = memory_fraction(gpuslots.held())
    if device == "cuda" and fraction is not None:
        # a sharer keeps to its parts of the GPU's memory: at the cap its allocator frees what it cached and tries
        # again, where it would otherwise grow its cache into what the other sharers need
        torch.cuda.set_per_process_memory_fraction(fraction)
    return torch.device(device)


def memory_fraction(slot):
    """The cap on this job's allocator (a fraction of its GPU's memory), or None: its slot's (Slot.memory_fraction;
    a parent's slot, Inherited, has none)."""
    fraction = getattr(slot, "memory_fraction", None)
    return None if fraction is None else fraction()


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def time_calls(fn, device, count):
    """Milliseconds of each of `count` calls: a CUDA event pair per call on a
    GPU (the GPU time between the two events, launch gaps included), or
    time.perf_counter around each call on the CPU."""
    if count <= 0:
        return []
    if device.type == "cuda":
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(count)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(count)]
        for start, end in zip(starts, ends):
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize()
        return [s.elapsed_time(e) for s, e in zip(starts, ends)]
    times = []
    for _ in range(count):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def preparing(device):
    """Whether this job prepares sharing its GPU (a job of a step that prepares, shapewise.inputs.steps, that
    entered as a sharer: config gpu_prepare_shared) and has yet to hold it alone (`hold_alone`)."""
    slot = gpuslots.held()
    return device.type == "cuda" and slot is not None and slot.mode == gpuslots.SHARED and hasattr(slot, "upgrade")


def shared_then_alone(device):
    """Whether this job made its first calls sharing its GPU and then held it alone (its lock's `alone_since`),
    wherever that happened: at `hold_alone`, or at a kernel choice to time on the way."""
    slot = gpuslots.held()
    return device.type == "cuda" and bool(getattr(slot, "note", {}).get("alone_since"))


def alone_waited_s():
    """Seconds this job waited to hold its GPU alone after sharing it (0 where it did not)."""
    return getattr(gpuslots.held(), "alone_waited_s", None) or 0.0


def hold_alone(device):
    """From here on this job holds its GPU alone: a job that was `preparing` waits for that here
    (shapewise.execution.gpushare.hold_alone); any other job already does, or runs where no lock applies. Returns
    whether it had to wait for it."""
    if not preparing(device):
        return False
    gpushare.hold_alone(gpuslots.held())
    return True


def first_call_ms(fn, device):
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return (time.perf_counter() - t0) * 1e3


def triton_cache_entries():
    """How many compiled kernels Triton's on-disk cache holds (one directory per kernel binary), or None when
    there is no such cache (no Triton, or the interpreter). Counting before and after a call tells whether the
    call compiled kernels rather than loading them (the cache persists between processes; delete it to start
    cold: TRITON_CACHE_DIR, default ~/.triton/cache)."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return None
    try:
        # Triton >= 3.4: knobs.cache.dir honours TRITON_CACHE_DIR
        from triton import knobs  # deferred: triton, on a GPU only (TRITON_INTERPRET is read when it loads)
    except ImportError:
        return None
    where = os.environ.get("TRITON_CACHE_DIR") or knobs.cache.dir
    try:
        return sum(1 for entry in os.scandir(where) if entry.is_dir())
    except OSError:
        return 0


def summarize(times_ms):
    if not times_ms:
        return None
    ordered = sorted(times_ms)
    p90_index = min(len(ordered) - 1, math.ceil(0.9 * len(ordered)) - 1)
    return {
        "count": len(ordered),
        "median_ms": statistics.median(ordered),
        "p90_ms": ordered[p90_index],
        "min_ms": ordered[0],
        "max_ms": ordered[-1],
        "mean_ms": statistics.fmean(ordered),
    }


def peak_memory_reset(device):
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def peak_memory_bytes(device):
    if device.type == "cuda":
        torch.cuda.synchronize()
        return int(torch.cuda.max_memory_allocated())
    return None


def free_memory_bytes(device):
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info()
        return int(free), int(total)
    available = total = None
    with open("/proc/meminfo") as fh:
        for line in fh:
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
            elif line.startswith("MemTotal:"):
                total = int(line.split()[1]) * 1024
    return available, total


# --- which GPU, its state, who else is on it, which CPU cores -------------------------------------------------

SLOT_ENV = "SHAPEWISE_PIPELINE_GPU_SLOT"
SLOT_SOURCE_ENV = "SHAPEWISE_PIPELINE_GPU_SLOT_SOURCE"
NOT_AVAILABLE_ON_CPU = {"available": False, "reason": "CPU job: no GPU"}


def gpu_identity(device):
    """{"index", "uuid", "name", "slot", "slot_source", "cuda_visible_devices", "lock"} of the GPU a job runs on, or
    None on a CPU. `index` is torch's index (among the visible GPUs), `slot` the physical index the slot pool gave,
    `lock` how the job holds it (shapewise.execution.gpuslots.Slot.record: alone or shared, since when, the other
    holders then; absent without a lock: under SLURM, or CUDA_VISIBLE_DEVICES chosen by hand)."""
    if torch.device(device).type != "cuda":
        return None
    index = torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    uuid = str(props.uuid)
    identity = {
        "index": index,
        "uuid": uuid if uuid.startswith("GPU-") else f"GPU-{uuid}",  # nvidia-smi's spelling
        "name": props.name,
        "slot": os.environ.get(SLOT_ENV),
        "slot_source": os.environ.get(SLOT_SOURCE_ENV),
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
    }
    slot = gpuslots.held()
    if slot is not None:
        identity["lock"] = slot.record()
    return identity


def nvidia_smi(args):
    """stdout of `nvidia-smi ARGS`, or None when there is no nvidia-smi or it fails."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        done = subprocess.run(["nvidia-smi", *args], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 else None


def _number(text):
    try:
        return float(text)
    except ValueError:
        return None  # "[N/A]", "[Not Supported]"


def gpu_state(gpu):
    """SM and memory clocks (MHz), temperature (C) and power draw (W) of the job's GPU now (nvidia-smi)."""
    if gpu is None:
        return dict(NOT_AVAILABLE_ON_CPU)
    out = nvidia_smi([f"--id={gpu['uuid']}", "--query-gpu=clocks.sm,clocks.mem,temperature.gpu,power.draw",
                      "--format=csv,noheader,nounits"])
    lines = [line for line in (out or "").splitlines() if line.strip()]
    if len(lines) != 1 or len(lines[0].split(",")) != 4:
        return {"available": False, "reason": "nvidia-smi gave no reading for this GPU", "time": _now()}
    sm, mem, temp, power = (_number(part.strip()) for part in lines[0].split(","))
    return {"available": True, "time": _now(), "sm_clock_mhz": sm, "mem_clock_mhz": mem, "temperature_c": temp,
            "power_w": power}


def compute_processes(gpu):
    """[{"pid", "name", "used_memory_bytes"}] of every compute process nvidia-smi lists on the job's GPU, or
    None when it cannot tell (no nvidia-smi)."""
    out = nvidia_smi(["--query-compute-apps=gpu_uuid,pid,process_name,used_memory",
                      "--format=csv,noheader,nounits"])
    if out is None:
        return None
    listed = []
    for line in out.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) < 4 or parts[0] != gpu["uuid"]:
            continue
        memory = _number(parts[-1])
        listed.append({"pid": int(parts[1]) if parts[1].isdigit() else parts[1], "name": ",".join(parts[2:-1]),
                       "used_memory_bytes": int(memory * 2**20) if memory is not None else None})
    return listed


# GPU memory in use beyond this job's own reservation that a contention check attributes to another process
# when nvidia-smi cannot list processes by pid: generous enough for this job's CUDA context and loaded modules.
FOREIGN_MEMORY_BYTES = 4 * 2**30


# What a job of the run waiting to hold the GPU alone keeps on it beside its allocator's memory: its CUDA context and
# loaded modules (a contention check by memory counts it as the run's, not as another process's).
IDLE_CONTEXT_BYTES = 2**30


def gpu_memory_used_bytes(gpu):
    out = nvidia_smi([f"--id={gpu['uuid']}", "--query-gpu=memory.used", "--format=csv,noheader,nounits"])
    lines = [line.strip() for line in (out or "").splitlines() if line.strip()]
    value = _number(lines[0]) if len(lines) == 1 else None
    return int(value * 2**20) if value is not None else None


def snapshot(gpu, at):
    """What a contention check looks at, now: the GPU's compute processes, its used memory, this job's own, the
    run's other jobs holding this GPU (their lock notes, shapewise.execution.gpuslots) and those waiting to hold it
    alone (their waiting notes: idle processes on it)."""
    slot = gpuslots.held()
    waiting = getattr(slot, "waiting_now", None)
    return {"at": at, "processes": compute_processes(gpu), "memory_used_bytes": gpu_memory_used_bytes(gpu),
            "own_reserved_bytes": int(torch.cuda.memory_reserved()),
            "run_jobs": slot.others_now() if slot is not None else None,
            "run_waiting": waiting() if waiting is not None else []}


def contention(gpu, snapshots, own_pid=None):
    """The contract's `contention` from snapshots (see `snapshot`).

    By pid when nvidia-smi lists this job's own process: every other listed process is contention. Inside a
    container nvidia-smi often lists no process at all, ours included (another pid namespace): then by memory,
    contended when the GPU's used memory exceeds this job's reserved memory by more than FOREIGN_MEMORY_BYTES.
    `method` says which; `checked` is false when neither could be read.

    The run's own jobs are checked apart, from the GPU's lock (snapshot's `run_jobs`): `run_jobs` lists every other
    job of the run seen holding this GPU at a check (none for a job that holds its GPU alone, by the lock), and
    any makes the job contended; `run_jobs_checked` is false for a job without a lock (SLURM, a GPU chosen by
    hand). A job of the run waiting to hold the GPU alone (snapshot's `run_waiting`) holds no lock and runs nothing
    on the GPU (it synchronized its device first): its process, and the memory its allocator held, are listed in
    `idle_run_jobs`, not counted as contention."""
    if gpu is None:
        return {"checked": False, "other_processes": [], "contended": False, "reason": "CPU job: no GPU"}
    idle, seen_by_device = {}, []
    for snap in snapshots:
        waiting = {note.get("pid"): note for note in snap.get("run_waiting") or []}
        for pid, note in waiting.items():
            idle.setdefault(pid, dict(note, seen=[]))["seen"].append(snap["at"])
        snap = dict(snap, idle_unlisted=0)
        if snap.get("processes") is not None:
            listed = [p for p in snap["processes"] if p["pid"] not in waiting]
            # in another pid namespace their pids are not the listed ones: as many listed processes are theirs
            snap["idle_unlisted"] = len(waiting) - (len(snap["processes"]) - len(listed))
            snap["processes"] = listed
        snap["own_reserved_bytes"] = snap.get("own_reserved_bytes", 0) + sum(
            int(note.get("reserved_bytes") or 0) + IDLE_CONTEXT_BYTES for note in waiting.values())
        seen_by_device.append(snap)
    result = _contention_by_device(gpu, seen_by_device, own_pid)
    if idle:
        result["idle_run_jobs"] = list(idle.values())
    seen = {}
    for snap in snapshots:
        for note in snap.get("run_jobs") or []:
            seen.setdefault(note.get("pid"), dict(note, seen=[]))["seen"].append(snap["at"])
    result["run_jobs_checked"] = any(s.get("run_jobs") is not None for s in snapshots)
    result["run_jobs"] = list(seen.values())
    result["contended"] = bool(result["contended"] or seen)
    return result


def _contention_by_device(gpu, snapshots, own_pid):
    own_pid = os.getpid() if own_pid is None else own_pid
    taken = [s for s in snapshots if s["processes"] is not None]
    own_listed = any(p["pid"] == own_pid for s in taken for p in s["processes"])
    base = {"checks": [s["at"] for s in snapshots], "own_pid": own_pid, "own_pid_listed": own_listed}
    if own_listed or any(s["processes"] for s in taken):
        others, contended = {}, False
        for snap in taken:
            rest = [p for p in snap["processes"] if p["pid"] != own_pid]
            contended = contended or len(rest) > (0 if own_listed else 1 + snap.get("idle_unlisted", 0))
            for p in rest:
                others.setdefault(p["pid"], dict(p, seen=[]))["seen"].append(snap["at"])
        result = dict(base, checked=True, method="pid", other_processes=list(others.values()), contended=contended)
        if not own_listed:
            result["note"] = ("this job's pid is not among the listed ones (another pid namespace): one listed "
                              "process per check is taken to be this job")
        return result
    readings = [s for s in snapshots if s.get("memory_used_bytes") is not None]
    if not readings:
        return dict(base, checked=False, other_processes=[], contended=False,
                    reason="nvidia-smi could read neither the GPU's processes nor its used memory")
    foreign = {s["at"]: s["memory_used_bytes"] - s["own_reserved_bytes"] for s in readings}
    return dict(base, checked=True, method="memory", other_processes=[],
                contended=any(v > FOREIGN_MEMORY_BYTES for v in foreign.values()),
                memory_beyond_own_bytes=foreign, threshold_bytes=FOREIGN_MEMORY_BYTES,
                note="nvidia-smi lists no process on this GPU, not even this job (another pid namespace): "
                     "judged by the GPU's used memory beyond this job's reserved memory")


def _job_start_record():
    start = cpus.job_start()
    if start is not None:
        return start
    now = sorted(os.sched_getaffinity(0))
    count, how = cpus.physical_core_count(now)
    return {"requested": None, "allowed": now, "cores": now, "applied": False, "topology": how,
            "physical_cores": count, "reason": "not started by `shapewise job`: cores left as they were"}


def job_cpu_affinity(explicit_threads=None):
    """The cores this job runs on, as every result records them (`cpu_affinity`): what the job did when it
    took its GPU slot (shapewise.execution.cpus.pin_job, in shapewise.cli), or, in a process not started by
    `shapewise job`, its cores as they are. The torch thread count is capped at the number of cores unless
    the job was given --threads (`explicit_threads`)."""
    start = _job_start_record()
    if not explicit_threads and torch.get_num_threads() > len(start["cores"]):
        torch.set_num_threads(len(start["cores"]))
    return dict(start, torch_threads=torch.get_num_threads())


def pin_cpus(spec):
    """Apply the timing protocol's `cpus` setting to this process, on top of the job-start pinning; returns what
    was done (the `cpu_affinity` record, `cores` = the cores the job runs on afterwards).

    "inherit": the cores the job started with (a job of the local lock pool: already its slot's cores).
    "per-slot": its slot's share of the job's allowed cores (shapewise.execution.cpus: whole physical cores, split among
    the GPUs of the run's pool), so concurrent GPU jobs never share a core; only with slots from the local lock
    pool (under SLURM the scheduler places the job, with CUDA_VISIBLE_DEVICES from the user nothing says which
    jobs run beside it). A list: those cores, which must be among the cores the job was allowed at its start."""
    start = cpus.job_start()
    allowed = start["allowed"] if start else sorted(os.sched_getaffinity(0))
    if spec == "inherit":
        record = _job_start_record()
        return dict(record, requested=spec, applied=False, torch_threads=torch.get_num_threads(),
                    reason=f"left as the job started ({record['reason']})")
    if spec == "per-slot":
        try:
            record = cpus.place_slot(spec, allowed)
        except cpus.CpuSlotError as exc:
            raise SystemExit(f"cpus per-slot: {exc}") from None
        if not record["applied"]:
            return dict(record, torch_threads=torch.get_num_threads())
        cores = record["cores"]
    elif isinstance(spec, list) and all(isinstance(c, int) for c in spec):
        cores = sorted(spec)
        foreign = sorted(set(cores) - set(allowed))
        if foreign or not cores:
            raise SystemExit(f"timing protocol cpus {spec!r}: cores {foreign or cores} are not among this job's "
                             f"allowed cores {allowed}")
        os.sched_setaffinity(0, cores)
        count, how = cpus.physical_core_count(cores)
        record = {"requested": spec, "allowed": allowed, "cores": cores, "applied": True, "topology": how,
                  "physical_cores": count, "reason": f"pinned to the {len(cores)} listed of {len(allowed)} cores"}
    else:
        raise SystemExit(f"timing protocol cpus {spec!r}: expected inherit, per-slot or a list of core numbers")
    if torch.get_num_threads() > len(cores):
        torch.set_num_threads(len(cores))
    return dict(record, torch_threads=torch.get_num_threads())


CORE_PICKS = ("none", "fastest-launch")  # the stable protocol's `core_pick`; absent = "none"
PROBE_LAUNCHES = 200


def launch_cost_us(device, launches=PROBE_LAUNCHES):
    """Host microseconds per launch of a tiny kernel issued back to back from the calling thread (the queue
    stays far below its depth, so this is the host's issue cost on the core the thread runs on now)."""
    y = torch.zeros(16, device=device)
    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(launches):
        y.add_(1.0)
    elapsed = time.perf_counter() - t0
    torch.cuda.synchronize(device)
    return elapsed / launches * 1e6


def pick_core(cores, cost_of):
    """Pin the calling thread (only it: the launching thread) to the core of `cores` with the lowest
    cost_of(core), measured with the thread on that core, twice, keeping the lower. Returns what was chosen.

    On a virtual machine the host cost of a launch differs by core and switches between levels within a minute
    (docs/decisions.md#core-pick), and a launch-bound model's time follows it; the core is picked again before every
    round."""
    costs = {}
    for core in cores:
        os.sched_setaffinity(0, {core})
        costs[core] = min(cost_of(core), cost_of(core))
    best = min(costs, key=costs.get)
    os.sched_setaffinity(0, {best})
    return {"core": best, "launch_us": round(costs[best], 3),
            "median_launch_us": round(statistics.median(costs.values()), 3), "cores_probed": len(costs)}


def _now():
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds")
