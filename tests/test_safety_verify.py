"""`shapewise verify` reads nothing outside the report: an artifact path that is absolute, climbs with `..` or
leaves through a symbolic link, an input outside the root, a root that is not above the report, or an entry
without a path is refused before any file is hashed. A record that is not one (a field missing or of another
type) is refused naming the field, and one that leaves out a file of the report itself fails naming the file.
The committed reports still verify."""

import json
import os
import sys
from pathlib import Path

import pytest

from shapewise.cli import main as cli_main
from shapewise.inputs import limits, paths
from shapewise.provenance import provenance

ROOT = Path(__file__).resolve().parent.parent
OWN_FILES = ["report.html", "report.md", "summary.csv"]  # a report's own files, as the record sorts them


@pytest.fixture
def report_dir(tmp_path, monkeypatch):
    """reports/r of a checkout without git: the report's own files, one input, a valid record."""
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))
    (tmp_path / "shapes").mkdir()
    (tmp_path / "shapes" / "s.yaml").write_text("- {id: r1}\n")
    out = tmp_path / "reports" / "r"
    out.mkdir(parents=True)
    (out / "summary.csv").write_text("id,status\nr1,pass\n")
    (out / "report.md").write_text("# r\n")
    (out / "report.html").write_text("<h1>r</h1>\n")
    (tmp_path.parent / f"{tmp_path.name}-secret.txt").write_text("not part of any report\n")
    provenance.write(out, ["shapes/s.yaml"], OWN_FILES, root=tmp_path)
    return out


def edit(report_dir, change):
    path = report_dir / "provenance.json"
    record = json.loads(path.read_text())
    change(record)
    path.write_text(json.dumps(record))


def verify(report_dir, **kwargs):
    lines = []
    rc = provenance.verify(report_dir, out=lines.append, **kwargs)
    return rc, "\n".join(lines)


def secret(report_dir):
    """A file beside the checkout (outside the report and its root)."""
    checkout = report_dir.parent.parent
    return checkout.parent / f"{checkout.name}-secret.txt"


def forged_entry(report_dir, path):
    """An entry for `path` with the real hash of the secret file it points at: what a forger would write (the
    check before this change hashed it and said OK)."""
    return {"path": path, "sha256": provenance.sha256_file(secret(report_dir)), "bytes": 23}


def test_the_fixture_verifies(report_dir):
    rc, text = verify(report_dir)
    assert rc == 0, text


@pytest.mark.parametrize("path, says", [("../../../{secret}", "'..' part"), ("{absolute}", "absolute path"),
                                        ("data/../../../../{secret}", "'..' part")])
def test_artifact_path_outside_the_report_is_refused(report_dir, path, says):
    path = path.format(secret=secret(report_dir).name, absolute=secret(report_dir))
    edit(report_dir, lambda r: r["artifacts"].append(forged_entry(report_dir, path)))
    rc, text = verify(report_dir)
    assert rc == 1 and says in text and path in text and "no file was read" in text
    assert "OK" not in text


def test_artifact_through_a_symbolic_link_out_is_refused(report_dir):
    (report_dir / "data").mkdir()
    os.symlink(secret(report_dir).parent, report_dir / "data" / "up")
    edit(report_dir, lambda r: r["artifacts"].append(forged_entry(report_dir, f"data/up/{secret(report_dir).name}")))
    rc, text = verify(report_dir)
    assert rc == 1 and "resolves outside" in text and "symbolic link" in text


def test_symbolic_link_inside_the_report_is_taken(report_dir):
    os.symlink("summary.csv", report_dir / "alias.csv")
    edit(report_dir, lambda r: r["artifacts"].append(
        {"path": "alias.csv", "sha256": provenance.sha256_file(report_dir / "summary.csv"), "bytes": 1}))
    assert verify(report_dir)[0] == 0


def test_input_outside_the_root_is_refused(report_dir):
    edit(report_dir, lambda r: r["inputs"].append(forged_entry(report_dir, f"../{secret(report_dir).name}")))
    rc, text = verify(report_dir)
    assert rc == 1 and "input #2" in text and "'..' part" in text


@pytest.mark.parametrize("root", ["/", "../../..x", "elsewhere", None, 3])
def test_root_that_is_not_above_the_report_is_refused(report_dir, root):
    edit(report_dir, lambda r: r.update(root=root))
    rc, text = verify(report_dir)
    assert rc == 1 and "the root must be a directory above the report directory" in text


@pytest.mark.parametrize("entry, says", [({"path": None, "sha256": "0" * 64}, "has no path (None)"),
                                         ({"sha256": "0" * 64}, "has no path (None)"),
                                         ({"path": "", "sha256": "0" * 64}, "has no path ('')"),
                                         ({"path": "summary.csv", "sha256": None}, "not an entry"),
                                         ("summary.csv", "not an entry")])
def test_entry_without_a_usable_path_or_hash_is_a_clear_error(report_dir, entry, says):
    edit(report_dir, lambda r: r["artifacts"].append(entry))
    rc, text = verify(report_dir)
    assert rc == 1 and f"artifact #{len(OWN_FILES) + 1}" in text and says in text


def test_entries_that_are_not_a_list(report_dir):
    edit(report_dir, lambda r: r.update(artifacts={"path": "summary.csv"}))
    rc, text = verify(report_dir)
    assert rc == 1 and "artifacts: a list of entries expected, got dict" in text


@pytest.mark.parametrize("text, says", [("{", "not valid JSON"), ("[1, 2]", "not a provenance record"),
                                        ('{"format": 2, "format": 1}', "written twice"),
                                        ("[" * 100 + "]" * 100, "nested deeper")])
def test_damaged_record_is_named(report_dir, text, says):
    (report_dir / "provenance.json").write_text(text)
    rc, out = verify(report_dir)
    assert rc == 1 and says in out and "provenance.json" in out


def test_cli_verify_of_a_forged_record_exits_1_without_a_traceback(report_dir, capsys):
    edit(report_dir, lambda r: r["artifacts"].append({"path": None, "sha256": "0" * 64}))
    assert cli_main(["verify", str(report_dir)]) == 1
    assert "has no path" in capsys.readouterr().out


def test_writing_a_record_refuses_paths_outside(report_dir, tmp_path):
    with pytest.raises(provenance.ProvenanceError, match="'..' part"):
        provenance.write(report_dir, ["../outside.txt"], ["summary.csv"], root=tmp_path)
    with pytest.raises(provenance.ProvenanceError, match="absolute path"):
        provenance.write(report_dir, ["shapes/s.yaml"], [str(report_dir / "summary.csv")], root=tmp_path)


@pytest.mark.parametrize("name", ["h200", "h200-contract", "h200-candidates"])
def test_committed_reports_still_verify(name):
    """provenance.json's SHA-256 covers every result; a result that carries a content digest (those that do not
    predate it) carries the right one."""
    lines = []
    assert provenance.verify(ROOT / "reports" / name, artifacts_only=True, out=lines.append) == 0, lines
    data = ROOT / "reports" / name / "data"
    results = [p for p in data.rglob("*.json") if isinstance(json.loads(p.read_text()), dict)]
    assert results and all(provenance.result_file_problem(p) is None for p in results)


def test_record_size_is_limited(report_dir):
    (report_dir / "provenance.json").write_text(" " * (limits.MAX_JSON_BYTES + 1))
    rc, text = verify(report_dir)
    assert rc == 1 and "larger than" in text


@pytest.mark.parametrize("commit", ["--output=/tmp/x", "HEAD", "main", "1234", 5, ["a"]])
def test_commit_that_is_not_a_full_id_is_never_handed_to_git(report_dir, commit):
    """Only 40 or 64 hex digits reach `git cat-file`: anything else is checked as a record without a known commit
    (or refused when it is not even text)."""
    edit(report_dir, lambda r: r.update(commit=commit))
    rc, text = verify(report_dir)
    if isinstance(commit, str):
        assert rc == 0 and "is not a full commit id" in text and "working tree" in text, text
    else:
        assert rc == 1 and "a commit id or null expected" in text


def test_dirty_inputs_that_are_not_a_list_of_paths(report_dir):
    edit(report_dir, lambda r: r.update(dirty_inputs=5))
    rc, text = verify(report_dir)
    assert rc == 1 and "dirty_inputs 5: a list of paths expected" in text


def test_path_with_a_control_character_is_refused(report_dir, capsys):
    edit(report_dir, lambda r: r["artifacts"].append({"path": "x\x1b[2J.csv", "sha256": "0" * 64}))
    rc, text = verify(report_dir)
    assert rc == 1 and "holds a control character" in text and "\x1b" not in text


# ------------------------------------------------------------------ what a record must hold


@pytest.mark.parametrize("fmt", [2.0, True, "2", None, [2]])
def test_format_that_is_not_an_integer_is_refused(report_dir, fmt):
    """2.0 and true compare equal to a format; the record must hold the integer."""
    edit(report_dir, lambda r: r.update(format=fmt))
    rc, text = verify(report_dir)
    assert rc == 1 and f"provenance.json: format {fmt!r}: not a format this shapewise reads" in text, text
    assert "no file was read" in text


def test_format_as_a_float_in_an_empty_directory_fails(tmp_path):
    (tmp_path / "provenance.json").write_text('{"format": 2.0, "root": "..", "inputs": [], "artifacts": []}')
    rc, text = verify(tmp_path)
    assert rc == 1 and "format 2.0" in text


@pytest.mark.parametrize("field", provenance.REQUIRED)
def test_missing_field_is_named(report_dir, field):
    edit(report_dir, lambda r: r.pop(field))
    rc, text = verify(report_dir)
    assert rc == 1 and f"provenance.json: field {field!r} missing" in text, text


@pytest.mark.parametrize("field, value, says", [("inputs", "shapes/s.yaml", "inputs: a list of entries expected"),
                                                ("artifacts", 5, "artifacts: a list of entries expected"),
                                                ("dirty", "no", "dirty 'no': true, false or null expected"),
                                                ("root", ["..", ".."], "root ['..', '..']")])
def test_field_of_another_type_is_named(report_dir, capsys, field, value, says):
    edit(report_dir, lambda r: r.update({field: value}))
    assert cli_main(["verify", str(report_dir)]) == 1
    out = capsys.readouterr().out
    assert says in out and "provenance.json" in out and "FAILED" in out


def test_integer_longer_than_python_reads_is_named(report_dir, capsys):
    """Python refuses to convert an integer of more than sys.get_int_max_str_digits() digits (a ValueError)."""
    path = report_dir / "provenance.json"
    path.write_text(path.read_text().replace('"bytes": ', '"bytes": ' + "1" * 5000, 1))
    assert cli_main(["verify", str(report_dir)]) == 1
    out = capsys.readouterr().out
    assert f"{path}: field inputs[0].bytes: an integer longer than the {sys.get_int_max_str_digits()} digits" \
        in out


@pytest.mark.parametrize("left_out", OWN_FILES)
def test_record_without_a_report_file_fails(report_dir, left_out):
    """A record that leaves a report file out would verify with that file changed."""
    edit(report_dir, lambda r: r.update(artifacts=[e for e in r["artifacts"] if e["path"] != left_out]))
    (report_dir / left_out).write_text("changed\n")
    rc, text = verify(report_dir)
    assert rc == 1 and f"artifact not listed in provenance.json (a report lists all its files): " \
                       f"{report_dir / left_out}" in text, text


def test_record_without_artifacts_fails_naming_each_report_file(report_dir):
    edit(report_dir, lambda r: r.update(artifacts=[]))
    (report_dir / "report.html").write_text("<h1>forged</h1>\n")
    rc, text = verify(report_dir)
    assert rc == 1 and all(f"not listed in provenance.json (a report lists all its files): {report_dir / name}"
                           in text for name in OWN_FILES), text


def test_report_file_deleted_and_dropped_from_the_record_fails(report_dir):
    (report_dir / "report.html").unlink()
    edit(report_dir, lambda r: r.update(artifacts=[e for e in r["artifacts"] if e["path"] != "report.html"]))
    rc, text = verify(report_dir)
    assert rc == 1 and f"not listed in provenance.json (a report lists all its files): {report_dir / 'report.html'}" \
        in text


@pytest.mark.parametrize("directory", paths.REPORT_DIRS)
def test_file_in_a_report_directory_must_be_listed(report_dir, directory):
    (report_dir / directory / "sub").mkdir(parents=True)
    (report_dir / directory / "sub" / "x.json").write_text("{}\n")
    rc, text = verify(report_dir)
    assert rc == 1 and f"{report_dir / directory / 'sub' / 'x.json'}" in text and "not listed" in text
    provenance.write(report_dir, ["shapes/s.yaml"], [*OWN_FILES, f"{directory}/sub/x.json"],
                     root=report_dir.parent.parent)
    assert verify(report_dir)[0] == 0


def test_report_directory_that_is_a_link_is_named_not_followed(report_dir):
    os.symlink(secret(report_dir).parent, report_dir / "data")
    rc, text = verify(report_dir)
    assert rc == 1 and f"not listed in provenance.json (a report lists all its files): {report_dir / 'data'}" in text
    assert secret(report_dir).name not in text
