"""Results carry a digest of their own content (`content_sha256`), written by the job's writer: the report refuses
a result edited by hand or without the digest, a job refuses an edited earlier result, and verify fails a report
whose copied result was edited even when its provenance.json was re-hashed. The report also refuses results that
ran on another device, or with other SHAPEWISE_* variables, than the run asks for, and a manifest that changed
after the run read its rows."""

import hashlib
import json
from pathlib import Path

import pytest
import torch

from shapewise.inputs import paths
from shapewise.jobs import io
from shapewise.provenance import provenance
from shapewise.report import report, report_data

from test_report import make_run, write_json  # tests/ is on sys.path under pytest


@pytest.fixture
def run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return make_run(tmp_path)


def refused(inputs):
    with pytest.raises(report_data.ReportInputError) as info:
        report.render(inputs, "results/report")
    assert not Path("results/report").exists()
    return str(info.value)


def edit_raw(path, change):
    """Change a result's JSON as a hand would: the old content_sha256 stays."""
    data = json.loads(Path(path).read_text())
    change(data)
    Path(path).write_text(json.dumps(data, indent=1))


# ------------------------------------------------------------------ the writer


def test_write_result_seals_what_a_reader_gets_back(tmp_path):
    path = tmp_path / "results" / "timing" / "r1.json"
    io.write_result(path, {"step": "timing", "dtype": torch.float16, "shape": (2, 3), "ratio": 0.1, "_t0": 0.0,
                           "keys": {1: "int key"}, "text": "caf\u00e9"})
    data = json.loads(path.read_text())
    assert data["dtype"] == "torch.float16" and data["shape"] == [2, 3] and data["keys"] == {"1": "int key"}
    assert data[provenance.CONTENT_FIELD] == provenance.content_sha256(data)
    assert provenance.seal_problem(data) is None
    assert [p.name for p in path.parent.iterdir()] == ["r1.json"]  # no partial file left


def test_partial_name_does_not_grow_with_the_id():
    short, long = io.partial_path("results/timing/a.json"), io.partial_path(f"results/timing/{'b' * 250}.json")
    assert len(short.name) == len(long.name) == len(".0123456789abcdef.partial")
    assert short.parent == long.parent == Path("results/timing")


def test_digest_is_of_the_content_not_its_layout():
    record = {"b": [1, 2.5, None], "a": {"z": True, "y": "\u00e9"}}
    reordered = json.loads(json.dumps(record, indent=4, sort_keys=True, ensure_ascii=False))
    assert provenance.content_sha256(record) == provenance.content_sha256(reordered)
    assert provenance.content_sha256(record) != provenance.content_sha256(dict(record, b=[1, 2.5]))
    sealed = provenance.seal(record)
    assert provenance.content_sha256(sealed) == sealed[provenance.CONTENT_FIELD]  # the field is not its own input


def test_job_refuses_an_edited_earlier_result(tmp_path):
    path = tmp_path / "results" / "preflight" / "row-a.json"
    io.write_result(path, {"step": "preflight", "models": {"optimized": {"fits": False}}})
    assert io.read_json(path)["models"]["optimized"]["fits"] is False
    edit_raw(path, lambda d: d["models"]["optimized"].update(fits=True))
    with pytest.raises(SystemExit) as info:
        io.read_json(path)
    message = str(info.value)
    assert str(path) in message and "edited after its job wrote it" in message
    assert "--forcerun $(shapewise targets row-a)" in message


def test_job_refuses_a_result_that_is_not_an_object(tmp_path):
    path = tmp_path / "pre.json"
    path.write_text("[1, 2]")
    with pytest.raises(SystemExit, match="a JSON list, not a result object"):
        io.read_json(path)


# ------------------------------------------------------------------ the report


def test_report_refuses_a_result_edited_by_hand(run):
    path = paths.result("accuracy", "t-01")
    edit_raw(path, lambda d: d["aggregate"]["official"].update(total_elements=1))
    message = refused(run)
    assert f"{path}: was edited after its job wrote it" in message
    assert "--forcerun $(shapewise targets t-01)" in message


def test_report_refuses_a_result_without_its_digest(run):
    path = paths.result("timing", "t-02")
    edit_raw(path, lambda d: d.pop(provenance.CONTENT_FIELD))
    message = refused(run)
    assert f"{path}: has no {provenance.CONTENT_FIELD}" in message


@pytest.mark.parametrize("which", ["microbench", "env", "impl"])
def test_report_refuses_an_edited_fingerprint_or_microbench(run, which):
    path = paths.MICROBENCH if which == "microbench" else paths.FINGERPRINTS[which]
    edit_raw(path, lambda d: d.update(note="edited"))
    assert f"{path}: was edited after its job wrote it" in refused(run)


def test_verify_fails_a_copied_result_edited_and_re_hashed(run):
    report.render(run, "results/report")
    out = Path("results/report")
    copy = out / paths.in_report(paths.result("accuracy", "t-01"))
    edit_raw(copy, lambda d: d["aggregate"]["official"].update(total_elements=1))
    record = json.loads((out / "provenance.json").read_text())
    for entry in record["artifacts"]:  # a forger who also rewrites the artifact's SHA-256
        if entry["path"] == copy.relative_to(out).as_posix():
            entry["sha256"] = hashlib.sha256(copy.read_bytes()).hexdigest()
    (out / "provenance.json").write_text(json.dumps(record))
    lines = []
    assert provenance.verify(out, artifacts_only=True, out=lines.append) == 1
    text = "\n".join(lines)
    assert "was edited after its job wrote it" in text and str(copy) in text


# ------------------------------------------------------------------ what the run asked for


def test_results_without_the_passed_variable_are_refused(run):
    """Results made without SHAPEWISE_NOTE (copied in from another run), a run that passes it: refused, so the
    report never says the variable reached jobs it did not reach."""
    for step in paths.SHAPE_STEPS:
        path = paths.result(step, "t-02")
        data = json.loads(Path(path).read_text())
        data["environment"] = dict(data["environment"], shapewise_variables={"SHAPEWISE_PIPELINE_GPU_SLOT": "1"})
        write_json(path, data)
    message = refused(dict(run, pass_env={"SHAPEWISE_NOTE": "x"}))
    assert paths.result("timing", "t-02") in message
    assert "ran with the SHAPEWISE_* variables none, but this run passes {'SHAPEWISE_NOTE': 'x'}" in message


def test_results_of_another_device_are_refused(run):
    message = refused(dict(run, device="cpu"))
    assert f"{paths.result('timing', 't-01')}: ran on 'cuda', but this run asks for device 'cpu'" in message
    assert report.render(dict(run, device="auto"), "results/report")  # auto takes either
    assert report.render(dict(run, device="cuda"), "results/report")


def test_manifest_changed_after_the_run_read_it_is_refused(run):
    digest = hashlib.sha256(Path("shapes/test.yaml").read_bytes()).hexdigest()
    assert report.render(dict(run, manifest_sha256={"shapes/test.yaml": digest}), "results/report")
    Path("shapes/test.yaml").write_text("# edited while the run computed\n")
    message = _refused_again(dict(run, manifest_sha256={"shapes/test.yaml": digest}))
    assert "shapes/test.yaml: changed since this run read its rows" in message


def _refused_again(inputs):
    with pytest.raises(report_data.ReportInputError) as info:
        report.render(inputs, "results/report")
    return str(info.value)


def test_result_file_problem_before_a_job_runs(tmp_path):
    """The check a rule can make of an earlier result when Snakemake builds the DAG (no torch)."""
    path = tmp_path / "pre.json"
    assert provenance.result_file_problem(path) == "is missing"
    io.write_result(path, {"step": "preflight", "models": {}})
    assert provenance.result_file_problem(path) is None
    edit_raw(path, lambda d: d.update(models={"optimized": {"fits": True}}))
    assert "edited after its job wrote it" in provenance.result_file_problem(path)
    path.write_text(path.read_text()[:40])
    assert provenance.result_file_problem(path).startswith("is not valid JSON")
    path.write_text('{"step": "preflight"}')  # no digest: taken as it is
    assert provenance.result_file_problem(path) is None
