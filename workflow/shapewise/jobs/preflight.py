"""Preflight: does each model of a shape fit in this device's free memory?

Uses shapewise.model.memory.estimate_memory_bytes. A model that does not fit is a
resource skip for that model in the later jobs, never a pass.
"""

from __future__ import annotations

import json

from shapewise.jobs.device import free_memory_bytes, setup
from shapewise.jobs.inputs import DTYPES
from shapewise.jobs.io import header, log, write_result
from shapewise.jobs.models import model_config


def main(args):
    from shapewise.model.memory import estimate_memory_bytes

    device = setup(args.device)
    row = json.loads(args.row)
    config = model_config(row)
    result = header("preflight", row, args.device)
    free, total = free_memory_bytes(device)
    budget = int(free * args.headroom) if free is not None else None
    result["free_bytes"] = free
    result["total_bytes"] = total
    result["headroom"] = args.headroom
    result["budget_bytes"] = budget
    result["memory_kind"] = "GPU free memory (torch.cuda.mem_get_info)" if device.type == "cuda" \
        else "available RAM (/proc/meminfo MemAvailable)"
    models = {}
    for which in ("reference", "optimized"):
        # the reference of an accuracy check runs in float32 whatever the row's dtype
        dtype = DTYPES["float32"] if which == "reference" else DTYPES[row["dtype"]]
        estimate = int(estimate_memory_bytes(config, dtype, which))
        fits = budget is not None and estimate <= budget
        models[which] = {"estimate_bytes": estimate, "dtype": str(dtype).replace("torch.", ""), "fits": fits}
        log(f"{row['id']}: {which} needs ~{estimate / 2**30:.2f} GiB of {budget / 2**30:.2f} GiB: "
            f"{'fits' if fits else 'DOES NOT FIT (resource skip)'}")
    result["models"] = models
    write_result(args.out, result)
    return 0


def fits(preflight, which):
    return bool(preflight["models"][which]["fits"])
