"""provenance.json: the SHA-256 of every input and artifact of a report, and the git commit it came from.

Artifacts (the report's own files, the copied per-shape results, figures)
are listed relative to the report directory; inputs (manifests, config,
sources) relative to the repository root, which provenance.json records
relative to the report directory ("../.." for both results/report and
reports/<name>). Copying the report directory to reports/<name>/ therefore
keeps `shapewise verify reports/<name>` working.

Format 2 adds the git state of the checkout the report was produced from:

- `commit`: `git rev-parse HEAD` in the root, or null when the root is not in a
  git repository (or git is missing).
- `dirty`: true when at least one input's bytes differ from that commit's blob
  (or the input is not in the commit), false when none does, null without a
  commit. The check is limited to the listed inputs, not the whole tree: an
  edited file the report did not read does not make it dirty, and an ignored or
  untracked input does.
- `dirty_inputs`: the inputs for which that holds (sorted paths).

`verify` then checks the inputs against the commit's git objects rather than
the working tree, so a report stays verifiable after the sources move on.

A record holds `format` (an integer of FORMATS), `root` (text), `inputs` and `artifacts` (lists); verify names
any of them that is missing or of another type before it reads a file. The artifacts include the report's own
files: paths.REPORT_FILES (but provenance.json) and every file under paths.REPORT_DIRS; verify fails a report
whose record leaves one out, since that file could then change unseen.

Every path of a record must stay inside its base: an artifact a relative path
under the report directory, an input a relative path under the root, and the
root a directory that holds the report directory; no `..` part, no absolute
path, nothing that resolves (through a symbolic link) outside. verify refuses
a record that breaks this before hashing any file.

The root is a number of '..' steps up from the report directory as the root
reaches it (results/report: "../.."), and verify takes those steps on the path
it is given, without following symbolic links (root_dir): `results/` or
`results/report` may be a symbolic link to another disk and
`shapewise verify results/report` still finds the checkout, where the link's
target directory's own parent is somewhere else.

A result file also carries a digest of its own content (`content_sha256`, see
seal): the SHA-256 of the canonical JSON of its other fields, written by the
job that made it (shapewise.jobs.io.write_result). The report refuses a result
whose digest is missing or wrong, and verify fails a JSON artifact whose
digest is wrong (results copied into reports before the digest existed carry
none; their SHA-256 in provenance.json still covers them). Neither hash is a
signature: anyone who can write the files can recompute both
(docs/robustness.md, trust model).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
from datetime import datetime, timezone
from pathlib import Path, PurePosixPath

from shapewise.inputs import limits, paths
from shapewise.provenance.inventory import sha256_file

FORMAT = 2
FORMATS = (1, 2)  # the formats verify understands
REQUIRED = ("format", "root", "inputs", "artifacts")  # the fields of every format
CONTENT_FIELD = "content_sha256"  # a result's digest of its own content (seal)


def content_sha256(record: dict) -> str:
    """SHA-256 of the canonical JSON (sorted keys, no spaces, ASCII) of `record` without its CONTENT_FIELD.
    `record` holds what JSON reads back (json.loads of the file): the digest is of the file's content."""
    body = {key: value for key, value in record.items() if key != CONTENT_FIELD}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(text.encode()).hexdigest()


def seal(record: dict) -> dict:
    """`record` with CONTENT_FIELD set to its content_sha256."""
    return dict(record, **{CONTENT_FIELD: content_sha256(record)})


def result_file_problem(path):
    """None when `path` holds a result a later job may read (a JSON object whose content digest, when it carries
    one, matches), else what is wrong (one clause). For a check before a job runs, e.g. of a preflight result
    when Snakemake builds the DAG; reads no torch."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return "is missing"
    except (OSError, UnicodeDecodeError) as exc:
        return f"cannot be read ({exc})"
    except ValueError as exc:
        return f"is not valid JSON ({exc})"
    if not isinstance(data, dict):
        return f"is a JSON {type(data).__name__}, not a result object"
    return seal_problem(data) if CONTENT_FIELD in data else None


def seal_problem(record: dict):
    """None when the record carries its correct content digest, else what is wrong (one clause)."""
    found = record.get(CONTENT_FIELD)
    if found is None:
        return (f"has no {CONTENT_FIELD}: it was written by a shapewise older than result digests, or the field "
                f"was removed")
    if found != content_sha256(record):
        return f"was edited after its job wrote it: its {CONTENT_FIELD} does not match its content"
    return None


class ProvenanceError(ValueError):
    """A path a record would list that lies outside its base (see the module docstring)."""


def has_control_character(text):
    """Whether `text` holds a character below U+0020 or DEL: a line break or escape a record's path may not hold."""
    return any(ord(c) < 32 or ord(c) == 127 for c in text)


def outside(base, path):
    """None when `path` is a relative path that stays inside `base` (also after symbolic links are followed),
    else why not."""
    if not isinstance(path, str) or not path:
        return f"has no path ({path!r}); an entry needs a relative path"
    if has_control_character(path):
        return f"{path!r}: holds a control character"
    pure = PurePosixPath(path)
    if pure.is_absolute():
        return f"{path}: an absolute path; entries are relative to their base"
    if ".." in pure.parts:
        return f"{path}: has a '..' part; entries stay inside their base"
    if not (Path(base) / path).resolve().is_relative_to(Path(base).resolve()):
        return f"{path}: resolves outside {base} (through a symbolic link)"
    return None


def unrecordable(root=".", inputs=(), artifacts=()):
    """What write would refuse among these paths, one line each (empty: nothing): `inputs` relative to `root`,
    `artifacts` relative to the report directory (paths.REPORT_DIR under root). For the check while Snakemake
    builds the DAG: a manifest linked from outside the checkout or a candidate file with a line break in its name
    stops the run before any job, not in its report job."""
    root = os.path.abspath(root)
    lines = [f"the report could not record the input {problem}" for path in inputs if (problem := outside(root, path))]
    report_dir = os.path.join(root, paths.REPORT_DIR)
    lines += [f"the report could not record its copy {problem}"
              for path in artifacts if (problem := outside(report_dir, path))]
    return lines


def _entry(path, base):
    problem = outside(base, Path(path).as_posix())
    if problem:
        raise ProvenanceError(f"cannot record {problem}")
    full = Path(base) / path
    return {"path": Path(path).as_posix(), "sha256": sha256_file(full), "bytes": full.stat().st_size}


def root_dir(report_dir, root):
    """The directory `root` ('..' steps, from a record) names from `report_dir`, the steps taken on the path as
    given (os.path.normpath), not through the symbolic links it holds: `results/report/../..` is the checkout
    even where `results` links to another disk."""
    return Path(os.path.normpath(os.path.join(os.path.abspath(report_dir), root)))


def _ups(path):
    """`path` when it is only '..' parts (or '.'), else None."""
    return path if all(part == ".." for part in PurePosixPath(Path(path).as_posix()).parts) else None


def recorded_root(report_dir, root):
    """The root as a record holds it: the '..' steps from the report directory up to `root`, as root_dir takes
    them back. The report directory lies under the root on the path it is given (a symbolic link on that path or
    not), or beside where paths.REPORT_DIR resolves to (the report job renders beside the directory a link at
    REPORT_DIR points to, then swaps it in): then it is REPORT_DIR's depth. Raises ProvenanceError for a report
    directory that lies nowhere under the root: no record could lead verify back to it."""
    report_dir, root = Path(report_dir), Path(root)
    lexical = os.path.relpath(os.path.abspath(root), os.path.abspath(report_dir))
    if _ups(lexical):
        return Path(lexical).as_posix()
    if report_dir.resolve().parent == (root / paths.REPORT_DIR).resolve().parent:
        return "/".join([".."] * len(PurePosixPath(paths.REPORT_DIR).parts))
    physical = os.path.relpath(root.resolve(), report_dir.resolve())
    if _ups(physical):
        return Path(physical).as_posix()
    raise ProvenanceError(f"cannot record the root {os.path.abspath(root)}: the report directory "
                          f"{os.path.abspath(report_dir)} does not lie under it (write the report under the "
                          f"root, e.g. {paths.REPORT_DIR}, a symbolic link there being fine)")


def _git(root, *args):
    """(ok, stdout bytes, first line of stderr) of `git -C root ARGS`; ok is False when git is missing too."""
    try:
        done = subprocess.run(["git", "-C", str(root), *args], capture_output=True, check=False)
    except FileNotFoundError:
        return False, b"", "git not found"
    err = done.stderr.decode(errors="replace").strip().splitlines()
    return done.returncode == 0, done.stdout, (err[0] if err else f"git exited {done.returncode}")


def head_commit(root="."):
    """The commit checked out in root (40 hex digits), or None when root is not in a git repository."""
    ok, out, _ = _git(root, "rev-parse", "--verify", "-q", "HEAD")
    return out.decode().strip() if ok else None


def commit_known(root, commit):
    """(True, "") when the repository at root has the commit, else (False, why). A commit is its full id (40 or 64
    hex digits): anything else is never handed to git, where a leading '-' would read as an option."""
    if not commit:
        return False, "no commit recorded"
    if not isinstance(commit, str) or not re.fullmatch(r"[0-9a-f]{40}|[0-9a-f]{64}", commit):
        return False, f"{commit!r:.60} is not a full commit id"
    ok, _, err = _git(root, "cat-file", "-e", f"{commit}^{{commit}}")
    return ok, ("" if ok else err)


def blob_sha256(root, commit, path):
    """SHA-256 of `path` as the commit holds it (with the checkout's filters applied, as the working tree would
    have it), or None when the commit has no such file. `path` is relative to root."""
    ok, out, _ = _git(root, "cat-file", "--filters", f"{commit}:./{Path(path).as_posix()}")
    return hashlib.sha256(out).hexdigest() if ok else None


def dirty_inputs(root, commit, entries):
    """Paths of the input entries whose recorded SHA-256 is not that of the commit's blob (or absent from it)."""
    return sorted(e["path"] for e in entries if blob_sha256(root, commit, e["path"]) != e["sha256"])


def write(report_dir, inputs, artifacts, root=".", commit=None, candidates=()):
    """inputs: paths relative to `root`; artifacts: paths relative to report_dir. Returns the record written.

    candidates: the measured candidates (config `candidates`), each {"name", "path" (as configured), "sha256"
    (what its results were measured with), "files" (its copies among the artifacts)}; recorded as given, and
    only when there are any.

    commit: the commit the inputs come from, for a root that is a copy of the tree without its git repository
    (a GPU machine that received the working tree); default: HEAD of root. When the repository at root does not
    have the commit, `dirty` is null (unknown) and verify later treats any input that differs from the commit as
    a false record."""
    report_dir = Path(report_dir)
    input_entries = [_entry(p, root) for p in sorted(set(map(str, inputs)))]
    if commit is None:
        commit = head_commit(root)
    dirty = dirty_inputs(root, commit, input_entries) if commit_known(root, commit)[0] else None
    record = {
        "format": FORMAT,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "root": recorded_root(report_dir, root),
        "commit": commit,
        "dirty": None if dirty is None else bool(dirty),
        "dirty_inputs": dirty or [],
        "inputs": input_entries,
        "artifacts": [_entry(p, report_dir) for p in sorted(set(map(str, artifacts)))],
    }
    if candidates:
        record["candidates"] = list(candidates)
    path = report_dir / "provenance.json"
    path.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    return record


def _field_problems(record):
    """What makes `record` no provenance record verify reads, one clause per field: not a JSON object, a REQUIRED
    field missing, a format that is not an integer of FORMATS (2.0 and true compare equal to one), a `dirty` that
    is not a boolean or null."""
    if not isinstance(record, dict):
        return [f"not a provenance record: a JSON {type(record).__name__} where an object belongs"]
    problems = [f"field {name!r} missing: a provenance record holds {', '.join(REQUIRED)}"
                for name in REQUIRED if name not in record]
    fmt = record.get("format")
    if "format" in record and (type(fmt) is not int or fmt not in FORMATS):
        problems.append(f"format {fmt!r:.60}: not a format this shapewise reads (the integers "
                        f"{', '.join(map(str, FORMATS))})")
    if type(record.get("dirty")) not in (type(None), bool):
        problems.append(f"dirty {record['dirty']!r:.60}: true, false or null expected")
    return problems


def _record_problems(report_dir, record):
    """What makes a record unusable before any file is hashed: a root that is not a directory above the report
    (only '..' parts), an entry that is not {"path", "sha256"}, a path outside its base."""
    root = record["root"]
    if not isinstance(root, str) or any(part != ".." for part in PurePosixPath(root).parts):
        return [f"root {root!r}: the root must be a directory above the report directory ('..', '../..', ...)"]
    problems = []
    if record.get("commit") is not None and not isinstance(record["commit"], str):
        problems.append(f"commit {record['commit']!r:.60}: a commit id or null expected")
    dirty = record.get("dirty_inputs")
    if dirty is not None and not (isinstance(dirty, list) and all(isinstance(p, str) for p in dirty)):
        problems.append(f"dirty_inputs {dirty!r:.60}: a list of paths expected")
    for kind, base in (("artifact", report_dir), ("input", root_dir(report_dir, root))):
        entries = record[f"{kind}s"]
        if not isinstance(entries, list):
            problems.append(f"{kind}s: a list of entries expected, got {type(entries).__name__}")
            continue
        for number, entry in enumerate(entries, 1):
            if not isinstance(entry, dict) or not isinstance(entry.get("sha256"), str):
                problems.append(f"{kind} #{number}: not an entry with a path and a sha256 string: {entry!r:.120}")
                continue
            problem = outside(base, entry.get("path"))
            if problem:
                problems.append(f"{kind} #{number} {problem}")
    return problems


def _report_files(report_dir):
    """The paths a report directory's record must list, since a file it leaves out could change unseen: the
    report's own files (paths.REPORT_FILES but provenance.json), whether or not they exist, and every entry under
    its directories (paths.REPORT_DIRS) that is not a directory; a symbolic link to a directory is such an entry,
    never followed."""
    names = {name for key, name in paths.REPORT_FILES.items() if key != "provenance"}
    for top in paths.REPORT_DIRS:
        start = report_dir / top
        if start.is_symlink() or (start.exists() and not start.is_dir()):
            names.add(top)  # where its directory belongs: listed like any file, never followed
            continue
        for dirpath, dirnames, filenames in os.walk(start):
            here = Path(dirpath).relative_to(report_dir)
            names.update((here / name).as_posix() for name in filenames)
            names.update((here / name).as_posix() for name in dirnames if (Path(dirpath) / name).is_symlink())
    return names


def _unlisted(report_dir, entries):
    """Problems ("artifact not listed in provenance.json ...: path") of the report's files the entries leave out."""
    listed = {PurePosixPath(entry["path"]).as_posix() for entry in entries}
    return [f"artifact not listed in provenance.json (a report lists all its files): {report_dir / name}"
            for name in sorted(_report_files(report_dir) - listed)]


def _check_files(kind, base, entries):
    """Problems ("<kind> missing: path", "<kind> changed (SHA-256 mismatch): path") of entries against files."""
    problems = []
    for entry in entries:
        path = base / entry["path"]
        if not path.is_file():
            problems.append(f"{kind} missing: {path}")
        elif sha256_file(path) != entry["sha256"]:
            problems.append(f"{kind} changed (SHA-256 mismatch): {path}")
    return problems


def _check_seals(base, entries):
    """Problems of JSON artifacts whose own content digest (seal) is wrong; one without a digest is not checked
    (it predates the digest; its SHA-256 in the record covers it)."""
    problems = []
    for entry in entries:
        path = base / entry["path"]
        if path.suffix != ".json" or not path.is_file():
            continue
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError, RecursionError):
            continue  # not a result: its SHA-256 alone covers it
        if isinstance(data, dict) and CONTENT_FIELD in data and (problem := seal_problem(data)):
            problems.append(f"artifact {problem}: {path}")
    return problems


def _check_inputs_against_commit(root, commit, record, out):
    """Inputs against the commit's git objects. Returns the problems (tampering); notes dirty inputs and
    whether the working tree still matches, neither of which fails."""
    dirty_at_production = set(record.get("dirty_inputs") or [])
    unrecorded = ("the record does not know whether the tree was dirty" if record.get("dirty") is None
                  else "was not recorded as dirty")
    problems, matched, unverifiable = [], 0, []
    for entry in record["inputs"]:
        blob = blob_sha256(root, commit, entry["path"])
        if blob == entry["sha256"]:
            matched += 1
        elif entry["path"] in dirty_at_production:
            unverifiable.append(entry["path"])
        else:
            how = "not in" if blob is None else "differs from"
            problems.append(f"input {how} commit {commit[:12]} and {unrecorded} "
                            f"(provenance.json does not match the commit): {entry['path']}")
    out(f"verify: inputs: {matched} of {len(record['inputs'])} match commit {commit[:12]} (git objects)")
    for path in unverifiable:
        out(f"verify: input dirty at production, not checkable against the commit: {path}")
    changed = [e["path"] for e in record["inputs"]
               if not (root / e["path"]).is_file() or sha256_file(root / e["path"]) != e["sha256"]]
    if changed:
        noun = "input" if len(changed) == 1 else "inputs"
        out(f"verify: {len(changed)} {noun} changed since {commit[:12]} (working tree; informational):")
        for path in changed:
            out(f"verify:   {path}{'' if (root / path).is_file() else ' (deleted)'}")
    else:
        out("verify: inputs: current (the working tree still matches)")
    return problems


def verify(report_dir, artifacts_only=False, out=print):
    """0 when the report's artifacts match provenance.json and its inputs are what it claims, else 1.

    Artifacts are always re-hashed: a missing or changed one fails. Inputs of a format-2 record whose commit the
    repository has are hashed as that commit holds them: a mismatch means the record lies and fails, except for
    inputs recorded as dirty at production (noted, not checkable). Whether the working tree still matches is
    reported but never fails. Without the commit (format 1, no git at production, or a commit this repository
    lacks) the inputs are checked against the working tree and a mismatch fails: it cannot be told from tampering.
    """
    report_dir = Path(report_dir)
    manifest = report_dir / "provenance.json"
    if not manifest.is_file():
        out(f"verify: FAILED: {manifest} not found")
        return 1
    try:
        record = limits.load_json(manifest, "provenance record")
    except limits.InputFileError as exc:
        out(f"verify: FAILED: {exc}")
        return 1
    unusable = _field_problems(record) or _record_problems(report_dir, record)
    if unusable:
        for problem in unusable:
            out(f"verify: {manifest}: {problem}")
        noun = "problem" if len(unusable) == 1 else "problems"
        out(f"verify: FAILED: {manifest}: {len(unusable)} {noun} in the record; no file was read")
        return 1
    fmt = record["format"]
    root = root_dir(report_dir, record["root"])

    problems = _check_files("artifact", report_dir, record["artifacts"])
    n_art = len(record["artifacts"])
    out(f"verify: artifacts: {n_art - len(problems)} of {n_art} match")
    problems += _unlisted(report_dir, record["artifacts"])
    problems += _check_seals(report_dir, record["artifacts"])
    if not artifacts_only:
        commit = record.get("commit") if fmt >= 2 else None
        known, why = commit_known(root, commit)
        if fmt >= 2 and record.get("dirty"):
            out(f"verify: produced from a dirty tree: {len(record.get('dirty_inputs') or [])} inputs differed "
                f"from commit {str(commit)[:12] if commit else '?'}")
        if known:
            problems += _check_inputs_against_commit(root, commit, record, out)
        else:
            if fmt < 2:
                reason = "format-1 record (no commit recorded)"
            elif not commit:
                reason = "the report was not produced in a git repository"
            else:
                reason = f"commit {str(commit)[:12]} unknown to the repository at {root} ({why})"
            hint = "fetch the commit, or use --artifacts-only" if commit else "or use --artifacts-only"
            out(f"verify: inputs: {reason}: checked against the working tree; a mismatch fails because it cannot "
                f"be told from tampering ({hint})")
            input_problems = _check_files("input", root, record["inputs"])
            out(f"verify: inputs: {len(record['inputs']) - len(input_problems)} of {len(record['inputs'])} "
                f"match the working tree")
            problems += input_problems
    for problem in problems:
        out(f"verify: {problem}")
    if problems:
        out(f"verify: FAILED: {len(problems)} problems in {report_dir}")
        return 1
    n_in = 0 if artifacts_only else len(record["inputs"])
    out(f"verify: OK: {n_art} artifacts and {n_in} inputs of {report_dir} match provenance.json")
    return 0
