"""`shapewise compare OLD NEW` on hand-made report directories."""

import csv
import json

import pytest

from shapewise.cli import main as cli_main
from shapewise.report import compare

# summary.csv columns of the current report (shapewise.report.report_data.SUMMARY_COLUMNS, spelled out so that a change
# of that list fails here), and of reports written before the intervals.
COLUMNS = ["id", "machine", "status", "call", "route", "failed_elements", "total_elements", "max_abs_error",
           "strict_failed_elements", "reference_median_ms", "reference_ci_low_ms", "reference_ci_high_ms",
           "optimized_median_ms", "optimized_ci_low_ms", "optimized_ci_high_ms", "speedup", "speedup_ci_low",
           "speedup_ci_high", "noisy", "target_ms", "target_met", "optimized_peak_memory_bytes", "io_bytes",
           "unmasked_median_ms", "mask_cost", "mask_cost_ci_low", "mask_cost_ci_high"]
OLD_COLUMNS = ["id", "status", "route", "failed_elements", "total_elements", "max_abs_error",
               "reference_median_ms", "optimized_median_ms", "speedup"]
H200 = "NVIDIA H200 | software aaaa"


def row(id, opt, ref=2.0, opt_ci=0.01, ref_ci=0.02, machine=H200, route="fused(32,4,2)", status="pass"):
    """A summary row; opt_ci / ref_ci are the interval's half-widths relative to the median (None: no interval)."""
    r = {"id": id, "machine": machine, "status": status, "call": "model(x, mask)", "route": route,
         "failed_elements": 0, "total_elements": 100, "max_abs_error": 1e-4, "strict_failed_elements": 0,
         "reference_median_ms": ref, "optimized_median_ms": opt, "speedup": ref / opt,
         "noisy": False, "target_ms": "", "target_met": "", "optimized_peak_memory_bytes": 1024, "io_bytes": ""}
    for model, median, half in (("reference", ref, ref_ci), ("optimized", opt, opt_ci)):
        r[f"{model}_ci_low_ms"] = "" if half is None else median * (1 - half)
        r[f"{model}_ci_high_ms"] = "" if half is None else median * (1 + half)
    return r


def report(path, rows, columns=COLUMNS):
    path.mkdir(parents=True, exist_ok=True)
    with open(path / "summary.csv", "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=columns, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    return path


def run(tmp_path, old_rows, new_rows, **kwargs):
    old = compare.load_rows(report(tmp_path / "old", old_rows))
    new = compare.load_rows(report(tmp_path / "new", new_rows))
    return compare.compare_rows(old, new, **kwargs)


def by_id(result, id, machine=H200):
    (found,) = [r for r in result["rows"] if r["id"] == id and r["machine"] == machine]
    return found


def test_load_rows_parses_numbers_and_empty_cells(tmp_path):
    (r,) = compare.load_rows(report(tmp_path, [row("a", 1.0)]))
    assert r["id"] == "a" and r["machine"] == H200 and r["machine_source"] == "summary.csv"
    assert r["optimized_median_ms"] == 1.0 and r["optimized_ci_low_ms"] == pytest.approx(0.99)
    assert r["total_elements"] == 100 and isinstance(r["total_elements"], int)
    assert r["noisy"] is False and r["target_ms"] is None and r["io_bytes"] is None


def test_faster_slower_and_within_noise(tmp_path):
    old = [row("fast", 1.0), row("slow", 1.0), row("overlap", 1.0, opt_ci=0.10), row("small", 1.0, opt_ci=0.001)]
    new = [row("fast", 0.9), row("slow", 1.1), row("overlap", 1.06, opt_ci=0.10), row("small", 1.02, opt_ci=0.001)]
    result = run(tmp_path, old, new)
    assert by_id(result, "fast")["optimized"]["verdict"] == "faster"
    assert by_id(result, "fast")["optimized"]["change"] == pytest.approx(-0.1)
    assert by_id(result, "slow")["optimized"]["verdict"] == "slower"
    # +6 % but the intervals overlap: noise
    assert by_id(result, "overlap")["optimized"]["verdict"] == "within noise"
    # intervals apart but +2 % is under the optimized floor of 3 %
    assert by_id(result, "small")["optimized"]["verdict"] == "within noise"
    assert by_id(result, "fast")["reference"]["verdict"] == "within noise"
    assert result["regressions"] == ["slow"]
    assert all(r["status"] == "both" for r in result["rows"])


def test_floors_are_per_model_and_adjustable(tmp_path):
    old = [row("a", 1.0, ref=2.0, opt_ci=0.001, ref_ci=0.001)]
    new = [row("a", 1.04, ref=2.08, opt_ci=0.001, ref_ci=0.001)]  # +4 % for both, intervals apart
    result = run(tmp_path, old, new)
    assert by_id(result, "a")["optimized"]["verdict"] == "slower"  # above 3 %
    assert by_id(result, "a")["reference"]["verdict"] == "within noise"  # under 5 %
    result = run(tmp_path, old, new, floors={"optimized": 0.05, "reference": 0.03})
    assert by_id(result, "a")["optimized"]["verdict"] == "within noise"
    assert by_id(result, "a")["reference"]["verdict"] == "slower"
    assert result["regressions"] == []


def test_rows_added_and_removed(tmp_path):
    result = run(tmp_path, [row("a", 1.0), row("gone", 1.0)], [row("a", 1.0), row("new", 5.0)])
    assert by_id(result, "gone")["status"] == "removed"
    assert by_id(result, "new")["status"] == "added"
    assert by_id(result, "new")["optimized"] == {"old_ms": None, "new_ms": 5.0, "change": None,
                                                 "verdict": "n/a", "basis": None}
    assert result["regressions"] == [] and result["not_comparable"] == []
    text = "\n".join(compare.format_comparison(result))
    assert "rows added: new" in text and "rows removed: gone" in text


def test_another_machine_is_never_compared(tmp_path):
    other = "NVIDIA A100 | software bbbb"
    result = run(tmp_path, [row("a", 1.0), row("b", 1.0)], [row("a", 1.0), row("b", 3.0, machine=other)])
    assert by_id(result, "b")["status"] == "removed"
    assert by_id(result, "b", other)["status"] == "added"
    assert by_id(result, "b", other)["optimized"]["verdict"] == "n/a"
    assert result["regressions"] == []
    assert result["not_comparable"] == [{"id": "b", "old_machines": [H200], "new_machines": [other]}]
    text = "\n".join(compare.format_comparison(result))
    assert "not comparable" in text and f"b: old on {H200}; new on {other}" in text
    assert "rows added" not in text


def test_same_gpu_compares_across_software_and_names_both_machines(tmp_path, capsys):
    newer = "NVIDIA H200 | software cccc"
    old = report(tmp_path / "old", [row("a", 1.0), row("b", 1.0, machine="NVIDIA A100 | software aaaa")])
    new = report(tmp_path / "new", [row("a", 1.5, machine=newer), row("b", 1.0, machine="NVIDIA A100 | software dd")])
    assert cli_main(["compare", str(old), str(new)]) == 2  # by machine: nothing in common
    assert cli_main(["compare", "--same-gpu", str(old), str(new)]) == 1  # by GPU: a slower beyond noise
    out = capsys.readouterr().out
    assert f"machines of {old}: NVIDIA A100 | software aaaa, {H200}; of {new}: NVIDIA A100 | software dd, {newer}" in out
    assert "REGRESSION: optimized model slower beyond noise on 1 row(s): a" in out
    assert "machine NVIDIA A100" in out and "machine NVIDIA H200" in out  # b still only against the A100's b


def test_the_projects_own_install_is_not_software(monkeypatch):
    # installing shapewise itself (pip install -e .) must not make two runs' machines differ
    from shapewise.provenance import inventory

    class Dist:
        def __init__(self, name, version):
            self.metadata, self.version = {"Name": name}, version

    dists = [Dist("torch", "2.11.0"), Dist("Shapewise", "0.1.0")]
    monkeypatch.setattr(inventory.importlib.metadata, "distributions", lambda: dists)
    assert inventory.installed_packages() == ["torch==2.11.0"]


def test_route_change_is_listed(tmp_path):
    result = run(tmp_path, [row("a", 1.0), row("b", 1.0)], [row("a", 1.0, route="graph"), row("b", 1.0)])
    assert by_id(result, "a")["route_changed"] and not by_id(result, "b")["route_changed"]
    assert (by_id(result, "a")["route_old"], by_id(result, "a")["route_new"]) == ("fused(32,4,2)", "graph")
    assert "route changed: a: fused(32,4,2) -> graph" in "\n".join(compare.format_comparison(result))


def test_old_format_summary_reads_machine_from_timing_json(tmp_path):
    old_rows = [row("a", 1.0, route="fused/fp16 launch=(32, 4, 2) (auto: short)"),
                row("b", 1.0, route="graph/fp16 (auto: launch-bound)"), row("c", 1.0)]
    old_dir = report(tmp_path / "old", old_rows, columns=OLD_COLUMNS)
    (old_dir / "data" / "timing").mkdir(parents=True)
    for id in ("a", "b"):
        (old_dir / "data" / "timing" / f"{id}.json").write_text(json.dumps({"environment": {"machine_key": H200}}))
    old = compare.load_rows(old_dir)
    assert [(r["id"], r["machine"], r["machine_source"]) for r in old] == [
        ("a", H200, "data/timing/a.json"), ("b", H200, "data/timing/b.json"), ("c", "unknown", "unknown")]
    assert "optimized_ci_low_ms" not in old[0]
    new = compare.load_rows(report(tmp_path / "new", [row("a", 1.2), row("b", 1.0, route="fused(32,4,2)"),
                                                      row("c", 1.0)]))
    result = compare.compare_rows(old, new)
    a = by_id(result, "a")
    assert a["optimized"]["verdict"] == "slower" and a["optimized"]["basis"].startswith("floor only")
    assert "old run" in a["optimized"]["basis"]
    # an old full route string against a new short label: compared by route name only
    assert not a["route_changed"] and by_id(result, "b")["route_changed"]
    assert result["not_comparable"] == [{"id": "c", "old_machines": ["unknown"], "new_machines": [H200]}]
    assert result["regressions"] == ["a"]
    text = "\n".join(compare.format_comparison(result))
    assert "slower*" in text and "the verdict rests on the floor alone" in text


def test_cli_exit_codes(tmp_path, capsys):
    old = report(tmp_path / "old", [row("a", 1.0)])
    same = report(tmp_path / "same", [row("a", 1.005)])
    worse = report(tmp_path / "worse", [row("a", 1.5)])
    assert cli_main(["compare", str(old), str(same)]) == 0
    assert "no regression" in capsys.readouterr().out
    assert cli_main(["compare", str(old), str(worse)]) == 1
    assert "REGRESSION: optimized model slower beyond noise on 1 row(s): a" in capsys.readouterr().out
    assert cli_main(["compare", "--optimized-floor", "0.6", str(old), str(worse)]) == 0


def test_a_row_that_passed_and_no_longer_does_fails_the_comparison(tmp_path, capsys):
    old = report(tmp_path / "old", [row("a", 1.0), row("b", 1.0)])
    skipped = report(tmp_path / "skipped", [row("a", 1.0), dict(row("b", 1.0, status="resource-skip"),
                                                                   optimized_median_ms="", speedup="")])
    assert cli_main(["compare", str(old), str(skipped)]) == 1
    assert "LOST: 1 row(s) passed in" in capsys.readouterr().out
    assert run(tmp_path, [row("a", 1.0)], [row("a", 1.0, status="fail")])["lost"] == ["a"]
    assert run(tmp_path, [row("a", 1.0, status="fail")], [row("a", 1.0)])["lost"] == []  # fixed: not lost


def test_unreadable_input_exits_2_naming_the_file(tmp_path, capsys):
    good = report(tmp_path / "good", [row("a", 1.0)])
    assert cli_main(["compare", str(good), str(tmp_path / "nowhere")]) == 2
    assert str(tmp_path / "nowhere" / "summary.csv") in capsys.readouterr().err

    bad = report(tmp_path / "bad", [dict(row("a", 1.0), optimized_median_ms="fast")])
    assert cli_main(["compare", str(good), str(bad)]) == 2
    err = capsys.readouterr().err
    assert str(bad / "summary.csv") in err and "line 2" in err and "optimized_median_ms" in err

    nocol = report(tmp_path / "nocol", [row("a", 1.0)], columns=["id", "status", "route"])
    assert cli_main(["compare", str(nocol), str(good)]) == 2
    assert "missing column(s) reference_median_ms, optimized_median_ms" in capsys.readouterr().err

    broken = report(tmp_path / "broken", [row("a", 1.0)], columns=OLD_COLUMNS)
    (broken / "data" / "timing").mkdir(parents=True)
    (broken / "data" / "timing" / "a.json").write_text("{not json")
    assert cli_main(["compare", str(broken), str(good)]) == 2
    assert str(broken / "data" / "timing" / "a.json") in capsys.readouterr().err
