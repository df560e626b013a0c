"""provenance.json: the SHA-256 of every input and artifact of a report.

Artifacts (the report's own files, the copied per-shape results, figures)
are listed relative to the report directory; inputs (manifests, config,
sources) relative to the repository root, which provenance.json records
relative to the report directory ("../.." for both results/report and
reports/<name>). Copying the report directory to reports/<name>/ therefore
keeps `shapewise verify reports/<name>` working.
"""

from __future__ import annotations

import json
import os
from datetime import datetime, timezone
from pathlib import Path

from shapewise.fingerprint import sha256_file

FORMAT = 1


def _entry(path, base):
    full = Path(base) / path
    return {"path": Path(path).as_posix(), "sha256": sha256_file(full), "bytes": full.stat().st_size}


def write(report_dir, inputs, artifacts, root="."):
    """inputs: paths relative to `root`; artifacts: paths relative to report_dir."""
    report_dir = Path(report_dir)
    record = {
        "format": FORMAT,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "root": os.path.relpath(Path(root).resolve(), report_dir.resolve()),
        "inputs": [_entry(p, root) for p in sorted(set(map(str, inputs)))],
        "artifacts": [_entry(p, report_dir) for p in sorted(set(map(str, artifacts)))],
    }
    path = report_dir / "provenance.json"
    path.write_text(json.dumps(record, indent=2) + "\n")
    return record


def verify(report_dir, artifacts_only=False, out=print):
    """0 when every listed file exists with its recorded SHA-256, else 1."""
    report_dir = Path(report_dir)
    manifest = report_dir / "provenance.json"
    if not manifest.is_file():
        out(f"verify: FAILED: {manifest} not found")
        return 1
    record = json.loads(manifest.read_text())
    root = report_dir / record["root"]
    groups = [("artifact", report_dir, record["artifacts"])]
    if not artifacts_only:
        groups.append(("input", root, record["inputs"]))
    problems, checked = [], 0
    for kind, base, entries in groups:
        for entry in entries:
            path = base / entry["path"]
            checked += 1
            if not path.is_file():
                problems.append(f"{kind} missing: {path}")
            elif sha256_file(path) != entry["sha256"]:
                problems.append(f"{kind} changed (SHA-256 mismatch): {path}")
    for problem in problems:
        out(f"verify: {problem}")
    if problems:
        out(f"verify: FAILED: {len(problems)} of {checked} files missing or changed in {report_dir}")
        return 1
    n_art = len(record["artifacts"])
    n_in = 0 if artifacts_only else len(record["inputs"])
    out(f"verify: OK: {n_art} artifacts and {n_in} inputs of {report_dir} match provenance.json")
    return 0
