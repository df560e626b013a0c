"""The report job: summary.csv, figures, report.md/.html, provenance.json.

    python -m shapewise.report.report --inputs INPUTS.json --outdir results/report

INPUTS.json is written by the report rule (workflow/rules/report.smk): the rows of the run and their result files,
as the DAG knows them (report.load checks each result's identity against its row). Results are grouped by
the machine that produced them (GPU or CPU model plus a digest of the software, see
shapewise.provenance.inventory.machine_key): each group gets its own table and geomean, and timings of different
machines are never mixed into one number.

A report that cannot be built leaves the previous one as it was: everything is rendered into a temporary
directory beside the output, which then takes the output's place in one step (swap_in).

The report's text is written once, in templates/report.j2, and rendered twice: to report.md with the macros of
templates/markdown.j2 and to report.html with those of templates/html.j2. Every value a page shows is escaped once,
where it is printed: report.html through html_value (`&`, `<`, `>` and `"`, since every attribute of html.j2 is
double-quoted), report.md through md_value (its Markdown characters, `<`, line breaks) or md_code in a code span.
Nothing in the templates is marked safe.
"""

from __future__ import annotations

import argparse
import ctypes
import errno
import html
import json
import os
import re
import shutil
import stat
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path

import jinja2
import markupsafe
import pandas as pd

from shapewise import candidates
from shapewise.analysis.stats import NOISY_HALF_WIDTH
from shapewise.execution.jobserver import RUN_VAR
from shapewise.inputs import paths
from shapewise.provenance import provenance
from shapewise.report import report_candidates, report_data, report_figures
from shapewise.report.compare import CompareError, compare_rows, label, load_rows, nothing_in_common
from shapewise.report.report_data import ReportInputError, copy_into

SOURCE_DIRS = ("model", "kernels", "workflow")
SOURCE_SUFFIXES = (".py", ".smk", ".yaml", ".yml", ".json", ".j2", ".csv", ".toml")
ROUTES_ANCHOR = "routes"


def fmt(value, digits=3):
    if value is None or (isinstance(value, float) and value != value):
        return "n/a"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if value == 0:
            return "0"
        if abs(value) >= 1e4 or abs(value) < 1e-2:
            return f"{value:.{digits}g}"
        return f"{value:.{digits}f}" if abs(value) < 10 else f"{value:.{max(1, digits - 1)}f}"
    return str(value)


def pct(value):
    return "n/a" if value is None or value != value else f"{value * 100:.1f} %"


def signed_pct(value):
    return "n/a" if value is None or value != value else f"{value * 100:+.1f} %"


def mib(value):
    """Bytes in B, KiB, MiB, GiB or TiB."""
    if value is None or value != value:
        return "n/a"
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if value >= scale:
            return f"{value / scale:.1f} {unit}"
    return f"{int(value)} B"


def _written(text):
    """`text`, already in its page's syntax, as Jinja's autoescaping takes it: written as it is."""
    return markupsafe.Markup(text)


def html_value(value):
    """A value as report.html shows it: `&`, `<`, `>` and `"` escaped (markupsafe would also turn `'` into `&#39;`,
    which no double-quoted attribute needs). Markup (a macro's or an escaped filter's output) is kept as it is."""
    if isinstance(value, markupsafe.Markup):
        return value
    return _written(html.escape(str(value), quote=False).replace('"', "&quot;"))


# Characters that mean something inside a Markdown line (CommonMark with GitHub's tables and strikethrough): each is
# written with a backslash, which every CommonMark viewer reads as the character itself. `_` only where it could
# open or close emphasis (not between two letters or digits, as in `fused_layer`); `]` only where a link would
# follow (`](` or `][`: a `[...]` alone is text); `<` as `&lt;` (no HTML tag or autolink in a viewer that renders
# HTML); `&` as `&amp;` only where it would start an entity.
_MD_ESCAPED = re.compile(r"[\\`*|~#]|\](?=[(\[])|(?<![A-Za-z0-9])_|_(?![A-Za-z0-9])")
_MD_ENTITY = re.compile(r"&(?=#?[A-Za-z0-9]+;)")


def md_text(value):
    """A value as report.md shows it in running text or a table cell: its Markdown characters escaped (_MD_ESCAPED;
    a `|` cannot end a table cell, a backtick cannot open a code span) and line breaks as spaces (a value stays in
    its line, table cell or list item, and cannot start a heading or a list)."""
    text = " ".join(str(value).splitlines())
    text = _MD_ENTITY.sub("&amp;", text).replace("<", "&lt;")
    return _MD_ESCAPED.sub(lambda m: "\\" + m.group(0), text)


def md_value(value):
    """What report.md's environment prints for `value`: md_text of it, or a macro's output (Markup) as it is."""
    if isinstance(value, markupsafe.Markup):
        return value
    return _written(md_text(value))


def md_code(value, cell=False):
    """A value as a Markdown code span: fenced by one backtick more than its longest run of backticks (padded with a
    space where it starts or ends with one), its line breaks as spaces; in a table cell (`cell`) each `|` written
    `\\|`, which GitHub's tables read as part of the cell even inside a code span. A value holding `<` is written as
    md_text instead: no viewer then reads a tag in it."""
    text = " ".join(str(value).splitlines())
    if "<" in text:
        return md_value(value)
    if cell:
        text = text.replace("|", "\\|")
    fence = "`" * (max((len(run) for run in re.findall(r"`+", text)), default=0) + 1)
    pad = " " if text[:1] == "`" or text[-1:] == "`" else ""
    return _written(f"{fence}{pad}{text}{pad}{fence}")


DIALECTS = {"md": "markdown.j2", "html": "html.j2"}  # the macros report.j2 is written in, per output


def environments():
    """{output suffix: Jinja environment}: both autoescaping, each value escaped once as its page needs it
    (html_value, md_value); report.j2 renders through either with its dialect (DIALECTS)."""
    def make(finalize):
        env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(paths.TEMPLATES)), autoescape=True,
                                 finalize=finalize, undefined=jinja2.StrictUndefined, trim_blocks=True,
                                 lstrip_blocks=True)
        env.filters.update(fmt=fmt, pct=pct, signed_pct=signed_pct, mib=mib, md_code=md_code)
        return env

    return {"md": make(md_value), "html": make(html_value)}


def write_pages(context, outdir):
    """report.md and report.html from the one template report.j2, written as UTF-8 whatever the locale."""
    envs = environments()
    for kind, dialect in DIALECTS.items():
        text = envs[kind].get_template("report.j2").render(dialect=dialect, **context)
        if kind == "md":  # blocks end with a blank line each; between two of them one is enough
            text = re.sub(r"\n{3,}", "\n\n", text).strip() + "\n"
        (Path(outdir) / f"report.{kind}").write_text(text, encoding="utf-8")


def source_inputs(root):
    root = Path(root)
    files = ["Snakefile", "pyproject.toml", "config/config.yaml"]
    for name in SOURCE_DIRS:
        files += [p.relative_to(root).as_posix() for p in sorted((root / name).rglob("*"))
                  if p.is_file() and p.suffix in SOURCE_SUFFIXES and "__pycache__" not in p.parts]
    return [f for f in files if (root / f).is_file()]


def chunked_notes(items):
    notes = []
    for item in items:
        acc = item["data"]["accuracy"]
        if acc.get("check_method") != "chunked":
            continue
        checked = acc["trials"][0]["checked"]
        notes.append({"id": item["id"], "trials": len(acc["trials"]), "batch_indices": checked["batch_indices"],
                      "query_ranges": checked["query_ranges"], "elements_compared": checked["elements_compared"],
                      "elements_total": checked["elements_total"], "reference": checked["reference"],
                      "batch_size": item["row"]["batch_size"]})
    return notes


def protocols(items):
    """The timing and ablation protocol most rows ran, and the rows that ran another one (heavy rows)."""
    out, exceptions = [], []
    for step in ("timing", "ablation"):
        seen = [json.dumps(i["data"][step].get("protocol"), sort_keys=True) for i in items
                if i["data"][step].get("protocol")]
        usual = max(set(seen), key=seen.count) if seen else None
        out.append(json.loads(usual) if usual else None)
        for i in items:
            p = i["data"][step].get("protocol")
            if p and json.dumps(p, sort_keys=True) != usual:
                exceptions.append({"id": i["id"], "step": step, "protocol": p})
    return out[0], out[1], exceptions


def speedup_outside(records, candidate_records):
    """The rows (shapewise's, then the candidates') whose speedup lies outside its own interval
    (report_data.outside): {"label", "speedup", "low", "high"} each, for the report's limitations."""
    return [{"label": label(r), "speedup": r["speedup"], "low": r["speedup_ci_low"], "high": r["speedup_ci_high"]}
            for r in [*records, *candidate_records] if r.get("speedup_outside_interval") is True]


def baseline_section(baseline, outdir):
    """compare_rows of the baseline report against this one (read back from the summary.csv just written)."""
    try:
        old = load_rows(baseline)
    except CompareError as exc:
        raise ReportInputError([f"baseline (config baseline={baseline}): {exc}"]) from None
    result = compare_rows(old, load_rows(outdir))
    problem = nothing_in_common(result, str(baseline), "this run")
    if problem:
        raise ReportInputError([f"baseline (config baseline={baseline}): {problem}"])
    result["path"] = str(baseline)
    result["added"] = [r for r in result["rows"] if r["status"] == "added"]
    result["removed"] = [r for r in result["rows"] if r["status"] == "removed"]
    result["route_changes"] = [r for r in result["rows"] if r["route_changed"]]
    return result


def build(inputs, loaded, outdir):
    """Write the whole report into outdir (an empty directory)."""
    from shapewise.model.tolerance import TOLERANCES  # deferred: torch, which the model imports, for this function only
    outdir = Path(outdir)
    root = inputs.get("root", ".")
    artifacts = []
    fp = inputs["fingerprints"]
    for src in (fp["env"], fp["impl"], inputs["microbench"]):
        artifacts.append(copy_into(src, outdir, paths.in_report(src)))
    items = loaded["rows"]
    for item in items:
        for path in item["paths"].values():
            artifacts.append(copy_into(path, outdir, paths.in_report(path)))
        if Path(item["profile_csv"]).is_file():
            artifacts.append(copy_into(item["profile_csv"], outdir, paths.in_report(item["profile_csv"])))
        for cand in item["candidates"].values():
            for path in [*cand["paths"].values(), cand["profile_csv"]]:
                artifacts.append(copy_into(path, outdir, paths.in_report(path)))
    source_artifacts, candidate_sources = report_candidates.copy_sources(loaded["candidates"], outdir, root)
    artifacts += source_artifacts

    frame = report_data.table(loaded)
    groups = report_data.machine_groups(frame, loaded)
    index_of = {g["key"]: g["index"] for g in groups}
    frame["machine_index"] = frame["machine"].map(index_of)
    candidate_records = report_candidates.records(loaded)
    candidate_frame = pd.DataFrame.from_records(candidate_records) if candidate_records else \
        pd.DataFrame(columns=frame.columns)
    row_machine = dict(zip(frame["id"], frame["machine"]))
    candidate_frame["machine_index"] = [index_of.get(m, index_of.get(row_machine.get(i)))
                                        for i, m in zip(candidate_frame["id"], candidate_frame["machine"])]
    report_data.write_summary(frame, outdir / "summary.csv", candidate_frame)
    artifacts.append("summary.csv")

    switches = next((i["data"]["ablation"]["switches"] for i in items if i["data"]["ablation"].get("switches")), [])
    made = report_figures.make_all(frame, items, switches, outdir, candidate_frame)
    artifacts += list(made.values())

    records = frame.to_dict("records")
    rows = []
    for item, rec in zip(items, records):
        rec = {k: (None if isinstance(v, float) and v != v else v) for k, v in rec.items()}
        for column in report_data.INTEGER_COLUMNS + ("rounds_run",):  # pandas keeps a column with gaps as float
            if rec[column] is not None:
                rec[column] = int(rec[column])
        rows.append({"id": item["id"], "row": item["row"], "data": item["data"], "r": rec,
                     "trace": item["profile_trace"]})
    for g in groups:
        g["rows"] = [r for r in rows if r["r"]["machine"] == g["key"]]
    report_candidates.side_by_side(groups, rows, candidate_records)

    baseline = baseline_section(inputs["baseline"], outdir) if inputs.get("baseline") else None
    timing_protocol, ablation_protocol, protocol_exceptions = protocols(items)
    manifests = inputs["manifests"]
    source_files = sorted(set(manifests + source_inputs(root)))
    context = {
        "generated": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "how_made": report_data.how_made(loaded, os.environ.get(RUN_VAR), STARTED),
        "cpu_run": any(g["is_cpu"] for g in groups),
        "groups": groups,
        "mixed_machines": len(groups) > 1,
        "rows": rows,
        "counts": {s: int((frame["status"] == s).sum()) for s in report_data.STATUSES},
        "elements": sum(g["elements"] for g in groups),
        "failed_elements": sum(g["failed_elements"] for g in groups),
        "tolerances": TOLERANCES,
        "noisy_half_width": NOISY_HALF_WIDTH,
        "manifests": manifests,
        "figures": made,
        "microbench": loaded["microbench"],
        "environment_fingerprint": loaded["environment_fingerprint"],
        "implementation": loaded["implementation"],
        "chunked": chunked_notes(items),
        "ablation_switches": switches,
        "timing_protocol": timing_protocol,
        "ablation_protocol": ablation_protocol,
        "protocol_exceptions": protocol_exceptions,
        "profile_kernels": {i["id"]: i["data"]["profile"].get("triton_kernels_ran", []) for i in items},
        "profile_shared": {i["id"]: len(i["data"]["profile"].get("gpu_shared_during_capture") or []) for i in items},
        "pass_env": inputs.get("pass_env") or {},
        "baseline": baseline,
        "routes_anchor": ROUTES_ANCHOR,
        "host_cpus_heading": report_data.HOST_CPUS_HEADING,
        "core_pick_note": report_data.core_pick_note([i["data"]["timing"] for i in items]),
        "stopping_note": report_data.stopping_note([i["data"]["timing"] for i in items]),
        "candidates": candidate_sources,
        "speedup_outside": speedup_outside(records, candidate_records),
        "candidate_failures": candidates.FAILURES,
    }
    # The provenance appendix lists the artifacts above (the report files themselves are in provenance.json).
    context["inputs"] = [provenance._entry(p, root) for p in source_files]
    context["artifacts_listed"] = [provenance._entry(p, outdir) for p in sorted(set(artifacts))]
    write_pages(context, outdir)
    artifacts += ["report.md", "report.html"]
    provenance.write(outdir, source_files, artifacts, root=root, commit=inputs.get("commit"),
                     candidates=candidate_sources)
    return context


REPORT_ENTRIES = (*paths.REPORT_DIRS, *paths.REPORT_FILES.values())
_AT_FDCWD, _RENAME_EXCHANGE = -100, 2  # <linux/fcntl.h>, <linux/fs.h>


def _exchange(a, b):
    """Swap the directories `a` and `b` in one step (Linux renameat2 with RENAME_EXCHANGE); False where the C
    library or the file system does not offer it."""
    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if renameat2 is None:
        return False
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(a), None, str(b))


def swap_in(staged, outdir):
    """Put the complete report `staged` (a directory beside `outdir`) in the place of `outdir`: a reader sees the
    old report or the new one, never one without its data/ or figures/. Entries of `outdir` that are not the
    report's (REPORT_ENTRIES) move into the new one first. `staged` holds the old report afterwards (the caller
    removes it). Where the directories cannot be exchanged in one step, `outdir` is absent between two renames."""
    if not outdir.exists():
        os.rename(staged, outdir)
        return
    for entry in outdir.iterdir():
        if entry.name not in REPORT_ENTRIES and not (staged / entry.name).exists():
            os.rename(entry, staged / entry.name)
    if not _exchange(staged, outdir):
        aside = staged.with_name(staged.name + ".old")
        os.rename(outdir, aside)
        os.rename(staged, outdir)
        os.rename(aside, staged)


def load(inputs):
    """Read and check every result the inputs name: shapewise's (report_data.load) and the candidates'
    (report_candidates.load_rows). Returns report_data.load's rows and fingerprints with "candidates" beside them;
    raises ReportInputError naming every bad file."""
    problems = []
    loaded, digests = report_data.load(inputs, problems)
    loaded["candidates"] = report_candidates.load_rows(inputs, loaded["rows"], digests, problems)
    if problems:
        raise ReportInputError(problems)
    return loaded


def render(inputs, outdir):
    """Check the inputs, render into a temporary directory beside `outdir`, then swap it in (swap_in).
    Raises ReportInputError (naming every bad file) before anything in `outdir` changes. A symbolic link at
    `outdir` stays: the directory it points to is the one replaced."""
    outdir = Path(outdir)
    loaded = load(inputs)
    if outdir.is_symlink():
        outdir = outdir.resolve()
    outdir.parent.mkdir(parents=True, exist_ok=True)
    staged = Path(tempfile.mkdtemp(prefix=f".{outdir.name}.tmp-", dir=outdir.parent))
    try:
        context = build(inputs, loaded, staged)
        # mkdtemp's directory is private; the report keeps the mode of the one it replaces
        staged.chmod(stat.S_IMODE(outdir.stat().st_mode) if outdir.is_dir() else 0o777 & ~_umask())
        swap_in(staged, outdir)
    finally:
        shutil.rmtree(staged, ignore_errors=True)
    return context


def _umask():
    mask = os.umask(0o22)
    os.umask(mask)
    return mask


STARTED = datetime.now(timezone.utc)  # the report job's start: the end of its run's wall time


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m shapewise.report.report", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--inputs", required=True, help="the JSON file of inputs the report rule writes")
    parser.add_argument("--outdir", required=True)
    args = parser.parse_args(argv)
    try:
        inputs = json.loads(Path(args.inputs).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        print(f"report: cannot read the inputs file {args.inputs}: {exc}", file=sys.stderr)
        return 2
    try:
        context = render(inputs, args.outdir)
    except (ReportInputError, provenance.ProvenanceError) as exc:
        print(f"report: {exc}\nThe previous report in {args.outdir} is unchanged.", file=sys.stderr)
        return 1
    counts = context["counts"]
    print(f"report: {len(context['rows'])} rows in {len(context['groups'])} machine group(s); "
          f"pass {counts['pass']}, fail {counts['fail']}, resource-skip {counts['resource-skip']}; "
          f"written to {args.outdir}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
