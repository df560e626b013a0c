"""CPU cores of a GPU slot: the one owner of how a node's logical CPUs are split among its GPU slots.

Every local GPU job (slot source `lock`, shapewise.execution.gpuslots) pins itself to its slot's share of the CPUs as
soon as it holds the slot (shapewise.cli.run_job, before torch is imported), so the CPU work of jobs on other GPUs
(Triton compiles, ptxas, host-bound models) never lands on its cores, and the compile subprocesses it starts
inherit its cores. The share is made of whole physical cores: all allowed hyperthreads of one core go to the
same slot, whatever the numbering of siblings (k and k+N/2, or 2k and 2k+1). Cores are ordered by
(package, core id) and split in contiguous, as-even-as-possible groups, so a slot stays on one package where
the counts allow it. A pool of one GPU gives its slot every allowed CPU.

The topology is read from sysfs (`cpu<N>/topology/physical_package_id` and `core_id`); when it cannot be read
every logical CPU counts as a core of its own and the record says `topology: "unknown: <why>"`.

Imports no torch: the job-start pinning runs before torch exists in the process. The torch thread count is
set and recorded where torch is already imported (shapewise.jobs.device).
"""

from __future__ import annotations

import os
from pathlib import Path

from shapewise.execution.gpuslots import POOL_VAR, SLOT_VAR, SOURCE_VAR

SYSFS_ROOT = "/sys/devices/system/cpu"

_JOB_START = None  # what pin_job did in this process (a record), None when it was not called


class CpuSlotError(ValueError):
    """A slot that cannot be placed: the message names the variable and the value that are wrong."""


def topology(allowed, sysfs_root=None):
    """({(package, core_id): [logical CPUs]}, how) for the logical CPUs `allowed`; how is "sysfs" or
    "unknown: <why>" (then every logical CPU is a core of its own, on package 0)."""
    root = Path(sysfs_root or SYSFS_ROOT)
    cores = {}
    for cpu in sorted(allowed):
        place = []
        for name in ("physical_package_id", "core_id"):
            path = root / f"cpu{cpu}" / "topology" / name
            try:
                place.append(int(path.read_text().strip()))
            except (OSError, ValueError) as exc:
                why = f"cannot read {path} ({type(exc).__name__})"
                return {(0, c): [c] for c in sorted(allowed)}, f"unknown: {why}; each logical CPU taken as a core"
        cores.setdefault(tuple(place), []).append(cpu)
    return cores, "sysfs"


def slot_cores(allowed, slot_index, n_slots, sysfs_root=None):
    """The CPUs of slot `slot_index` of `n_slots`: {"cores": sorted logical CPUs (whole physical cores), "topology",
    "physical_cores": physical cores of the slot, "allowed_physical_cores": physical cores among `allowed`}.
    `cores` is [] when there are fewer physical cores than slots (no core of its own)."""
    if not 0 <= slot_index < n_slots:
        raise CpuSlotError(f"slot index {slot_index} is not among the {n_slots} slots of the pool")
    by_core, how = topology(allowed, sysfs_root)
    ordered = sorted(by_core)
    start, end = slot_index * len(ordered) // n_slots, (slot_index + 1) * len(ordered) // n_slots
    mine = ordered[start:end] if len(ordered) >= n_slots else []
    return {"cores": sorted(cpu for core in mine for cpu in by_core[core]), "topology": how,
            "physical_cores": len(mine), "allowed_physical_cores": len(ordered)}


def physical_core_count(cpus, sysfs_root=None):
    """(physical cores the logical CPUs `cpus` belong to, how the topology was read)."""
    by_core, how = topology(cpus, sysfs_root)
    return len(by_core), how


def slot_position(environ=None):
    """(index of this job's slot in the pool, pool size) from the pipeline's variables."""
    env = os.environ if environ is None else environ
    pool, slot = env.get(POOL_VAR, ""), env.get(SLOT_VAR)
    gpus = [g.strip() for g in pool.split(",") if g.strip()]
    if slot not in gpus:
        raise CpuSlotError(f"this job's slot {SLOT_VAR}={slot!r} is not in the pool {POOL_VAR}={pool!r}")
    return gpus.index(slot), len(gpus)


def place_slot(requested, allowed, environ=None, sysfs_root=None):
    """Pin this process to its slot's share of `allowed` when its slot comes from the local lock pool.
    Returns the record {"requested", "allowed", "cores", "applied", "reason", "topology", "physical_cores"};
    `cores` is the affinity the process has afterwards."""
    env = os.environ if environ is None else environ
    allowed = sorted(allowed)
    now = sorted(os.sched_getaffinity(0))
    source = env.get(SOURCE_VAR)
    if source != "lock":
        count, how = physical_core_count(now, sysfs_root)
        why = ("CPU job: no GPU slot" if source in (None, "none") else
               f"slot source {source!r}, not the local lock pool (the scheduler or the user placed it)")
        return {"requested": requested, "allowed": allowed, "cores": now, "applied": False, "topology": how,
                "physical_cores": count, "reason": f"{why}: cores left as they were"}
    index, n_slots = slot_position(env)
    share = slot_cores(allowed, index, n_slots, sysfs_root)
    record = {"requested": requested, "allowed": allowed, "topology": share["topology"]}
    if not share["cores"]:
        return dict(record, cores=now, applied=False, physical_cores=physical_core_count(now, sysfs_root)[0],
                    reason=f"{share['allowed_physical_cores']} physical cores for {n_slots} GPUs: no core of its "
                           f"own, left as they were")
    os.sched_setaffinity(0, share["cores"])
    return dict(record, cores=share["cores"], applied=True, physical_cores=share["physical_cores"],
                reason=f"slot {index + 1} of {n_slots}: pinned to {share['physical_cores']} of "
                       f"{share['allowed_physical_cores']} physical cores ({len(share['cores'])} of "
                       f"{len(allowed)} logical CPUs)")


def pin_job(environ=None, sysfs_root=None):
    """At job start, right after the job took its GPU slot: pin the process to its slot's cores (only for a slot
    of the local lock pool) and remember what was done (job_start()). Returns the record."""
    global _JOB_START
    allowed = sorted(os.sched_getaffinity(0))
    _JOB_START = place_slot("per-slot", allowed, environ, sysfs_root)
    return dict(_JOB_START)


def job_start():
    """A copy of what pin_job did in this process, or None when it was not called."""
    return None if _JOB_START is None else dict(_JOB_START)


def adopt_job_start(record):
    """In a child process a job started (shapewise.jobs.candidate): take the job's pin_job record as this
    process's own (the child inherited the cores it pinned), so its results record them as the job's do."""
    global _JOB_START
    _JOB_START = None if record is None else dict(record)
