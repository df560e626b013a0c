"""Candidates (config `candidates`): their names and paths, digests, loading, isolation, and their jobs on the CPU
with a small candidate file for every way a candidate can fail a row (tests/candidates/)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from shapewise import candidates
from shapewise.inputs import paths
from shapewise.inputs.manifest import normalize_row, row_json

ROOT = Path(__file__).resolve().parent.parent
CASES = Path(__file__).resolve().parent / "candidates"
ROW = normalize_row({"id": "cand-row", "batch_size": 2, "seq_len": 7, "d_model": 32, "num_heads": 2,
                     "ffn_dim": 64, "num_layers": 1, "trials": 2})
ONE_TRIAL = normalize_row({"id": "cand-one", "batch_size": 2, "seq_len": 9, "d_model": 32, "num_heads": 2,
                           "ffn_dim": 32, "num_layers": 1, "causal": False, "padding_ratio": 0.3, "mask": "holes",
                           "trials": 1})


# ------------------------------------------------------------------ names, paths, digests


def test_config_takes_a_mapping_or_the_command_lines_string():
    assert candidates.parse(None) == {} and candidates.parse({}) == {} and candidates.parse("") == {}
    as_string = candidates.parse(f"ref={CASES / 'reference.py'},pkg={CASES / 'package'}")
    assert as_string == {"ref": str(CASES / "reference.py"), "pkg": str(CASES / "package")}
    assert candidates.parse({"ref": "tests/candidates/reference.py"}, root=ROOT) == \
        {"ref": "tests/candidates/reference.py"}


@pytest.mark.parametrize("value, says", [
    ("ref", "is not NAME=PATH"),
    ("a=tests/candidates/reference.py,a=tests/candidates/raises.py", "named twice"),
    ({"bad name": "tests/candidates/reference.py"}, "does not match"),
    ({"-x": "tests/candidates/reference.py"}, "does not match"),
    ({"shapewise": "tests/candidates/reference.py"}, "a model every run measures"),
    ({"reference": "tests/candidates/reference.py"}, "a model every run measures"),
    ({"gone": "tests/candidates/no_such_file.py"}, "no such file or directory"),
    ({"dir": "tests"}, "a directory without __init__.py"),
    ({"yaml": "config/config.yaml"}, "not a .py file"),
    (["ref"], "expected a mapping"),
])
def test_a_bad_entry_is_named(value, says):
    with pytest.raises(candidates.CandidateError, match=says):
        candidates.parse(value, root=ROOT)


def test_names_follow_the_row_id_pattern_of_the_shapes_schema_and_the_config_schema_says_the_same():
    schema = yaml.safe_load(paths.CONFIG_SCHEMA.read_text())
    mapping, string, _ = schema["properties"]["candidates"]["oneOf"]
    assert mapping["propertyNames"]["pattern"] == candidates.name_pattern()
    assert string["pattern"].count(candidates.name_body() + "=") == 2  # the first entry, then each next
    assert sorted(mapping["propertyNames"]["not"]["enum"]) == sorted(candidates.RESERVED)


def test_a_files_digest_is_its_sha256_and_a_packages_covers_every_file_but_bytecode(tmp_path):
    single = CASES / "reference.py"
    assert candidates.digest(single) == hashlib.sha256(single.read_bytes()).hexdigest()
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("from .impl import UserOptimizedTransformer\n")
    (package / "impl.py").write_text("UserOptimizedTransformer = None\n")
    first = candidates.digest(package)
    assert set(candidates.files(package)) == {"__init__.py", "impl.py"}
    (package / "__pycache__").mkdir()
    (package / "__pycache__" / "impl.cpython-311.pyc").write_bytes(b"\0")
    assert candidates.digest(package) == first
    (package / "tables.json").write_text("{}")  # a data file is part of the candidate too
    second = candidates.digest(package)
    assert second != first
    (package / "impl.py").write_text("UserOptimizedTransformer = None  # edited\n")
    assert candidates.digest(package) not in (first, second)


def test_reference_files_are_the_baselines_modules_and_not_the_optimized_models():
    names = {p.name for p in candidates.reference_files(ROOT)}
    assert {"__init__.py", "reference.py", "config.py", "cases.py", "chunked.py", "memory.py", "tolerance.py"} <= names
    assert not names & {"optimized.py", "routing.py", "weights.py", "routing_policy.json"}, names
    assert all(p.parent == ROOT / "model" for p in candidates.reference_files(ROOT))


# ------------------------------------------------------------------ loading


def test_a_harness_copy_loads_as_it_is_without_running_its_main():
    cls = candidates.load_class(CASES / "harness_copy.py", "harness")
    assert cls.__name__ == "UserOptimizedTransformer"
    module = sys.modules[cls.__module__]
    assert module.__name__ == "shapewise_candidate_harness" and hasattr(module, "main")


def test_a_package_directory_loads_with_its_relative_imports():
    cls = candidates.load_class(CASES / "package", "pkg")
    assert cls.__module__ == "shapewise_candidate_pkg.model"
    assert not (CASES / "package" / "__pycache__").exists()


def test_a_file_without_the_class_is_an_import_failure():
    with pytest.raises(ImportError, match="defines no class UserOptimizedTransformer"):
        candidates.load_class(CASES / "no_class.py", "noclass")


def test_failed_allocations_are_out_of_memory():
    assert candidates.classify(MemoryError(), "forward") == "out-of-memory"
    assert candidates.classify(RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried"), "forward") \
        == "out-of-memory"
    assert candidates.classify(RuntimeError("CUDA error: an illegal memory access"), "forward") == "raises"
    assert candidates.classify(ModuleNotFoundError("x"), "import") == "import"


def test_the_reference_running_out_of_memory_beside_the_candidate_is_the_candidates_failure():
    from shapewise.jobs.candidate import CandidateFailed, beside

    def allocate():
        raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")

    with pytest.raises(CandidateFailed) as failed:
        beside("compare (trial 0)", allocate)
    assert failed.value.kind == "out-of-memory" and "the reference ran out of memory" in failed.value.message
    with pytest.raises(ValueError):  # any other error is the harness's own
        beside("compare (trial 0)", lambda: int("x"))


# ------------------------------------------------------------------ isolation


def test_a_child_past_its_time_limit_is_killed_with_its_whole_process_group(tmp_path):
    marker = tmp_path / "grandchild.pid"
    script = ("import subprocess, sys, time; "
              f"p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); "
              f"open({str(marker)!r}, 'w').write(str(p.pid)); time.sleep(600)")
    t0 = time.monotonic()
    outcome = candidates.run_isolated([sys.executable, "-c", script], 3, log=lambda line: None)
    assert outcome["timed_out"] and outcome["signal"] == "SIGKILL" and time.monotonic() - t0 < 30
    grandchild = int(marker.read_text())
    for _ in range(50):
        if not Path(f"/proc/{grandchild}").exists() or "Z" in Path(f"/proc/{grandchild}/stat").read_text().split()[2]:
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"the grandchild {grandchild} outlived the time limit")


def test_a_child_that_ends_reports_its_code_or_signal_and_reads_its_input():
    done = candidates.run_isolated([sys.executable, "-c", "import sys; sys.exit(len(sys.stdin.read()))"], 30,
                                   stdin_text="abc")
    assert done == dict(done, returncode=3, signal=None, timed_out=False)
    killed = candidates.run_isolated([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), "
                                      "signal.SIGSEGV)"], 30)
    assert killed["signal"] == "SIGSEGV" and not killed["timed_out"]


# ------------------------------------------------------------------ the jobs, one candidate file per case


def run_job(tmp_path, step, path, row=ROW, limit=60, name="cand"):
    """`shapewise job candidate-<step>` as Snakemake runs it; returns the result JSON."""
    out = tmp_path / f"{step}-{name}.json"
    args = ["job", f"candidate-{step}", "--device", "cpu", "--row", row_json(row), "--candidate", name,
            "--candidate-path", str(path), "--time-limit", json.dumps({"cpu": limit, "cuda": limit}),
            "--impl-digest", candidates.digest(path), "--out", str(out)]
    if step == "accuracy":
        args += ["--headroom", "0.85", "--chunked",
                 json.dumps({"batch_samples": 2, "query_block": 1024, "query_samples": "all"})]
    elif step == "timing":
        args += ["--headroom", "0.85", "--protocol", json.dumps({
            "cpu": {"warmup": 1, "calls": 3, "min_rounds": 3, "max_rounds": 3, "ci_half_width": 0.05,
                    "gc_off": True, "cpus": "inherit"}, "cuda": "stable"})]
    else:
        args += ["--capture", json.dumps({"cpu": {"warmup": 1, "calls": 1}, "cuda": {"warmup": 1, "calls": 1}}),
                 "--csv", str(tmp_path / "kernels.csv"), "--trace", str(tmp_path / "trace.json")]
    env = dict(os.environ, PYTHONPATH=str(ROOT / "workflow"), TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, "-m", "shapewise", *args], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert not Path(f"{out}.progress").exists()
    result = json.loads(out.read_text())
    assert result["identity"]["implementation_digest"] == candidates.digest(path)
    assert result["candidate"]["sha256"] == candidates.digest(path) and result["candidate"]["name"] == name
    return result


@pytest.mark.slow
@pytest.mark.parametrize("case, layout", [("reference.py", "file"), ("harness_copy.py", "file"),
                                          ("package", "package")])
def test_a_correct_candidate_passes_with_the_references_weights_loaded_strictly(tmp_path, case, layout):
    acc = run_job(tmp_path, "accuracy", CASES / case)
    assert acc["status"] == "pass" and acc["failure"] is None, acc
    assert acc["weights"] == {"strict": True, "missing_keys": [], "unexpected_keys": [], "strict_error": None}
    assert acc["candidate"]["layout"] == layout and acc["check_method"] == "full"
    assert acc["aggregate"]["official"]["total_elements"] == 2 * 2 * 7 * 32
    if case == "reference.py":  # the reference itself: the very same numbers
        assert acc["aggregate"]["official"]["max_abs_error"] == 0.0
    if case == "package":
        assert set(acc["candidate"]["files"]) == {"__init__.py", "model.py", "scale.py"}


@pytest.mark.slow
def test_extra_parameters_load_non_strictly_with_the_missing_keys_recorded(tmp_path):
    acc = run_job(tmp_path, "accuracy", CASES / "extra_parameter.py")
    assert acc["status"] == "pass"
    weights = acc["weights"]
    assert not weights["strict"] and weights["missing_keys"] == ["output_gain"] and weights["unexpected_keys"] == []
    assert "output_gain" in weights["strict_error"]


@pytest.mark.slow
@pytest.mark.parametrize("case, kind, stage, says", [
    ("import_error.py", "import", "import", "No module named 'shapewise_no_such_module'"),
    ("no_class.py", "import", "import", "defines no class UserOptimizedTransformer"),
    ("raises.py", "raises", "forward (trial 0)", "RuntimeError: kernel launch failed"),
    ("out_of_memory.py", "out-of-memory", "forward (trial 0)", "can't allocate memory"),
    ("wrong_shape.py", "wrong-output", "forward (trial 0)", "shape (2, 6, 32) (expected (2, 7, 32))"),
    ("wrong_dtype.py", "wrong-output", "forward (trial 0)", "dtype torch.float64 (expected torch.float32)"),
    ("aliases.py", "aliased-output", "forward (trial 1)", "shares memory with its previous output"),
    ("modifies_input.py", "modified-input", "forward (trial 0)", "wrote into its input"),
    ("inaccurate.py", "accuracy", "compare", "elements outside the official tolerance"),
    ("hangs.py", "timeout", "forward (trial 0)", "time limit of 8 s"),
    ("crashes.py", "crashed", "forward (trial 0)", "killed by SIGSEGV"),
])
def test_every_way_a_candidate_fails_is_that_rows_failure_with_its_reason(tmp_path, case, kind, stage, says):
    acc = run_job(tmp_path, "accuracy", CASES / case, limit=8 if case == "hangs.py" else 120)
    assert acc["status"] == "fail", acc
    failure = acc["failure"]
    assert (failure["kind"], failure["stage"]) == (kind, stage), failure
    assert says in failure["message"], failure
    assert failure["what"] == candidates.FAILURES[kind]
    assert acc["environment"]["machine_key"] and acc["row"]["id"] == ROW["id"]  # groups with its machine


@pytest.mark.slow
def test_one_trial_rows_call_twice_for_the_aliasing_check(tmp_path):
    acc = run_job(tmp_path, "accuracy", CASES / "aliases.py", row=ONE_TRIAL)
    assert acc["failure"]["kind"] == "aliased-output" and acc["failure"]["stage"] == "forward (second call on trial 0)"
    assert run_job(tmp_path, "accuracy", CASES / "reference.py", row=ONE_TRIAL)["status"] == "pass"


@pytest.mark.slow
def test_timing_pairs_reference_and_candidate_and_times_an_inaccurate_one(tmp_path):
    for case in ("reference.py", "inaccurate.py"):
        tim = run_job(tmp_path, "timing", CASES / case)
        assert tim["status"] == "ok" and tim["failure"] is None, tim
        rounds = tim["stopping"]["rounds_run"]
        assert len(tim["reference"]["round_medians_ms"]) == len(tim["optimized"]["round_medians_ms"]) == rounds == 3
        assert tim["speedup"] > 0 and tim["speedup_ci"]["low"] <= tim["speedup_ci"]["high"]
        assert tim["optimized"]["first_call_ms"] > 0 and tim["protocol"]["name"] == "stable"
        assert tim["call"] == "model(x, mask)"


@pytest.mark.slow
def test_timing_and_profile_record_a_failing_candidate_and_write_every_output(tmp_path):
    tim = run_job(tmp_path, "timing", CASES / "aliases.py")
    assert tim["status"] == "fail" and tim["failure"]["kind"] == "aliased-output", tim
    assert tim["failure"]["stage"] == "timing (second call)"
    prof = run_job(tmp_path, "profile", CASES / "hangs.py", limit=8)
    assert prof["status"] == "fail" and prof["failure"]["kind"] == "timeout"
    assert (tmp_path / "kernels.csv").read_text().startswith("name,calls,total_us,mean_us")
    assert "timeout" in json.loads((tmp_path / "trace.json").read_text())["note"]
    prof = run_job(tmp_path, "profile", CASES / "reference.py")
    assert prof["status"] == "ok" and any(k["name"] == "aten::addmm" for k in prof["kernels"])


@pytest.mark.slow
def test_a_candidate_edited_after_the_dag_was_built_fails_the_job(tmp_path):
    edited = tmp_path / "edited.py"
    edited.write_text((CASES / "reference.py").read_text())
    digest = candidates.digest(edited)
    edited.write_text(edited.read_text() + "# edited\n")
    env = dict(os.environ, PYTHONPATH=str(ROOT / "workflow"))
    done = subprocess.run([sys.executable, "-m", "shapewise", "job", "candidate-profile", "--device", "cpu",
                           "--row", row_json(ROW), "--candidate", "e", "--candidate-path", str(edited),
                           "--time-limit", '{"cpu": 60, "cuda": 60}', "--impl-digest", digest, "--out", "p.json",
                           "--capture", "{}", "--csv", "p.csv", "--trace", "t.json"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0 and "changed since" in done.stderr and not (tmp_path / "p.json").exists()


# ------------------------------------------------------------------ the shipped candidates


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("mask", ["none", "all-true", "prefix", "holes"])
def test_the_sdpa_candidate_matches_the_reference_on_every_mask(causal, mask):
    import torch

    from shapewise.jobs.inputs import make_case
    from shapewise.jobs.models import model_config, seeded_reference
    from shapewise.model import TOLERANCES, compare_outputs

    row = normalize_row({"id": "sdpa-row", "batch_size": 3, "seq_len": 17, "d_model": 32, "num_heads": 4,
                         "ffn_dim": 48, "num_layers": 2, "causal": causal, "pass_mask": mask != "none",
                         "mask": "holes" if mask == "holes" else ("prefix" if mask == "prefix" else "none"),
                         "padding_ratio": 0.4 if mask in ("prefix", "holes") else 0.0})
    config = model_config(row)
    reference = seeded_reference(config).eval()
    model = candidates.load_class(ROOT / "candidates" / "sdpa.py", "sdpa")(config).eval()
    model.load_state_dict(reference.state_dict(), strict=True)
    x, valid, _ = make_case(row, config, "cpu", 1234)
    with torch.inference_mode():
        want, got = reference(x, valid), model(x, valid)
    assert compare_outputs(want, got, **TOLERANCES["strict"]).passed


@pytest.mark.slow
def test_the_torch_compile_candidate_passes_on_the_cpu(tmp_path):
    acc = run_job(tmp_path, "accuracy", ROOT / "candidates" / "torch_compile.py", row=ONE_TRIAL, limit=580)
    assert acc["status"] == "pass" and acc["weights"]["strict"], acc
