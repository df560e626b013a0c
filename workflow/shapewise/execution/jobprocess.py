"""One pipeline job (`shapewise job STEP ...`) in this process, a fresh one or a fork of the run's job server
(shapewise.execution.jobserver): its sub-command's parser, its SHAPEWISE_* variables, its GPU slot and CPU cores, its
step; and how the process started (`process_record`, for the job's result).

shapewise.cli runs a job as a client of the job server, which forks and runs it here (run_forked), or, where there
is no server, runs it here itself (run_job_here): both ways parse and run the job the same way.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from shapewise.execution import cpus, gpushare, gpuslots
from shapewise.inputs import steps
from shapewise.inputs.settings import devices

PIPELINE_PREFIX = "SHAPEWISE_PIPELINE_"  # the pipeline's own variables (GPU slot pool), never removed

_RECORD = {"started_as": "fresh process", "reason": "not started by `shapewise job`"}


class RunFresh(Exception):
    """The job cannot run in a fork of this server (its device is not the server's): run it as a fresh process."""


def process_record():
    """How this job's process started, for its result: a fork of the job server (with the server's pid and
    start, and how long the fork took) or a fresh process (with the reason)."""
    return dict(_RECORD)


def record_process(**how):
    """This process started as `how` says (shapewise.execution.jobserver: a fork of the server, or fresh and why)."""
    _RECORD.clear()
    _RECORD.update(how)


def adopt_process_record(record):
    """In a child process a job started (shapewise.jobs.candidate): the job's record is its job process's, with
    this child's pid beside it."""
    if record is not None:
        record_process(**{**record, "child": {"pid": os.getpid(), "started_as": "child process of the job process"}})


def add_job_parser(sub):
    """`shapewise job STEP`: one sub-command per step of shapewise.inputs.steps, with the options every job takes and
    the step's own (each required)."""
    job = sub.add_parser("job", help="run one pipeline job (Snakemake calls this)")
    parsers = job.add_subparsers(dest="step", required=True)
    for name, step in steps.STEPS.items():
        p = parsers.add_parser(name)
        p.add_argument("--device", choices=devices(), required=True)
        p.add_argument("--threads", type=steps.JOB_WIDE["threads"].type, default=None)
        p.add_argument("--out", required=True)
        p.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                       help="a SHAPEWISE_* variable the job keeps (config pass_env); every other one is removed")
        p.add_argument("--impl-digest", default=None,
                       help="digest of the implementation (model/, kernels/; a candidate's job: the candidate's), "
                            "recorded in the result's identity")
        p.add_argument("--env-digest", default=None,
                       help="digest of the environment, recorded in the result's identity")
        for option, spec in step.own_options().items():
            p.add_argument(f"--{option}", type=spec.type, required=True)


def job_environment_variables(passed):
    """Remove every SHAPEWISE_* variable of the user's shell from this process, except the pipeline's own
    (SHAPEWISE_PIPELINE_*), then set those passed explicitly as NAME=VALUE (config pass_env). Runs before
    the job builds the model, which reads SHAPEWISE_ROUTE and SHAPEWISE_DISABLE when it is built."""
    kept = {}
    for item in passed:
        name, sep, value = item.partition("=")
        if not sep or not name.startswith("SHAPEWISE_") or name.startswith(PIPELINE_PREFIX):
            raise SystemExit(f"--env {item!r}: expected NAME=VALUE with NAME a SHAPEWISE_* variable "
                             f"(not {PIPELINE_PREFIX}*)")
        kept[name] = value
    for name in [n for n in os.environ if n.startswith("SHAPEWISE_") and not n.startswith(PIPELINE_PREFIX)]:
        del os.environ[name]
    os.environ.update(kept)


def run_job_here(args, argv, server_mode=None):
    """Run the job in this process (fresh, or forked from the job server that serves `server_mode`)."""
    job_environment_variables(getattr(args, "env", []))
    # A GPU job takes one GPU of the run's pool for its whole run (shapewise.execution.gpuslots), before anything
    # imports torch: CUDA_VISIBLE_DEVICES must be set before CUDA initializes. `auto` is resolved after
    # that. The GPU jobs are those measure.smk gives a GPU (all device jobs but the implementation
    # fingerprint); a job that times holds it alone, the others may share it (gpuslots.GPU_USE). Triton reads
    # TRITON_INTERPRET when it is imported: set it before any job module (the model, the kernels) is imported;
    # torch itself does not import triton.
    mode, prepares = None, False
    if getattr(args, "device", None) is not None:
        def pin():
            # holding a slot of the local lock pool: the CPU cores of that slot (shapewise.execution.cpus), before torch
            # is imported (also by `auto`): its threads and the compile subprocesses (ptxas) stay on these cores
            try:
                cpus.pin_job()
            except cpus.CpuSlotError as exc:
                raise SystemExit(f"{args.step} job: cannot pin its GPU slot's CPU cores: {exc}") from None

        needs_gpu = not (args.step == "fingerprint" and args.kind == "implementation")
        try:
            mode = gpuslots.job_mode(args.step)
        except gpuslots.GpuError as exc:
            raise SystemExit(f"{args.step} job: {exc}") from None
        why, parts, capped, prepares = None, 1, False, False
        if mode == gpuslots.SHARED and args.device != "cpu" and os.environ.get(gpuslots.POOL_VAR):
            # nothing would keep it from choosing kernels by timing beside other jobs, or its row's memory would
            # leave too little for them
            why = gpushare.unavailable()
            if why is None:
                parts, why = gpuslots.memory_parts(getattr(args, "preflight", None), args.step)
                # a sharer whose parts come from its row's estimate keeps its allocator to them
                capped = getattr(args, "preflight", None) is not None and gpuslots.memory_parts_on()
            if why is not None and parts in (None, 1):
                print(f"job process: holds its GPU alone: {why}", file=sys.stderr, flush=True)
                mode, parts = gpuslots.EXCLUSIVE, 1
            elif parts > 1:
                print(f"job process: takes {parts} parts of its GPU: {why}", file=sys.stderr, flush=True)
        elif (args.step in gpuslots.PREPARING and gpuslots.prepare_shared_on() and args.device != "cpu"
              and os.environ.get(gpuslots.POOL_VAR) and os.environ.get(gpuslots.USE_VAR) != gpuslots.EXCLUSIVE):
            # it builds its models sharing the GPU (one part, uncapped: its estimate), then holds it alone to time
            why = gpushare.unavailable()
            if why is None:  # None with one part: more parts (or none) come with the reason
                _, why = gpuslots.memory_parts(getattr(args, "preflight", None), args.step)
            if why is None:
                print("job process: prepares sharing its GPU, then holds it alone for what it times", file=sys.stderr,
                      flush=True)
                mode, prepares = gpuslots.SHARED, True
            else:
                print(f"job process: holds its GPU alone from the start: {why}", file=sys.stderr, flush=True)
        args.device = gpuslots.enter_job(args.device, needs_gpu=needs_gpu, label=f"{args.step} {args.out}",
                                         on_slot=pin, mode=mode, why=why, parts=parts,
                                         profiling=args.step in gpuslots.PROFILING, memory_cap=capped)
    if server_mode is not None and args.device != server_mode:
        slot = gpuslots.held()
        if slot is not None:
            slot.release()
        raise RunFresh(f"the job runs on {args.device}, the job server serves {server_mode}")
    if getattr(args, "device", None) == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    if args.device == "cuda" and gpuslots.held() is not None:
        gpushare.install(warm=args.step == "warmup",
                         alone_until_chosen=os.environ.get(gpuslots.USE_VAR) == gpuslots.EXCLUSIVE, prepares=prepares)
    module = importlib.import_module(steps.STEPS[args.step].module)
    try:
        return module.main(args)
    except gpushare.NeedsExclusiveGPU as exc:
        if server_mode is not None:
            raise  # the client asks the job server for a fork that holds the GPU alone
        # a fresh process: start again as a new one (this one's CUDA state is taken), holding the GPU alone
        print(f"job process: runs again holding its GPU alone: {exc}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os.environ[gpuslots.USE_VAR] = gpuslots.EXCLUSIVE
        os.execv(sys.executable, [sys.executable, "-m", "shapewise", *argv])


def run_forked(argv, server_mode):
    """A job in a fork of the job server that serves `server_mode`: `argv` (`job STEP ...`, as its client was
    given it) parsed as shapewise.cli parses it, then run here."""
    parser = argparse.ArgumentParser(prog="shapewise")
    add_job_parser(parser.add_subparsers(dest="command", required=True))
    return run_job_here(parser.parse_args(argv), argv, server_mode)
