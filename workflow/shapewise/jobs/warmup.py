"""Warm-up: compile a row's Triton kernels before the jobs that time them, in a job that shares its GPU.

Every optimized model the row's timing and ablation jobs will build is built here and called once on the row's
input: the model as the row calls it, model(x) where the row's mask is all-True (the timing job's second call),
and each ablation variant the ablation job will run (jobs.ablation.variants and skip_of, from the ablation
protocol). Triton writes what it compiles to its on-disk cache (TRITON_CACHE_DIR, shared by the run's jobs), so
the timing and ablation jobs, which hold their GPU alone, load those kernels instead of compiling them. Nothing
here is timed against anything: an autotuned kernel with several candidates has every candidate compiled and
none chosen (shapewise.execution.gpushare); the choice is timed in a job that holds its GPU alone.

The result records each call's first-call wall time and the kernels it compiled (new entries in Triton's cache):
what a cold cache costs, which the later jobs no longer show. A row whose optimized model does not fit
(preflight) is a resource skip; a variant the model refuses is recorded with its error, as the ablation job
records it. On a CPU the kernels run in Triton's interpreter, which compiles nothing: the job records that and
calls nothing.
"""

from __future__ import annotations

import json

import torch

from shapewise.jobs.ablation import skip_of, variants
from shapewise.jobs.device import first_call_ms, setup, triton_cache_entries
from shapewise.jobs.inputs import FIRST_TRIAL_SEED, make_case
from shapewise.jobs.io import header, log, read_json, resource_skip_reason, write_result
from shapewise.jobs.models import build_optimized, model_config, route_of, run_optimized, set_precision
from shapewise.jobs.preflight import fits
from shapewise.model.optimized import switches_used


def _call(model, x, mask, row, device):
    before = triton_cache_entries()
    ms = first_call_ms(lambda: run_optimized(model, x, mask, row), device)
    after = triton_cache_entries()
    return {"first_call_ms": ms, "compiled_kernels": None if before is None or after is None else after - before,
            "route": route_of(model)[0]}


def main(args):
    device = setup(args.device, args.threads)
    row = json.loads(args.row)
    protocol = json.loads(args.protocol)[device.type]
    preflight = read_json(args.preflight)
    result = header("warmup", row, args.device, args)
    result["calls"] = []
    if device.type != "cuda":
        result.update(status="nothing-to-compile", reason="Triton's interpreter compiles nothing")
        log(f"{row['id']}: nothing to compile on {device.type} (Triton's interpreter)")
        write_result(args.out, result)
        return 0
    if not fits(preflight, "optimized"):
        result.update(status="resource-skip", reason=resource_skip_reason(preflight, "optimized"))
        write_result(args.out, result)
        return 0
    config = model_config(row)
    x, mask, mask_kind = make_case(row, config, device, FIRST_TRIAL_SEED)
    set_precision(reference=False)
    used, base_route = (), None
    with torch.inference_mode():
        for name, disable in variants():
            if disable:
                skip = skip_of(name, used, base_route, protocol)
                if skip:
                    continue
            entry = {"variant": name, "disable": list(disable), "call": "model(x, mask)" if mask is not None
                     else "model(x)"}
            try:
                model = build_optimized(row, config, device, disable=disable)
                entry.update(_call(model, x, mask, row, device))
            except Exception as exc:  # recorded, as the ablation job records a refused variant
                if not disable:
                    raise
                entry["error"] = f"{type(exc).__name__}: {exc}"
                result["calls"].append(entry)
                continue
            result["calls"].append(entry)
            log(f"{row['id']} {name}: first call {entry['first_call_ms']:.0f} ms, "
                f"{entry['compiled_kernels']} kernels compiled")
            if not disable:
                used = switches_used(model.last_route, x.dtype, device.type)
                base_route = entry["route"]
                if mask_kind == "all-true":  # the timing job's model(x) beside the row's call
                    unmasked = dict(variant=name, disable=[], call="model(x)", **_call(model, x, None, row, device))
                    result["calls"].append(unmasked)
                    log(f"{row['id']} model(x): first call {unmasked['first_call_ms']:.0f} ms, "
                        f"{unmasked['compiled_kernels']} kernels compiled")
            del model
    compiled = [c["compiled_kernels"] for c in result["calls"] if c.get("compiled_kernels") is not None]
    result["compiled_kernels"] = sum(compiled) if compiled else None
    result["status"] = "ok"
    write_result(args.out, result)
    return 0
