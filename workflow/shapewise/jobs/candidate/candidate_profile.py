"""A torch.profiler capture of a few calls of a candidate on a row, as shapewise's profile job captures its
model (shapewise.jobs.profile): the per-kernel table as JSON and CSV, and a Chrome trace. One checked call
(shapewise.jobs.candidate.check_output) comes before the capture's warm-up.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from shapewise.jobs.candidate import begin, build, call, forward, guarded, run_step, supervise
from shapewise.jobs.device import setup
from shapewise.jobs.inputs import FIRST_TRIAL_SEED, make_case
from shapewise.jobs.io import log, write_result
from shapewise.jobs.models import call_of, model_config, set_precision
from shapewise.jobs.profile import DEVICE_TIME_SOURCE, capture_calls, kernel_table, write_csv, write_empty_trace

STAGE = "profile"


def main(args):
    return supervise(args, empty_outputs, extra=("csv", "trace"))


def child(args):
    return run_step(work, args, empty_outputs)


def empty_outputs(args, note):
    """The table and the trace of a capture that did not happen."""
    for path in (args.csv, args.trace):
        Path(path).parent.mkdir(parents=True, exist_ok=True)
    write_csv(args.csv, [])
    write_empty_trace(args.trace, note)


def work(args, progress):
    device = setup(args.device, args.threads)
    row = json.loads(args.row)
    capture = json.loads(args.capture)[args.device]
    config = model_config(row)
    result = begin("candidate-profile", row, args, progress)
    result.update(capture=capture, call=None, status=None, failure=None, kernels=[])
    for path in (args.csv, args.trace):
        Path(path).parent.mkdir(parents=True, exist_ok=True)
    model, result["weights"] = build(args, row, config, device, progress)
    x, mask, _ = make_case(row, config, device, FIRST_TRIAL_SEED)
    result["call"] = call_of(mask)
    set_precision(reference=False)
    progress.stage(STAGE)
    with torch.inference_mode():
        forward(model, x, mask, STAGE + " (first call)")
    prof, result["gpu_shared_during_capture"] = capture_calls(lambda: guarded(STAGE, call, model, x, mask), device,
                                                              capture, row["id"])
    progress.stage("write", candidate_code=False)
    prof.export_chrome_trace(args.trace)
    result["kernels"] = kernel_table(prof, device)
    result["time_source"] = DEVICE_TIME_SOURCE if device.type == "cuda" else "CPU time"
    result["status"] = "ok"
    log(f"{row['id']} {args.candidate}: {len(result['kernels'])} entries")
    write_csv(args.csv, result["kernels"])
    write_result(args.out, result)
