"""A candidate's timing on a row: shapewise's timing protocol (shapewise.jobs.timing: the same protocols,
rounds, stopping rule and per-model figures), the reference and the candidate alternating in the same rounds, so
the candidate's speedup over the reference has its own paired interval. The candidate's first output is checked
(shapewise.jobs.candidate.check_output), and its second against its first.

A candidate that fails accuracy is still timed (the accuracy job runs beside this one); the report shows its
time with the failure and never counts it as the fastest. Where the plain reference does not fit, the candidate
is timed alone and has no speedup.
"""

from __future__ import annotations

import json

import torch

from shapewise import stats
from shapewise.jobs.candidate import (begin, beside, build, call, check_output, guarded, reference_fit, run_step,
                                      supervise)
from shapewise.jobs.device import setup
from shapewise.jobs.inputs import DTYPES, FIRST_TRIAL_SEED, make_case
from shapewise.jobs.io import log, write_result
from shapewise.jobs.models import call_of, model_config, set_precision
from shapewise.jobs.timing import describe, model_entries, resolve_protocol, time_protocol

STAGE = "timing"


def main(args):
    return supervise(args)


def child(args):
    return run_step(work, args)


def work(args, progress):
    device = setup(args.device, args.threads)
    row = json.loads(args.row)
    name, protocol = resolve_protocol(json.loads(args.protocol), device.type)
    config = model_config(row)
    fit = reference_fit(config, device, args.headroom)
    result = begin("candidate-timing", row, args, progress)
    result.update(protocol=describe(name, protocol, device), reference_fit=fit, call=None, status=None,
                  failure=None, speedup=None, speedup_ci=None, noisy=None,
                  skips={} if fit["fits"] else {"reference": fit["reason"]})
    if not fit["fits"]:
        log(f"{row['id']}: reference {fit['reason']}: the candidate is timed alone")
    set_precision(reference=False)
    reference, model, result["weights"] = build(args, row, config, device, progress,
                                                DTYPES[row["dtype"]] if fit["fits"] else None)
    x, mask, _ = make_case(row, config, device, FIRST_TRIAL_SEED)
    result["call"] = call_of(mask)
    version, kept = x._version, []

    def candidate():
        out = guarded(STAGE, call, model, x, mask)
        if len(kept) < 2:  # its first two outputs, checked after its warm-up
            kept.append(out)
        return out

    def check_kept(which):
        if which == "optimized":
            check_output(kept[0], x, STAGE + " (first call)", version)
            if len(kept) > 1:
                check_output(kept[1], x, STAGE + " (second call)", version, previous=kept[0])
            kept.clear()

    calls = {"optimized": candidate}  # first: its very first call is the one of the process
    if reference is not None:
        calls["reference"] = lambda: beside(STAGE, reference, x, mask)
    progress.stage(STAGE)
    rounds, seen = time_protocol(calls, row, device, name, protocol, result, after_warmup=check_kept)
    summary = stats.summarize(rounds)
    entries = model_entries(rounds, summary, seen, config.batch_size * config.seq_len, row)
    result["optimized"] = entries["optimized"]  # the model under test, as in shapewise's timing results
    result["reference"] = entries.get("reference")
    result.update(speedup=summary["speedup"], speedup_ci=summary["speedup_ci"], noisy=summary["noisy"], status="ok")
    write_result(args.out, result)
