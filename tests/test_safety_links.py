"""Symbolic links and what the report job would refuse: `results/` or `results/report` linked to another disk gives
a report that `shapewise verify results/report` passes (its root recorded as '..' steps, taken on the path verify is
given); a report directory nowhere under the root is refused by name when the record is written. What the report
job would refuse to record (a manifest linked from outside the checkout, a candidate path or file name with a line
break) stops Snakemake while it builds the DAG, before any job. Reports from the hand-made results of
tests/test_report.py; dry runs of a copied checkout."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from checkout import copy_checkout
from shapewise.provenance import provenance
from shapewise.report import report
from test_report import make_run


def verify(report_dir):
    lines = []
    return provenance.verify(report_dir, out=lines.append), "\n".join(lines)


@pytest.fixture
def checkout(tmp_path, monkeypatch):
    """A checkout without git (inputs checked against the working tree) and a second disk beside it."""
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))
    work, disk = tmp_path / "checkout", tmp_path / "disk"
    work.mkdir()
    disk.mkdir()
    monkeypatch.chdir(work)
    return work, disk, make_run(work)


def test_results_on_a_symbolic_link_verifies(checkout):
    work, disk, inputs = checkout
    shutil.move(work / "results", disk / "results")
    os.symlink(disk / "results", work / "results")
    report.render(inputs, "results/report")
    rc, text = verify("results/report")
    assert rc == 0, text
    assert (disk / "results" / "report" / "report.html").is_file()


def test_report_directory_on_a_symbolic_link_verifies(checkout):
    work, disk, inputs = checkout
    (disk / "report").mkdir()
    os.symlink(disk / "report", work / "results" / "report")
    report.render(inputs, "results/report")
    assert (work / "results" / "report").is_symlink() and (disk / "report" / "provenance.json").is_file()
    rc, text = verify("results/report")
    assert rc == 0, text
    rc, text = verify(work / "results" / "report")  # an absolute path through the link, too
    assert rc == 0, text


def test_the_root_is_taken_on_the_path_given_not_through_its_links(tmp_path):
    (tmp_path / "disk" / "deep").mkdir(parents=True)
    os.symlink(tmp_path / "disk" / "deep", tmp_path / "linked")  # its target's parent: disk/, not tmp_path
    assert provenance.root_dir(tmp_path / "linked" / "report", "../..") == tmp_path
    assert provenance.recorded_root(tmp_path / "results" / "report", tmp_path) == "../.."


def test_a_report_nowhere_under_the_root_is_named(tmp_path):
    (tmp_path / "root").mkdir()
    with pytest.raises(provenance.ProvenanceError) as info:
        provenance.recorded_root(tmp_path / "out" / "report", tmp_path / "root")
    assert f"the report directory {tmp_path / 'out' / 'report'} does not lie under it" in str(info.value)


# ---- what the report job would refuse, refused while the DAG is built -------------------------------------------

@pytest.fixture(scope="module")
def dag_checkout(tmp_path_factory):
    return copy_checkout(tmp_path_factory.mktemp("checkout"))


def dry_run(workdir, *args):
    env = dict(os.environ, SHAPEWISE_DEVICE="cpu")
    done = subprocess.run([sys.executable, "-m", "snakemake", "-n", "--cores", "2", *args], cwd=workdir, env=env,
                          capture_output=True, text=True, timeout=300)
    return done.returncode, done.stdout + done.stderr


def test_a_manifest_linked_from_outside_the_checkout_stops_before_any_job(dag_checkout, tmp_path):
    outside = tmp_path / "rows.yaml"
    shutil.copy(dag_checkout / "shapes" / "smoke.yaml", outside)
    link = dag_checkout / "shapes" / "linked.yaml"
    os.symlink(outside, link)
    try:
        rc, text = dry_run(dag_checkout, "--config", "shapes=linked")
    finally:
        link.unlink()
    assert rc != 0
    assert "the report could not record the input shapes/linked.yaml: resolves outside" in text, text
    assert "rule " not in text and "nothing was run" in text


@pytest.mark.parametrize("where, says", [("directory", "the path holds a control character"),
                                         ("file", "the path holds a control character"),
                                         ("package", "the report could not record its copy 'candidates/nl/x\\ny.py'")])
def test_a_candidate_path_with_a_line_break_stops_before_any_job(dag_checkout, tmp_path, where, says):
    sdpa = Path(__file__).resolve().parent.parent / "candidates" / "sdpa.py"
    if where == "package":
        path = tmp_path / "pkg"
        path.mkdir()
        shutil.copy(sdpa, path / "__init__.py")
        (path / "x\ny.py").write_text("")
    else:
        path = tmp_path / "a\nb" / "model.py" if where == "directory" else tmp_path / "a\nb.py"
        path.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(sdpa, path)
    config = tmp_path / "candidates.yaml"
    config.write_text('candidates:\n  nl: "' + str(path).replace("\n", "\\n") + '"\n')
    rc, text = dry_run(dag_checkout, "--configfile", str(config))
    assert rc != 0
    assert says in text, text
    assert "rule " not in text and "nothing was run" in text
