"""A candidate's timing on a row: shapewise's timing protocol (shapewise.jobs.timing: the same protocols,
rounds, stopping rule and per-model figures), the reference and the candidate alternating in the same rounds, so
the candidate's speedup over the reference has its own paired interval. The candidate's first output is checked
(shapewise.jobs.candidate.check_output), and its second against its first.

The job process (`main`) runs the protocol: the reference's calls in its own process, on inputs it draws from the
seed, the candidate's in the child (`child`), one round at a time on request (`Remote`), on the same device; each
waits while the other's round runs. Each process times its own calls (CUDA events, or time.perf_counter on a CPU)
and reads its own peak memory; the job process moves the child's launching thread with its own where the protocol
pins cores, and counts the child as the job's own in the contention checks.

A candidate that fails accuracy is still timed (the accuracy job runs beside this one); the report shows its
time with the failure and never counts it as the fastest. Where the plain reference does not fit, the candidate
is timed alone and has no speedup.
"""

from __future__ import annotations

import gc
import json
import math
import os

import torch

from shapewise.analysis import stats
from shapewise.jobs.candidate import (CandidateFailed, beside, build, call, check_output, drive, guarded,
                                      reference_fit, serve)
from shapewise.jobs.device import first_call_ms, peak_memory_bytes, peak_memory_reset, setup, time_calls
from shapewise.jobs.inputs import DTYPES, FIRST_TRIAL_SEED, make_case
from shapewise.jobs.io import log
from shapewise.jobs.models import call_of, model_config, place_reference, seeded_reference, set_precision
from shapewise.jobs.timing import Timed, describe, model_entries, resolve_protocol, time_protocol

STAGE = "timing"
CALLS = ("model(x, mask)", "model(x)")  # what shapewise.jobs.models.call_of says


def main(args):
    return drive(args, run)


class Remote(Timed):
    """The candidate, timed in its child process (`child`) on request; what it answers is checked here."""

    def __init__(self, process):
        self.process = process
        self.pid = process.pid

    def first_call(self):
        return milliseconds(self.process.request("first", STAGE)["ms"], "first call")

    def warmup(self, count):
        return peak(self.process.request("warmup", STAGE, count=count)["peak"])

    def round(self, count, gc_off):
        answer = self.process.request("round", STAGE, count=count, gc_off=gc_off)
        times = answer["times"]
        if not isinstance(times, list) or len(times) != count:
            raise CandidateFailed("crashed", STAGE, f"its process answered a round of {count} calls with "
                                  f"{str(times)[:200]}")
        return [milliseconds(t, "round") for t in times], peak(answer["peak"])

    def pin(self, cores):
        try:
            os.sched_setaffinity(self.pid, cores)
        except ProcessLookupError:  # it ended: the next request says how
            pass

    def reserved_bytes(self):
        return peak(self.process.request("reserved", STAGE)["bytes"]) or 0


def milliseconds(value, what):
    if type(value) not in (int, float) or not math.isfinite(value) or value < 0:
        raise CandidateFailed("crashed", STAGE, f"its process answered its {what} time with {str(value)[:200]}")
    return float(value)


def peak(value):
    if value is not None and (type(value) is not int or value < 0):
        raise CandidateFailed("crashed", STAGE, f"its process answered a memory figure with {str(value)[:200]}")
    return value


def run(args, device, row, result, start):
    """The job process: the reference and its inputs, the protocol over both processes."""
    name, protocol = resolve_protocol(json.loads(args.protocol), device.type)
    config = model_config(row)
    fit = reference_fit(config, device, args.headroom)
    result.update(protocol=describe(name, protocol, device), reference_fit=fit, call=None, speedup=None,
                  speedup_ci=None, noisy=None, skips={} if fit["fits"] else {"reference": fit["reason"]})
    if not fit["fits"]:
        log(f"{row['id']}: reference {fit['reason']}: the candidate is timed alone")
    set_precision(reference=False)
    with start() as child:
        built = child.request("build", "import")
        result["weights"] = built["weights"]
        result["call"] = built["call"] if built["call"] in CALLS else None
        calls = {"optimized": Remote(child)}  # first: its very first call is the one of its process
        if fit["fits"]:
            reference = beside("reference", place_reference, seeded_reference(config), row, device,
                               DTYPES[row["dtype"]])
            x, mask, _ = make_case(row, config, device, FIRST_TRIAL_SEED)  # drawn here, never the candidate's
            result["call"] = call_of(mask)
            calls["reference"] = lambda: beside(STAGE, reference, x, mask)

        def check_kept(which):
            if which == "optimized":
                child.request("check", STAGE)

        rounds, seen = time_protocol(calls, row, device, name, protocol, result, after_warmup=check_kept)
    summary = stats.summarize(rounds)
    entries = model_entries(rounds, summary, seen, config.batch_size * config.seq_len, row)
    result["optimized"] = entries["optimized"]  # the model under test, as in shapewise's timing results
    result["reference"] = entries.get("reference")
    result.update(speedup=summary["speedup"], speedup_ci=summary["speedup_ci"], noisy=summary["noisy"], status="ok")


def child(args):
    """The child: the candidate built on request, then its first call, warm-up, first outputs' check and rounds,
    each timed here."""
    device = setup(args.device, args.threads)
    row = json.loads(args.row)
    config = model_config(row)
    held = {"kept": []}

    def build_candidate(request, progress):
        held["model"], weights = build(args, row, config, device, progress)
        held["x"], held["mask"], _ = make_case(row, config, device, FIRST_TRIAL_SEED)
        held["version"] = held["x"]._version
        set_precision(reference=False)
        progress.stage(STAGE)
        return {"weights": weights, "call": call_of(held["mask"])}

    def candidate():
        out = guarded(STAGE, call, held["model"], held["x"], held["mask"])
        if len(held["kept"]) < 2:  # its first two outputs, checked after its warm-up
            held["kept"].append(out)
        return out

    @torch.inference_mode()
    def first(request, progress):
        peak_memory_reset(device)
        return {"ms": first_call_ms(candidate, device)}

    @torch.inference_mode()
    def warmup(request, progress):
        time_calls(candidate, device, int(request["count"]))
        return {"peak": peak_memory_bytes(device)}

    def check(request, progress):
        kept, x, version = held["kept"], held["x"], held["version"]
        check_output(kept[0], x, STAGE + " (first call)", version)
        if len(kept) > 1:
            check_output(kept[1], x, STAGE + " (second call)", version, previous=kept[0])
        kept.clear()
        return {}

    @torch.inference_mode()
    def timed_round(request, progress):
        if request["gc_off"]:  # as run_rounds does in the job process: what is held now frozen, the collector off
            if not gc.get_freeze_count():
                gc.collect()
                gc.freeze()
            gc.collect()
            gc.disable()
        try:
            peak_memory_reset(device)
            times = time_calls(candidate, device, int(request["count"]))
        finally:
            gc.enable()
        return {"times": times, "peak": peak_memory_bytes(device)}

    def reserved(request, progress):
        return {"bytes": int(torch.cuda.memory_reserved()) if device.type == "cuda" else 0}

    return serve(args, {"build": build_candidate, "first": first, "warmup": warmup, "check": check,
                        "round": timed_round, "reserved": reserved})
