"""Official rows 14 and 6 with and without a memory cap: the streaming plan, time, peak memory and accuracy of each run.

Usage (CUDA machine, a few minutes): python -m benchmarks.memory_cap [OUT.json] [--runs row14,row6-cap24GB,...]
       on a CPU, a check of this script:  python -m benchmarks.memory_cap [OUT.json] --tiny

Runs, each on a fresh model built as the pipeline builds it (shapewise.jobs.models) and the pipeline's trial-0
inputs (shapewise.jobs.inputs.make_case: the official call, model(x, mask) with an all-True mask):
- row 14 uncapped, and under torch.cuda.set_per_process_memory_fraction equal to 40 GB (a 40 GB GPU);
- row 6 uncapped, and under 24 GB.
Per run: the memory plan the model chose (model.last_memory_plan) and its route; the first call (wall clock,
compile included); `calls` timed calls (the timing job's timer, median); peak memory over the timed calls
(torch.cuda.max_memory_allocated, input and weights included) against input + output; the official-tolerance
comparison of the first and last batch elements (row 14: shapewise.model.chunked.chunked_reference_forward, every
position; row 6: the reference model on the first and last 4 elements), made with the cap lifted after the
optimized output is kept. The targets checked: row 14 uncapped peaks at most input + output + 8 GB; each capped
run finishes, passes, and is at most 10 % slower than its uncapped run.

--tiny: the same runs on tiny shapes on the CPU (or --device), the cap given as the model's memory_budget_bytes
(CPUs have no allocator fraction) and chosen so the capped runs stream: a check of this script, not a measurement.
"""
from __future__ import annotations

import gc
import statistics
import sys
import time

import torch

from benchmarks.common import device_name, parser, write_json
from shapewise.inputs.manifest import normalize_row, official_rows
from shapewise.jobs.device import sync, time_calls
from shapewise.jobs.inputs import FIRST_TRIAL_SEED, make_case
from shapewise.jobs.models import build_models, model_config, set_precision
from shapewise.model import TOLERANCES, compare_outputs
from shapewise.model.chunked import chunked_reference_forward
from shapewise.model.memory import RESERVE_FRACTION

GB = 10**9
PEAK_TARGET_OVER_IO = 8 * GB  # row 14 uncapped peaks at most input + output + 8 GB
SLOWDOWN_TARGET = 1.10  # a capped run at most 10 % slower than the uncapped one
# name, official row, cap (GB; None: uncapped), timed calls, uncapped run it is compared with
RUNS = (
    ("row14", 14, None, 3, None),
    ("row14-cap40GB", 14, 40, 3, "row14"),
    ("row6", 6, None, 20, None),
    ("row6-cap24GB", 6, 24, 20, "row6"),
)
TINY_ROWS = {  # small stand-ins of rows 14 and 6 (B, S, d, H, ffn, L), fast on a CPU
    14: {"batch_size": 4, "seq_len": 48, "d_model": 32, "num_heads": 2, "ffn_dim": 32, "num_layers": 2},
    6: {"batch_size": 6, "seq_len": 16, "d_model": 32, "num_heads": 2, "ffn_dim": 32, "num_layers": 2},
}
CHECK_ELEMENTS = {14: 1, 6: 4}  # batch elements checked at each end of the batch


def parse_args(argv=None):
    p = parser(__doc__, "memory-cap.json")
    p.add_argument("--tiny", action="store_true", help="tiny shapes (CPU check of this script)")
    p.add_argument("--device", default=None, help="default: cuda, or cpu with --tiny")
    p.add_argument("--runs", default=",".join(r[0] for r in RUNS), help="comma-separated subset of the runs")
    args = p.parse_args(argv)
    args.device = args.device or ("cpu" if args.tiny else "cuda")
    known = {r[0] for r in RUNS}
    args.runs = [name.strip() for name in args.runs.split(",") if name.strip()]
    unknown = [name for name in args.runs if name not in known]
    if unknown:
        p.error(f"--runs: unknown run(s) {unknown}; runs are {sorted(known)}")
    if not args.tiny and torch.device(args.device).type != "cuda":
        p.error("without --tiny this script measures a CUDA GPU: --device must be cuda")
    return args


def row_of(number, tiny):
    if tiny:
        return normalize_row({"id": f"tiny-{number:02d}", **TINY_ROWS[number]})
    return official_rows()[number]


def release(device):
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def set_cap(device, cap_bytes):
    """The allocator's per-process fraction equal to `cap_bytes` (None: lifted). CUDA only."""
    if device.type != "cuda":
        return None
    total = torch.cuda.get_device_properties(device).total_memory
    fraction = 1.0 if cap_bytes is None else min(1.0, cap_bytes / total)
    torch.cuda.set_per_process_memory_fraction(fraction, device)
    return fraction


def tiny_cap(model, x, mask):
    """A memory_budget_bytes under which `model` streams x in two halves (its input on the device counted)."""
    half = x.shape[0] // 2
    part = model.memory_plan(x[:half], mask[:half], available=(None, "unbounded"))
    whole = model.memory_plan(x, mask, available=(None, "unbounded"))
    return int((whole.output_bytes + part.estimate_bytes) / (1 - RESERVE_FRACTION)) + 16


def check(number, model, reference, x, mask, out, device, tiny):
    """Official-tolerance comparison of the first and last CHECK_ELEMENTS batch elements; the cap is lifted."""
    n = CHECK_ELEMENTS[number]
    B = x.shape[0]
    index = torch.tensor(sorted(set(range(min(n, B))) | set(range(max(0, B - n), B))), device=x.device)
    got = out.index_select(0, index)
    xs, ms = x.index_select(0, index), None if mask is None else mask.index_select(0, index)
    set_precision(reference=True)
    with torch.no_grad():
        if number == 14:
            want = chunked_reference_forward(model, xs, ms, query_block=64 if tiny else 512)
            method = "chunked_reference_forward"
        else:
            want = reference(xs, ms)
            method = "reference model"
    set_precision(reference=False)
    tol = TOLERANCES["official"]
    cmp = compare_outputs(want, got, rtol=tol["rtol"], atol=tol["atol"])
    return {"method": method, "batch_indices": index.tolist(), **cmp.as_dict()}


def run(name, number, cap_gb, calls, device, tiny):
    row = row_of(number, tiny)
    config = model_config(row)
    release(device)
    reference, model = build_models(row, config, device, reference_dtype=torch.float32 if number == 6 else None)
    set_precision(reference=False)
    x, mask, _ = make_case(row, config, device, FIRST_TRIAL_SEED)
    cap_bytes = None if cap_gb is None else int(cap_gb * GB)
    if tiny and cap_gb is not None:
        cap_bytes = model.memory_budget_bytes = tiny_cap(model, x, mask)
    fraction = set_cap(device, cap_bytes)
    io_bytes = 2 * x.numel() * x.element_size()
    result = {"run": name, "row": row["id"], "shape": list(x.shape), "dtype": str(x.dtype), "cap_bytes": cap_bytes,
              "memory_fraction": fraction, "io_bytes": io_bytes}
    try:
        with torch.no_grad():
            sync(device)
            t0 = time.perf_counter()
            model(x, mask)
            sync(device)
            result["first_call_ms"] = (time.perf_counter() - t0) * 1e3
            plan = model.last_memory_plan
            result["plan"] = None if plan is None else plan.as_dict()
            result["route"] = str(model.last_route)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            times = time_calls(lambda: model(x, mask), device, calls)
            out = model(x, mask)
            sync(device)
        result["times_ms"] = times
        result["median_ms"] = statistics.median(times)
        if device.type == "cuda":
            result["peak_bytes"] = int(torch.cuda.max_memory_allocated(device))
            result["peak_over_io_bytes"] = result["peak_bytes"] - io_bytes
        result["status"] = "ran"
    except Exception as exc:  # an out-of-memory under the cap is a result of this experiment, recorded
        result["status"] = "failed"
        result["error"] = f"{type(exc).__name__}: {exc}"
        set_cap(device, None)
        return result
    keep = out
    del out
    set_cap(device, None)  # the reference check is the measuring tool, not the model under the cap
    result["accuracy"] = check(number, model, reference, x, mask, keep, device, tiny)
    return result  # the next run releases this one's tensors


def verdicts(results):
    """The targets, per run, where they apply."""
    by = {r["run"]: r for r in results}
    for r in results:
        v = {}
        if r["status"] == "ran":
            v["passes"] = r["accuracy"]["failed_elements"] == 0
            if r["run"] == "row14" and "peak_bytes" in r:
                v["peak_within_io_plus_8GB"] = r["peak_over_io_bytes"] <= PEAK_TARGET_OVER_IO
            base = next((by.get(x[4]) for x in RUNS if x[0] == r["run"] and x[4]), None)
            if base is not None and base["status"] == "ran":
                r["slowdown_vs_uncapped"] = r["median_ms"] / base["median_ms"]
                v["within_10pct_of_uncapped"] = r["slowdown_vs_uncapped"] <= SLOWDOWN_TARGET
        r["targets"] = v


def table(results):
    header = (f"{'run':<15} {'status':<7} {'chunks':>11} {'median ms':>10} {'peak GB':>8} {'io GB':>7} "
              f"{'failed/compared':>18} targets")
    lines = [header]
    for r in results:
        plan = r.get("plan") or {}
        chunks = f"{plan.get('num_chunks', '-')}x{plan.get('chunk_size', '-')}"
        acc = r.get("accuracy")
        failed = f"{acc['failed_elements']}/{acc['total_elements']}" if acc else "-"
        peak = f"{r['peak_bytes'] / GB:.2f}" if "peak_bytes" in r else "-"
        median = f"{r['median_ms']:.3f}" if "median_ms" in r else "-"
        targets = ", ".join(f"{k}={'yes' if ok else 'NO'}" for k, ok in r.get("targets", {}).items())
        lines.append(f"{r['run']:<15} {r['status']:<7} {chunks:>11} {median:>10} {peak:>8} "
                     f"{r['io_bytes'] / GB:>7.2f} {failed:>18} {targets or r.get('error', '')}")
    return "\n".join(lines)


def main(argv=None):
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    results = []
    for name, number, cap_gb, calls, _ in RUNS:
        if name not in args.runs:
            continue
        t0 = time.perf_counter()
        results.append(run(name, number, cap_gb, calls if not args.tiny else 2, device, args.tiny))
        results[-1]["wall_s"] = time.perf_counter() - t0
        print(f"{name}: {results[-1]['status']} in {results[-1]['wall_s']:.1f} s", flush=True)
    verdicts(results)
    write_json(args.out, {"device": device_name(device), "torch": torch.__version__, "tiny": args.tiny,
                          "runs": results})
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
