"""provenance.json format 2: the commit a report came from, and `verify` against that commit's git objects."""

import json
import subprocess

import pytest

from shapewise.cli import main as cli_main
from shapewise.provenance import provenance

INPUTS = ["model/a.py", "shapes/s.yaml"]
ARTIFACTS = ["report.md", "report.html", "summary.csv", "data/timing/r1.json"]


def git(repo, *args):
    return subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@example.invalid",
                           "-c", "commit.gpgsign=false", *args], check=True, capture_output=True, text=True).stdout


@pytest.fixture
def repo(tmp_path, monkeypatch):
    """A git repository with two committed inputs and a report directory reports/r (not yet written)."""
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))
    (tmp_path / "model").mkdir()
    (tmp_path / "shapes").mkdir()
    (tmp_path / "model" / "a.py").write_text("x = 1\n")
    (tmp_path / "shapes" / "s.yaml").write_text("- {id: r1}\n")
    git(tmp_path, "init", "-q")
    git(tmp_path, "add", "model", "shapes")
    git(tmp_path, "commit", "-q", "-m", "first")
    report = tmp_path / "reports" / "r"
    (report / "data" / "timing").mkdir(parents=True)
    (report / "summary.csv").write_text("id,status\nr1,pass\n")
    (report / "report.md").write_text("# r\n")
    (report / "report.html").write_text("<h1>r</h1>\n")
    (report / "data" / "timing" / "r1.json").write_text("{}\n")
    return tmp_path


def write(repo):
    return provenance.write(repo / "reports" / "r", INPUTS, ARTIFACTS, root=repo)


def verify(repo, **kwargs):
    lines = []
    rc = provenance.verify(repo / "reports" / "r", out=lines.append, **kwargs)
    return rc, "\n".join(lines)


def edit_record(repo, change):
    path = repo / "reports" / "r" / "provenance.json"
    record = json.loads(path.read_text())
    change(record)
    path.write_text(json.dumps(record))


def test_record_has_commit_and_clean_flag(repo):
    record = write(repo)
    assert record["format"] == 2
    assert record["commit"] == git(repo, "rev-parse", "HEAD").strip()
    assert record["dirty"] is False and record["dirty_inputs"] == []
    assert record["root"] == "../.."
    assert [e["path"] for e in record["inputs"]] == INPUTS
    rc, text = verify(repo)
    assert rc == 0, text
    assert "inputs: 2 of 2 match commit" in text and "inputs: current" in text


def test_source_changed_and_committed_after_the_report_still_verifies(repo):
    record = write(repo)
    (repo / "model" / "a.py").write_text("x = 2\n")
    git(repo, "commit", "-q", "-am", "second")
    rc, text = verify(repo)
    assert rc == 0, text
    assert f"1 input changed since {record['commit'][:12]}" in text and "model/a.py" in text


def test_deleted_input_is_reported_not_failed(repo):
    write(repo)
    git(repo, "rm", "-q", "shapes/s.yaml")
    git(repo, "commit", "-q", "-m", "drop")
    rc, text = verify(repo)
    assert rc == 0, text
    assert "shapes/s.yaml (deleted)" in text


def test_tampered_or_missing_artifact_fails(repo):
    write(repo)
    (repo / "reports" / "r" / "summary.csv").write_text("id,status\nr1,fail\n")
    rc, text = verify(repo)
    assert rc == 1 and "artifact changed (SHA-256 mismatch)" in text and "summary.csv" in text
    rc, text = verify(repo, artifacts_only=True)
    assert rc == 1
    (repo / "reports" / "r" / "data" / "timing" / "r1.json").unlink()
    rc, text = verify(repo)
    assert rc == 1 and "artifact missing" in text and "r1.json" in text


def test_tampered_input_hash_fails(repo):
    write(repo)
    edit_record(repo, lambda r: r["inputs"][0].update(sha256="0" * 64))
    rc, text = verify(repo)
    assert rc == 1
    assert "model/a.py" in text and "does not match the commit" in text
    # --artifacts-only does not look at the inputs
    assert verify(repo, artifacts_only=True)[0] == 0


def test_input_listed_but_absent_from_commit_and_not_dirty_fails(repo):
    (repo / "model" / "b.py").write_text("y = 1\n")
    provenance.write(repo / "reports" / "r", INPUTS + ["model/b.py"], ARTIFACTS, root=repo)
    edit_record(repo, lambda r: r.update(dirty=False, dirty_inputs=[]))
    rc, text = verify(repo)
    assert rc == 1 and "input not in commit" in text and "model/b.py" in text


def test_dirty_tree_at_production_passes_with_a_note(repo):
    (repo / "model" / "a.py").write_text("x = 3  # not committed\n")
    (repo / "model" / "b.py").write_text("untracked\n")
    record = provenance.write(repo / "reports" / "r", INPUTS + ["model/b.py"], ARTIFACTS, root=repo)
    assert record["dirty"] is True
    assert record["dirty_inputs"] == ["model/a.py", "model/b.py"]
    rc, text = verify(repo)
    assert rc == 0, text
    assert "produced from a dirty tree" in text
    assert "input dirty at production, not checkable against the commit: model/a.py" in text
    assert "input dirty at production, not checkable against the commit: model/b.py" in text
    assert "inputs: current" in text


def test_unknown_commit_falls_back_to_the_working_tree_strictly(repo):
    write(repo)
    edit_record(repo, lambda r: r.update(commit="1" * 40))
    rc, text = verify(repo)
    assert rc == 0, text
    assert "unknown to the repository" in text and "working tree" in text
    (repo / "model" / "a.py").write_text("x = 4\n")
    rc, text = verify(repo)
    assert rc == 1 and "input changed (SHA-256 mismatch)" in text and "model/a.py" in text


def test_format_1_record_stays_strict(repo):
    write(repo)
    edit_record(repo, lambda r: r.update(format=1))
    assert verify(repo)[0] == 0
    (repo / "model" / "a.py").write_text("x = 5\n")
    git(repo, "commit", "-q", "-am", "later")
    rc, text = verify(repo)
    assert rc == 1 and "format-1 record" in text and "model/a.py" in text


def test_no_git_records_null_commit_and_checks_the_working_tree(repo):
    import shutil

    shutil.rmtree(repo / ".git")
    record = write(repo)
    assert record["commit"] is None and record["dirty"] is None
    rc, text = verify(repo)
    assert rc == 0 and "not produced in a git repository" in text
    (repo / "shapes" / "s.yaml").write_text("- {id: r2}\n")
    assert verify(repo)[0] == 1


def test_unknown_format_and_missing_record_fail(repo):
    assert verify(repo)[0] == 1  # no provenance.json yet
    write(repo)
    edit_record(repo, lambda r: r.update(format=99))
    rc, text = verify(repo)
    assert rc == 1 and "format 99" in text


def test_cli_verify(repo, capsys):
    write(repo)
    (repo / "model" / "a.py").write_text("x = 6\n")
    git(repo, "commit", "-q", "-am", "later")
    assert cli_main(["verify", str(repo / "reports" / "r")]) == 0
    assert "1 input changed since" in capsys.readouterr().out
    assert cli_main(["verify", "--artifacts-only", str(repo / "reports" / "r")]) == 0


def test_commit_given_for_a_tree_without_git(repo, tmp_path_factory):
    """A copy of the tree without .git (as sent to a GPU machine) records the commit it is told; verify in the
    repository then checks the inputs against that commit, and dirty is unknown so any difference fails."""
    import shutil

    commit = git(repo, "rev-parse", "HEAD").strip()
    copy = tmp_path_factory.mktemp("device") / "tree"
    shutil.copytree(repo, copy, ignore=shutil.ignore_patterns(".git"))
    (copy / "model" / "a.py").write_text("x = 7  # edited on the device\n")
    record = provenance.write(copy / "reports" / "r", INPUTS, ARTIFACTS, root=copy, commit=commit)
    assert record["commit"] == commit and record["dirty"] is None
    shutil.rmtree(repo / "reports" / "r")
    shutil.copytree(copy / "reports" / "r", repo / "reports" / "r")
    rc, text = verify(repo)
    assert rc == 1 and "does not know whether the tree was dirty" in text and "model/a.py" in text

    (copy / "model" / "a.py").write_text("x = 1\n")
    provenance.write(copy / "reports" / "r", INPUTS, ARTIFACTS, root=copy, commit=commit)
    shutil.rmtree(repo / "reports" / "r")
    shutil.copytree(copy / "reports" / "r", repo / "reports" / "r")
    rc, text = verify(repo)
    assert rc == 0 and "inputs: 2 of 2 match commit" in text, text
