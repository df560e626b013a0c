"""The timing protocol.

Inputs in the row's dtype (float32 for every official row) with
torch.set_float32_matmul_precision('high'). First the very first call of
each model is timed alone (wall clock, synchronized: compile, autotune and
graph capture of the optimized model land here). Then `warmup` calls each,
then `rounds` rounds alternating reference and optimized, `calls` calls per
model per round. On a GPU every call is timed by its own pair of CUDA events
(so p90 is a per-call figure); on a CPU by time.perf_counter. Reported: the
median, p90 and min over all timed calls, tokens/s at the median, peak memory
(torch.cuda.max_memory_allocated over warm-up and timed calls), speedup =
reference median / optimized median, and the fraction of the roofline floor.
"""

from __future__ import annotations

import json

import torch

from shapewise import roofline
from shapewise.jobs.device import first_call_ms, peak_memory_bytes, peak_memory_reset, setup, summarize, time_calls
from shapewise.jobs.inputs import FIRST_TRIAL_SEED, make_case
from shapewise.jobs.io import header, log, read_json, write_result
from shapewise.jobs.models import build_models, build_optimized, model_config, route_of, run_optimized, set_precision
from shapewise.jobs.microbench import peaks
from shapewise.jobs.preflight import fits


def roofline_entry(row, median_ms, microbench, environment):
    same_device = microbench["environment"].get("gpu_name") == environment.get("gpu_name") and \
        microbench["environment"].get("cpu") == environment.get("cpu")
    if not same_device:
        return {"available": False, "reason": "microbench ran on a different device model"}
    peak, bandwidth = peaks(microbench, row["dtype"])
    floor = roofline.floor_seconds(row, peak, bandwidth)
    if floor is None or median_ms is None:
        return {"available": False, "reason": f"no measured peak for {row['dtype']} on this device"}
    floor["available"] = True
    floor["peak_flop_per_s"] = peak
    floor["bandwidth_bytes_per_s"] = bandwidth
    floor["floor_ms"] = floor["floor_s"] * 1e3
    floor["fraction_of_floor"] = floor["floor_ms"] / median_ms
    return floor


def main(args):
    device = setup(args.device, args.threads)
    row = json.loads(args.row)
    protocol = json.loads(args.protocol)[args.device]
    preflight = read_json(args.preflight)
    microbench = read_json(args.microbench)
    result = header("timing", row, args.device)
    result["protocol"] = dict(protocol, timer="cuda events per call" if device.type == "cuda"
                              else "time.perf_counter per call", float32_matmul_precision="high")
    config = model_config(row)
    tokens = config.batch_size * config.seq_len
    run_reference = fits(preflight, "reference")
    run_optimized_model = fits(preflight, "optimized")
    result["skips"] = {}
    for which, ok in (("reference", run_reference), ("optimized", run_optimized_model)):
        if not ok:
            result["skips"][which] = (f"resource skip: estimated {preflight['models'][which]['estimate_bytes']} "
                                      f"bytes > budget {preflight['budget_bytes']} bytes")
            log(f"{row['id']}: {which} {result['skips'][which]}")

    set_precision(reference=False)
    if run_reference:
        reference, optimized = build_models(row, config, device, reference_dtype=getattr(torch, row["dtype"]))
    else:
        reference, optimized = None, build_optimized(row, config, device)
    x, mask, _ = make_case(row, config, device, FIRST_TRIAL_SEED)
    calls = {}
    if run_optimized_model:
        calls["optimized"] = lambda: run_optimized(optimized, x, mask, row)
    if run_reference:
        calls["reference"] = lambda: reference(x, mask)

    measured = {}
    with torch.inference_mode():
        for which, fn in calls.items():  # optimized first: its very first call is the one of the process
            peak_memory_reset(device)
            first = first_call_ms(fn, device)
            log(f"{row['id']}: first {which} call {first:.2f} ms; warm-up x{protocol['warmup']}")
            time_calls(fn, device, protocol["warmup"])
            measured[which] = {"first_call_ms": first, "times_ms": [], "peak_memory_bytes": None}
            measured[which]["_peak"] = peak_memory_bytes(device)
        for r in range(protocol["rounds"]):
            for which in ("reference", "optimized"):
                if which not in calls:
                    continue
                peak_memory_reset(device)
                measured[which]["times_ms"] += time_calls(calls[which], device, protocol["calls"])
                peak = peak_memory_bytes(device)
                if peak is not None:
                    measured[which]["_peak"] = max(measured[which]["_peak"] or 0, peak)
            log(f"{row['id']}: round {r + 1}/{protocol['rounds']} done")
    if run_optimized_model:
        result["route"], result["route_detail"] = route_of(optimized)
    for which, m in measured.items():
        stats = summarize(m["times_ms"])
        stats["first_call_ms"] = m["first_call_ms"]
        stats["peak_memory_bytes"] = m.pop("_peak")
        stats["tokens_per_s"] = tokens / (stats["median_ms"] * 1e-3)
        stats["times_ms"] = m["times_ms"]
        result[which] = stats
        log(f"{row['id']}: {which} median {stats['median_ms']:.4f} ms, p90 {stats['p90_ms']:.4f} ms")
    ref_ms = result.get("reference", {}).get("median_ms")
    opt_ms = result.get("optimized", {}).get("median_ms")
    result["speedup"] = ref_ms / opt_ms if ref_ms and opt_ms else None
    result["roofline"] = roofline_entry(row, opt_ms, microbench, result["environment"])
    result["flops"] = roofline.flops(**row)
    result["min_bytes"] = roofline.min_bytes(**row)
    write_result(args.out, result)
    return 0
