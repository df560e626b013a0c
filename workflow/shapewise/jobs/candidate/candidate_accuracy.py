"""A candidate's accuracy on a row: the trials of shapewise's accuracy job (inputs seeded 1234 + t, the same
weights, the same comparison against the reference in float32 with TF32 off, or the chunked reference where the
plain one does not fit), each output checked (shapewise.jobs.candidate.check_output) against the candidate's
previous one. A row of one trial calls the candidate once more on the same input for that check.

Status: pass when every trial passes the official tolerance; fail otherwise, with `failure` saying why (kind
accuracy, or the way the candidate failed before a comparison was made).
"""

from __future__ import annotations

import json

import torch

from shapewise.jobs.accuracy import aggregate
from shapewise.jobs.candidate import (CandidateFailed, begin, beside, build, forward, reference_fit, run_step,
                                      supervise)
from shapewise.jobs.check import check
from shapewise.jobs.device import setup
from shapewise.jobs.inputs import FIRST_TRIAL_SEED, input_generator, make_case
from shapewise.jobs.io import log, write_result
from shapewise.jobs.models import call_of, model_config, set_precision


def main(args):
    return supervise(args)


def child(args):
    return run_step(work, args)


def work(args, progress):
    device = setup(args.device, args.threads)
    row = json.loads(args.row)
    settings = json.loads(args.chunked)
    config = model_config(row)
    fit = reference_fit(config, device, args.headroom)  # before anything is allocated, as the preflight job reads
    result = begin("candidate-accuracy", row, args, progress)
    result.update(reference_fit=fit, trials=[], call=None, status=None, failure=None)
    reference, model, result["weights"] = build(args, row, config, device, progress, torch.float32)
    previous, calls = None, set()
    for t in range(row["trials"]):
        seed = FIRST_TRIAL_SEED + t
        x, mask, mask_kind = make_case(row, config, device, seed)
        calls.add(call_of(mask))
        set_precision(reference=False)
        progress.stage(f"forward (trial {t})")
        with torch.inference_mode():
            out = forward(model, x, mask, f"forward (trial {t})", previous)
        progress.stage(f"compare (trial {t})", candidate_code=False)
        comparisons, checked = beside(f"compare (trial {t})", check, reference, out, x, mask, fit["fits"], settings)
        result["trials"].append({"trial": t, "seed": seed, "call": call_of(mask),
                                 "input_generator": input_generator(config, device), "mask_kind": mask_kind,
                                 "comparisons": comparisons, "checked": checked,
                                 "output_finite": bool(torch.isfinite(out).all().item())})
        official = comparisons["official"]
        log(f"{row['id']} {args.candidate} trial {t} (seed {seed}): {official['failed_elements']}/"
            f"{official['total_elements']} failed, max abs {official['max_abs_error']:.3g}, check {checked['method']}")
        previous = out
        if row["trials"] == 1:  # a second call on the same input, for the check against the previous output
            progress.stage("forward (second call on trial 0)")
            with torch.inference_mode():
                forward(model, x, mask, "forward (second call on trial 0)", previous)
        del x, mask, out
    result["aggregate"] = aggregate(result["trials"])
    result["call"] = ",".join(sorted(calls))
    result["check_method"] = result["trials"][0]["checked"]["method"]
    official = result["aggregate"]["official"]
    result["status"] = "pass" if official["passed"] else "fail"
    if not official["passed"]:
        result["failure"] = CandidateFailed(
            "accuracy", "compare", f"{official['failed_elements']} of {official['total_elements']} elements "
            f"outside the official tolerance (max abs error {official['max_abs_error']:.3g})").record()
    log(f"{row['id']} {args.candidate}: {result['status']}")
    write_result(args.out, result)
