"""Candidates in the pipeline on the CPU: one DAG measures shapewise and every candidate of config `candidates` on
a tiny manifest, the report puts them side by side, a failing candidate leaves every other result standing, and
`snakemake -n` plans only an edited or added candidate's jobs.

The candidates are copies of tests/candidates/ in the temporary checkout, so the edits below touch only the copy.
"""

from __future__ import annotations

import csv
import json
import re
import shutil
from pathlib import Path

import pytest
from checkout import copy_checkout
from test_pipeline import shapewise, snakemake

CASES = Path(__file__).resolve().parent / "candidates"
TINY = """\
- {id: tiny-cand, batch_size: 2, seq_len: 7, d_model: 32, num_heads: 2, ffn_dim: 64, num_layers: 1, trials: 2}
"""
CANDIDATES = {"ref": "mine/reference.py", "pkg": "mine/package", "inaccurate": "mine/inaccurate.py",
              "hangs": "mine/hangs.py"}
STEPS = {"candidate_accuracy", "candidate_timing", "candidate_profile"}

pytestmark = pytest.mark.slow


def write_config(workdir, candidates):
    (workdir / "candidates.yaml").write_text(json.dumps({
        "shapes": "tiny", "candidates": candidates, "candidate_time_limit_s": {"cuda": 1500, "cpu": 15}}))


def run(workdir, *args):
    return snakemake(workdir, "--configfile", "candidates.yaml", *args)


def planned(workdir):
    """{(rule, candidate or None)} that a dry run would execute."""
    done = run(workdir, "-n")
    text = done.stdout + done.stderr
    jobs = set()
    for block in re.split(r"\n\s*\n", text):
        match = re.search(r"^(?:local)?rule (\w+):", block, re.M)
        if match:
            candidate = re.search(r"wildcards:.*?candidate=([\w-]+)", block)
            jobs.add((match.group(1), candidate.group(1) if candidate else None))
    if not jobs:
        assert "Nothing to be done" in text, text
    return jobs


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    work = tmp_path_factory.mktemp("candidates")
    copy_checkout(work)
    (work / "shapes" / "tiny.yaml").write_text(TINY)
    shutil.copytree(CASES, work / "mine")
    write_config(work, CANDIDATES)
    run(work)
    return work


def summary(workdir):
    with open(workdir / "results" / "report" / "summary.csv") as fh:
        return {r["candidate"]: r for r in csv.DictReader(fh)}


def test_the_report_shows_every_candidate_beside_shapewise(workdir):
    rows = summary(workdir)
    assert list(rows) == ["shapewise", "ref", "pkg", "inaccurate", "hangs"]
    assert all(r["id"] == "tiny-cand" for r in rows.values())
    assert rows["shapewise"]["status"] == "pass" and rows["shapewise"]["route"]
    for name in ("ref", "pkg"):
        r = rows[name]
        assert r["status"] == "pass" and r["failed_elements"] == "0" and r["route"] == ""
        assert float(r["optimized_median_ms"]) > 0 and float(r["reference_median_ms"]) > 0
        assert float(r["speedup_ci_low"]) <= float(r["speedup"]) <= float(r["speedup_ci_high"])
    # failed accuracy, still timed against its own paired reference
    assert rows["inaccurate"]["status"] == "fail" and int(rows["inaccurate"]["failed_elements"]) > 0
    assert float(rows["inaccurate"]["optimized_median_ms"]) > 0 and float(rows["inaccurate"]["speedup"]) > 0
    assert rows["hangs"]["status"] == "fail" and rows["hangs"]["optimized_median_ms"] == ""
    md = (workdir / "results" / "report" / "report.md").read_text()
    table = [line for line in md.splitlines() if line.startswith("| tiny-cand |") or line.startswith("|  |")]
    assert md.count("(fastest passing)") == 1
    assert any("timeout [timing job, timing]: still running after the time limit of 15 s" in line for line in table)
    assert any("accuracy [accuracy job, compare]: " in line and "elements outside the official tolerance" in line
               for line in table)
    html = (workdir / "results" / "report" / "report.html").read_text()
    assert html.count("(fastest passing)") == 1 and 'class="candidates"' in html
    assert "Candidates (config `candidates`)" in md
    # the candidates' jobs are jobs of the run that made them, recorded as their job process's
    assert f"{len(CANDIDATES)} candidate-accuracy, {len(CANDIDATES)} candidate-profile" in md
    # accuracy's result is written by the job process (which holds the reference), profile's by its child
    results = workdir / "results" / "candidates" / "ref"
    process = json.loads((results / "accuracy" / "tiny-cand.json").read_text())["environment"]["job_process"]
    assert "child" not in process and process["started_as"] in ("fork of the job server", "fresh process")
    process = json.loads((results / "profile" / "tiny-cand" / "kernels.json").read_text())["environment"]["job_process"]
    assert process["child"]["started_as"] == "child process of the job process"
    assert process["started_as"] in ("fork of the job server", "fresh process")


def test_provenance_records_each_candidate_and_verify_passes(workdir):
    report = workdir / "results" / "report"
    prov = json.loads((report / "provenance.json").read_text())
    from shapewise import candidates

    recorded = {c["name"]: c for c in prov["candidates"]}
    assert set(recorded) == set(CANDIDATES)
    for name, path in CANDIDATES.items():
        assert recorded[name]["path"] == path
        assert recorded[name]["sha256"] == candidates.digest(path, workdir)
    assert sorted(recorded["pkg"]["files"]) == ["candidates/pkg/__init__.py", "candidates/pkg/model.py",
                                                "candidates/pkg/scale.py"]
    artifacts = {e["path"] for e in prov["artifacts"]}
    assert {"candidates/ref/reference.py", "data/candidates/ref/timing/tiny-cand.json",
            "data/candidates/hangs/accuracy/tiny-cand.json"} <= artifacts
    assert (report / "figures" / "speedup.png").stat().st_size > 1000
    done = shapewise(workdir, "verify", "results/report")
    assert done.returncode == 0, done.stdout + done.stderr


def test_compare_matches_rows_candidate_by_candidate(workdir):
    done = shapewise(workdir, "compare", "results/report", "results/report")
    assert done.returncode == 0, done.stdout + done.stderr
    for name in ("shapewise", *CANDIDATES):
        assert f"candidate {name}:" in done.stdout, done.stdout


def test_second_run_has_nothing_to_do(workdir):
    assert planned(workdir) == set()


def test_editing_one_candidate_reruns_only_its_jobs(workdir):
    for edited, path in (("inaccurate", workdir / "mine" / "inaccurate.py"),
                         ("pkg", workdir / "mine" / "package" / "scale.py")):
        original = path.read_text()
        try:
            path.write_text(original + "# an edit\n")
            jobs = planned(workdir)
        finally:
            path.write_text(original)
        assert jobs == {(step, edited) for step in STEPS} | {("report_inputs", None), ("report", None), ("all", None)}, jobs


def test_adding_a_candidate_runs_only_its_jobs(workdir):
    try:
        write_config(workdir, dict(CANDIDATES, harness="mine/harness_copy.py"))
        jobs = planned(workdir)
    finally:
        write_config(workdir, CANDIDATES)
    assert jobs == {(step, "harness") for step in STEPS} | {("report_inputs", None), ("report", None), ("all", None)}, jobs


def test_editing_shapewise_reruns_no_candidate(workdir):
    source = workdir / "kernels" / "attention.py"
    original = source.read_bytes()
    stat = source.stat()
    try:
        source.write_bytes(original + b"\n# an edit\n")
        jobs = planned(workdir)
    finally:
        source.write_bytes(original)
        import os

        os.utime(source, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert ("timing", None) in jobs and not any(rule in STEPS for rule, _ in jobs), jobs


def test_a_bad_candidate_entry_stops_before_any_job(workdir):
    done = snakemake(workdir, "-n", "--configfile", "candidates.yaml", "--config",
                     "candidates=shapewise=mine/reference.py", check=False)
    assert done.returncode != 0 and "a model every run measures" in done.stdout + done.stderr
    done = snakemake(workdir, "-n", "--configfile", "candidates.yaml", "--config", "candidates=x=mine/gone.py",
                     check=False)
    assert done.returncode != 0 and "x=mine/gone.py: no such file or directory" in done.stdout + done.stderr
