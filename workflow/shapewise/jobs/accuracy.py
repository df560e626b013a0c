"""Accuracy of the optimized model against the reference, per trial.

Trial t uses inputs seeded 1234 + t; both models share weights seeded with
torch.manual_seed(0). The status is pass when every trial passes the
official tolerance, fail otherwise, resource-skip when the optimized model
does not fit. The strict preset is recorded alongside.
"""

from __future__ import annotations

import json

import torch

from shapewise.jobs.check import Sampled, all_finite
from shapewise.jobs.device import setup
from shapewise.jobs.inputs import FIRST_TRIAL_SEED, input_generator, make_case
from shapewise.jobs.io import header, log, read_json, resource_skip_reason, write_result
from shapewise.jobs.models import build_models, call_of, model_config, route_of, run_optimized, set_precision
from shapewise.jobs.preflight import fits


def aggregate(trials):
    out = {}
    for preset in trials[0]["comparisons"]:
        runs = [t["comparisons"][preset] for t in trials]
        out[preset] = {
            "passed": all(r["passed"] for r in runs),
            "trials_passed": sum(r["passed"] for r in runs),
            "failed_elements": sum(r["failed_elements"] for r in runs),
            "total_elements": sum(r["total_elements"] for r in runs),
            "max_abs_error": max(r["max_abs_error"] for r in runs),
            "max_rel_error": max(r["max_rel_error"] for r in runs),
            "nonfinite_elements": sum(r.get("nonfinite_elements", 0) for r in runs),
        }
    return out


def main(args):
    device = setup(args.device, args.threads)
    row = json.loads(args.row)
    settings = json.loads(args.chunked)
    preflight = read_json(args.preflight)
    result = header("accuracy", row, args.device, args)
    result["trials"] = []
    if not fits(preflight, "optimized"):
        result["status"] = "resource-skip"
        result["call"] = None
        result["skip_reason"] = resource_skip_reason(preflight, "optimized")
        log(f"{row['id']}: {result['skip_reason']}")
        write_result(args.out, result)
        return 0
    reference_fits = fits(preflight, "reference")
    config = model_config(row)
    reference, optimized = build_models(row, config, device)
    routes = set()
    calls = set()
    for t in range(row["trials"]):
        seed = FIRST_TRIAL_SEED + t
        x, mask, mask_kind = make_case(row, config, device, seed)
        calls.add(call_of(mask))
        set_precision(reference=False)
        with torch.inference_mode():
            out = run_optimized(optimized, x, mask, row)
        route_name, route = route_of(optimized)
        routes.add(route_name)
        trial = {"trial": t, "seed": seed, "call": call_of(mask), "input_generator": input_generator(config, device),
                 "mask_kind": mask_kind, "route": route_name, "route_detail": route,
                 "output_finite": all_finite(out)}
        # a chunked check keeps only what it compares: the whole input and output go before its reference runs
        sampled = Sampled(out, x, mask, reference_fits, settings)
        del x, mask, out
        comparisons, checked = sampled.check(reference)
        del sampled
        trial.update(comparisons=comparisons, checked=checked)
        result["trials"].append(trial)
        official = comparisons["official"]
        log(f"{row['id']} trial {t} (seed {seed}) route {route_name}: "
            f"{official['failed_elements']}/{official['total_elements']} failed, "
            f"max abs {official['max_abs_error']:.3g}, check {checked['method']}")
    result["aggregate"] = aggregate(result["trials"])
    result["call"] = ",".join(sorted(calls))  # one call for every trial of a row
    result["routes"] = sorted(r for r in routes if r is not None)
    result["route"] = ",".join(result["routes"])
    result["check_method"] = result["trials"][0]["checked"]["method"]
    result["status"] = "pass" if result["aggregate"]["official"]["passed"] else "fail"
    log(f"{row['id']}: {result['status']}")
    write_result(args.out, result)
    return 0
