"""The timing job: two protocols, both recorded by name.

Inputs in the row's dtype with torch.set_float32_matmul_precision('high'), called as the row says
(`call`: model(x, mask) or model(x)). First the very first call of each model is timed alone (wall clock,
synchronized: compile, autotune and graph capture of the optimized model land here), then `warmup` calls each,
then rounds alternating reference and optimized, `calls` calls per model per round (stable: fewer for a slow
model where `round_seconds` is set). On a GPU every call is timed by its own pair of CUDA events (so p90 is a
per-call figure); on a CPU by time.perf_counter.

- "official": exactly `rounds` rounds, nothing else touched (the official harness's protocol).
- "stable": Python's garbage collector collected before each round and disabled during it (what the job held
  before the first round frozen, gc.freeze, so that each collection walks only the objects made since); the job
  optionally pinned to CPU cores (`cpus`); rounds continue from `min_rounds` until the bootstrap interval of the speedup
  (or, with one model, of each model's median) is within +-`ci_half_width`, at most `max_rounds`, and, where
  `max_seconds` is set, not beyond it: from `min_rounds` on, the rounds stop before one that would take them past
  `max_seconds` seconds, a round's time estimated as the mean of the rounds so far (a host that never settles
  otherwise pays every row the full `max_rounds`). `stopping.reason` records the rule that stopped them: settled, cap,
  time (fixed: the official protocol). Where `round_seconds` is set, a model whose calls are slow gets fewer calls a
  round: max(`min_calls`, min(`calls`, floor(round_seconds / its seconds per call))), its seconds per call estimated
  as its warm-up's wall time over the warm-up's calls (no warm-up: `calls`): a GPU-bound 100 ms call's round median
  is stable to well under 1 % with 10 calls, where 50 a round spend most of such a row's job. Each model's entry
  records its `calls_per_round` and `seconds_per_call_estimate` (model_entries; the official protocol always runs
  `calls`). With `core_pick: fastest-launch` (GPU only) the launching thread is pinned before every round to the
  core of its allowed set on which a tiny kernel launch costs least at that moment (shapewise.jobs.device.pick_core):
  on a virtual machine a core's launch cost switches between levels within a minute (docs/decisions.md#core-pick),
  and a launch-bound model's time with it. Each round's core and launch cost are recorded (`core_pick`).

Both record the GPU's clocks, temperature and power before and after, and the other processes on the GPU
(`contention`). Reported per model: the median over all timed calls, its bootstrap interval over rounds, the
round medians and their spread, p90, min, tokens/s, peak memory; the speedup with its interval and the `noisy`
flag (shapewise.analysis.stats); the fraction of the roofline floor. A row whose optimized model does not fit
(preflight) is a resource skip: nothing is built or allocated.

Where the row's call passes an all-True mask (the official harness's call), each round also times the optimized
model called without it (model(x), same x, last in the round): `mask_cost` is the median over rounds of the ratio
of the two calls' round medians, with its interval over rounds (shapewise.analysis.stats.paired_round_ratio), against
MASK_COST_LIMIT; the ratio of the two pooled medians beside it (`ratio_of_medians`, which a round's level moves;
see mask_cost). Its calls are not part of the speedup or the stopping rule.
"""

from __future__ import annotations

import gc
import json
import math
import os
import time

import torch

from shapewise.analysis import roofline, stats
from shapewise.jobs.device import (CORE_PICKS, PROBE_LAUNCHES, alone_waited_s, contention, first_call_ms, gpu_state,
                                   hold_alone, launch_cost_us, peak_memory_bytes, peak_memory_reset, pick_core,
                                   pin_cpus, preparing, setup, shared_then_alone, snapshot, summarize, time_calls,
                                   triton_cache_entries)
from shapewise.jobs.inputs import FIRST_TRIAL_SEED, make_case
from shapewise.jobs.io import header, log, read_json, resource_skip_reason, write_result
from shapewise.jobs.models import (build_models, build_optimized, call_of, model_config, route_of, run_optimized,
                                   set_precision)
from shapewise.jobs.microbench import peaks
from shapewise.jobs.preflight import fits

PROTOCOL_NAMES = ("official", "stable")
# The clock of the stable protocol's time budget (max_seconds): the rounds' elapsed time, not the calls' own timers.
clock = time.perf_counter
# The order within a round. optimized_unmasked: the optimized model called as model(x) on the same x, timed beside
# the official call model(x, mask) where the row's mask is all-True (see mask_cost).
MODELS = ("reference", "optimized", "optimized_unmasked")
# What the official harness's all-True mask may cost the optimized model against no mask, as a fraction.
MASK_COST_LIMIT = 0.03
# The fewest calls of a model in a stable round cut by `round_seconds` where the protocol sets no `min_calls` (at
# most `calls`): a GPU-bound ~100 ms call's round median is stable to well under 1 % with 10 calls.
MIN_ROUND_CALLS = 10


def resolve_protocol(settings, device_type):
    """(name, parameters) of the protocol this device runs, from the config's `timing` section.

    settings[device] is a protocol name (official, stable: defined in the same section) or a protocol given
    inline (the cpu entry, or a heavy row's shorter protocol): one with `rounds` runs the official procedure,
    one with `min_rounds`/`max_rounds` the stable one."""
    entry = settings[device_type]
    if isinstance(entry, str):
        if entry not in PROTOCOL_NAMES or entry not in settings:
            raise SystemExit(f"timing protocol {entry!r} (timing.{device_type}): expected one of {PROTOCOL_NAMES}, "
                             f"defined under timing")
        name, protocol = resolve_protocol({device_type: settings[entry]}, device_type)
        if name != entry:
            raise SystemExit(f"timing.{entry} does not define the {entry} procedure")
        return name, protocol
    if "rounds" in entry:
        return "official", dict(entry)
    if "min_rounds" in entry and "max_rounds" in entry:
        if entry["min_rounds"] > entry["max_rounds"]:
            raise SystemExit(f"timing.{device_type}: min_rounds {entry['min_rounds']} > max_rounds "
                             f"{entry['max_rounds']}")
        return "stable", dict(entry)
    raise SystemExit(f"timing.{device_type} {entry!r}: neither `rounds` (official) nor `min_rounds` and "
                     "`max_rounds` (stable)")


def core_pick_of(protocol):
    """The stable protocol's `core_pick` (absent = "none"), checked against CORE_PICKS."""
    pick = protocol.get("core_pick", CORE_PICKS[0])
    if pick not in CORE_PICKS:
        raise SystemExit(f"timing protocol core_pick {pick!r}: expected one of {CORE_PICKS}")
    return pick


def _seconds_of(protocol, key, null_means):
    """`protocol[key]`, a number of seconds above 0, or None where absent or null (`null_means` what that is)."""
    seconds = protocol.get(key)
    if seconds is not None and (isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or seconds <= 0):
        raise SystemExit(f"timing protocol {key} {seconds!r}: expected a number of seconds above 0, or null "
                         f"for {null_means}")
    return seconds


def max_seconds_of(protocol):
    """The stable protocol's time budget in seconds, `max_seconds` (absent or null = None: no bound), checked."""
    return _seconds_of(protocol, "max_seconds", "no time bound")


def round_seconds_of(protocol):
    """(round_seconds, min_calls) of the stable protocol, checked: `round_seconds` absent or null = (None, None), every
    round `calls` calls of each model; `min_calls` absent or null = min(MIN_ROUND_CALLS, calls). A `min_calls` is
    checked even without `round_seconds`, so that a bad value never waits for the bound to be switched on."""
    seconds = _seconds_of(protocol, "round_seconds", "rounds of `calls` calls of every model")
    floor = protocol.get("min_calls")
    if floor is not None and (isinstance(floor, bool) or not isinstance(floor, (int, float))
                              or (isinstance(floor, float) and not floor.is_integer())
                              or not 1 <= floor <= protocol["calls"]):
        raise SystemExit(f"timing protocol min_calls {floor!r}: expected a whole number of calls from 1 to calls "
                         f"({protocol['calls']}), or null for min({MIN_ROUND_CALLS}, calls)")
    if seconds is None:
        return None, None
    # 2.0 is a whole number to the config schema (JSON Schema's integer) and so to the job
    return seconds, min(MIN_ROUND_CALLS, protocol["calls"]) if floor is None else int(floor)


def round_calls(name, protocol, seconds_per_call):
    """A model's calls in each round: `calls`, or in the stable protocol with `round_seconds` set and an estimate of
    the model's seconds per call (None: no warm-up to estimate it from), as many as fit in round_seconds, at least
    min_calls and at most `calls`."""
    if name != "stable":
        return protocol["calls"]
    seconds, floor = round_seconds_of(protocol)
    if seconds is None or not seconds_per_call:  # none, or a clock too coarse to see the warm-up
        return protocol["calls"]
    return max(floor, min(protocol["calls"], math.floor(seconds / seconds_per_call)))


def describe(name, protocol, device):
    """The protocol as the result records it: the configured parameters only (the same for every row that ran
    it; what happened in a row is recorded beside it)."""
    out = {"name": name, "warmup": protocol["warmup"], "calls": protocol["calls"],
           "rounds": protocol.get("rounds"),
           "timer": "cuda events per call" if device.type == "cuda" else "time.perf_counter per call",
           "float32_matmul_precision": "high", "order": "reference then optimized in each round"}
    if name == "stable":
        out.update(min_rounds=protocol["min_rounds"], max_rounds=protocol["max_rounds"],
                   ci_half_width=protocol["ci_half_width"], gc_off=protocol["gc_off"], cpus=protocol["cpus"],
                   core_pick=core_pick_of(protocol), max_seconds=max_seconds_of(protocol))
        out["round_seconds"], out["min_calls"] = round_seconds_of(protocol)
    return out


class Timed:
    """A model the protocol times: its first call, its warm-up and its rounds, each measured in the process that
    runs the model (CUDA events and peak memory are per process), and the cores that process's launching thread
    may use. `pid` is that process where it is not this one (None: this one)."""

    pid = None

    def first_call(self) -> float:
        """Milliseconds of the very first call, peak memory counted from it."""
        raise NotImplementedError

    def warmup(self, count):
        """`count` untimed calls; the peak memory since the first call (None on a CPU)."""
        raise NotImplementedError

    def round(self, count, gc_off):
        """(milliseconds of each of `count` calls, peak memory of the round or None); gc_off: the collector off
        during the calls in the model's own process (run_rounds switches this process's)."""
        raise NotImplementedError

    def pin(self, cores):
        """Move the launching thread of the model's process to `cores` (this process's thread the caller moves)."""

    def reserved_bytes(self) -> int:
        """GPU memory the model's process holds reserved beyond this process's own."""
        return 0


class Local(Timed):
    """A model timed in this process; `fn` is one call of it."""

    def __init__(self, fn, device):
        self.fn, self.device = fn, device
        self.first_peak = None  # its first call's peak memory (None on a CPU, or before that call)

    def first_call(self):
        peak_memory_reset(self.device)
        ms = first_call_ms(self.fn, self.device)
        self.first_peak = peak_memory_bytes(self.device)
        return ms

    def warmup(self, count):
        # its own first call's peak and the warm-up's: another model's first call may come between the two
        peak_memory_reset(self.device)
        time_calls(self.fn, self.device, count)
        peaks = [p for p in (self.first_peak, peak_memory_bytes(self.device)) if p is not None]
        return max(peaks) if peaks else None

    def round(self, count, gc_off):
        peak_memory_reset(self.device)
        times = time_calls(self.fn, self.device, count)
        return times, peak_memory_bytes(self.device)


def timed(calls, device):
    """{model: Timed}: a plain function is a model of this process (Local)."""
    return {which: fn if isinstance(fn, Timed) else Local(fn, device) for which, fn in calls.items()}


def run_rounds(calls, device, name, protocol, tag="", calls_per_round=None):
    """Alternating timed rounds of `calls` ({model: function or Timed}), `calls_per_round[model]` calls of each model
    a round (a model it does not name, or None for all: protocol["calls"]; shapewise.analysis.stats resamples each
    model's rounds apart and pairs rounds by their medians, so the models' counts may differ). Returns ({model:
    [round times]}, {model: peak bytes}, stopping) where stopping says how many rounds ran and why they stopped
    (`reason`: fixed, settled, cap or time; the stable protocol's interval and time budget beside it)."""
    models = timed(calls, device)
    rounds = {which: [] for which in MODELS if which in models}
    counts = {which: (calls_per_round or {}).get(which, protocol["calls"]) for which in rounds}
    peaks_seen = {which: None for which in rounds}
    stable = name == "stable"
    limit = protocol["max_rounds"] if stable else protocol["rounds"]
    budget = max_seconds_of(protocol) if stable else None
    if stable:
        round_seconds_of(protocol)  # a bad value stops the job before any round, as the schema would
    width = None
    reason = "fixed"
    pick = core_pick_of(protocol) if stable else CORE_PICKS[0]
    picking = pick != CORE_PICKS[0]
    if picking and device.type != "cuda":
        raise SystemExit(f"timing protocol core_pick {pick!r} probes kernel launches: it needs a CUDA device, this "
                         f"job runs on {device.type}")
    cores = sorted(os.sched_getaffinity(0)) if picking else None  # the thread's cores, given back after the rounds
    picks = []
    gc_off = stable and protocol["gc_off"]
    if gc_off:  # what the job holds now (modules, models, inputs) is never garbage: each round's collection
        gc.collect()  # then walks only what came since, not the ~200 k objects of torch and Triton (~75 ms)
        gc.freeze()
    start = clock()
    for r in range(limit):
        if picking:
            picks.append(pick_core(cores, lambda core: launch_cost_us(device)))
            for model in models.values():  # a model of another process launches from the picked core too
                model.pin({picks[-1]["core"]})
        if gc_off:
            gc.collect()
            gc.disable()
        try:
            for which in rounds:
                times, peak = models[which].round(counts[which], gc_off)
                rounds[which].append(times)
                if peak is not None:
                    peaks_seen[which] = max(peaks_seen[which] or 0, peak)
        finally:
            if gc_off:
                gc.enable()
        if stable and r + 1 >= protocol["min_rounds"]:
            width = stats.settled_width(rounds)
            log(f"{tag}round {r + 1}: interval half-width "
                f"{'n/a' if width is None else f'{width * 100:.2f} %'} (target {protocol['ci_half_width'] * 100} %)")
            if width is not None and width <= protocol["ci_half_width"]:
                reason = "settled"
                break
            elapsed = clock() - start
            if budget is not None and r + 1 < limit and elapsed * (r + 2) / (r + 1) > budget:
                log(f"{tag}round {r + 1}: {elapsed:.2f} s; another round would pass max_seconds {budget} s")
                reason = "time"
                break
        else:
            log(f"{tag}round {r + 1}/{limit} done")
    else:
        if stable:
            reason = "cap"
    if gc_off:
        gc.unfreeze()
    if picking:
        os.sched_setaffinity(0, cores)
        for model in models.values():
            model.pin(cores)
    rounds_run = len(next(iter(rounds.values()))) if rounds else 0
    stopping = {"rounds_run": rounds_run, "reason": reason}
    if picking:
        stopping["core_pick"] = {"method": pick, "probe_launches": PROBE_LAUNCHES,
                                 "cores": cores, "rounds": picks}
    if stable:
        stopping.update(half_width=width, target_half_width=protocol["ci_half_width"],
                        measured_on="speedup" if len(rounds) == 2 else "each model's median", max_seconds=budget)
    return rounds, peaks_seen, stopping


def job_snapshot(gpu, at, models):
    """A contention check's snapshot (shapewise.jobs.device.snapshot) that counts the processes of the job's models
    in other processes as the job's own: their pids out of the GPU's processes, their reserved memory in the job's."""
    snap = snapshot(gpu, at)
    others = [model for model in models.values() if model.pid is not None]
    if others:
        pids = {model.pid for model in others}
        snap["own_reserved_bytes"] += sum(model.reserved_bytes() for model in others)
        if snap["processes"] is not None:
            snap["processes"] = [p for p in snap["processes"] if p["pid"] not in pids]
        snap["job_child_pids"] = sorted(pids)
    return snap


def time_protocol(calls, row, device, name, protocol, result, after_warmup=None, prepared=()):
    """Run the protocol on `calls` ({model: function or Timed}): the job's cores pinned as the protocol says; the
    very first calls of the models named in `prepared` (timed alone, in that order), after which the job holds its
    GPU alone (shapewise.jobs.device.hold_alone: a job that prepares made those calls sharing it); the GPU's state
    and the other processes on it read before the rest and after it; then for each model in the dict's order its
    very first call where it was not prepared and its warm-up (`after_warmup(model)` after it; the warm-up's wall
    time over its calls is the model's seconds per call, from which round_calls takes its calls a round), then the
    alternating rounds. Records cpu_affinity, gpu_state, contention, core_pick and stopping in `result` (and
    `first_calls_shared` where the first calls were made sharing the GPU); returns (rounds, seen) with seen =
    {"first", "compiled", "warm_peak", "round_peak", "seconds_per_call_estimate", "calls_per_round"}, each
    {model: value}."""
    models = timed(calls, device)
    gpu = result["gpu"]
    result["cpu_affinity"] = pin_cpus(protocol["cpus"]) if name == "stable" else \
        dict(pin_cpus("inherit"), requested=None,
             reason="official protocol: cores left as the job started (a local GPU job: its slot's cores)")
    for model in models.values():  # a model of another process runs on the cores this process now has
        model.pin(os.sched_getaffinity(0))
    first, compiled = {}, {}  # compiled: kernels the first call compiled (new entries in Triton's disk cache)

    def first_call(which):
        cached, waited = triton_cache_entries(), alone_waited_s()
        first[which] = models[which].first_call()
        after = triton_cache_entries()
        compiled[which] = None if cached is None or after is None else after - cached
        # a kernel choice on the way waited for the GPU alone (shapewise.execution.gpushare): not the call's time
        first[which] -= (alone_waited_s() - waited) * 1e3
        log(f"{row['id']}: first {which} call {first[which]:.2f} ms")

    with torch.inference_mode():
        for which in prepared:  # the first of them is the very first call of its process
            first_call(which)
    hold_alone(device)
    if prepared and shared_then_alone(device):
        result["first_calls_shared"] = list(prepared)
        log(f"{row['id']}: holding the GPU alone from here (the first calls of {', '.join(prepared)} shared it)")
    snapshots = [job_snapshot(gpu, "before", models)] if gpu else []
    result["gpu_state"] = {"before": gpu_state(gpu)}
    warm_peak, estimate, counts = {}, {}, {}
    with torch.inference_mode():
        for which, model in models.items():
            if which not in first:
                first_call(which)
            log(f"{row['id']}: {which} warm-up x{protocol['warmup']}")
            t0 = clock()  # a warm-up ends synchronized (time_calls on CUDA; a Remote's answer after its calls)
            warm_peak[which] = model.warmup(protocol["warmup"])
            estimate[which] = (clock() - t0) / protocol["warmup"] if protocol["warmup"] > 0 else None
            counts[which] = round_calls(name, protocol, estimate[which])
            if counts[which] != protocol["calls"]:
                log(f"{row['id']}: {which} {estimate[which] * 1e3:.2f} ms a warm-up call: {counts[which]} calls a "
                    f"round (round_seconds {protocol['round_seconds']} s)")
            if after_warmup is not None:
                after_warmup(which)
        t0 = time.perf_counter()
        rounds, round_peak, stopping = run_rounds(models, device, name, protocol, tag=f"{row['id']}: ",
                                                  calls_per_round=counts)
        stopping["seconds"] = round(time.perf_counter() - t0, 3)
    result["gpu_state"]["after"] = gpu_state(gpu)
    if gpu:
        snapshots.append(job_snapshot(gpu, "after", models))
    result["contention"] = contention(gpu, snapshots)
    if result["contention"]["contended"]:
        log(f"{row['id']}: WARNING other processes on the GPU: {result['contention']['other_processes']}")
    result["core_pick"] = stopping.pop("core_pick", None)
    result["stopping"] = stopping
    return rounds, {"first": first, "compiled": compiled, "warm_peak": warm_peak, "round_peak": round_peak,
                    "seconds_per_call_estimate": estimate, "calls_per_round": counts}


def model_entries(rounds, summary, seen, tokens, row, warm_peak_only=()):
    """{model: entry} of the timed models: every call's time, the per-call and per-round figures, the first call,
    peak memory (the peak of warm-up and rounds; for the models in `warm_peak_only` the warm-up's alone), tokens
    per second, and the model's calls a round with the seconds per call they were cut by (time_protocol)."""
    entries = {}
    for which, model_rounds in rounds.items():
        times = [t for r in model_rounds for t in r]
        entry = summarize(times)
        entry.update(summary[which])  # median_ms (the same median), round_medians_ms, median_ci_ms, rel_spread
        entry["first_call_ms"] = seen["first"][which]
        entry["first_call_compiled_kernels"] = seen["compiled"][which]
        peaks = (seen["warm_peak"][which],) if which in warm_peak_only else \
            (seen["warm_peak"][which], seen["round_peak"][which])
        peaks_known = [p for p in peaks if p is not None]
        entry["peak_memory_bytes"] = max(peaks_known) if peaks_known else None
        entry["tokens_per_s"] = tokens / (entry["median_ms"] * 1e-3)
        entry["calls_per_round"] = seen["calls_per_round"][which]
        entry["seconds_per_call_estimate"] = seen["seconds_per_call_estimate"][which]
        entry["times_ms"] = times
        entries[which] = entry
        ci = entry["median_ci_ms"]
        log(f"{row['id']}: {which} median {entry['median_ms']:.4f} ms "
            f"(95 % CI {'n/a' if ci is None else f'{ci[0]:.4f}-{ci[1]:.4f}'}), p90 {entry['p90_ms']:.4f} ms, "
            f"{len(model_rounds)} rounds, spread {entry['rel_spread'] * 100:.1f} %")
    return entries


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


def mask_cost(rounds, summary, mask_kind, routes):
    """The official call's all-True mask against no mask, same process, same x, paired rounds: the median over
    rounds of model(x, mask)'s round median over model(x)'s, its interval, and whether it is within
    MASK_COST_LIMIT. Paired by round because a launch-bound row's rounds switch between a quiet and a host-bound
    level on either side, which moves the ratio of the pooled medians by several per cent and widens its interval
    (docs/decisions.md#mask-cost-paired). Measured only where the row's call passes an all-True mask (with padding,
    the two calls compute different things)."""
    if "optimized_unmasked" not in rounds:
        why = ("the row's call passes no mask" if mask_kind == "none" else
               f"the row's mask is {mask_kind}, not all-True: without it the model computes something else")
        return {"measured": False, "reason": why, "limit": MASK_COST_LIMIT}
    masked, unmasked = summary["optimized"], summary["optimized_unmasked"]
    paired = stats.paired_round_ratio(rounds["optimized"], rounds["optimized_unmasked"],
                                      ("model(x, mask)", "model(x)"))
    ratio = paired["ratio"]
    return {
        "measured": True, "limit": MASK_COST_LIMIT, "call": "model(x)", "compared_with": "model(x, mask)",
        "ratio": ratio, "ratio_ci": paired["interval"], "round_ratios": paired["round_ratios"],
        "ratio_of_medians": masked["median_ms"] / unmasked["median_ms"],
        "ratio_of_medians_ci": stats.ratio_interval(rounds["optimized"], rounds["optimized_unmasked"],
                                                    ("model(x, mask)", "model(x)")),
        "within_limit": ratio <= 1.0 + MASK_COST_LIMIT,
        "unmasked_median_ms": unmasked["median_ms"], "unmasked_ci_ms": unmasked["median_ci_ms"],
        "route": routes.get("optimized"), "route_unmasked": routes.get("optimized_unmasked"),
    }


def main(args):
    device = setup(args.device, args.threads)
    row = json.loads(args.row)
    name, protocol = resolve_protocol(json.loads(args.protocol), device.type)
    preflight = read_json(args.preflight)
    microbench = read_json(args.microbench)
    result = header("timing", row, args.device, args)
    result["protocol"] = describe(name, protocol, device)
    result["flops"] = roofline.flops(**row)
    result["min_bytes"] = roofline.min_bytes(**row)
    result["skips"] = {which: resource_skip_reason(preflight, which)
                       for which in ("reference", "optimized") if not fits(preflight, which)}
    for which, reason in result["skips"].items():
        log(f"{row['id']}: {which} {reason}")
    if "optimized" in result["skips"]:
        # the row is a resource skip: build nothing, allocate no input
        result.update(status="resource-skip", call=None, speedup=None, speedup_ci=None, noisy=None,
                      contention={"checked": False, "other_processes": [], "contended": False,
                                  "reason": "resource skip: nothing was timed"},
                      roofline={"available": False, "reason": "resource skip: the optimized model does not fit"})
        write_result(args.out, result)
        return 0
    run_reference = "reference" not in result["skips"]
    config = model_config(row)
    tokens = config.batch_size * config.seq_len

    set_precision(reference=False)
    if run_reference:
        reference, optimized = build_models(row, config, device, reference_dtype=getattr(torch, row["dtype"]))
    else:
        reference, optimized = None, build_optimized(row, config, device)
    x, mask, mask_kind = make_case(row, config, device, FIRST_TRIAL_SEED)
    result["call"] = call_of(mask)
    calls = {"optimized": lambda: run_optimized(optimized, x, mask, row)}
    if run_reference:
        calls["reference"] = lambda: reference(x, mask)
    if mask_kind == "all-true":  # timed last in each round, and its first call after the others'
        calls["optimized_unmasked"] = lambda: run_optimized(optimized, x, None, row)

    routes = {}

    def keep_route(which):  # the route of this call (the last call's is all a model keeps)
        if which != "reference":
            routes[which] = route_of(optimized)

    # a job that prepares makes the first calls, which build what each model keeps (graphs, compiled kernels),
    # before it holds its GPU alone; the unmasked call's after the official one's warm-up, whose peak memory it
    # would otherwise enter
    prepared = [which for which in ("optimized", "reference") if which in calls] if preparing(device) else ()
    rounds, seen = time_protocol(calls, row, device, name, protocol, result, after_warmup=keep_route,
                                 prepared=prepared)
    result["route"], result["route_detail"] = routes["optimized"]

    summary = stats.summarize(rounds)
    # the rounds' peaks hold the unmasked call's captured graph as well: the official call's own peak is the one
    # read before that call first ran
    own_peak = ("optimized",) if "optimized_unmasked" in rounds else ()
    result.update(model_entries(rounds, summary, seen, tokens, row, warm_peak_only=own_peak))
    result["mask_cost"] = mask_cost(rounds, summary, mask_kind,
                                    {which: route for which, (route, _) in routes.items()})
    if result["mask_cost"]["measured"]:
        log(f"{row['id']}: all-True mask over no mask {result['mask_cost']['ratio']:.4f}")
    result["speedup"] = summary["speedup"]
    result["speedup_ci"] = summary["speedup_ci"]
    result["noisy"] = summary["noisy"]
    result["status"] = "ok"
    result["roofline"] = roofline_entry(row, result["optimized"]["median_ms"], microbench, result["environment"])
    write_result(args.out, result)
    return 0
