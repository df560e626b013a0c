"""What a job that shares its GPU must not do: choose a kernel by timing it.

Triton's autotuner times each candidate launch of a kernel on its first call for a new key, keeps the fastest and
writes the choice to Triton's on-disk cache, where every later job finds it. Timed beside other jobs, the choice
could be another one. So in a job holding its GPU shared (shapewise.execution.gpuslots), a choice among several
candidates is never made:
- a warm-up job (`warm`) launches every candidate once (Triton compiles each into its cache) and goes on with the
  first, in this process only: nothing is timed, nothing is written to the cache as chosen;
- any other job compiles the candidates the same way, then stops with NeedsExclusiveGPU: it runs again from the
  start, as a new process holding its GPU alone, where the choice is timed and written. Such a job
  (`alone_until_chosen`) shares its GPU again once the choice is made (gpuslots.Slot.downgrade).
A job that prepares sharing its GPU (gpuslots.PREPARING) holds it alone at such a choice instead (`hold_alone`),
and keeps it so for the timing it prepares. A choice with one candidate cannot depend on what else runs, and is
made as Triton makes it. Jobs that hold their GPU alone and jobs SLURM placed (a GPU of their own, no slot) choose
as Triton does.

The autotuner's methods are wrapped in this process only (triton.runtime.autotuner.Autotuner.check_disk_cache,
which receives the candidates and decides about the cache, and Autotuner._bench, which times one candidate): Triton's
internals, which `unavailable` checks at each job's start (docs/decisions.md, private-apis).
"""

from __future__ import annotations

import inspect
import sys
import threading
from datetime import datetime

from shapewise.execution import gpuslots
from shapewise.execution.gpuslots import EXCLUSIVE

_STATE = threading.local()
_INSTALLED = {}


class NeedsExclusiveGPU(BaseException):
    """This job must run again holding its GPU alone: a kernel choice among several candidates is to be timed.
    A BaseException, so that a job's own `except Exception` (an ablation variant that fails) does not take it
    for a failure of its own."""


def _log(message):
    print(f"[{datetime.now().strftime('%H:%M:%S')}] gpu share: {message}", file=sys.stderr, flush=True)


def _launch_once(kernel_call, quantiles):
    kernel_call()  # compiles the candidate (into Triton's cache) and runs it once, untimed
    return [0.0 for _ in quantiles]


def _compile_candidates(tuner, bench_fn):
    """Run the autotuner's benchmark with every timing replaced by one untimed launch."""
    had = "do_bench" in tuner.__dict__
    saved = tuner.__dict__.get("do_bench")
    tuner.__dict__["do_bench"] = _launch_once
    _STATE.compiling = True
    try:
        bench_fn()
    finally:
        _STATE.compiling = False
        if had:
            tuner.__dict__["do_bench"] = saved
        else:
            tuner.__dict__.pop("do_bench", None)


class _Compiled(BaseException):
    """Raised out of a warm-up's benchmark so that Triton writes no choice to its cache."""


def hold_alone(slot):
    """Hold `slot`'s GPU alone from here on (gpuslots.Slot.upgrade), this process's queued GPU work finished
    first and its allocator's cached blocks given back: while it waits for the GPU it runs nothing there and holds
    only what its models keep."""
    import torch  # deferred: torch, in a job that runs on its GPU

    torch.cuda.synchronize()
    peak = int(torch.cuda.max_memory_allocated())
    torch.cuda.empty_cache()
    slot.upgrade(reserved_bytes=int(torch.cuda.memory_reserved()), peak_allocated_bytes=peak)


def _prepares_shared(slot, prepares):
    """Whether this job still prepares sharing its GPU (`prepares`: a job of a PREPARING step)."""
    return prepares and slot is not None and slot.mode != EXCLUSIVE


def decide(tuner, tuning_key, configs, bench_fn, original, slot, warm, alone_until_chosen, prepares=False):
    """The wrapped check_disk_cache: `original(tuner, tuning_key, configs, bench_fn)` where the choice may be timed
    here (`prepares`: a sharer that prepares holds its GPU alone for it), else the candidates compiled and (warm)
    the first kept in memory or (not warm) NeedsExclusiveGPU."""
    name = getattr(getattr(tuner, "base_fn", None), "__name__", "kernel")
    if _prepares_shared(slot, prepares) and len(configs) > 1:
        hold_alone(slot)
        _log(f"{name} {tuning_key}: {len(configs)} candidates to time: holding the GPU alone from here")
    if slot is None or len(configs) <= 1 or slot.mode == EXCLUSIVE:
        _STATE.timing_allowed = True
        try:
            used_cache = original(tuner, tuning_key, configs, bench_fn)
        finally:
            _STATE.timing_allowed = False
        if slot is not None and slot.mode == EXCLUSIVE and len(configs) > 1 and alone_until_chosen and not warm:
            slot.downgrade()
            _log(f"{name} {tuning_key}: chosen among {len(configs)} candidates holding the GPU alone; sharing it "
                 "from here")
        return used_cache

    def compile_only():
        _compile_candidates(tuner, bench_fn)
        raise _Compiled()

    try:
        return original(tuner, tuning_key, configs, compile_only)
    except _Compiled:
        if not warm:
            raise NeedsExclusiveGPU(f"{name} {tuning_key}: {len(configs)} candidates to time, compiled; the choice "
                                    "is timed holding the GPU alone") from None
        _log(f"{name} {tuning_key}: {len(configs)} candidates compiled, none chosen here (a job holding the GPU "
             "alone times them)")
        return False


def bench(tuner, args, config, meta, original, slot, warm, prepares=False):
    """The wrapped _bench: as Triton's, except where a shared job would time a candidate outside decide() (an
    autotuner that keeps no choice on disk): there it is compiled, and (not warm) the job runs again alone, or
    (`prepares`) holds its GPU alone from there."""
    if _prepares_shared(slot, prepares) and not getattr(_STATE, "compiling", False):
        hold_alone(slot)
    if (getattr(_STATE, "compiling", False) or getattr(_STATE, "timing_allowed", False) or slot is None
            or slot.mode == EXCLUSIVE):
        return original(tuner, *args, config=config, **meta)
    had = "do_bench" in tuner.__dict__
    saved = tuner.__dict__.get("do_bench")
    tuner.__dict__["do_bench"] = _launch_once
    try:
        timing = original(tuner, *args, config=config, **meta)
    finally:
        if had:
            tuner.__dict__["do_bench"] = saved
        else:
            tuner.__dict__.pop("do_bench", None)
    if not warm:
        raise NeedsExclusiveGPU(f"{getattr(tuner.base_fn, '__name__', 'kernel')}: a candidate to time outside "
                                "Triton's cached choices; timed holding the GPU alone")
    return timing


# The Triton autotuner methods wrapped here, as Triton 3.x defines them.
WRAPPED = {"check_disk_cache": ["self", "tuning_key", "configs", "bench_fn"],
           "_bench": ["self", "args", "config", "meta"]}


def unavailable():
    """Why this process's Triton cannot be kept from choosing kernels by timing (then a job that would share its
    GPU holds it alone), or None. No Triton: nothing to keep."""
    try:
        from triton.runtime.autotuner import Autotuner  # deferred: triton, for a job that runs kernels only
    except ImportError:
        return None
    for name, params in WRAPPED.items():
        method = getattr(Autotuner, name, None)
        found = list(inspect.signature(method).parameters) if callable(method) else None
        if found != params:
            return f"triton.runtime.autotuner.Autotuner.{name} is {found}, not {params}"
    return None


def install(warm=False, alone_until_chosen=False, prepares=False):
    """Wrap Triton's autotuner in this process (once): the lock this process holds decides what it may do
    (`prepares`: a job of a PREPARING step, sharing its GPU until it holds it alone)."""
    if _INSTALLED:
        return
    try:
        from triton.runtime.autotuner import Autotuner  # deferred: triton, for a job that runs kernels only
    except ImportError:
        return  # no Triton: nothing chooses kernels by timing
    original_decide, original_bench = Autotuner.check_disk_cache, Autotuner._bench

    def check_disk_cache(self, tuning_key, configs, bench_fn):
        return decide(self, tuning_key, configs, bench_fn, original_decide, gpuslots.held(), warm,
                      alone_until_chosen, prepares)

    def _bench(self, *args, config, **meta):
        return bench(self, args, config, meta, original_bench, gpuslots.held(), warm, prepares)

    Autotuner.check_disk_cache, Autotuner._bench = check_disk_cache, _bench
    _INSTALLED.update(decide=original_decide, bench=original_bench)
