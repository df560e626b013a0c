"""`shapewise compare OLD NEW`: two report runs side by side, a regression gate for CI.

Rows are matched by (machine, id, candidate): a row measured on one machine is never compared with a row measured
on another (those are listed as not comparable), and each candidate of config `candidates` (summary.csv's
`candidate` column; shapewise's own rows are `shapewise`, as every row of a summary without the column) only with
itself. For each model of a row in both runs:

- change = new median / old median - 1;
- "faster" / "slower" when the change is beyond noise, else "within noise". Beyond noise means both: the two
  runs' 95 % intervals of the median (summary.csv's `<model>_ci_low_ms` / `<model>_ci_high_ms`) do not overlap,
  and |change| exceeds the model's floor (DEFAULT_FLOORS: 3 % for the optimized model, 5 % for the reference,
  whose launch-bound rows move more between processes). When either run has no interval (older reports), the
  floor alone decides and the verdict says so;
- "n/a" when either median is missing (row not timed, added or removed).

A regression is a row whose optimized model (shapewise's, or the candidate's) is slower beyond noise; `main` exits
1 when there is one, 0 otherwise, 2 when a report cannot be read (the message names the file), when the two runs
have no row in common (by machine, id and candidate: nothing would be compared) or when a noise floor is not a
fraction in [0, 1).

Every number compare reads is checked: a time (median or interval bound, ms) or a speedup must be a finite number
above 0, a count of elements a whole number >= 0, an error a finite number >= 0; anything else (`nan`, `abc`, `-1`)
is an error naming the file, the line, the row and the column, never a "+nan %" verdict.

OLD or NEW may also be a results directory of a run that rendered no report (e.g. timing jobs only): without a
summary.csv, its rows are read from <dir>/timing/*.json (median, interval, machine, route of each result).

Older summary.csv files (columns id, status, route, failed_elements, total_elements, max_abs_error,
reference_median_ms, optimized_median_ms, speedup) have no machine column: the machine is read from the
report's data/timing/<id>.json (`environment.machine_key`) when that file exists, else it is "unknown".
"""

from __future__ import annotations

import csv
import json
import math
import re
from pathlib import Path

from shapewise.candidates import SHAPEWISE
from shapewise.inputs import paths
from shapewise.provenance.inventory import SOFTWARE_SEPARATOR

SUMMARY = "summary.csv"
MODELS = ("optimized", "reference")
DEFAULT_FLOORS = {"optimized": 0.03, "reference": 0.05}
UNKNOWN_MACHINE = "unknown"
FLOOR_ONLY = "floor only"  # how a verdict's basis starts when a run had no interval
REQUIRED_COLUMNS = ("id", "status", "route", "reference_median_ms", "optimized_median_ms")
TEXT_COLUMNS = ("id", "candidate", "machine", "status", "call", "route")
# Columns compare reads as numbers: a cell that is neither empty nor a number is an error, not a silent None.
NUMBER_COLUMNS = tuple(f"{m}_{c}" for m in MODELS for c in ("median_ms", "ci_low_ms", "ci_high_ms"))
# What a number of a column may be, for the columns of summary.csv that hold numbers (when present).
POSITIVE = "a finite number above 0"
NON_NEGATIVE = "a finite number >= 0"
COUNT = "a whole number >= 0"
VALUE_RULES = {**{column: POSITIVE for column in NUMBER_COLUMNS},
               **{column: POSITIVE for column in ("speedup", "speedup_ci_low", "speedup_ci_high")},
               **{column: COUNT for column in ("failed_elements", "total_elements", "strict_failed_elements")},
               "max_abs_error": NON_NEGATIVE}


class CompareError(Exception):
    """A report that cannot be read; the message names the file (and row / column)."""


def _timing_json(report_dir, row_id):
    return Path(report_dir) / paths.in_report(paths.result("timing", row_id))


def _cell(text):
    """'' -> None, 'true'/'false' -> bool, integers and floats parsed, anything else kept as text."""
    if text is None or text == "":
        return None
    low = text.strip().lower()
    if low in ("true", "false"):
        return low == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def _breaks_rule(value, rule):
    """Whether a parsed cell (int, float, bool or text) breaks its column's rule."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return True
    if rule == COUNT:
        return value < 0 or value != int(value)
    return value <= 0 if rule == POSITIVE else value < 0


def check_values(row, where):
    """Raise CompareError when a number of `row` breaks VALUE_RULES, or a text holds a control character (which
    a terminal would act on when compare prints it); `where` names the file and line. Returns the row with its
    times as floats."""
    for column in TEXT_COLUMNS:
        value = row.get(column)
        if isinstance(value, str) and any(ord(c) < 32 or ord(c) == 127 for c in value):
            raise CompareError(f"{where}: {column} {value!r} holds a control character")
    for column, rule in VALUE_RULES.items():
        value = row.get(column)
        if value is None:
            continue
        if _breaks_rule(value, rule):
            raise CompareError(f"{where} (row {row['id']}): {column} is {value!r}, not {rule}")
        if column in NUMBER_COLUMNS:
            row[column] = float(value)
    return row


def _machine_from_timing(report_dir, row_id):
    path = _timing_json(report_dir, row_id)
    if not path.is_file():
        return UNKNOWN_MACHINE, "unknown"
    try:
        key = json.loads(path.read_text(encoding="utf-8")).get("environment", {}).get("machine_key")
    except (ValueError, AttributeError) as exc:
        raise CompareError(f"{path}: not a timing result JSON ({exc})") from exc
    return (key, path.relative_to(report_dir).as_posix()) if key else (UNKNOWN_MACHINE, "unknown")


def rows_from_timing_results(results_dir) -> list[dict]:
    """Rows of a results directory without a report: one per <results_dir>/timing/*.json (shapewise's) and
    <results_dir>/candidates/<name>/timing/*.json (a candidate's), with the columns compare reads (what the
    report's summary.csv would carry for them)."""
    from shapewise.report.report_data import route_label  # deferred: pandas, which report_data imports

    rows = []
    timing_dirs = [(SHAPEWISE, Path(results_dir) / "timing")] + [
        (d.name, d / "timing") for d in sorted((Path(results_dir) / "candidates").glob("*")) if d.is_dir()]
    for candidate, path in [(c, p) for c, d in timing_dirs for p in sorted(d.glob("*.json"))]:
        try:
            result = json.loads(path.read_text(encoding="utf-8"))
            row = {"id": result["row"]["id"], "candidate": candidate, "status": result["status"],
                   "call": result.get("call"), "route": route_label(result.get("route")),
                   "machine": result["environment"]["machine_key"],
                   "machine_source": path.relative_to(results_dir).as_posix()}
        except (ValueError, KeyError, TypeError) as exc:
            raise CompareError(f"{path}: not a timing result JSON ({exc!r} missing or unreadable)") from exc
        for model in MODELS:
            entry = result.get(model) or {}
            ci = entry.get("median_ci_ms") or (None, None)
            row[f"{model}_median_ms"], row[f"{model}_ci_low_ms"], row[f"{model}_ci_high_ms"] = \
                entry.get("median_ms"), ci[0], ci[1]
        rows.append(check_values(row, str(path)))
    return rows


def load_rows(report_dir) -> list[dict]:
    """Rows of report_dir/summary.csv as dicts: numbers parsed, '' -> None. Each row also gets
    `machine_source`: "summary.csv", "data/timing/<id>.json" (older summaries) or "unknown". A directory with
    no summary.csv but timing results (a results directory) is read by rows_from_timing_results."""
    report_dir = Path(report_dir)
    path = report_dir / SUMMARY
    if not path.is_file() and (report_dir / "timing").is_dir():
        return rows_from_timing_results(report_dir)
    if not path.is_file():
        raise CompareError(f"{path}: not found (is {report_dir} a report directory?)")
    try:
        with open(path, newline="", encoding="utf-8-sig") as fh:  # a spreadsheet's BOM is no part of `id`
            reader = csv.DictReader(fh)
            columns = reader.fieldnames or []
            raw = list(reader)
    except (OSError, UnicodeDecodeError, csv.Error) as exc:
        raise CompareError(f"{path}: cannot be read as CSV ({exc})") from exc
    missing = [c for c in REQUIRED_COLUMNS if c not in columns]
    if missing:
        raise CompareError(f"{path}: missing column(s) {', '.join(missing)} (has: {', '.join(columns)})")
    rows, seen = [], set()
    for line, cells in enumerate(raw, start=2):
        if None in cells or any(v is None for v in cells.values()):
            raise CompareError(f"{path}, line {line}: wrong number of cells for the header")
        row = {k: (v if k in TEXT_COLUMNS and v != "" else _cell(v)) for k, v in cells.items()}
        if not row["id"]:
            raise CompareError(f"{path}, line {line}: empty id")
        check_values(row, f"{path}, line {line}")
        if "machine" in columns and row.get("machine"):
            row["machine_source"] = SUMMARY
        else:
            row["machine"], row["machine_source"] = _machine_from_timing(report_dir, row["id"])
        row["candidate"] = candidate_of(row)
        key = (row["machine"], row["id"], row["candidate"])
        if key in seen:
            raise CompareError(f"{path}, line {line}: row {label(row)} appears twice for machine {row['machine']!r}")
        seen.add(key)
        rows.append(row)
    return rows


def _interval(row, model):
    low, high = row.get(f"{model}_ci_low_ms"), row.get(f"{model}_ci_high_ms")
    return (low, high) if low is not None and high is not None else None


def model_change(old, new, model, floor):
    """{"old_ms", "new_ms", "change", "verdict", "basis"} of one model between two matched rows (either may be
    None for an added / removed row). basis says what decided the verdict."""
    old_ms = old.get(f"{model}_median_ms") if old else None
    new_ms = new.get(f"{model}_median_ms") if new else None
    entry = {"old_ms": old_ms, "new_ms": new_ms, "change": None, "verdict": "n/a", "basis": None}
    if old_ms is None or new_ms is None or old_ms <= 0:
        return entry
    change = new_ms / old_ms - 1
    old_ci, new_ci = _interval(old, model), _interval(new, model)
    beyond_floor = abs(change) > floor
    if old_ci and new_ci:
        overlap = old_ci[0] <= new_ci[1] and new_ci[0] <= old_ci[1]
        beyond = beyond_floor and not overlap
        basis = f"intervals {'overlap' if overlap else 'apart'}, floor {floor:.0%}"
    else:
        beyond = beyond_floor
        runs = " and ".join(n for n, ci in (("old", old_ci), ("new", new_ci)) if not ci)
        basis = f"{FLOOR_ONLY}: no interval in the {runs} run"
    entry.update(change=change, basis=basis,
                 verdict=("slower" if change > 0 else "faster") if beyond else "within noise")
    return entry


def _route_name(route):
    match = re.match(r"[A-Za-z_]+", route or "")
    return match.group(0) if match else None


def _route_changed(old, new):
    """Whether the route changed. Both are labels (report_data.route_label: `name/precision ...`); an older
    summary's short label (`fused(32,4,2)+kv`, no `/`) against such a label is compared by the route's name (fused,
    graph, triton, ...) only, since the two spell the rest differently."""
    if old.get("route") is None or new.get("route") is None:
        return False
    if ("/" in old["route"]) == ("/" in new["route"]):
        return old["route"] != new["route"]
    return _route_name(old["route"]) != _route_name(new["route"])


def candidate_of(row):
    """The model a row measured: its `candidate`, shapewise's own where it names none (a summary without the
    column, an older report)."""
    return row.get("candidate") or SHAPEWISE


def label(row):
    """How a row is named: its id for shapewise's rows, `<id> (<candidate>)` for a candidate's."""
    candidate = candidate_of(row)
    return row["id"] if candidate == SHAPEWISE else f"{row['id']} ({candidate})"


def gpu_of(machine):
    """The GPU model of a machine key (`NVIDIA H200 | software 5af37da32336` -> `NVIDIA H200`)."""
    return machine.split(SOFTWARE_SEPARATOR, 1)[0]


def compare_rows(old_rows, new_rows, floors=None, same_gpu=False) -> dict:
    """Match rows by (machine, id, candidate) and give each model's change and verdict (see the module docstring).
    same_gpu: match by the GPU model alone (`--same-gpu`), the machines' software keys kept in `software`.

    floors: {"optimized": fraction, "reference": fraction}, default DEFAULT_FLOORS. Returns {"rows": [...],
    "regressions": [labels], "lost": [labels of rows that passed in the old run and do not in the new one: failed,
    skipped for resources, not run], "not_comparable": [{"id" (a label), "old_machines", "new_machines"}],
    "floors": {...}}; a row's label is `label(row)`."""
    floors = {**DEFAULT_FLOORS, **(floors or {})}
    key = gpu_of if same_gpu else (lambda machine: machine)
    software = {"old": sorted({r.get("machine") or UNKNOWN_MACHINE for r in old_rows}),
                "new": sorted({r.get("machine") or UNKNOWN_MACHINE for r in new_rows})} if same_gpu else None
    old_by = {(key(r.get("machine") or UNKNOWN_MACHINE), label(r)): r for r in old_rows}
    new_by = {(key(r.get("machine") or UNKNOWN_MACHINE), label(r)): r for r in new_rows}
    keys = list(old_by) + [k for k in new_by if k not in old_by]
    rows, regressions, lost = [], [], []
    for machine, row_id in keys:
        old, new = old_by.get((machine, row_id)), new_by.get((machine, row_id))
        status = "both" if old and new else ("removed" if old else "added")
        entry = {"id": (old or new)["id"], "candidate": candidate_of(old or new), "label": row_id,
                 "machine": machine, "status": status,
                 "route_old": old.get("route") if old else None, "route_new": new.get("route") if new else None,
                 "route_changed": bool(old and new and _route_changed(old, new)),
                 "result_old": old.get("status") if old else None, "result_new": new.get("status") if new else None}
        for model in MODELS:
            entry[model] = model_change(old, new, model, floors[model])
        if entry["optimized"]["verdict"] == "slower" and row_id not in regressions:
            regressions.append(row_id)
        if status == "both" and entry["result_old"] == "pass" and entry["result_new"] != "pass":
            lost.append(row_id)
        rows.append(entry)
    old_machines, new_machines = {}, {}
    for machine, row_id in old_by:
        old_machines.setdefault(row_id, []).append(machine)
    for machine, row_id in new_by:
        new_machines.setdefault(row_id, []).append(machine)
    not_comparable = [{"id": i, "old_machines": old_machines[i], "new_machines": new_machines[i]}
                      for i in old_machines if i in new_machines and not set(old_machines[i]) & set(new_machines[i])]
    return {"rows": rows, "regressions": regressions, "lost": lost, "not_comparable": not_comparable,
            "floors": floors, "software": software}


def nothing_in_common(result, old_name="OLD", new_name="NEW"):
    """None when at least one row is in both runs (same machine and id), else the sentence that says why the
    comparison is empty: no common id, or common ids measured on other machines."""
    if any(r["status"] == "both" for r in result["rows"]):
        return None
    old = sorted({r["id"] for r in result["rows"] if r["status"] == "removed"})
    new = sorted({r["id"] for r in result["rows"] if r["status"] == "added"})
    if result["not_comparable"]:
        machines = "; ".join(f"{n['id']}: {', '.join(n['old_machines'])} against {', '.join(n['new_machines'])}"
                             for n in result["not_comparable"][:5])
        return (f"no row of {old_name} is in {new_name} on the same machine, so nothing can be compared "
                f"(rows with the same id ran on different machines: {machines})")
    return (f"no row of {old_name} is in {new_name}, so nothing can be compared ({old_name}: {_some(old)}; "
            f"{new_name}: {_some(new)})")


def _some(ids, shown=10):
    """Up to `shown` ids, then how many more."""
    if not ids:
        return "no rows"
    more = f" and {len(ids) - shown} more" if len(ids) > shown else ""
    return ", ".join(ids[:shown]) + more


def check_floors(floors):
    """Raise CompareError unless every floor is a fraction in [0, 1)."""
    for model, floor in (floors or {}).items():
        if isinstance(floor, bool) or not isinstance(floor, (int, float)) or not 0 <= floor < 1:
            raise CompareError(f"the {model} noise floor is {floor!r}; it must be a fraction in [0, 1), "
                               f"e.g. {DEFAULT_FLOORS[model]}")


def _ms(value):
    return "-" if value is None else f"{value:.4g}"


def _pct(change):
    return "" if change is None else f"{change * 100:+.1f} %"


def format_comparison(result, old_name="OLD", new_name="NEW") -> list[str]:
    """The comparison as text lines: per machine a table of the rows in both runs, then route and status
    changes, rows added and removed, rows not comparable, and the verdict."""
    floors = result["floors"]
    lines = [f"compare: {old_name} -> {new_name} (noise floors: optimized {floors['optimized']:.0%}, "
             f"reference {floors['reference']:.0%}; beyond noise = intervals apart and change above the floor)"]
    if result.get("software"):
        lines.append(f"matched by GPU model alone (--same-gpu); machines of {old_name}: "
                     f"{', '.join(result['software']['old'])}; of {new_name}: {', '.join(result['software']['new'])}")
    elsewhere = {n["id"] for n in result["not_comparable"]}
    groups = list(dict.fromkeys((r["machine"], r["candidate"]) for r in result["rows"]))
    with_candidates = any(candidate != SHAPEWISE for _, candidate in groups)
    for machine, candidate in groups:
        rows = [r for r in result["rows"] if (r["machine"], r["candidate"]) == (machine, candidate)]
        both = [r for r in rows if r["status"] == "both"]
        lines.append("")
        lines.append(f"machine {machine}{f', candidate {candidate}' if with_candidates else ''}: {len(both)} rows in "
                     f"both runs")
        if both:
            lines.append(f"  {'id':<20} {'model':<10} {'old ms':>9} {'new ms':>9} {'change':>9}  verdict")
        for r in both:
            for n, model in enumerate(MODELS):
                m = r[model]
                verdict = m["verdict"] + ("*" if m["basis"] and m["basis"].startswith(FLOOR_ONLY) else "")
                lines.append(f"  {r['id'] if n == 0 else '':<20} {model:<10} {_ms(m['old_ms']):>9} "
                             f"{_ms(m['new_ms']):>9} {_pct(m['change']):>9}  {verdict}")
        for r in both:
            if r["route_changed"]:
                lines.append(f"  route changed: {r['id']}: {r['route_old']} -> {r['route_new']}")
            if r["result_old"] != r["result_new"]:
                lines.append(f"  status changed: {r['id']}: {r['result_old']} -> {r['result_new']}")
        added = [r["id"] for r in rows if r["status"] == "added" and r["label"] not in elsewhere]
        removed = [r["id"] for r in rows if r["status"] == "removed" and r["label"] not in elsewhere]
        if added:
            lines.append(f"  rows added: {', '.join(added)}")
        if removed:
            lines.append(f"  rows removed: {', '.join(removed)}")
    if result["not_comparable"]:
        lines.append("")
        lines.append("not comparable (measured on different machines):")
        for n in result["not_comparable"]:
            lines.append(f"  {n['id']}: old on {', '.join(n['old_machines'])}; new on {', '.join(n['new_machines'])}")
    floor_only = sorted({r[m]["basis"].split(": ", 1)[1] for r in result["rows"] for m in MODELS
                         if r[m]["basis"] and r[m]["basis"].startswith(FLOOR_ONLY)})
    if floor_only:
        lines.append("")
        lines.append(f"* {'; '.join(floor_only)} (an older report): the verdict rests on the floor alone")
    lines.append("")
    if result["regressions"]:
        lines.append(f"compare: REGRESSION: optimized model slower beyond noise on {len(result['regressions'])} "
                     f"row(s): {', '.join(result['regressions'])}")
    else:
        lines.append("compare: no regression (no row's optimized model is slower beyond noise)")
    if result.get("lost"):
        lines.append(f"compare: LOST: {len(result['lost'])} row(s) passed in {old_name} and do not in {new_name}: "
                     + ", ".join(f"{r['label']} ({r['result_new']})" for r in result["rows"]
                                 if r["label"] in result["lost"]))
    return lines


def main(old_dir, new_dir, floors=None, out=print, err=print, same_gpu=False) -> int:
    """Print the comparison of two report directories; 1 on a regression or a row that passed and no longer does,
    0 without, 2 on unreadable input."""
    try:
        check_floors(floors)
        result = compare_rows(load_rows(old_dir), load_rows(new_dir), floors, same_gpu)
        empty = nothing_in_common(result, str(old_dir), str(new_dir))
        if empty:
            raise CompareError(empty)
    except CompareError as exc:
        err(f"compare: {exc}")
        return 2
    for line in format_comparison(result, str(old_dir), str(new_dir)):
        out(line)
    return 1 if result["regressions"] or result["lost"] else 0
