"""Preflight: can each model of a shape run in this device's memory?

- The reference: `shapewise.model.memory.estimate_memory_bytes(..., "reference")` (its `[B, H, S, S]` scores
  decide) against the free memory times the pipeline's headroom (config `preflight.headroom`).
- The optimized model: the very plan its forward would make (`UserOptimizedTransformer.memory_plan`, owned by
  `shapewise.model.memory`), for the row's input before it exists. A row the model streams in batch chunks fits;
  the plan (chunk size, number of chunks, estimate, budget, why) is recorded. It does not fit only when the input
  and output (or those and one batch element's pass) exceed what the model may allocate: on a GPU the free and
  cached memory under any per-process fraction and the user's cap; on a CPU the user's cap when set, else the
  available RAM times the headroom against the unstreamed estimate (the model streams on a CPU only under a cap).

Before the optimized model is built to ask it for its plan, the bytes that building it takes (build_bytes: the
weights, on the host and on the device) are checked against the available RAM and the device's budget, each times
the headroom: a row whose weights alone cannot be held is a resource skip without building anything.

A model that does not fit is a resource skip for that model in the later jobs, never a pass.

`job_bytes`: the estimated peak of each of the row's jobs that may share their GPU (warm-up, accuracy, profile;
timing and ablation while they prepare, config gpu_prepare_shared), from which shapewise.execution.gpuslots gives
each job as many parts of the GPU as it needs.
"""

from __future__ import annotations

import json

import torch
from shapewise.jobs.device import free_memory_bytes, setup
from shapewise.jobs.inputs import DTYPES
from shapewise.jobs.io import header, log, write_result
from shapewise.jobs.models import build_optimized, model_config
from shapewise.model.config import parameter_count
from shapewise.model.memory import MemoryBudgetError, chunked_reference_bytes, estimate_memory_bytes, io_bytes
from shapewise.model.optimized import OPTIMIZATIONS
from shapewise.model.routing import RouteUnavailable


def budget_bytes(free, headroom):
    """What a row may plan with: the free device memory (or available RAM) times the headroom; None when the free
    memory is not known."""
    return int(free * headroom) if free is not None else None


def reference_fit(config, budget):
    """(estimated peak bytes, whether it fits `budget`) of the plain reference, in float32: the reference of an
    accuracy check runs in float32 whatever the row's dtype."""
    estimate = int(estimate_memory_bytes(config, DTYPES["float32"], "reference"))
    return estimate, budget is not None and estimate <= budget


def main(args):
    device = setup(args.device)
    row = json.loads(args.row)
    config = model_config(row)
    result = header("preflight", row, args.device, args)
    free, total = free_memory_bytes(device)
    budget = budget_bytes(free, args.headroom)
    result["free_bytes"] = free
    result["total_bytes"] = total
    result["headroom"] = args.headroom
    result["budget_bytes"] = budget
    result["memory_kind"] = "GPU free memory (torch.cuda.mem_get_info)" if device.type == "cuda" \
        else "available RAM (/proc/meminfo MemAvailable)"
    estimate, reference_fits = reference_fit(config, budget)
    models = {"reference": {"estimate_bytes": estimate, "dtype": "float32", "fits": reference_fits}}
    log(f"{row['id']}: reference needs ~{estimate / 2**30:.2f} GiB of {_gib(budget)}: "
        f"{'fits' if reference_fits else 'DOES NOT FIT (resource skip)'}")
    models["optimized"] = optimized_fit(row, config, device, budget, args.headroom)
    result["io_bytes"] = models["optimized"]["io_bytes"]
    result["models"] = models
    result["job_bytes"] = job_bytes(row, config, models, json.loads(args.chunked))
    write_result(args.out, result)
    return 0


def job_bytes(row, config, models, chunked):
    """{step: estimated peak device bytes} of the row's jobs that may share their GPU (timing and ablation: while
    they prepare, shapewise.inputs.steps), {} where the optimized model does not fit (its jobs are resource skips).
    Warm-up and profile run the optimized model: its plan's estimate, input included. Timing runs it and the
    reference (whole, where it fits); ablation holds the reference's output and every variant
    (model.optimized.OPTIMIZATIONS, and all on) at once. Accuracy runs it, then the reference: whole in float32
    (its estimate) beside the input and the optimized output, or, where that does not fit, chunked on
    `chunked["batch_samples"]` elements beside the optimized output at those elements alone
    (shapewise.jobs.check.Sampled: the job lets go of the whole input and output first); with both models' float32
    weights."""
    optimized = models["optimized"]
    if not optimized["fits"]:
        return {}
    x_bytes, out_bytes = io_bytes(config, DTYPES[row["dtype"]])
    weights = 2 * parameter_count(config.d_model, config.ffn_dim, config.num_layers) * 4
    if models["reference"]["fits"]:
        reference = models["reference"]["estimate_bytes"] + x_bytes + out_bytes
    else:
        samples = min(int(chunked["batch_samples"]), config.batch_size)
        sampled_out = out_bytes * samples // config.batch_size
        reference = sampled_out + chunked_reference_bytes(config, samples, chunked["query_block"])
    run = int(optimized["estimate_bytes"])
    # timing: both models built and called one after the other in one process (the first one's cached memory
    # stays); ablation: the reference's check as accuracy's, beside the whole input where it is chunked (every
    # variant runs on it), and every variant's model with what its first call keeps (at most its run but the input,
    # which they share), built and called before any is timed
    fits = models["reference"]["fits"]
    return {"warmup": run, "profile": run, "accuracy": max(run, reference) + weights,
            "timing": run + (models["reference"]["estimate_bytes"] if fits else 0) + weights,
            "ablation": reference + (0 if fits else x_bytes) + (1 + len(OPTIMIZATIONS)) * max(run - x_bytes, 0)
            + weights}


def _gib(value):
    return "n/a (not known)" if value is None else f"{value / 2**30:.2f} GiB"


def build_bytes(config, dtype, device):
    """(host bytes, device bytes) that build_optimized allocates: build_models holds the reference's and the
    optimized model's float32 weights on the host at once, then the optimized model's copy in `dtype` (on the
    device; on a CPU one more host copy)."""
    params = parameter_count(config.d_model, config.ffn_dim, config.num_layers)
    weights = params * torch.empty((), dtype=dtype).element_size()
    if device.type == "cuda":
        return 2 * params * 4, weights
    return 2 * params * 4 + weights, 0


def unbuildable(config, dtype, device, device_budget, headroom):
    """Why building the optimized model would not fit (build_bytes against the available RAM and the device's
    budget, times the headroom), or None when it fits or the RAM is not known."""
    host, on_device = build_bytes(config, dtype, device)
    available = free_memory_bytes(torch.device("cpu"))[0]
    if available is not None and host > available * headroom:
        return (f"building the model takes ~{host} bytes of host RAM for its weights, more than the available "
                f"{available} bytes x headroom {headroom}")
    if on_device and device_budget is not None and on_device > device_budget:
        return (f"the model's weights take {on_device} bytes on {device.type}, more than the budget of "
                f"{device_budget} bytes (free memory x headroom {headroom})")
    return None


def optimized_fit(row, config, device, ram_budget, headroom):
    """{"estimate_bytes", "io_bytes", "dtype", "fits", "budget_bytes", "budget_source", "plan" or "reason"} of
    the optimized model on this row: the plan its first forward would make, asked before the input exists."""
    dtype = DTYPES[row["dtype"]]
    out = {"dtype": str(dtype).replace("torch.", "")}
    reason = unbuildable(config, dtype, device, ram_budget, headroom)
    if reason:
        out.update(estimate_bytes=estimate_memory_bytes(config, dtype, "optimized"),
                   io_bytes=sum(io_bytes(config, dtype)), fits=False, budget_bytes=ram_budget, budget_source=f"available memory x headroom {headroom}",
                   reason=reason)
        log(f"{row['id']}: optimized DOES NOT FIT (resource skip), not built: {reason}")
        return out
    model = build_optimized(row, config, device)  # its weights are on the device, as in a job, when it plans
    B, S, d = config.batch_size, config.seq_len, config.d_model
    # stand-ins of the row's inputs with their shapes, dtypes and device and no memory: planning reads no values
    x = torch.empty((), dtype=dtype, device=device).expand(B, S, d)
    masked = row["padding_ratio"] > 0 or row.get("pass_mask", True)
    mask = torch.ones((), dtype=torch.bool, device=device).expand(B, S) if masked else None
    available = None
    if device.type != "cuda" and model.memory_budget_bytes is None:
        available = (None, "no memory budget on the CPU: one pass")  # the model does not stream: RAM decides
    try:
        plan = model.memory_plan(x, mask, resident_input=False, available=available)
    except RouteUnavailable as exc:  # a forced route that cannot serve the row: this row's jobs fail, no other
        raise SystemExit(f"shape {row['id']}: the row forces route {row['route']!r}, which cannot serve it "
                         f"({type(exc).__name__}: {exc})")
    except MemoryBudgetError as exc:
        unbounded = model.memory_plan(x, mask, resident_input=False, available=(None, "unbounded"))
        out.update(estimate_bytes=unbounded.estimate_bytes, io_bytes=unbounded.input_bytes + unbounded.output_bytes,
                   fits=False, budget_bytes=None, budget_source=None, reason=str(exc))
        log(f"{row['id']}: optimized DOES NOT FIT (resource skip): {exc}")
        return out
    out.update(estimate_bytes=plan.estimate_bytes, io_bytes=plan.input_bytes + plan.output_bytes,
               budget_bytes=plan.available_bytes, budget_source=plan.budget_source, plan=plan.as_dict())
    if available is not None:  # CPU without a cap: the unstreamed forward against the available RAM
        out.update(fits=ram_budget is not None and plan.estimate_bytes <= ram_budget, budget_bytes=ram_budget,
                   budget_source=f"available RAM x headroom {headroom}")
    else:
        out["fits"] = True
    how = plan.reason if out["fits"] else f"DOES NOT FIT (resource skip): needs more than {out['budget_bytes']} bytes"
    log(f"{row['id']}: optimized needs ~{plan.estimate_bytes / 2**30:.2f} GiB "
        f"(input + output {out['io_bytes'] / 2**30:.2f} GiB): {how}")
    return out


def fits(preflight, which):
    return bool(preflight["models"][which]["fits"])
