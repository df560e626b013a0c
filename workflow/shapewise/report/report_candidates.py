"""The candidates' part of the report (config `candidates`, shapewise.candidates; docs/candidates.md).

- `load_rows`: each candidate's accuracy, timing and profile results of each row, read and checked as shapewise's
  are (report_data.read_steps), the candidate's SHA-256 standing for the
  implementation digest;
- `records`: one record per candidate and row with report_data.row_record's fields (summary.csv's columns: the
  `optimized_*` figures are the candidate's, `reference_*` the reference timed in the same rounds) plus the
  candidate's name, its failures with their reasons, how its weights loaded and, where it ran unconfined, a note;
- `side_by_side`: per machine and row, shapewise and every candidate in one table, the fastest passing one (lowest
  median among those that passed, timed on that machine) marked, and per model its geomean speedup;
- `copy_sources`: each candidate's files copied into the report (candidates/<name>/...), their SHA-256 checked
  against the one the results were measured with, for provenance.json.

A candidate that failed accuracy was still timed (its timing job does not depend on its accuracy job): the table
shows its time beside its failure, and it is never the fastest.
"""

from __future__ import annotations

from shapewise import candidates
from shapewise.inputs import paths
from shapewise.provenance import identity
from shapewise.report.report_data import ReportInputError, copy_into, geomean, read_steps, row_record

SHAPEWISE = candidates.SHAPEWISE  # the `candidate` column's value for shapewise's own rows
SOURCES = paths.REPORT_SOURCES  # where a report keeps each candidate's files: candidates/<name>/<file>


def regenerate(name, row_id):
    files = " ".join(paths.candidate_per_shape(name, row_id).values())
    return f"snakemake --cores all --forcerun {files}"


def load_rows(inputs, rows, digests, problems):
    """Fill rows[i]["candidates"] = {name: {"data", "paths", "profile_csv"}} from the inputs; append a problem per
    bad file. Returns the candidates of the run: [{"name", "path", "sha256"}]."""
    listed = inputs.get("candidates") or []
    sha = {c["name"]: c["sha256"] for c in listed}
    by_id = {r["id"]: r for r in rows}
    for entry in inputs["rows"]:
        row = entry["row"]
        item = by_id[row["id"]]
        item["candidates"] = {}
        for name, spec in (entry.get("candidates") or {}).items():
            expected = dict(digests, implementation_digest=sha[name], row_id=row["id"],
                            row_digest=identity.row_digest(row))
            data = read_steps(spec["results"], paths.CANDIDATE_STEPS, expected, regenerate(name, row["id"]), inputs,
                              problems)
            item["candidates"][name] = {"data": data, "paths": spec["results"], "profile_csv": spec["profile_csv"]}
    return listed


def failure_text(step, failure):
    """`timeout [timing job, timing]: still running after ...`: the kind, the job and stage, the reason."""
    return f"{failure['kind']} [{step} job, {failure['stage']}]: {failure['message']}"


def weights_text(weights):
    if not isinstance(weights, dict):
        return None
    if weights.get("strict"):
        return "strict"
    return (f"non-strict: {len(weights.get('missing_keys') or [])} missing, "
            f"{len(weights.get('unexpected_keys') or [])} unexpected key(s)")


def containment_notes(data):
    """A note per job whose candidate ran with its writes unconfined (its result's `containment`, written by
    shapewise.jobs.candidate.contain)."""
    notes = []
    for step in paths.CANDIDATE_STEPS:
        held = data[step].get("containment")
        if isinstance(held, dict) and held.get("writes") == "unconfined":
            notes.append(f"ran unconfined [{step} job]: its writes were not restricted ({held.get('reason')})")
    return notes


def record(item, name):
    """The candidate's record on one row."""
    data = item["candidates"][name]["data"]
    rec = row_record({"row": item["row"], "data": {"accuracy": data["accuracy"], "timing": data["timing"]}})
    failures = [failure_text(step, data[step]["failure"]) for step in paths.CANDIDATE_STEPS
                if isinstance(data[step].get("failure"), dict)]
    weights = next((data[s].get("weights") for s in paths.CANDIDATE_STEPS if data[s].get("weights")), None)
    rec.update(candidate=name, status="fail" if failures else data["accuracy"].get("status"), failures=failures,
               weights=weights_text(weights), weights_detail=weights, route=None, notes=containment_notes(data),
               environment=(data["timing"].get("environment") or data["accuracy"].get("environment") or {}))
    return rec


def records(loaded):
    """Every candidate's record, row by row in the order of the inputs, candidates in the config's order."""
    names = [c["name"] for c in loaded["candidates"]]
    return [record(item, name) for item in loaded["rows"] for name in names if name in item["candidates"]]


def side_by_side(groups, shapewise_rows, candidate_records):
    """Add g["candidate_rows"] to every machine group: per row of the group {"id", "row", "entries"}, the entries
    shapewise's record and each candidate's, each with `fastest` (the lowest median among the entries that
    passed and were timed on this machine) and `elsewhere` (the machine it was measured on, when not this one)."""
    by_row = {}
    for rec in candidate_records:
        by_row.setdefault(rec["id"], []).append(rec)
    for g in groups:
        g["candidate_rows"] = []
        for x in g["rows"]:
            entries = [dict(x["r"], candidate=SHAPEWISE, failures=[], notes=[], weights="strict",
                            elsewhere=None)]
            entries += [dict(rec, elsewhere=None if rec["machine"] == g["key"] else rec["machine"])
                        for rec in by_row.get(x["id"], [])]
            timed = [e for e in entries if e["status"] == "pass" and e["optimized_median_ms"] is not None
                     and e["elsewhere"] is None]
            fastest = min(timed, key=lambda e: e["optimized_median_ms"])["candidate"] if timed else None
            for e in entries:
                e["fastest"] = e["candidate"] == fastest
            g["candidate_rows"].append({"id": x["id"], "row": x["row"], "entries": entries})
        g["candidate_summary"] = summary(g["candidate_rows"])


def summary(candidate_rows):
    """Per model (shapewise first, then the candidates): rows passed, rows timed with a speedup, the geomean of
    those speedups, and the rows on which it was the fastest passing model."""
    names = list(dict.fromkeys(e["candidate"] for c in candidate_rows for e in c["entries"]))
    out = []
    for name in names:
        mine = [e for c in candidate_rows for e in c["entries"] if e["candidate"] == name and not e["elsewhere"]]
        speedups = [e["speedup"] for e in mine if e["speedup"] is not None and e["speedup"] > 0]
        out.append({"name": name, "rows": len(mine), "passed": sum(e["status"] == "pass" for e in mine),
                    "timed_rows": len(speedups), "fastest_rows": sum(e["fastest"] for e in mine),
                    "geomean_speedup": geomean(speedups)})
    return out


def copy_sources(listed, outdir, root):
    """Copy each candidate's files into outdir/candidates/<name>/ and check their digest against the one its
    results were measured with. Returns (artifact paths, provenance entries {"name", "path", "sha256", "files"})."""
    artifacts, entries, problems = [], [], []
    for c in listed:
        found = candidates.digest(c["path"], root)
        if found != c["sha256"]:
            problems.append(f"candidate {c['name']} ({c['path']}): SHA-256 {found}, but its results were measured "
                            f"with {c['sha256']}: it changed; rerun snakemake to measure it again")
            continue
        source = candidates.location(c["path"], root)
        files = []
        for rel in candidates.files(c["path"], root):
            src = source if source.is_file() else source / rel
            files.append(copy_into(src, outdir, f"{SOURCES}/{c['name']}/{rel}"))
        artifacts += files
        entries.append({"name": c["name"], "path": c["path"], "sha256": c["sha256"], "files": files})
    if problems:
        raise ReportInputError(problems)
    return artifacts, entries
