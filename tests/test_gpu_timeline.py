"""benchmarks.gpu_timeline: exclusive time, the gaps between exclusive jobs, and what held the GPU in each gap."""
import json

import pytest

from benchmarks.gpu_timeline import timeline

GPU = "GPU-0000"


def write_result(results, name, mode, start_s, end_s):
    """A GPU job's result holding GPU for [start_s, end_s] seconds after 10:00:00 in `mode`."""
    stamp = lambda s: f"2026-12-02T10:00:{s:02d}+00:00"  # noqa: E731
    path = results / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"started": stamp(start_s), "finished": stamp(end_s), "step": name.split("/")[0],
                                "device": "cuda", "environment": {"host": "h"},
                                "gpu": {"uuid": GPU, "lock": {"mode": mode, "acquired": stamp(start_s)}}}))


@pytest.fixture
def results(tmp_path):
    r = tmp_path / "results"
    write_result(r, "timing/a.json", "exclusive", 0, 10)
    write_result(r, "accuracy/b.json", "shared", 9, 30)      # holds the GPU through the gap
    write_result(r, "profile/c.json", "shared", 12, 14)      # inside the gap too
    write_result(r, "timing/d.json", "exclusive", 30, 40)    # 20 s after a
    write_result(r, "ablation/e.json", "exclusive", 42, 50)  # 2 s after d
    write_result(r, "report/data/timing/a.json", "exclusive", 0, 59)  # a report's copy: no job of its own
    return r


def test_exclusive_time_and_gaps(results):
    (gpu,) = timeline(results).values()
    assert gpu["jobs"] == 5 and gpu["span_s"] == 50.0
    assert gpu["exclusive_intervals"] == 3 and gpu["exclusive_s"] == 28.0
    assert gpu["gaps_between_exclusive_s"] == 22.0 and gpu["longest_gap_s"] == 20.0
    assert gpu["before_first_exclusive_s"] == 0.0 and gpu["after_last_exclusive_s"] == 0.0
    assert "gaps_over" not in gpu


def test_gaps_over_a_threshold_name_the_next_exclusive_job_and_the_shared_jobs_in_them(results):
    (gpu,) = timeline(results, min_gap_s=5).values()
    (gap,) = gpu["gaps_over"]["gaps"]  # the 2 s gap before e is below the threshold
    assert gap["at_s"] == 10.0 and gap["gap_s"] == 20.0 and gap["next_exclusive"] == "timing/d.json"
    assert [(j["job"], j["from_s"], j["to_s"]) for j in gap["shared_in_gap"]] == [
        ("accuracy/b.json", 9.0, 30.0), ("profile/c.json", 12.0, 14.0)]
    assert len(timeline(results, min_gap_s=1)[GPU]["gaps_over"]["gaps"]) == 2
