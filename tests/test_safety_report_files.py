"""The report's files: the report directory is replaced in one step (a reader never finds it without data/ or
figures/), written as UTF-8 under any locale, and rendered when a speedup lies outside its own interval (the row
named, the figure drawn) or fifteen switches make the ablation wide. Built from the hand-made results of
tests/test_report.py (no Snakemake, no models)."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from shapewise.inputs import paths
from shapewise.report import report

import test_report  # tests/ is on sys.path under pytest
from test_report import make_run, write_json


@pytest.fixture
def run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return make_run(tmp_path)


def _can_exchange(tmp_path):
    a, b = tmp_path / "swap-a", tmp_path / "swap-b"
    a.mkdir()
    b.mkdir()
    try:
        return report._exchange(a, b)
    finally:
        a.rmdir()
        b.rmdir()


def test_report_directory_is_never_without_its_data(run, tmp_path, monkeypatch):
    """After every rename and every removal the report job makes while it replaces a report, the report
    directory holds report.html, data/ and figures/."""
    if not _can_exchange(tmp_path):
        pytest.skip("renameat2(RENAME_EXCHANGE) is not offered here: the two-rename fallback has a gap by design")
    report.render(run, "results/report")
    out = Path("results/report")
    (out / "notes.txt").write_text("kept")  # not the report's: it stays
    seen = []

    def complete(what):
        seen.append(what)
        for name in ("report.html", paths.REPORT_DATA, paths.REPORT_FIGURES):
            assert (out / name).exists(), f"{name} missing after {what}"

    for module, name in ((os, "rename"), (os, "replace"), (shutil, "rmtree")):
        real = getattr(module, name)

        def checked(*args, _real=real, _name=name, **kwargs):
            result = _real(*args, **kwargs)
            complete(_name)
            return result

        monkeypatch.setattr(module, name, checked)
    exchanged = []
    real_exchange = report._exchange
    monkeypatch.setattr(report, "_exchange", lambda a, b: exchanged.append(a) or real_exchange(a, b))
    report.render(run, "results/report")
    assert exchanged and "rmtree" in seen
    assert (out / "notes.txt").read_text() == "kept"
    assert [p.name for p in Path("results").iterdir() if p.name.startswith(".report")] == []  # nothing left


def test_two_renames_where_no_exchange_is_offered(run, monkeypatch):
    report.render(run, "results/report")
    Path("results/report/figures/stale.png").write_bytes(b"x")  # of the old report: gone with it
    monkeypatch.setattr(report, "_exchange", lambda a, b: False)
    report.render(run, "results/report")
    assert not Path("results/report/figures/stale.png").exists()
    assert Path("results/report/data/timing/t-01.json").is_file()
    assert [p.name for p in Path("results").iterdir() if p.name.startswith(".report")] == []


def test_report_job_writes_utf8_under_the_c_locale(run, tmp_path):
    """`LC_ALL=C PYTHONUTF8=0` makes Python's default encoding ASCII; the report's files hold "×", "µ" and "→",
    and a result may hold any character."""
    path = tmp_path / paths.result("timing", "t-01")
    data = json.loads(path.read_text(encoding="utf-8"))
    data["environment"]["host"] = "nœud-1"
    write_json(path, data)
    (tmp_path / "inputs.json").write_text(json.dumps(run))
    env = dict(os.environ, LC_ALL="C", LANG="C", PYTHONUTF8="0", PYTHONIOENCODING="",
               PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    done = subprocess.run([sys.executable, "-m", "shapewise.report.report", "--inputs", "inputs.json", "--outdir",
                           "results/report"], cwd=tmp_path, env=env, capture_output=True, timeout=300)
    assert done.returncode == 0, done.stderr.decode(errors="replace")[-3000:]
    for name in ("report.md", "report.html"):
        text = (tmp_path / "results/report" / name).read_bytes().decode("utf-8")
        assert "×" in text and "nœud-1" in text


def test_speedup_outside_its_interval_is_drawn_and_named(run, tmp_path):
    """A paired interval over the rounds need not hold the ratio of the medians; the figure draws the interval
    where it lies (matplotlib refuses a negative error bar) and the limitations name the row."""
    path = tmp_path / paths.result("timing", "t-01")
    data = json.loads(path.read_text(encoding="utf-8"))
    data["speedup_ci"].update(low=data["speedup"] * 1.05, high=data["speedup"] * 1.2)
    write_json(path, data)
    report.render(run, "results/report")
    assert Path("results/report/figures/speedup.png").stat().st_size > 0
    md = " ".join(Path("results/report/report.md").read_text().split())
    assert "t-01: its speedup 9.565× lies outside its own 95 % interval [10.04, 11.48]" in md
    html = " ".join(Path("results/report/report.html").read_text().split())
    assert "t-01: its speedup 9.565× lies outside its own 95 % interval" in html
    assert "t-02: its speedup" not in md


def test_ablation_heat_map_of_fifteen_switches_keeps_its_labels_readable(tmp_path, monkeypatch):
    """The page shows a figure at most 1200 px wide; a heat map drawn wider is shrunk, and its labels with it."""
    from PIL import Image

    from test_browser import MANY_SWITCHES

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(test_report, "SWITCHES", MANY_SWITCHES)
    report.render(make_run(tmp_path), "results/report")
    with Image.open("results/report/figures/ablation.png") as image:
        assert image.size[0] <= 1200, image.size
    assert report.report_figures.HEATMAP_MAX_WIDTH * report.report_figures.FIGURE_DPI <= 1200


def test_result_that_is_not_utf8_is_named(run, tmp_path):
    path = paths.result("accuracy", "t-02")
    (tmp_path / path).write_bytes(b'{"step": "accuracy", "host": "\xff"}')
    with pytest.raises(report.ReportInputError) as info:
        report.render(run, "results/report")
    assert f"{path}: damaged, not UTF-8 text (byte 30)" in str(info.value)
