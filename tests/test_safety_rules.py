"""Bad input the pipeline's rules and Snakefile catch while Snakemake builds the DAG, before any job runs: an empty
config value, text where a number belongs (a nested `--config` mapping), a baseline that is no report, a trial count
beyond its bound, a damaged preflight result (the good results of its row are kept), results of another device
(rerun, not reused), and the manifest's bytes handed to the report (a manifest edited during the run is refused)."""

import hashlib
import json
import re
import subprocess
import sys

import pytest

from checkout import copy_checkout
from test_config import dry_run, job_blocks

ROW = "- {id: guard, batch_size: 1, seq_len: 4, d_model: 16, num_heads: 1, ffn_dim: 16, num_layers: 1}\n"


@pytest.fixture()
def checkout(tmp_path):
    work = copy_checkout(tmp_path)
    (work / "shapes" / "guard.yaml").write_text(ROW)
    return work


def test_empty_value_names_the_key(checkout):
    rc, text = dry_run(checkout, "--config", "shapes=")
    assert rc != 0
    assert "config shapes is empty" in text and "rule " not in text, text


@pytest.mark.parametrize("value,key", [("preflight={headroom: 2}", "preflight.headroom"),
                                       ("timing={official: {warmup: 20}}", "timing.official.warmup")])
def test_text_inside_a_config_mapping_says_why(checkout, value, key):
    rc, text = dry_run(checkout, "--config", "shapes=guard", value)
    assert rc != 0
    assert f"config {key}:" in text and "--configfile" in text and "rule " not in text, text


def test_baseline_that_is_no_report_is_named(checkout, tmp_path):
    rc, text = dry_run(checkout, "--config", "shapes=guard", f"baseline={tmp_path}")
    assert rc != 0
    assert f"config baseline={tmp_path}: not a report directory" in text, text


def test_trials_beyond_the_bound(checkout):
    (checkout / "shapes" / "guard.yaml").write_text(ROW.replace("}", ", trials: 1001}"))
    rc, text = dry_run(checkout, "--config", "shapes=guard")
    assert rc != 0
    assert "field trials: 1001 is greater than the maximum of 1000" in text, text


def test_damaged_preflight_stops_before_any_output_is_removed(checkout):
    results = checkout / "results"
    (results / "preflight").mkdir(parents=True)
    (results / "accuracy").mkdir(parents=True)
    (results / "preflight" / "guard.json").write_text('{"truncated": ')
    kept = results / "accuracy" / "guard.json"
    kept.write_text(json.dumps({"status": "pass"}))
    rc, text = dry_run(checkout, "--config", "shapes=guard")
    assert rc != 0
    assert "results/preflight/guard.json is not valid JSON" in text and "rm results/preflight/guard.json" in text, text
    assert kept.read_text() == json.dumps({"status": "pass"})


def test_device_is_a_rerun_trigger_and_reaches_the_report(checkout):
    rc, text = dry_run(checkout, "--config", "shapes=guard", "device=cpu")
    assert rc == 0, text
    for rule in ("preflight", "accuracy", "timing", "profile", "ablation", "microbench"):
        (block,) = job_blocks(text, rule)
        assert "--device cpu" in block, block
    # nothing is written while Snakemake builds the DAG: neither the report's inputs nor the run's marker
    assert not (checkout / "results").exists()
    assert not list((checkout / ".snakemake").glob("shapewise-*"))
    (inputs,) = re.findall(r"--inputs (results/report-inputs/\w+\.json)", text)
    done = subprocess.run([sys.executable, "-m", "snakemake", "--cores", "1", "report_inputs", "--config",
                           "shapes=guard", "device=cpu"], cwd=checkout, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    data = json.loads((checkout / inputs).read_text())
    assert data["device"] == "cpu"
    assert data["manifest_sha256"] == {"shapes/guard.yaml": hashlib.sha256(ROW.encode()).hexdigest()}
