"""A candidate's accuracy on a row: the trials of shapewise's accuracy job (inputs seeded 1234 + t, the same
weights, the same comparison against the reference in float32 with TF32 off, or the chunked reference where the
plain one does not fit), each output checked (shapewise.jobs.candidate.check_output) against the candidate's
previous one. A row of one trial calls the candidate once more on the same input for that check.

The job process (`main`) builds the reference, draws each trial's inputs from its seed and compares; the child
(`child`) runs the candidate on inputs it draws from the same seed and hands each output over as plain tensor data
(shapewise.jobs.candidate.write_plain, read_plain). Whatever the candidate did in its process (to torch, to
shapewise, to the inputs it was given) reaches neither the reference nor its inputs.

Status: pass when every trial passes the official tolerance; fail otherwise, with `failure` saying why (kind
accuracy, or the way the candidate failed before a comparison was made).
"""

from __future__ import annotations

import json

import torch

from shapewise.jobs.accuracy import aggregate
from shapewise.jobs.candidate import (CandidateFailed, beside, build, drive, forward, host_copy, guarded,
                                      read_plain, reference_fit, serve, write_plain)
from shapewise.jobs.check import all_finite, check
from shapewise.jobs.device import setup
from shapewise.jobs.inputs import FIRST_TRIAL_SEED, input_generator, make_case
from shapewise.jobs.io import log
from shapewise.jobs.models import call_of, model_config, place_reference, seeded_reference, set_precision
from shapewise.model import describe_comparison

SECOND_CALL = "forward (second call on trial 0)"


def main(args):
    return drive(args, judge)


def judge(args, device, row, result, start):
    """The job process: the reference and its inputs, the comparison of each trial's handed-over output."""
    settings = json.loads(args.chunked)
    config = model_config(row)
    fit = reference_fit(config, device, args.headroom)  # before anything is allocated, as the preflight job reads
    result.update(reference_fit=fit, trials=[], call=None)
    calls = set()
    with start() as child:
        handed = child.scratch / "output"  # one trial's output at a time, where the child may write
        result["weights"] = child.request("build", "import")["weights"]
        reference = beside("reference", place_reference, seeded_reference(config), row, device, torch.float32)
        for t in range(row["trials"]):
            seed = FIRST_TRIAL_SEED + t
            stage = f"forward (trial {t})"
            data = child.request("forward", stage, trial=t, path=str(handed))
            x, mask, mask_kind = make_case(row, config, device, seed)  # drawn here, never the candidate's
            out = read_plain(handed, data, x.shape, row["dtype"], stage).to(device)
            handed.unlink()
            calls.add(call_of(mask))
            comparisons, checked = beside(f"compare (trial {t})", check, reference, out, x, mask, fit["fits"],
                                          settings)
            result["trials"].append({"trial": t, "seed": seed, "call": call_of(mask),
                                     "input_generator": input_generator(config, device), "mask_kind": mask_kind,
                                     "comparisons": comparisons, "checked": checked,
                                     "output_finite": all_finite(out)})
            official = comparisons["official"]
            log(f"{row['id']} {args.candidate} trial {t} (seed {seed}): {official['failed_elements']}/"
                f"{official['total_elements']} failed, max abs {official['max_abs_error']:.3g}, check "
                f"{checked['method']}")
            del x, mask, out
            if row["trials"] == 1:  # a second call on the same input, for the check against the previous output
                child.request("again", SECOND_CALL)
    result["aggregate"] = aggregate(result["trials"])
    result["call"] = ",".join(sorted(calls))
    result["check_method"] = result["trials"][0]["checked"]["method"]
    official = result["aggregate"]["official"]
    result["status"] = "pass" if official["passed"] else "fail"
    if not official["passed"]:
        result["failure"] = CandidateFailed(
            "accuracy", "compare", describe_comparison(official, "the official tolerance")).record()
    log(f"{row['id']} {args.candidate}: {result['status']}")


def child(args):
    """The child: the candidate built on request, then called on each trial's inputs (drawn here from the trial's
    seed), its output checked and handed over."""
    device = setup(args.device, args.threads)
    row = json.loads(args.row)
    config = model_config(row)
    held = {}

    def build_candidate(request, progress):
        held["model"], weights = build(args, row, config, device, progress)
        return {"weights": weights}

    def forward_trial(request, progress):
        t = int(request["trial"])
        stage = f"forward (trial {t})"
        held.pop("x", None), held.pop("mask", None)  # the previous trial's inputs go before this one's are drawn
        x, mask, _ = make_case(row, config, device, FIRST_TRIAL_SEED + t)
        set_precision(reference=False)
        progress.stage(stage)
        with torch.inference_mode():
            out = forward(held["model"], x, mask, stage, held.get("previous"))
        host = guarded(stage, host_copy, out)  # the device's queue: the candidate's kernels finish here
        progress.stage(f"hand over (trial {t})", candidate_code=False)
        data = write_plain(host, request["path"])
        held.update(previous=out, x=x, mask=mask)
        return data

    def again(request, progress):
        progress.stage(SECOND_CALL)
        with torch.inference_mode():
            forward(held["model"], held["x"], held["mask"], SECOND_CALL, held["previous"])
        return {}

    return serve(args, {"build": build_candidate, "forward": forward_trial, "again": again})
