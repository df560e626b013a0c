"""The pipeline's config and the environment of its jobs.

- config/config.yaml against its schema; an unknown top-level key (a --config typo) stops Snakemake before
  any job, naming the key (a dry run, no job runs);
- one definition of a heavy row (config heavy.min_gflop) and its resources (heavy.resources);
- SHAPEWISE_* variables of the user's shell are removed inside a job unless config pass_env names them, and
  what a job kept is recorded in its result.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import yaml
from checkout import copy_checkout
from shapewise.cli import job_environment_variables
from shapewise.inputs.paths import CONFIG_SCHEMA

ROOT = Path(__file__).resolve().parent.parent


def config():
    return yaml.safe_load((ROOT / "config" / "config.yaml").read_text())


def schema():
    return yaml.safe_load(CONFIG_SCHEMA.read_text())


def test_shipped_config_is_valid():
    jsonschema.validate(config(), schema())


def test_the_candidates_configfile_merged_over_the_config_is_valid_and_names_the_shipped_candidates():
    from snakemake.utils import update_config  # how Snakemake merges a --configfile over the Snakefile's

    merged = config()
    update_config(merged, yaml.safe_load((ROOT / "config" / "candidates.yaml").read_text()))
    jsonschema.validate(merged, schema())
    assert merged["heavy"]["min_gflop"] == config()["heavy"]["min_gflop"]  # merged, not replaced
    assert sorted(merged["candidates"].values()) == sorted(
        str(p.relative_to(ROOT)) for p in (ROOT / "candidates").glob("*.py")
    )


@pytest.mark.parametrize("extra", [{"devcie": "cpu"}, {"shape": "smoke"}])
def test_schema_rejects_an_unknown_key(extra):
    with pytest.raises(jsonschema.ValidationError, match=next(iter(extra))):
        jsonschema.validate(dict(config(), **extra), schema())


@pytest.mark.parametrize("value,ok", [
    ([], True), (["SHAPEWISE_ROUTE", "SHAPEWISE_DISABLE"], True), ("SHAPEWISE_ROUTE,SHAPEWISE_DISABLE", True),
    (["HOME"], False), (["SHAPEWISE_PIPELINE_GPUS"], False), ("SHAPEWISE_ROUTE,SHAPEWISE_PIPELINE_GPUS", False),
    ("shapewise_route", False), (["SHAPEWISE_ROUTE", "SHAPEWISE_ROUTE"], False)])
def test_pass_env_names(value, ok):
    cfg = dict(config(), pass_env=value)
    if ok:
        jsonschema.validate(cfg, schema())
    else:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(cfg, schema())


def test_other_helpers_keys_have_defaults():
    props = schema()["properties"]
    assert props["baseline"]["default"] is None and props["pass_env"]["default"] == []
    jsonschema.validate(dict(config(), baseline="reports/h200"), schema())


@pytest.mark.parametrize("budget,ok", [(3, True), (0.5, True), (None, True), (0, False), (-2, False),
                                       ("3", False), (True, False)])
def test_the_stable_protocols_time_budget_is_a_positive_number_or_null(budget, ok):
    """timing.stable.max_seconds (absent or null: no time bound); an error names the field. The shipped GPU protocol
    sets one, the CPU smoke protocol none."""
    cfg = config()
    assert cfg["timing"]["stable"]["max_seconds"] > 0 and "max_seconds" not in cfg["timing"]["cpu"]
    cfg["timing"]["stable"]["max_seconds"] = budget
    if ok:
        jsonschema.validate(cfg, schema())
    else:
        with pytest.raises(jsonschema.ValidationError) as caught:
            jsonschema.validate(cfg, schema())
        assert list(caught.value.absolute_path) == ["timing", "stable", "max_seconds"], caught.value


@pytest.mark.parametrize("field,value,ok", [
    ("round_seconds", 0.5, True), ("round_seconds", 2, True), ("round_seconds", None, True),
    ("round_seconds", 0, False), ("round_seconds", -0.5, False), ("round_seconds", "0.5", False),
    ("round_seconds", True, False), ("min_calls", 1, True), ("min_calls", 10, True), ("min_calls", None, True),
    ("min_calls", 0, False), ("min_calls", -2, False), ("min_calls", 2.5, False), ("min_calls", True, False),
    ("min_calls", "10", False)])
def test_the_stable_protocols_round_bound_is_a_positive_number_or_null(field, value, ok):
    """timing.stable.round_seconds (absent or null: `calls` every round) and min_calls (absent or null:
    shapewise.jobs.timing.MIN_ROUND_CALLS); an error names the field. The shipped GPU protocol bounds its rounds'
    calls, the CPU smoke protocol does not."""
    cfg = config()
    assert cfg["timing"]["stable"]["round_seconds"] > 0 and "round_seconds" not in cfg["timing"]["cpu"]
    cfg["timing"]["stable"][field] = value
    if ok:
        jsonschema.validate(cfg, schema())
    else:
        with pytest.raises(jsonschema.ValidationError) as caught:
            jsonschema.validate(cfg, schema())
        assert list(caught.value.absolute_path) == ["timing", "stable", field], caught.value


def test_one_definition_of_a_heavy_row():
    """Heavy rows (by GFLOP) take heavy.resources; there is no second, token-count based `large` entry."""
    cfg = config()
    assert set(cfg["resources"]) == {"default"}
    assert set(cfg["heavy"]["resources"]) == {"mem_mb", "runtime", "threads"}
    with pytest.raises(jsonschema.ValidationError, match="large"):
        jsonschema.validate(dict(cfg, resources=dict(cfg["resources"], large=cfg["resources"]["default"])),
                            schema())


def test_the_schema_owns_the_device_choices():
    """config `device`, SHAPEWISE_DEVICE (common.smk) and a job's --device (shapewise.cli) take the schema's enum."""
    import argparse

    from shapewise.cli import build_parser
    from shapewise.inputs import settings

    assert settings.devices() == tuple(schema()["properties"]["device"]["enum"]) == ("auto", "cuda", "cpu")
    job = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices["job"]
    steps = next(a for a in job._actions if isinstance(a, argparse._SubParsersAction)).choices
    for name, step in steps.items():
        device = next(a for a in step._actions if a.dest == "device")
        assert tuple(device.choices) == settings.devices(), name


def test_pass_env_keeps_the_named_variables_that_are_set():
    """One reading of config pass_env (a list, or --config's comma-separated string) for the jobs and the report."""
    from shapewise.inputs.settings import pass_env

    environ = {"SHAPEWISE_ROUTE": "reference", "SHAPEWISE_DISABLE": "a=b", "SHAPEWISE_OTHER": "x"}
    assert pass_env(["SHAPEWISE_DISABLE", "SHAPEWISE_ROUTE"], environ) == {"SHAPEWISE_DISABLE": "a=b",
                                                                           "SHAPEWISE_ROUTE": "reference"}
    assert list(pass_env("SHAPEWISE_ROUTE,SHAPEWISE_UNSET", environ)) == ["SHAPEWISE_ROUTE"]
    assert pass_env([], environ) == {}


# --- Snakemake at parse time (dry runs: no job runs) ---------------------------------------------------------

@pytest.fixture(scope="module")
def checkout(tmp_path_factory):
    work = tmp_path_factory.mktemp("checkout")
    copy_checkout(work)
    (work / "shapes" / "cfg.yaml").write_text(
        # heavy: ~4.7e14 FLOP (official row 14's shape); many tokens but few GFLOP: not heavy
        "- {id: cfg-heavy, batch_size: 32, seq_len: 100000, d_model: 1024, num_heads: 16, ffn_dim: 4096, "
        "num_layers: 2}\n"
        "- {id: cfg-many-tokens, batch_size: 1000, seq_len: 1000, d_model: 8, num_heads: 1, ffn_dim: 8, "
        "num_layers: 1}\n")
    return work


def dry_run(workdir, *args, env=None):
    env = dict(os.environ if env is None else env, SHAPEWISE_DEVICE="cpu")
    done = subprocess.run([sys.executable, "-m", "snakemake", "-n", "--cores", "2", "-p", *args], cwd=workdir,
                          env=env, capture_output=True, text=True, timeout=300)
    return done.returncode, done.stdout + done.stderr


def job_blocks(text, rule):
    return [b for b in text.split("\n\n") if f"rule {rule}:" in b]


def test_unknown_config_key_stops_before_any_job(checkout):
    rc, text = dry_run(checkout, "--config", "devcie=cpu")
    assert rc != 0
    assert "unknown config key 'devcie'" in text and "did you mean 'device'" in text, text
    assert "rule " not in text  # no job was planned
    assert not (checkout / "results").exists()


def test_heavy_rows_get_heavy_resources(checkout):
    rc, text = dry_run(checkout, "--config", "shapes=cfg")
    assert rc == 0, text
    heavy, default = config()["heavy"]["resources"], config()["resources"]["default"]
    timing = {b.split("shape=")[1].split()[0].strip(","): b for b in job_blocks(text, "timing")}
    assert f"mem_mb={heavy['mem_mb']}" in timing["cfg-heavy"], timing["cfg-heavy"]
    assert f"mem_mb={default['mem_mb']}" in timing["cfg-many-tokens"], timing["cfg-many-tokens"]


def test_pass_env_reaches_the_job_commands(checkout):
    env = dict(os.environ, SHAPEWISE_ROUTE="reference", SHAPEWISE_DISABLE="fused_layer")
    rc, text = dry_run(checkout, "--config", "shapes=smoke", env=env)
    assert rc == 0, text
    assert "SHAPEWISE_ROUTE" not in text and "--env " not in text
    rc, text = dry_run(checkout, "--config", "shapes=smoke", "pass_env=SHAPEWISE_ROUTE", env=env)
    assert rc == 0, text
    for rule in ("preflight", "accuracy", "timing", "profile", "ablation", "microbench"):
        blocks = job_blocks(text, rule)
        assert blocks and all("--env SHAPEWISE_ROUTE=reference" in b for b in blocks), rule
        assert all("SHAPEWISE_DISABLE" not in b for b in blocks), rule
    for rule in ("preflight", "accuracy", "timing", "profile", "ablation", "microbench"):
        assert all("--impl-digest " in b and "--env-digest " in b for b in job_blocks(text, rule)), rule


# --- the job process: SHAPEWISE_* of the shell removed, pass_env kept ------------------------------------------

def test_job_removes_shell_variables(monkeypatch):
    monkeypatch.setenv("SHAPEWISE_ROUTE", "reference")
    monkeypatch.setenv("SHAPEWISE_DISABLE", "fused_layer")
    monkeypatch.setenv("SHAPEWISE_PIPELINE_GPUS", "0,1")
    monkeypatch.setenv("SHAPEWISE_PIPELINE_GPU_SLOT", "1")
    monkeypatch.setenv("NOT_SHAPEWISE_ROUTE", "kept")
    job_environment_variables(["SHAPEWISE_DISABLE=cuda_graph"])
    assert "SHAPEWISE_ROUTE" not in os.environ
    assert os.environ["SHAPEWISE_DISABLE"] == "cuda_graph"  # the passed value, not the shell's
    assert os.environ["SHAPEWISE_PIPELINE_GPUS"] == "0,1" and os.environ["SHAPEWISE_PIPELINE_GPU_SLOT"] == "1"
    assert os.environ["NOT_SHAPEWISE_ROUTE"] == "kept"


def test_passed_value_may_be_empty_or_hold_equals(monkeypatch):
    monkeypatch.delenv("SHAPEWISE_ROUTE", raising=False)
    job_environment_variables(["SHAPEWISE_ROUTE=", "SHAPEWISE_X=a=b"])
    assert os.environ["SHAPEWISE_ROUTE"] == "" and os.environ["SHAPEWISE_X"] == "a=b"
    monkeypatch.delenv("SHAPEWISE_X")


@pytest.mark.parametrize("item", ["SHAPEWISE_ROUTE", "HOME=/tmp", "SHAPEWISE_PIPELINE_GPUS=0"])
def test_bad_env_option(item):
    with pytest.raises(SystemExit, match="--env"):
        job_environment_variables([item])


def test_job_result_records_the_variables_it_kept(tmp_path):
    """A real job process (the environment fingerprint, CPU): the shell's SHAPEWISE_ROUTE is gone, the
    passed SHAPEWISE_DISABLE and the pipeline's own variables are in the result."""
    out = tmp_path / "environment.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT / "workflow"), SHAPEWISE_ROUTE="reference",
               SHAPEWISE_DISABLE="from-the-shell", SHAPEWISE_PIPELINE_GPUS="")
    done = subprocess.run([sys.executable, "-m", "shapewise", "job", "fingerprint", "--kind", "environment",
                           "--device", "cpu", "--dag-digest", "x", "--root", str(ROOT), "--out", str(out),
                           "--env", "SHAPEWISE_DISABLE=cuda_graph"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    recorded = json.loads(out.read_text())["environment"]["shapewise_variables"]
    assert "SHAPEWISE_ROUTE" not in recorded
    assert recorded["SHAPEWISE_DISABLE"] == "cuda_graph"
    assert recorded["SHAPEWISE_PIPELINE_GPUS"] == ""
