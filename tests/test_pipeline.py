"""The evidence pipeline end to end on the CPU, then its caching and provenance.

One copy of the repository's workflow files goes into a temporary directory;
a tiny manifest runs there for real (Triton kernels in the interpreter), and
the later tests use dry runs of that same directory to check what Snakemake
would rerun after an edit. Every edit is undone before the next test.
"""

from __future__ import annotations

import csv
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from checkout import copy_checkout

ROOT = Path(__file__).resolve().parent.parent
TINY = """\
- {id: tiny-triton, batch_size: 2, seq_len: 7, d_model: 32, num_heads: 2, ffn_dim: 64, num_layers: 1, trials: 2, route: triton}
- {id: tiny-holes, batch_size: 2, seq_len: 9, d_model: 32, num_heads: 2, ffn_dim: 32, num_layers: 1, causal: false, padding_ratio: 0.3, mask: holes, trials: 1}
"""
SHAPE_STEPS = {"preflight", "accuracy", "timing", "profile", "ablation"}

pytestmark = pytest.mark.slow


def snakemake(workdir, *args, check=True, env=None):
    env = dict(os.environ if env is None else env, SHAPEWISE_DEVICE="cpu")
    done = subprocess.run([sys.executable, "-m", "snakemake", "--cores", "2", *args], cwd=workdir, env=env,
                          capture_output=True, text=True, timeout=900)
    if check and done.returncode != 0:
        raise AssertionError(f"snakemake {' '.join(args)} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
    return done


def planned_jobs(workdir, *args, env=None):
    """{(rule, shape or None)} that a dry run would execute."""
    done = snakemake(workdir, "-n", *args, env=env)
    text = done.stdout + done.stderr
    jobs = set()
    for block in re.split(r"\n\s*\n", text):
        match = re.search(r"^(?:local)?rule (\w+):", block, re.M)
        if not match:
            continue
        shape = re.search(r"wildcards:.*?shape=([\w-]+)", block)
        jobs.add((match.group(1), shape.group(1) if shape else None))
    if not jobs:
        assert "Nothing to be done" in text, text
    return jobs


def shapewise(workdir, *args):
    return subprocess.run([sys.executable, "-m", "shapewise", *args], cwd=workdir,
                          capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    work = tmp_path_factory.mktemp("pipeline")
    copy_checkout(work)
    (work / "shapes" / "tiny.yaml").write_text(TINY)
    snakemake(work, "--config", "shapes=tiny")
    return work


def test_report_summary_and_provenance(workdir):
    report = workdir / "results" / "report"
    for name in ("report.md", "report.html", "summary.csv", "provenance.json"):
        assert (report / name).is_file(), name
    with open(report / "summary.csv") as fh:
        rows = list(csv.DictReader(fh))
    assert [r["id"] for r in rows] == ["tiny-triton", "tiny-holes"]
    assert list(rows[0]) == [  # shapewise.report.report_data.SUMMARY_COLUMNS, spelled out (candidate: shapewise's rows)
        "id", "candidate", "machine", "status", "call", "route", "failed_elements", "total_elements",
        "max_abs_error", "strict_failed_elements", "reference_median_ms", "reference_ci_low_ms",
        "reference_ci_high_ms", "optimized_median_ms", "optimized_ci_low_ms", "optimized_ci_high_ms", "speedup",
        "speedup_ci_low", "speedup_ci_high", "noisy", "target_ms", "target_met", "optimized_peak_memory_bytes",
        "io_bytes", "unmasked_median_ms", "mask_cost", "mask_cost_ci_low", "mask_cost_ci_high"]
    for r in rows:
        assert r["status"] == "pass" and r["candidate"] == "shapewise", r
        assert int(r["failed_elements"]) == 0 and int(r["total_elements"]) > 0
        assert float(r["reference_median_ms"]) > 0 and float(r["optimized_median_ms"]) > 0
    assert rows[0]["route"].startswith("triton")
    md = (report / "report.md").read_text()
    assert "CPU smoke run, not a performance measurement" in md
    assert "## Provenance" in md and "## Limitations" in md and "## Methods" in md
    for figure in ("speedup.png", "latency.png", "ablation.png"):
        assert (report / "figures" / figure).stat().st_size > 1000
    prov = json.loads((report / "provenance.json").read_text())
    listed = {e["path"] for e in prov["artifacts"]}
    assert {"summary.csv", "report.md", "data/accuracy/tiny-triton.json", "data/timing/tiny-holes.json"} <= listed
    assert "shapes/tiny.yaml" in {e["path"] for e in prov["inputs"]}
    assert "kernels/attention.py" in {e["path"] for e in prov["inputs"]}


def test_results_record_what_ran(workdir):
    acc = json.loads((workdir / "results/accuracy/tiny-holes.json").read_text())
    assert acc["trials"][0]["mask_kind"] == "general" and acc["environment"]["host"]
    assert set(acc["aggregate"]) == {"official", "strict"}
    prof = json.loads((workdir / "results/profile/tiny-triton/kernels.json").read_text())
    assert any(name.startswith("_attention_fwd") for name in prof["triton_kernels_ran"]), prof
    ablation = json.loads((workdir / "results/ablation/tiny-triton.json").read_text())
    from shapewise.model.optimized import OPTIMIZATIONS

    assert [v["variant"] for v in ablation["variants"]] == ["all-on", *OPTIMIZATIONS]
    timing = json.loads((workdir / "results/timing/tiny-triton.json").read_text())
    # every timed call of every round is kept, as the protocol the job recorded says
    rounds = len(timing["optimized"]["round_medians_ms"])
    assert rounds >= 1 and len(timing["optimized"]["times_ms"]) == rounds * timing["protocol"]["calls"], timing["protocol"]


def test_second_run_has_nothing_to_do(workdir):
    assert planned_jobs(workdir, "--config", "shapes=tiny") == set()


def test_a_copied_checkout_reruns_nothing(workdir, tmp_path_factory):
    """The cache is relocatable: no params value, input or shell command of a rule holds the checkout's path."""
    copy = tmp_path_factory.mktemp("moved") / "checkout"
    shutil.copytree(workdir, copy, symlinks=True)  # file times kept, as `cp -a` or a moved directory keeps them
    try:
        assert planned_jobs(copy, "--config", "shapes=tiny") == set()
    finally:
        shutil.rmtree(copy)


def test_shapewise_variables_of_the_shell_change_nothing_unless_passed(workdir):
    """SHAPEWISE_ROUTE left in the shell reaches no job (nothing reruns); named in pass_env, it is a
    params value of every measuring job, so they all rerun."""
    env = dict(os.environ, SHAPEWISE_ROUTE="reference", SHAPEWISE_DISABLE="fused_layer")
    assert planned_jobs(workdir, "--config", "shapes=tiny", env=env) == set()
    jobs = planned_jobs(workdir, "--config", "shapes=tiny", "pass_env=SHAPEWISE_ROUTE", env=env)
    for shape in ("tiny-triton", "tiny-holes"):
        assert {(step, shape) for step in SHAPE_STEPS} <= jobs, jobs
    assert ("microbench", None) in jobs and ("fingerprint", None) not in jobs, jobs


def test_editing_one_row_reruns_only_that_row(workdir):
    manifest = workdir / "shapes" / "tiny.yaml"
    original = manifest.read_text()
    try:
        manifest.write_text(original.replace("seq_len: 9,", "seq_len: 11,"))
        jobs = planned_jobs(workdir, "--config", "shapes=tiny")
    finally:
        manifest.write_text(original)
    assert {(step, "tiny-holes") for step in SHAPE_STEPS} <= jobs
    assert not any(shape == "tiny-triton" for _, shape in jobs), jobs
    assert ("report", None) in jobs
    assert not any(rule in ("fingerprint", "microbench") for rule, _ in jobs), jobs


def test_changing_a_kernel_reruns_every_measurement(workdir):
    source = workdir / "kernels" / "attention.py"
    original = source.read_bytes()
    stat = source.stat()
    try:
        source.write_bytes(original + b"\n# an edit\n")
        jobs = planned_jobs(workdir, "--config", "shapes=tiny")
    finally:
        source.write_bytes(original)
        os.utime(source, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    for shape in ("tiny-triton", "tiny-holes"):
        for step in ("accuracy", "timing", "profile", "ablation"):
            assert (step, shape) in jobs, (step, shape, jobs)
    assert ("fingerprint", None) in jobs


def test_touching_a_kernel_without_change_reruns_nothing(workdir):
    (workdir / "kernels" / "attention.py").touch()
    assert planned_jobs(workdir, "--config", "shapes=tiny") == set()


def test_verify_passes_then_names_tampered_and_deleted_files(workdir):
    assert shapewise(workdir, "verify", "results/report").returncode == 0
    copy = workdir / "reports" / "copy"
    shutil.copytree(workdir / "results" / "report", copy)
    try:
        done = shapewise(workdir, "verify", "reports/copy")
        assert done.returncode == 0 and "OK" in done.stdout, done.stdout + done.stderr

        target = copy / "data" / "accuracy" / "tiny-triton.json"
        data = bytearray(target.read_bytes())
        data[10] ^= 0x01
        target.write_bytes(bytes(data))
        done = shapewise(workdir, "verify", "reports/copy")
        assert done.returncode != 0
        assert "data/accuracy/tiny-triton.json" in done.stdout and "mismatch" in done.stdout

        shutil.copyfile(workdir / "results/report/data/accuracy/tiny-triton.json", target)
        (copy / "summary.csv").unlink()
        done = shapewise(workdir, "verify", "reports/copy")
        assert done.returncode != 0
        assert "missing" in done.stdout and "summary.csv" in done.stdout

        shutil.copyfile(workdir / "results/report/summary.csv", copy / "summary.csv")
        assert shapewise(workdir, "verify", "reports/copy").returncode == 0
    finally:
        shutil.rmtree(copy)


def job_priorities(workdir, *args):
    """{(rule, shape): priority} of every job of a forced dry run."""
    text = snakemake(workdir, "-n", "--forceall", *args).stdout
    found = {}
    for block in re.split(r"\n\s*\n", text):
        rule, shape = re.search(r"^(?:local)?rule (\w+):", block, re.M), re.search(r"shape=([\w-]+)", block)
        priority = re.search(r"priority: ([-\d.]+)", block)
        if rule and shape and priority:
            found[(rule.group(1), shape.group(1))] = float(priority.group(1))
    return found


@pytest.mark.parametrize("shared_first", [False, True])
def test_heavy_shared_first_starts_a_heavy_rows_shared_jobs_first_in_their_step(workdir, tmp_path, shared_first):
    # tiny-holes (0.000242 GFLOP) is heavy at this threshold, tiny-triton (0.000236) is not
    extra = tmp_path / "heavy.yaml"
    extra.write_text(f"heavy: {{min_gflop: 0.00024, shared_first: {str(shared_first).lower()}}}\n")
    p = job_priorities(workdir, "--configfile", str(extra), "--config", "shapes=tiny")
    for step in ("preflight", "accuracy", "profile"):
        assert (p[(step, "tiny-holes")] > p[(step, "tiny-triton")]) == shared_first, step
    # the warm-ups, which compile side by side, start with the costliest row either way
    assert p[("warmup", "tiny-holes")] > p[("warmup", "tiny-triton")]
    for step in ("timing", "ablation"):  # the jobs that time keep the cheapest row first either way
        assert p[(step, "tiny-triton")] > p[(step, "tiny-holes")], step
    # the steps keep their order: every shared job before every job that times
    assert min(v for (rule, _), v in p.items() if rule in ("accuracy", "profile")) > max(
        v for (rule, _), v in p.items() if rule in ("timing", "ablation"))


def test_a_candidates_jobs_keep_the_step_order(workdir, tmp_path):
    # a candidate that compiles on its first call does it in its accuracy job, before any job that times
    (tmp_path / "mine.py").write_text("from shapewise.model import BaselineTransformer as UserOptimizedTransformer\n")
    p = job_priorities(workdir, "--config", "shapes=tiny", f"candidates=mine={tmp_path / 'mine.py'}")
    shared = [v for (rule, _), v in p.items() if rule in ("accuracy", "profile", "candidate_accuracy",
                                                            "candidate_profile")]
    timed = [v for (rule, _), v in p.items() if rule in ("timing", "ablation", "candidate_timing")]
    assert any(rule == "candidate_accuracy" for rule, _ in p) and any(rule == "candidate_timing" for rule, _ in p)
    assert min(shared) > max(timed)


def test_bad_manifest_stops_before_any_job(workdir):
    (workdir / "shapes" / "bad.yaml").write_text(
        "- {id: bad-row, batch_size: 2, seq_len: 8, d_model: 30, num_heads: 4, ffn_dim: 8, num_layers: 1}\n"
        "- {id: bad-route, batch_size: 2, seq_len: 8, d_model: 32, num_heads: 4, ffn_dim: 8, num_layers: 1, "
        "route: fuzed}\n"
        "- {id: bad-numbers, batch_size: 2.0, seq_len: 8, d_model: 32, num_heads: 4, ffn_dim: 8, num_layers: 1, "
        "input_scale: .nan}\n")
    done = snakemake(workdir, "-n", "--config", "shapes=bad", check=False)
    text = done.stdout + done.stderr
    assert done.returncode != 0
    for row, field in (("bad-row", "d_model"), ("bad-route", "route"), ("bad-numbers", "batch_size"),
                       ("bad-numbers", "input_scale")):
        assert f"shapes/bad.yaml: row '{row}': field {field}:" in text, (row, field, text)
    assert "rule preflight" not in text
    assert not (workdir / "results" / "preflight" / "bad-row.json").exists()


def test_forced_route_that_cannot_serve_fails_the_job_only(workdir):
    (workdir / "shapes" / "broken.yaml").write_text(
        "- {id: broken-graph, batch_size: 1, seq_len: 4, d_model: 16, num_heads: 2, ffn_dim: 16, num_layers: 1, "
        "route: graph, trials: 1}\n")
    done = snakemake(workdir, "results/accuracy/broken-graph.json", "--config", "shapes=broken", check=False)
    assert done.returncode != 0
    # the row's first job (its preflight plans the forced route's memory) fails, naming the row and why
    log = (workdir / "results" / "logs" / "preflight" / "broken-graph.log").read_text()
    assert "shape broken-graph" in log and "'graph'" in log and "CUDA" in log, log
    assert not (workdir / "results" / "accuracy" / "broken-graph.json").exists()
    # what was computed before is still there
    assert (workdir / "results" / "accuracy" / "tiny-triton.json").is_file()


def test_results_from_different_gpus_are_reported_apart(workdir):
    """Two rows measured on different device models: two groups, two geomeans, a banner."""
    from shapewise.provenance import provenance

    timing = workdir / "results" / "timing" / "tiny-holes.json"
    original = timing.read_bytes()
    stat = timing.stat()
    data = json.loads(original)
    data["environment"]["gpu_name"] = "Another GPU model"
    data["environment"]["machine_key"] = "Another GPU model | software 000000000000"
    timing.write_text(json.dumps(provenance.seal(data)))  # sealed as a job of that machine would have written it
    try:
        # what the report rule handed the plain run's report: its rows are the manifest's as they are now
        # (other tests' runs, dry ones included, wrote other inputs files: a baseline, passed variables, candidates)
        from shapewise.inputs.manifest import load_manifest, row_json

        rows = [row_json(r) for r in load_manifest(workdir / "shapes" / "tiny.yaml")]
        (inputs,) = {json.dumps(d["rows"], sort_keys=True): p
                     for p in sorted((workdir / "results" / "report-inputs").glob("*.json"), key=os.path.getmtime)
                     for d in [json.loads(p.read_text())]
                     if [row_json(r["row"]) for r in d["rows"]] == rows and not d["pass_env"]
                     and not d["baseline"] and not d["candidates"]}.values()
        done = subprocess.run([sys.executable, "-m", "shapewise.report.report", "--inputs", str(inputs), "--outdir",
                               "results/report-mixed"], cwd=workdir, capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 0, done.stdout + done.stderr
        md = (workdir / "results" / "report-mixed" / "report.md").read_text()
    finally:
        timing.write_bytes(original)
        os.utime(timing, ns=(stat.st_atime_ns, stat.st_mtime_ns))
        shutil.rmtree(workdir / "results" / "report-mixed", ignore_errors=True)
    assert "These results come from 2 different machines" in md
    assert "## Machine M1:" in md and "## Machine M2: Another GPU model" in md
    assert md.count("geomean speedup") == 2
