"""A torch.profiler capture of a few optimized calls.

Writes a per-kernel table (name, calls, total time) as JSON and CSV, and a
Chrome trace. Lists which of our Triton kernels (the @triton.jit functions in
kernels/) ran. On a CPU the kernels run in Triton's interpreter, which the
profiler cannot see; there each interpreted launch is wrapped in a
torch.profiler.record_function named after the kernel, so the table still
says which kernels ran and how often (their times are interpreter times).
"""

from __future__ import annotations

import csv
import importlib
import inspect
import json
import pkgutil
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from shapewise import kernels
from shapewise.execution import gpuslots
from shapewise.jobs.device import setup, sync
from shapewise.jobs.inputs import FIRST_TRIAL_SEED, make_case
from shapewise.jobs.io import header, log, read_json, write_result
from shapewise.jobs.models import build_optimized, call_of, model_config, route_of, run_optimized
from shapewise.jobs.preflight import fits


TRITON_WRAPPERS = ("JITFunction", "InterpretedFunction", "Autotuner", "Heuristics")


def our_triton_kernels():
    """Names of every @triton.jit function defined in the kernels package."""
    names = set()
    for info in pkgutil.iter_modules(kernels.__path__):
        module = importlib.import_module(f"shapewise.kernels.{info.name}")
        for attr in vars(module).values():
            if type(attr).__name__ not in TRITON_WRAPPERS:
                continue
            fn = attr
            for _ in range(5):  # Autotuner -> JITFunction -> python function
                if inspect.isfunction(fn) or not hasattr(fn, "fn"):
                    break
                fn = fn.fn
            if inspect.isfunction(fn):
                names.add(fn.__name__)
    return sorted(names)


def annotate_interpreted_launches():
    """Make interpreted Triton launches visible to the CPU profiler."""
    from triton.runtime.interpreter import InterpretedFunction  # deferred: triton, on a CPU only

    original = InterpretedFunction.run

    def run(self, *args, **kwargs):
        with record_function(getattr(self.fn, "__name__", "triton_kernel")):
            return original(self, *args, **kwargs)

    InterpretedFunction.run = run


def main(args):
    device = setup(args.device, args.threads)
    row = json.loads(args.row)
    capture = json.loads(args.capture)[args.device]
    preflight = read_json(args.preflight)
    result = header("profile", row, args.device, args)
    result["capture"] = capture
    table = []
    for path in (args.out, args.csv, args.trace):
        Path(path).parent.mkdir(parents=True, exist_ok=True)
    result["call"] = None
    if not fits(preflight, "optimized"):
        result["status"] = "resource-skip"
        write_empty_trace(args.trace, "resource skip: the optimized model does not fit")
    else:
        interpreted = device.type == "cpu"
        if interpreted:
            annotate_interpreted_launches()
        config = model_config(row)
        model = build_optimized(row, config, device)
        x, mask, _ = make_case(row, config, device, FIRST_TRIAL_SEED)
        result["call"] = call_of(mask)
        prof, result["gpu_shared_during_capture"] = capture_calls(lambda: run_optimized(model, x, mask, row), device,
                                                                  capture, row["id"])
        prof.export_chrome_trace(args.trace)
        result["route"], result["route_detail"] = route_of(model)
        table = kernel_table(prof, device)
        ours = our_triton_kernels()
        result["triton_kernels_defined"] = ours
        result["triton_kernels_ran"] = sorted({r["name"] for r in table
                                               if any(r["name"].startswith(k) for k in ours)})
        result["time_source"] = (DEVICE_TIME_SOURCE if device.type == "cuda"
                                 else "CPU time; Triton kernels timed inside the interpreter")
        result["status"] = "ok"
        log(f"{row['id']}: {len(table)} entries; our Triton kernels that ran: {result['triton_kernels_ran']}")
    result["kernels"] = table
    write_csv(args.csv, table)
    write_result(args.out, result)
    return 0


DEVICE_TIME_SOURCE = "CUDA kernel time (self device time)"  # what kernel_table's times are on a GPU


def sharing_jobs():
    """The labels of the run's other jobs holding this job's GPU now, or None where this job holds no GPU slot."""
    slot = gpuslots.held()
    return None if slot is None else [note.get("job") or f"pid {note.get('pid')}" for note in slot.others_now()]


def capture_calls(fn, device, capture, tag):
    """The profiler's record of capture["calls"] calls of fn, after capture["warmup"] calls outside it, and the other
    jobs on this GPU when the capture began or ended (beside them kernels run longer; None: no GPU slot held)."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with torch.inference_mode():
        for _ in range(capture["warmup"]):
            fn()
        sync(device)
        log(f"{tag}: profiling {capture['calls']} calls")
        before = sharing_jobs()
        with profile(activities=activities) as prof:
            for _ in range(capture["calls"]):
                fn()
            sync(device)
    return prof, None if before is None else sorted(set(before) | set(sharing_jobs()))


def kernel_table(prof, device):
    """[{"name", "calls", "total_us", "mean_us"}] of a capture, most time first: on a GPU the device kernels
    (self device time), on a CPU every entry (self CPU time)."""
    table = []
    time_field = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    for evt in prof.key_averages():
        total_us = float(getattr(evt, time_field, 0.0) or 0.0)
        if device.type == "cuda" and total_us <= 0:
            continue  # host-only entries: the table lists device kernels
        table.append({"name": evt.key, "calls": int(evt.count), "total_us": total_us,
                      "mean_us": total_us / max(1, int(evt.count))})
    table.sort(key=lambda r: -r["total_us"])
    return table


def write_empty_trace(path, note):
    """The Chrome trace of a capture that did not happen, saying why."""
    Path(path).write_text(json.dumps({"traceEvents": [], "note": note}))


def write_csv(path, table):
    with open(path, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=["name", "calls", "total_us", "mean_us"])
        writer.writeheader()
        writer.writerows(table)
