"""`shapewise compare` never reports "no regression" for a comparison it could not make: two runs without a row in
common (or with common ids on other machines) and a number that is not one (`nan`, `abc`, `-1`) are errors naming
the file, line, row and column; a noise floor outside [0, 1) is refused; a report's baseline with no row in common
is refused too."""

import csv
import json
import shutil
from pathlib import Path

import pytest

from shapewise.cli import main as cli_main
from shapewise.report import compare, report, report_data

from test_report import make_run  # tests/ is on sys.path under pytest

HEADER = ["id", "machine", "status", "route", "reference_median_ms", "reference_ci_low_ms", "reference_ci_high_ms",
          "optimized_median_ms", "optimized_ci_low_ms", "optimized_ci_high_ms", "speedup", "failed_elements",
          "total_elements", "max_abs_error"]


def row(rid, machine="M1", opt="1.0", **cells):
    out = {"id": rid, "machine": machine, "status": "pass", "route": "fused", "reference_median_ms": "2.0",
           "reference_ci_low_ms": "1.9", "reference_ci_high_ms": "2.1", "optimized_median_ms": opt,
           "optimized_ci_low_ms": "0.95", "optimized_ci_high_ms": "1.05", "speedup": "2.0", "failed_elements": "0",
           "total_elements": "100", "max_abs_error": "0.001"}
    out.update(cells)
    return out


def summary(directory, rows):
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / "summary.csv", "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=HEADER)
        writer.writeheader()
        writer.writerows(rows)
    return directory


def run_compare(old, new, *options):
    lines, errors = [], []
    rc = compare.main(old, new, *options, out=lines.append, err=errors.append)
    return rc, "\n".join(lines), "\n".join(errors)


def test_no_row_in_common_is_an_error(tmp_path):
    old = summary(tmp_path / "old", [row("a"), row("b")])
    new = summary(tmp_path / "new", [row("c")])
    rc, out, err = run_compare(old, new)
    assert rc == 2 and out == ""
    assert f"no row of {old} is in {new}, so nothing can be compared ({old}: a, b; {new}: c)" in err
    assert "no regression" not in out + err


def test_common_ids_on_other_machines_only_is_an_error(tmp_path):
    old = summary(tmp_path / "old", [row("a", machine="CPU x")])
    new = summary(tmp_path / "new", [row("a", machine="NVIDIA H200")])
    rc, _, err = run_compare(old, new)
    assert rc == 2 and "on the same machine" in err and "a: CPU x against NVIDIA H200" in err


def test_one_row_in_common_is_enough(tmp_path):
    old = summary(tmp_path / "old", [row("a"), row("b")])
    new = summary(tmp_path / "new", [row("a"), row("c")])
    assert run_compare(old, new)[0] == 0


def test_empty_summary_is_an_error(tmp_path):
    old = summary(tmp_path / "old", [row("a")])
    new = summary(tmp_path / "new", [])
    rc, _, err = run_compare(old, new)
    assert rc == 2 and "no rows" in err


@pytest.mark.parametrize("column, value", [("optimized_median_ms", "nan"), ("optimized_median_ms", "inf"),
                                           ("optimized_median_ms", "-1"), ("optimized_median_ms", "0"),
                                           ("optimized_median_ms", "abc"), ("reference_ci_low_ms", "nan"),
                                           ("speedup", "abc"), ("speedup", "nan"), ("failed_elements", "-3"),
                                           ("total_elements", "2.5"), ("max_abs_error", "-0.1"),
                                           ("optimized_median_ms", "true")])
def test_a_value_that_is_not_a_number_names_file_line_row_and_column(tmp_path, column, value):
    old = summary(tmp_path / "old", [row("a"), row("b")])
    new = summary(tmp_path / "new", [row("a"), row("b", **{column: value})])
    rc, out, err = run_compare(old, new)
    assert rc == 2 and "within noise" not in out and "nan %" not in out
    assert f"{new / 'summary.csv'}, line 3 (row b): {column} is" in err and "not a" in err, err


def test_nan_median_and_abc_speedup_together(tmp_path):
    old = summary(tmp_path / "old", [row("a")])
    new = summary(tmp_path / "new", [row("a", opt="nan", speedup="abc")])
    rc, out, err = run_compare(old, new)
    assert rc == 2 and "optimized_median_ms is nan, not a finite number above 0" in err


def test_nan_in_a_results_directory(tmp_path):
    """A results directory without a report: its timing JSON is checked the same way."""
    old = summary(tmp_path / "old", [row("a")])
    timing = tmp_path / "results" / "timing"
    timing.mkdir(parents=True)
    (timing / "a.json").write_text(json.dumps({
        "row": {"id": "a"}, "status": "pass", "route": "fused", "environment": {"machine_key": "M1"},
        "optimized": {"median_ms": float("nan"), "median_ci_ms": [0.9, 1.1]},
        "reference": {"median_ms": 2.0, "median_ci_ms": [1.9, 2.1]}}))
    rc, _, err = run_compare(old, tmp_path / "results")
    assert rc == 2 and f"{timing / 'a.json'} (row a): optimized_median_ms is nan" in err


@pytest.mark.parametrize("floor", [float("nan"), -0.1, 1.0, 5.0])
def test_noise_floor_outside_a_fraction_is_refused(tmp_path, floor):
    old = summary(tmp_path / "old", [row("a")])
    rc, _, err = run_compare(old, old, {"optimized": floor})
    assert rc == 2 and "noise floor" in err and "[0, 1)" in err


def test_cli_compare_exit_codes(tmp_path, capsys):
    old = summary(tmp_path / "old", [row("a")])
    new = summary(tmp_path / "new", [row("z")])
    assert cli_main(["compare", str(old), str(new)]) == 2
    assert cli_main(["compare", str(old), str(tmp_path / "missing")]) == 2
    assert cli_main(["compare", str(old), str(old), "--optimized-floor", "nan"]) == 2
    err = capsys.readouterr().err
    assert "nothing can be compared" in err and "not found" in err and "noise floor" in err


def test_committed_reports_compare_with_themselves():
    root = Path(__file__).resolve().parent.parent / "reports"
    for name in ("h200", "h200-contract", "h200-candidates"):
        assert run_compare(root / name, root / name)[0] == 0


# ------------------------------------------------------------------ the report's baseline


@pytest.fixture
def rendered(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    inputs = make_run(tmp_path)
    report.render(inputs, "results/report")
    return inputs


def _refused(inputs):
    with pytest.raises(report_data.ReportInputError) as info:
        report.render(inputs, "results/report")
    return str(info.value)


def test_baseline_without_a_row_in_common_is_refused(rendered):
    summary("other", [row("x1"), row("x2")])
    message = _refused(dict(rendered, baseline="other"))
    assert "baseline (config baseline=other)" in message and "nothing can be compared" in message


def test_baseline_that_is_missing_or_not_a_report(rendered):
    assert "not found" in _refused(dict(rendered, baseline="nowhere"))
    Path("empty-dir").mkdir()
    message = _refused(dict(rendered, baseline="empty-dir"))
    assert "empty-dir" in message and "report directory" in message
    shutil.copytree("results/report", "damaged")
    Path("damaged/summary.csv").write_text("id,status\n")
    assert "missing column(s)" in _refused(dict(rendered, baseline="damaged"))


@pytest.mark.parametrize("column", ["id", "machine", "route"])
def test_a_text_with_a_control_character_is_refused(tmp_path, column):
    """A terminal acts on escape sequences compare would print (a foreign report's id, machine or route)."""
    old = summary(tmp_path / "old", [row("a")])
    new = summary(tmp_path / "new", [row("a", **{column: "a\x1b]0;owned\x07"})])
    rc, out, err = run_compare(old, new)
    assert rc == 2 and "holds a control character" in err and "\x1b" not in err and out == ""


def test_summary_with_a_byte_order_mark_is_read(tmp_path):
    """A summary.csv saved by a spreadsheet starts with a UTF-8 BOM; its first column is still `id`."""
    plain = summary(tmp_path / "plain", [row("a")])
    bom = tmp_path / "bom"
    bom.mkdir()
    (bom / "summary.csv").write_bytes(b"\xef\xbb\xbf" + (plain / "summary.csv").read_bytes())
    assert [r["id"] for r in compare.load_rows(bom)] == ["a"]
    assert compare.main(plain, bom, out=lambda *_: None, err=print) == 0
