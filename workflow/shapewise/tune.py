"""Write the fused kernel's launch configurations into model/routing_policy.json from a sweep.

Usage: shapewise tune SWEEP.json [POLICY.json]   (default policy: the model's own routing_policy.json)

Reads the `fused` records of a launch sweep (benchmarks/launch_sweep.py writes them). Per official row, a
configuration qualifies when it compiled and its errors against the fp64 reference (plain and masked) are at most
twice those of the baseline configuration (the sweep's first, the one the policy ran before): a configuration
that computes something else is never picked for speed. The rows are grouped as the policy's launch entries are: each row
joins the first of GROUPS whose bounds cover it (batch_size*seq_len up to max_tokens, num_heads up to
max_heads). Small (rows 2 and 12: fewer 32-row programs than the H200 has SMs, so smaller row blocks add
parallelism); mid (rows 1 and 7, and the unswept 9 and 10: 8192 tokens, few heads); large (rows 5, 6 and 11:
more tokens, or 16 heads of head_dim 8, where keys and values computed once per layer are faster, and the plain
kernel on row 7). Each group gets the configuration with the lowest
geometric-mean time among those qualifying on all its rows; a group the sweep has no row of gets no entry.
If one fused layer of row 6 beats one layer of the unfused triton route by more than 10%, the fused route's
size bound is raised to cover row 6. Prints every decision; the policy's other entries are kept.

Both files are read through shapewise.inputs.limits.load_json (size, UTF-8, nesting, no key twice) and checked before
anything is decided (check_sweep, check_policy): a missing, damaged or malformed file stops the command with its
name and, for a sweep record, the record's number and field.
"""
from __future__ import annotations

import json
import math
from collections import defaultdict

from shapewise.inputs import limits
from shapewise.inputs.manifest import official_rows
from shapewise.model.policy import POLICY_PATH

# (max_tokens, max_heads) of each launch entry, in order; None: no bound. 4096 tokens = 128 programs of 32 rows,
# under one wave of the H200's 132 SMs.
GROUPS = ((4096, None), (8192, 4), (None, None))
OFFICIAL = official_rows()  # the rows the sweep ran, by number
TOKENS = {n: r["batch_size"] * r["seq_len"] for n, r in OFFICIAL.items()}
ROW6_TOKENS_X_D = TOKENS[6] * OFFICIAL[6]["d_model"]


def config_of(record):
    """(block_m, num_warps, num_stages, kv_precompute, key_block, ffn_block) of a sweep record (older sweeps: no
    kv_precompute, and no block sizes: 0 = the kernel's default)."""
    return (record["block_m"], record["num_warps"], record["num_stages"], record.get("kv_precompute", False),
            record.get("key_block") or 0, record.get("ffn_block") or 0)


def qualifying(records):
    """{config: {row: ms}} of the configurations that are as accurate as the baseline on a row."""
    by_row = defaultdict(list)
    for r in records:
        by_row[r["row"]].append(r)
    good = defaultdict(dict)
    for row, recs in by_row.items():
        base = recs[0]
        if "error" in base:
            raise SystemExit(f"tune_policy: the baseline configuration failed on row {row}: {base['error']}")
        for r in recs:
            cfg = config_of(r)
            ok = "error" not in r and all(r[k] <= 2 * base[k] + 1e-6 for k in ("max_abs_error", "max_abs_error_masked"))
            print(f"row {row:2d} {cfg}: " + (f"{r['ms']:.4f} ms, errors {r['max_abs_error']:.2e} / "
                                           f"{r['max_abs_error_masked']:.2e}" if "error" not in r else r["error"])
                  + ("" if ok else "  (rejected)"))
            if ok:
                good[cfg][row] = r["ms"]
    return good, sorted(by_row)


def best(good, rows):
    cands = {cfg: math.exp(sum(math.log(t[r]) for r in rows) / len(rows))
             for cfg, t in good.items() if all(r in t for r in rows)}
    if not cands:
        raise SystemExit(f"tune_policy: no configuration qualifies on rows {rows}")
    return min(cands, key=cands.get), cands


CONFIG_FIELDS = ("block_m", "num_warps", "num_stages")  # whole numbers >= 1 in every record
MEASURED_FIELDS = ("ms", "max_abs_error", "max_abs_error_masked")  # finite numbers >= 0 where no error


def _number(value, whole=False):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return False
    return not whole or value == int(value)


def check_sweep(sweep, path):
    """Raise SystemExit naming the file, the record and the field unless `sweep` is a sweep this command reads."""
    if not isinstance(sweep, dict) or not isinstance(sweep.get("fused"), list) or not sweep["fused"]:
        raise SystemExit(f"tune: {path}: not a launch sweep: a JSON object with a non-empty list 'fused' expected")
    for number, record in enumerate(sweep["fused"], 1):
        where = f"tune: {path}: fused record #{number}"
        if not isinstance(record, dict):
            raise SystemExit(f"{where}: a JSON object expected, got {type(record).__name__}")
        if record.get("row") not in OFFICIAL or isinstance(record.get("row"), bool):
            raise SystemExit(f"{where}: field row is {record.get('row')!r}, not an official row number "
                             f"({min(OFFICIAL)}-{max(OFFICIAL)})")
        for field in CONFIG_FIELDS:
            if not _number(record.get(field), whole=True) or record[field] < 1:
                raise SystemExit(f"{where}: field {field} is {record.get(field)!r}, not a whole number >= 1")
        if "error" in record:
            continue
        for field in MEASURED_FIELDS:
            if not _number(record.get(field)) or record[field] < 0:
                raise SystemExit(f"{where}: field {field} is {record.get(field)!r}, not a finite number >= 0 "
                                 "(a failed configuration carries 'error' instead)")
    if "row6_triton_layer_ms" in sweep and not (_number(sweep["row6_triton_layer_ms"])
                                                 and sweep["row6_triton_layer_ms"] > 0):
        raise SystemExit(f"tune: {path}: field row6_triton_layer_ms is {sweep['row6_triton_layer_ms']!r}, not a "
                         "finite number above 0")


def check_policy(policy, path):
    """Raise SystemExit naming the file unless `policy` has the fused entry this command rewrites."""
    if not isinstance(policy, dict) or not isinstance(policy.get("fused"), dict):
        raise SystemExit(f"tune: {path}: not a routing policy: a JSON object with an object 'fused' expected")


def _load(path, what):
    try:
        return limits.load_json(path, what)
    except limits.InputFileError as exc:
        raise SystemExit(f"tune: {exc}") from None


def main(sweep_path, policy_path=None):
    sweep = _load(sweep_path, "sweep")
    check_sweep(sweep, sweep_path)
    policy_path = policy_path or POLICY_PATH
    policy = _load(policy_path, "routing policy")
    check_policy(policy, policy_path)
    good, rows = qualifying(sweep["fused"])
    launch = []
    groups = [[] for _ in GROUPS]
    for r in rows:
        heads = OFFICIAL[r]["num_heads"]
        first = next(i for i, (tokens, most) in enumerate(GROUPS)
                     if (tokens is None or TOKENS[r] <= tokens) and (most is None or heads <= most))
        groups[first].append(r)
    for (bound, most), group in zip(GROUPS, groups):
        if not group:
            continue
        cfg, cands = best(good, group)
        print(f"rows {group}: picked {cfg} (geomean {cands[cfg]:.4f} ms; baseline "
              f"{cands.get(config_of(sweep['fused'][0]), float('nan')):.4f} ms)")
        entry = {"max_tokens": bound, "block_m": cfg[0], "num_warps": cfg[1], "num_stages": cfg[2]}
        if most is not None:
            entry["max_heads"] = most
        if cfg[3]:
            entry["kv_precompute"] = True
        for key, value in (("key_block", cfg[4]), ("ffn_block", cfg[5])):
            if value:
                entry[key] = value
        launch.append(entry)
    launch[-1]["max_tokens"] = None  # the last entry covers every shape
    launch[-1].pop("max_heads", None)
    policy["fused"]["launch"] = launch
    if "row6_triton_layer_ms" in sweep and 6 in rows:
        fused6 = min(t[6] for t in good.values() if 6 in t)
        unfused6 = sweep["row6_triton_layer_ms"]
        covers = fused6 < 0.9 * unfused6
        print(f"row 6, one layer: fused {fused6:.3f} ms, triton route {unfused6:.3f} ms -> "
              f"{'fused' if covers else 'unfused'} route")
        if covers:
            policy["fused"]["max_tokens_x_d_model"] = max(policy["fused"].get("max_tokens_x_d_model") or 0,
                                                          ROW6_TOKENS_X_D)
            policy["fused"]["max_tokens"] = None  # the ablation's token bound no longer stands once row 6 is fused
    try:
        with open(policy_path, "w") as f:
            json.dump(policy, f, indent=2)
            f.write("\n")
    except OSError as exc:
        raise SystemExit(f"tune: {policy_path}: cannot be written ({exc.strerror})") from None
    print("wrote", policy_path, json.dumps(policy["fused"]))
    return 0
