"""Ablation: switch off one optimization at a time.

For the "all on" model and for each name in model.optimized.OPTIMIZATIONS,
UserOptimizedTransformer(cfg, disable=(name,)): one accuracy trial against
the reference (official tolerance; chunked reference when the plain one does
not fit; computed once, before any variant's model exists, so that each variant's
memory plan counts it; every variant runs the same input) and a median time
with the shorter ablation protocol. A job that prepares sharing its GPU (config
gpu_prepare_shared) builds and checks every variant before it holds the GPU
alone to time them; any other builds, checks and times one after another. A variant the
model refuses (for example a forced route that needs the disabled switch) is
recorded with its error; the job fails only when the "all on" model fails.

A switch the "all on" route does not use (model.optimized.switches_used) is recorded as
`skipped: not-applicable`: switching it off would run the same code. A switch named in the
protocol's `skip` mapping (config `heavy.ablation.skip`, for rows where a variant takes minutes
per call) is recorded as `skipped: time` with the configured reason. Neither is a pass.
"""

from __future__ import annotations

import json
import statistics

import torch

from shapewise.jobs.check import Expected
from shapewise.jobs.device import hold_alone, preparing, setup, shared_then_alone, time_calls
from shapewise.jobs.inputs import FIRST_TRIAL_SEED, make_case
from shapewise.jobs.io import header, log, read_json, write_result
from shapewise.jobs.models import (build_models, build_optimized, call_of, model_config, route_of, run_optimized,
                                   set_precision)
from shapewise.jobs.preflight import fits
from shapewise.model.optimized import OPTIMIZATIONS, switches_used


def variants():
    """(name, switches off) of every variant, "all-on" first."""
    return [("all-on", ())] + [(s, (s,)) for s in OPTIMIZATIONS]


def skip_of(name, used, base_route, protocol):
    """{"skipped", "reason"} of a variant that is not run ({} for one that is): a switch the all-on route does not
    use (`used`, known after its first call), or one the protocol's `skip` names."""
    if name not in used:
        return {"skipped": "not-applicable", "reason": f"the all-on route ({base_route}) does not use it"}
    if name in protocol.get("skip", {}):
        return {"skipped": "time", "reason": protocol["skip"][name]}
    return {}


def _failed(variant, row, exc):
    """Record that the model of `variant` failed (no route, no check: it gave nothing to judge); re-raise for the
    all-on model, whose failure is the job's."""
    if not variant["disable"]:
        raise exc
    for key in ("route", "route_detail", "accuracy", "passed", "checked"):
        variant.pop(key, None)
    variant["error"] = f"{type(exc).__name__}: {exc}"
    log(f"{row['id']} without {variant['variant']}: {variant['error']}")


def prepare(variant, row, config, device, x, mask, expected):
    """Build the optimized model of `variant` (its switches off), make its first call on x and check the output
    against `expected` into the entry; the model, or None where the model failed (the error recorded; re-raised
    for the all-on model)."""
    try:
        model = build_optimized(row, config, device, disable=variant["disable"])
        with torch.inference_mode():
            out = run_optimized(model, x, mask, row)
    except Exception as exc:
        _failed(variant, row, exc)
        return None
    comparisons, checked = expected.compare(out)
    variant["route"], variant["route_detail"] = route_of(model)
    variant["accuracy"] = comparisons["official"]
    variant["passed"] = comparisons["official"]["passed"]
    variant["checked"] = checked
    return model


def time_variants(held, row, device, x, mask, protocol):
    """Time each built variant of `held` (emptied: each model freed once timed) with the ablation protocol."""
    while held:
        variant, model = held.pop(0)
        try:
            with torch.inference_mode():
                time_calls(lambda: run_optimized(model, x, mask, row), device, protocol["warmup"])
                times = []
                for _ in range(protocol["rounds"]):
                    times += time_calls(lambda: run_optimized(model, x, mask, row), device, protocol["calls"])
        except Exception as exc:
            _failed(variant, row, exc)
            continue
        variant["median_ms"] = statistics.median(times)
        log(f"{row['id']} {variant['variant']}: {variant['median_ms']:.4f} ms, route {variant['route']}, "
            f"{'pass' if variant['passed'] else 'FAIL'}")
        del model  # freed before the next variant is timed (or built)


def main(args):
    device = setup(args.device, args.threads)
    row = json.loads(args.row)
    protocol = json.loads(args.protocol)[args.device]
    settings = dict(json.loads(args.chunked), batch_samples=1)
    preflight = read_json(args.preflight)
    result = header("ablation", row, args.device, args)
    result["protocol"] = protocol
    result["switches"] = list(OPTIMIZATIONS)
    result["variants"] = []
    result["call"] = None
    if not fits(preflight, "optimized"):
        result["status"] = "resource-skip"
        write_result(args.out, result)
        return 0
    config = model_config(row)
    reference_fits = fits(preflight, "reference")
    reference, _ = build_models(row, config, device)
    x, mask, _ = make_case(row, config, device, FIRST_TRIAL_SEED)
    result["call"] = call_of(mask)
    # the reference's output, computed before any variant's model exists and held beside each: every variant's
    # memory plan (made at its first call, from the memory free then) counts it
    expected = Expected(reference, x, mask, reference_fits, settings)
    reference = None
    set_precision(reference=False)
    # A job that prepares builds every variant and makes its first call and check sharing the GPU, then times them
    # all holding it alone; any other builds, times and frees one variant after the other (row 14's do not fit at
    # once).
    held = []  # (variant entry, model) of the variants built and checked, not yet timed
    used = base_route = None  # the switches the all-on route uses and its route, known after its first call
    ahead = preparing(device)
    for name, disable in variants():
        variant = {"variant": name, "disable": list(disable)}
        result["variants"].append(variant)
        if disable:
            variant.update(skip_of(name, used, base_route, protocol))
        if "skipped" in variant:
            log(f"{row['id']} {name}: skipped ({variant['skipped']}: {variant['reason']})")
            continue
        model = prepare(variant, row, config, device, x, mask, expected)
        if model is None:
            continue
        if not disable:
            used, base_route = switches_used(model.last_route, x.dtype, device.type), variant["route"]
            result["switches_used"] = list(used)
        held.append((variant, model))
        model = None  # `held` holds it alone, so that timing it frees it
        if not ahead:
            time_variants(held, row, device, x, mask, protocol)
    if held:
        hold_alone(device)
        if shared_then_alone(device):
            result["prepared_sharing"] = True
            log(f"{row['id']}: {len(held)} variants built and checked sharing the GPU; timed holding it alone")
        time_variants(held, row, device, x, mask, protocol)
    base = result["variants"][0]["median_ms"]
    for variant in result["variants"]:
        if "median_ms" in variant:
            variant["slowdown_vs_all_on"] = variant["median_ms"] / base
    result["status"] = "ok"
    write_result(args.out, result)
    return 0
