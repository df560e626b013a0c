"""The report's data: the inputs the DAG hands it, checked, and the per-row table built from them.

The report rule writes one JSON file of inputs (see workflow/rules/report.smk): the rows of the run with their
manifest fields, each row's result files (from shapewise.inputs.paths), the fingerprints, the microbenchmark, the
environment digest of the run and, optionally, a baseline report directory. Nothing here re-reads a manifest.

Every result is checked before it is used: it must parse, carry the digest of its own content that its job wrote
(`content_sha256`, shapewise.provenance.provenance.seal: a result edited by hand, or written before the digest existed,
is refused), and its `identity` (shapewise.provenance.identity) must name the row, the row digest, the implementation
digest and the environment digest of this run. Where the inputs say so, its device must be the one the run asked for
(`device`: cuda or cpu) and the SHAPEWISE_* variables it recorded must be the ones the run passed (`pass_env`), and
every manifest must still hold the bytes the rows were read from (`manifest_sha256`). A result that does not is
refused by file name with the command that regenerates it; all problems are collected first and raised together
(ReportInputError), so one report run names every bad file.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import statistics
from pathlib import Path

import pandas as pd

from shapewise.analysis import roofline
from shapewise.candidates import SHAPEWISE
from shapewise.execution import runs
from shapewise.execution.jobprocess import PIPELINE_PREFIX
from shapewise.inputs import paths
from shapewise.provenance import identity, provenance
from shapewise.provenance.inventory import sha256_file

# The columns of summary.csv, in this order: their one list (the report writes them, shapewise.report.compare reads
# them).
SUMMARY_COLUMNS = [
    "id", "candidate", "machine", "status", "call", "route", "failed_elements", "total_elements", "max_abs_error",
    "strict_failed_elements", "reference_median_ms", "reference_ci_low_ms", "reference_ci_high_ms",
    "optimized_median_ms", "optimized_ci_low_ms", "optimized_ci_high_ms", "speedup", "speedup_ci_low",
    "speedup_ci_high", "noisy", "target_ms", "target_met", "optimized_peak_memory_bytes", "io_bytes",
    "unmasked_median_ms", "mask_cost", "mask_cost_ci_low", "mask_cost_ci_high",
]
STATUSES = ("pass", "fail", "resource-skip")
INTEGER_COLUMNS = ("failed_elements", "total_elements", "strict_failed_elements", "optimized_peak_memory_bytes",
                   "io_bytes")


class ReportInputError(RuntimeError):
    """Results the report refuses; `problems` holds one line per bad file."""

    def __init__(self, problems):
        self.problems = list(problems)
        super().__init__("the report refuses these results:\n  " + "\n  ".join(self.problems))


def regenerate_row(row_id):
    return f"snakemake --cores all --forcerun $(shapewise targets {row_id})"


def regenerate_file(path):
    return f"snakemake --cores all --forcerun {path}"


def read_result(path, regenerate, problems):
    """The parsed JSON of `path`, or None after appending a problem that names the file and the fix."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        problems.append(f"{path}: missing; regenerate it with: {regenerate}")
        return None
    except OSError as exc:
        problems.append(f"{path}: cannot be read ({exc.strerror}); regenerate it with: {regenerate}")
        return None
    except UnicodeDecodeError as exc:
        problems.append(f"{path}: damaged, not UTF-8 text (byte {exc.start}); regenerate it with: {regenerate}")
        return None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        problems.append(f"{path}: damaged, not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno}); "
                        f"regenerate it with: {regenerate}")
        return None
    if not isinstance(data, dict):
        problems.append(f"{path}: damaged, a JSON {type(data).__name__} instead of an object; "
                        f"regenerate it with: {regenerate}")
        return None
    sealed = provenance.seal_problem(data)
    if sealed:
        problems.append(f"{path}: {sealed}; regenerate it with: {regenerate}")
    return data


def check_run_settings(path, data, inputs, regenerate, problems):
    """Append a problem when a result ran on another device than the run asked for (inputs `device`: cuda or cpu;
    auto takes either) or with other SHAPEWISE_* variables than the run passed (inputs `pass_env`)."""
    if data is None:
        return
    wanted = inputs.get("device")
    if wanted in ("cuda", "cpu") and data.get("device") not in (None, wanted):
        problems.append(f"{path}: ran on {data.get('device')!r}, but this run asks for device {wanted!r}; "
                        f"regenerate it with: {regenerate}")
    env = data.get("environment")
    recorded = env.get("shapewise_variables") if isinstance(env, dict) else None
    if isinstance(recorded, dict):
        # the pipeline's own variables: recorded, never passed
        recorded = {k: v for k, v in recorded.items() if not k.startswith(PIPELINE_PREFIX)}
        passed = inputs.get("pass_env") or {}
        if recorded != passed:
            problems.append(f"{path}: ran with the SHAPEWISE_* variables {recorded or 'none'}, but this run passes "
                            f"{passed or 'none'} (config pass_env); regenerate it with: {regenerate}")


def check_manifests(inputs, problems):
    """Append a problem for each manifest whose bytes are not those its rows were read from (inputs
    `manifest_sha256`: {path: SHA-256} when the DAG was built): a manifest edited while the run computed."""
    root = Path(inputs.get("root", "."))
    for manifest, digest in (inputs.get("manifest_sha256") or {}).items():
        path = root / manifest
        now = sha256_file(path) if path.is_file() else None
        if now != digest:
            problems.append(f"{manifest}: {'changed' if now else 'removed'} since this run read its rows, so the "
                            f"results may not be of the rows it holds now; run snakemake again")


def check_identity(path, data, expected, regenerate, problems):
    """Append a problem when the result's identity is absent or does not match `expected`."""
    if data is None:
        return
    if "identity" not in data:
        problems.append(f"{path}: has no identity: it predates result identities (written by an older shapewise), "
                        f"so what it measured cannot be checked; regenerate it with: {regenerate}")
        return
    wrong = identity.mismatches(data, expected)
    if wrong:
        problems.append(f"{path}: does not belong to this run: {'; '.join(wrong)}; regenerate it with: {regenerate}")


def read_steps(results, steps, expected, regenerate, inputs, problems):
    """{step: the result at results[step]} for each of `steps`, each read and checked against `expected` (its
    identity) and the run's settings, appending what is wrong to `problems`."""
    data = {}
    for step in steps:
        path = results[step]
        data[step] = read_result(path, regenerate, problems)
        check_identity(path, data[step], expected, regenerate, problems)
        check_run_settings(path, data[step], inputs, regenerate, problems)
    return data


def load(inputs, problems):
    """Read and check shapewise's own results the inputs name, appending what is wrong with them to `problems`.
    Returns ({"rows": [...], "environment_fingerprint", "implementation", "microbench"}, the digests every result
    carries); raises ReportInputError at once when the fingerprints cannot be read. The candidates' results:
    shapewise.report.report_candidates.load_rows (shapewise.report.report.load reads both)."""
    fp_paths = inputs["fingerprints"]
    env_fp = read_result(fp_paths["env"], regenerate_file(fp_paths["env"]), problems)
    impl_fp = read_result(fp_paths["impl"], regenerate_file(fp_paths["impl"]), problems)
    if impl_fp is not None and "digest" not in impl_fp:
        problems.append(f"{fp_paths['impl']}: has no field 'digest'; regenerate it with: "
                        f"{regenerate_file(fp_paths['impl'])}")
        impl_fp = None
    if problems:  # without the digests nothing else can be checked
        raise ReportInputError(problems)
    digests = {"implementation_digest": impl_fp["digest"], "environment_digest": inputs["environment_digest"]}

    microbench = read_result(inputs["microbench"], regenerate_file(inputs["microbench"]), problems)
    check_identity(inputs["microbench"], microbench, digests, regenerate_file(inputs["microbench"]), problems)
    check_run_settings(inputs["microbench"], microbench, inputs, regenerate_file(inputs["microbench"]), problems)
    check_manifests(inputs, problems)

    rows = []
    for entry in inputs["rows"]:
        row = entry["row"]
        expected = dict(digests, row_id=row["id"], row_digest=identity.row_digest(row))
        data = read_steps(entry["results"], paths.SHAPE_STEPS, expected, regenerate_row(row["id"]), inputs, problems)
        rows.append({"id": row["id"], "row": row, "data": data, "paths": entry["results"],
                     "profile_csv": entry["profile_csv"], "profile_trace": entry["profile_trace"]})
    return {"rows": rows, "environment_fingerprint": env_fp, "implementation": impl_fp,
            "microbench": microbench}, digests


# ------------------------------------------------------------------ one row


# The clause Route.__str__ (shapewise.model.routing) closes a route's string with: how it was chosen and why. Every
# field before it changes what runs; the reason only explains the choice.
_ROUTE_REASON = re.compile(r" \((auto|forced): .*\)\Z", re.S)


def route_label(route):
    """The label of a route as a result records it: the string Route.__str__ wrote (`hopper/bf16+hopper-attention
    pair eager prepared-launch (auto: ...)`: name, precision and every field that changes what runs)
    without its closing `(auto: reason)`; a forced route keeps ` (forced)`. A string without that clause is kept
    whole; None for none."""
    if not route:
        return None
    route = str(route)
    match = _ROUTE_REASON.search(route)
    if not match:
        return route
    return route[:match.start()] + (" (forced)" if match.group(1) == "forced" else "")


def routes_of(timing, accuracy):
    """The route strings a row ran: the timing result's, else the accuracy result's (one per distinct route of its
    trials, `routes`; `route` of an older result)."""
    if timing.get("route"):
        return [timing["route"]]
    if isinstance(accuracy.get("routes"), list):
        return [r for r in accuracy["routes"] if r]
    return [accuracy["route"]] if accuracy.get("route") else []


def _num(value):
    """A finite float, or None."""
    if value is None or isinstance(value, bool):
        return None
    try:
        value = float(value)
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) else None


def _ci(model):
    ci = model.get("median_ci_ms") if isinstance(model, dict) else None
    if isinstance(ci, (list, tuple)) and len(ci) == 2:
        return _num(ci[0]), _num(ci[1])
    return None, None


def call_of_row(row):
    """The call a row measures, from its pass_mask (the timing result's `call` is preferred where present)."""
    return "model(x, mask)" if row.get("pass_mask", True) else "model(x)"


def row_record(item):
    """One row of the report's table: the summary.csv fields plus what the HTML/Markdown tables show."""
    row, data = item["row"], item["data"]
    acc, tim = data["accuracy"], data["timing"]
    aggregate = acc.get("aggregate") or {}
    official, strict = aggregate.get("official") or {}, aggregate.get("strict") or {}
    ref, opt = tim.get("reference") or {}, tim.get("optimized") or {}
    ref_lo, ref_hi = _ci(ref)
    opt_lo, opt_hi = _ci(opt)
    sci = tim.get("speedup_ci") or {}
    routes = routes_of(tim, acc)
    opt_ms = _num(opt.get("median_ms"))
    target = _num(row.get("target_ms"))
    gpu = tim.get("gpu") or {}
    contention = tim.get("contention") or {}
    mask = tim.get("mask_cost") or {}
    measured = bool(mask.get("measured"))
    mask_ci = (mask.get("ratio_ci") or {}) if measured else {}
    env = tim.get("environment") or acc.get("environment") or {}
    return {
        "id": row["id"],
        "machine": env.get("machine_key") or "unknown",
        "status": acc.get("status"),
        "call": tim.get("call") or call_of_row(row),
        "route": "; ".join(route_label(r) for r in routes) or None,
        "failed_elements": official.get("failed_elements"),
        "total_elements": official.get("total_elements"),
        "max_abs_error": _num(official.get("max_abs_error")),
        "strict_failed_elements": strict.get("failed_elements"),
        "reference_median_ms": _num(ref.get("median_ms")),
        "reference_ci_low_ms": ref_lo,
        "reference_ci_high_ms": ref_hi,
        "optimized_median_ms": opt_ms,
        "optimized_ci_low_ms": opt_lo,
        "optimized_ci_high_ms": opt_hi,
        "speedup": _num(tim.get("speedup")),
        "speedup_ci_low": _num(sci.get("low")),
        "speedup_ci_high": _num(sci.get("high")),
        "noisy": tim.get("noisy") if isinstance(tim.get("noisy"), bool) else None,
        "target_ms": target,
        "target_met": (opt_ms <= target) if opt_ms is not None and target is not None else None,
        "optimized_peak_memory_bytes": opt.get("peak_memory_bytes"),
        "io_bytes": roofline.min_bytes(**row)["activations"],
        # the all-True mask against no mask (timing job, `mask_cost`): median of the per-round ratios - 1
        "unmasked_median_ms": _num(mask.get("unmasked_median_ms")) if measured else None,
        "mask_cost": _minus_one(mask.get("ratio")) if measured else None,
        "mask_cost_ci_low": _minus_one(mask_ci.get("low")),
        "mask_cost_ci_high": _minus_one(mask_ci.get("high")),
        # shown in the tables, not in summary.csv
        "speedup_outside_interval": outside(_num(tim.get("speedup")), _num(sci.get("low")), _num(sci.get("high"))),
        "mask_cost_limit": _num(mask.get("limit")),
        "mask_cost_within": mask.get("within_limit") if measured else None,
        "mask_cost_reason": None if measured else mask.get("reason", "not measured (a result older than the check)"),
        "route_full": "; ".join(routes) or None,
        "reference_rel_spread": _num(ref.get("rel_spread")),
        "optimized_rel_spread": _num(opt.get("rel_spread")),
        "reference_round_medians_ms": ref.get("round_medians_ms"),
        "optimized_round_medians_ms": opt.get("round_medians_ms"),
        "protocol_name": (tim.get("protocol") or {}).get("name"),
        "rounds_run": (tim.get("stopping") or {}).get("rounds_run"),
        "stopping_reason": (tim.get("stopping") or {}).get("reason"),
        "stopping_max_seconds": _num((tim.get("stopping") or {}).get("max_seconds")),
        "gpu": gpu_label(gpu),
        "gpu_uuid": gpu.get("uuid") if isinstance(gpu, dict) else None,
        "contended": contention.get("contended") if contention.get("checked") else None,
        "contention_detail": contention.get("other_processes") or [],
        "optimized_p90_ms": _num(opt.get("p90_ms")),
        "optimized_first_call_ms": _num(opt.get("first_call_ms")),
        "optimized_first_call_compiled": opt.get("first_call_compiled_kernels"),
        "optimized_tokens_per_s": _num(opt.get("tokens_per_s")),
        "skips": tim.get("skips") or {},
        "skip_reason": acc.get("skip_reason"),
        "check_method": acc.get("check_method"),
        "fraction_of_floor": _num((tim.get("roofline") or {}).get("fraction_of_floor")),
        "floor_ms": _num((tim.get("roofline") or {}).get("floor_ms")),
        "cores": cores_label(tim),
        "cores_reason": tim["cpu_affinity"].get("reason") if isinstance(tim.get("cpu_affinity"), dict) else None,
        "core_pick": core_pick_label(tim),
    }


def outside(value, low, high):
    """Whether `value` lies outside [low, high]: a speedup (the ratio of the two medians) outside its own interval
    (a bootstrap over the rounds' paired ratios), which happens when the rounds disagree; None without all three."""
    if value is None or low is None or high is None:
        return None
    return not min(low, high) <= value <= max(low, high)


def _minus_one(ratio):
    value = _num(ratio)
    return None if value is None else value - 1.0


def gpu_label(gpu):
    """`GPU 1 (slot 1, lock)` from a timing result's `gpu` (its UUID is `gpu_uuid`); None on a CPU or absent."""
    if not isinstance(gpu, dict) or not gpu:
        return None
    parts = [f"GPU {gpu.get('index')}" if gpu.get("index") is not None else "GPU ?"]
    slot = gpu.get("slot")
    source = gpu.get("slot_source")
    if slot is not None or source:
        parts.append(f"(slot {slot if slot is not None else '-'}" + (f", {source})" if source else ")"))
    return " ".join(parts)


# ------------------------------------------------------------------ host CPUs of a timing result

NOT_RECORDED = "not recorded"  # a result written before the timing job recorded its CPUs
NOT_TIMED = "not timed (resource skip)"
HOST_CPUS_HEADING = "CPU cores per row"  # the report section that lists cores_label and core_pick_label per row


def _host_record(timing, field):
    """(the timing result's record `field`, or None, label to show instead of it, or None)."""
    if timing.get("status") == "resource-skip":
        return None, NOT_TIMED
    if field not in timing:
        return None, NOT_RECORDED
    return timing[field], None


def cores_label(timing):
    """The CPUs the timing job ran on, from its `cpu_affinity` record: `16 logical CPUs (16 physical, sysfs)`;
    "not pinned" when the job left its cores alone and did not list them (the official protocol; the record's
    `reason`, shown beside it, says why); "not recorded" when the result predates the record."""
    affinity, label = _host_record(timing, "cpu_affinity")
    if label:
        return label
    if not isinstance(affinity, dict):
        return NOT_RECORDED
    cores = affinity.get("cores")
    if not isinstance(cores, list):
        return "not pinned"
    physical = affinity.get("physical_cores")
    label = (f"{len(cores)} logical CPU{'s' if len(cores) != 1 else ''} "
             f"({physical if physical is not None else '?'} physical, {affinity.get('topology') or 'topology n/a'})")
    if affinity.get("torch_threads") is not None:
        label += f", {affinity['torch_threads']} torch threads"
    return label


def core_pick_label(timing):
    """The timing job's core pick, from its `core_pick` record: `fastest-launch: picked core launch 6.3 µs (median
    over rounds; all cores' median 7.4 µs), 9 rounds on 6 cores`; "none" when no core was picked; "not recorded"
    when the result predates the record."""
    pick, label = _host_record(timing, "core_pick")
    if label:
        return label
    if pick is None:
        return "none"
    if not isinstance(pick, dict):
        return NOT_RECORDED
    method = pick.get("method") or "unknown method"
    rounds = [r for r in pick.get("rounds") or [] if isinstance(r, dict)]
    if not rounds:
        return f"{method}: no rounds recorded"
    picked = [v for v in (_num(r.get("launch_us")) for r in rounds) if v is not None]
    typical = [v for v in (_num(r.get("median_launch_us")) for r in rounds) if v is not None]
    picked_text = f"{statistics.median(picked):.1f} µs" if picked else "n/a"
    typical_text = f"{statistics.median(typical):.1f} µs" if typical else "n/a"
    distinct = len({r.get("core") for r in rounds})
    return (f"{method}: picked core launch {picked_text} (median over rounds; all cores' median {typical_text}), "
            f"{len(rounds)} round{'s' if len(rounds) != 1 else ''} on {distinct} "
            f"core{'s' if distinct != 1 else ''}")


def core_pick_note(timings):
    """One or two plain sentences on what the fastest-launch core pick does, for the report's method section;
    None when no timing result in `timings` used it."""
    picks = [t.get("core_pick") for t in timings]
    used = [p for p in picks if isinstance(p, dict) and p.get("method") == "fastest-launch"]
    if not used:
        return None
    probes = used[0].get("probe_launches")
    probed = f" (each core timed over {probes} launches)" if probes else ""
    return ("Core pick (fastest-launch): before every timed round, the thread that launches the GPU kernels was "
            f"moved to the CPU core of the job's cores on which a tiny kernel launch was cheapest at that moment"
            f"{probed}; on a shared virtual machine a core's launch cost changes from minute to minute, and the "
            f"time of a launch-bound model follows it. Each row's picks are listed under \"{HOST_CPUS_HEADING}\".")


def stopping_note(timings):
    """One sentence counting how the rows timed by the stable protocol stopped: on the interval (`stopping.reason`
    settled), on the time budget before the interval settled (time; the budget, `max_seconds`, beside it), at the
    round cap (cap); None when no row ran the stable protocol."""
    stops = [t.get("stopping") for t in timings if (t.get("protocol") or {}).get("name") == "stable"]
    stops = [s for s in stops if isinstance(s, dict) and s.get("reason") in ("settled", "time", "cap")]
    if not stops:
        return None
    count = {reason: sum(s["reason"] == reason for s in stops) for reason in ("settled", "time", "cap")}
    budgets = sorted({b for b in (_num(s.get("max_seconds")) for s in stops) if b is not None})
    budget = ("max_seconds " + ", ".join(f"{b:g} s" for b in budgets) + " of rounds a row") if budgets else \
        "no time budget set"
    return (f"Stopping (stable protocol), {len(stops)} row{'s' if len(stops) != 1 else ''} timed: "
            f"{count['settled']} stopped once the speedup's interval settled, {count['time']} on the time budget "
            f"({budget}) before it settled, {count['cap']} at the round cap; a row stopped on time or at the cap "
            "has the interval it reached, shown in its timing row.")


# ------------------------------------------------------------------ the table


def table(loaded):
    """pandas DataFrame, one row per result row, in the order of the inputs."""
    records = [dict(row_record(item), candidate=SHAPEWISE) for item in loaded["rows"]]
    return pd.DataFrame.from_records(records, columns=list(records[0]) if records else SUMMARY_COLUMNS)


def copy_into(src, outdir, rel):
    """Copy `src` to outdir/rel (its directories made); returns `rel`, the copy's path in the report."""
    dst = Path(outdir) / rel
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(src, dst)
    return rel


def geomean(values):
    """The geometric mean of the positive values among `values` (a series or any iterable; None and NaN left out),
    or None when there is none."""
    values = pd.Series(values, dtype=float).dropna()
    values = values[values > 0]
    if values.empty:
        return None
    return float(math.exp(values.map(math.log).mean()))


def _max(series):
    values = series.dropna()
    return None if values.empty else float(values.max())


def machine_groups(frame, loaded):
    """One dict per machine (in order of first appearance): counts, geomean speedup, its rows."""
    groups = []
    items = {item["id"]: item for item in loaded["rows"]}
    for index, (key, part) in enumerate(frame.groupby("machine", sort=False), 1):
        counts = part["status"].value_counts()
        envs = [(items[i]["data"]["timing"].get("environment") or {}) for i in part["id"]]
        env = envs[0] if envs else {}
        groups.append({
            "index": index,
            "key": key,
            "environment": env,
            "hosts": sorted({e.get("host") for e in envs if e.get("host")}),
            "is_cpu": env.get("gpu_name") is None,
            "ids": list(part["id"]),
            "geomean_speedup": geomean(part["speedup"]),
            "timed_rows": int(part["speedup"].notna().sum()),
            "passed": int(counts.get("pass", 0)),
            "failed": int(counts.get("fail", 0)),
            "skipped": int(counts.get("resource-skip", 0)),
            "elements": int(part["total_elements"].fillna(0).sum()),
            "failed_elements": int(part["failed_elements"].fillna(0).sum()),
            "noisy_rows": int((part["noisy"] == True).sum()),  # noqa: E712 (a column of True/False/None)
            "targets": int(part["target_met"].notna().sum()),
            "targets_met": int((part["target_met"] == True).sum()),  # noqa: E712
            "mask_cost_rows": int(part["mask_cost"].notna().sum()),
            "mask_cost_within": int((part["mask_cost_within"] == True).sum()),  # noqa: E712
            "mask_cost_max": _max(part["mask_cost"]),
            "mask_cost_limit": _max(part["mask_cost_limit"]),
        })
    return groups


def write_summary(frame, path, candidate_frame=None):
    """summary.csv: exactly SUMMARY_COLUMNS, empty cells for missing values, booleans as true/false; shapewise's
    rows (candidate `shapewise`), then those of the candidates (`candidate_frame`, report_candidates.records)."""
    out = frame[SUMMARY_COLUMNS].copy()
    if candidate_frame is not None and len(candidate_frame):
        out = pd.concat([out, candidate_frame[SUMMARY_COLUMNS]], ignore_index=True)
    for column in ("noisy", "target_met"):
        out[column] = out[column].map(lambda v: "" if v is None or v != v else ("true" if v else "false"))
    for column in INTEGER_COLUMNS:
        out[column] = out[column].astype("Int64")
    out.to_csv(path, index=False, na_rep="", float_format="%.8g", encoding="utf-8")


# ------------------------------------------------------------------ how the results were made


def how_made(loaded, report_run=None, report_started=None):
    """Lines saying which pipeline runs made the report's results (shapewise.execution.runs): per run its start, jobs,
    wall time, GPUs, how the jobs held them, how their processes started and whether the Triton cache was empty at its
    start. The rows' warm-ups (not read by the report otherwise) and the candidates' jobs count as jobs of the run
    that made them."""
    results = [loaded["environment_fingerprint"], loaded["microbench"]]  # the implementation's digest names no run
    for item in loaded["rows"]:
        results += [d for d in item["data"].values() if isinstance(d, dict)]
        for cand in (item.get("candidates") or {}).values():  # the candidates' jobs are the run's jobs too
            results += [d for d in cand["data"].values() if isinstance(d, dict)]
        warmup = Path(paths.result(paths.WARMUP_STEP, item["id"]))
        if warmup.is_file():
            try:
                results.append(json.loads(warmup.read_text(encoding="utf-8")))
            except (OSError, ValueError):
                pass
    found = runs.summarize(results, report_run, report_started)
    lines = []
    for entry in found:
        if entry["run"] is None:
            lines.append(f"{entry['jobs']} results name no run (made before runs were recorded), "
                         f"{entry['first_started']} to {entry['last_finished']}.")
            continue
        own = " (this report's run)" if entry["run"] == report_run else ""
        wall = "n/a" if entry["wall_s"] is None else f"{entry['wall_s']:.0f} s"
        steps = ", ".join(f"{n} {s}" for s, n in sorted(entry["steps"].items()))
        gpus = (f"{len(entry['gpus'])} GPU(s) ({', '.join(u[:12] for u in entry['gpus'])})" if entry["gpus"]
                else "no GPU")
        locks = ", ".join(f"{n} {m}" for m, n in sorted(entry["lock_modes"].items())) or "none"
        cache = entry["triton_cache"]
        if cache:
            state = "cold (empty)" if not cache["entries_at_start"] else f"warm ({cache['entries_at_start']} entries)"
            cache_text = f"Triton cache {cache['dir']} {state} at its start"
        else:
            cache_text = "no marker of this run here (made in another checkout or on another machine)"
        lines.append(f"Run {entry['run']}{own}: started {entry['started']}; {entry['jobs']} jobs ({steps}); "
                     f"wall time {wall} (from its start to {entry['wall_to']}); {gpus}; GPU locks: {locks}; "
                     f"job processes: {entry['forked']} forked from the job server, {entry['fresh']} fresh; "
                     f"{cache_text}.")
    if len(found) > 1:
        lines.insert(0, f"The results come from {len(found)} runs (a partial rerun, or a run in parts):")
    return lines
