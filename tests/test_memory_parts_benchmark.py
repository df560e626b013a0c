"""benchmarks.memory_parts: each sharing job's parts, estimate and peak, and the moment the most was held at once."""
import json

from benchmarks.memory_parts import sharers, worst_moments

GPU = "GPU-0000"


def stamp(s):
    return f"2026-12-06T10:00:{s:02d}+00:00"


def write(results, name, step, row, mode, start_s, end_s, peak=None, share_slots=None, **extra):
    lock = {"mode": mode, "acquired": stamp(start_s)}
    if share_slots:
        lock["share_slots"] = share_slots
    gpu = {"uuid": GPU, "lock": lock}
    if peak is not None:
        gpu["peak_allocated_bytes"], gpu["peak_reserved_bytes"] = peak, peak * 1.25
    path = results / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"step": step, "row": {"id": row}, "started": stamp(start_s),
                                "finished": stamp(end_s), "device": "cuda", "gpu": gpu, **extra}))


def test_parts_estimates_peaks_and_the_worst_moment(tmp_path):
    r = tmp_path / "results"
    write(r, "preflight/big.json", "preflight", "big", "shared", 0, 1, total_bytes=150e9,
          environment={"cuda_visible_devices": GPU}, job_bytes={"accuracy": 62e9, "profile": 28e9})
    write(r, "preflight/small.json", "preflight", "small", "shared", 0, 1, total_bytes=150e9,
          environment={"cuda_visible_devices": GPU}, job_bytes={"accuracy": 1e9, "profile": 1e9})
    write(r, "accuracy/big.json", "accuracy", "big", "shared", 2, 30, peak=50e9, share_slots=[0, 1, 2])
    write(r, "accuracy/small.json", "accuracy", "small", "shared", 5, 10, peak=2e9)  # above its estimate
    write(r, "profile/big/kernels.json", "profile", "big", "shared", 31, 40, peak=20e9, share_slots=[0, 1])
    write(r, "timing/small.json", "timing", "small", "exclusive", 41, 45)  # held alone: not a sharer
    jobs, _, totals = sharers(r)
    by_job = {j["job"]: j for j in jobs}
    assert set(by_job) == {"preflight/big.json", "preflight/small.json", "accuracy/big.json", "accuracy/small.json",
                           "profile/big/kernels.json"}
    assert by_job["accuracy/big.json"]["parts"] == 3 and by_job["accuracy/big.json"]["peak_over_estimate"] == 0.806
    assert by_job["accuracy/small.json"]["peak_over_estimate"] == 2.0
    assert totals == {GPU: 150e9}
    (worst,) = worst_moments(jobs).values()
    assert worst["most_estimate_bytes"] == 63e9
    assert worst["jobs_at_most_estimate_bytes"] == ["accuracy/big.json", "accuracy/small.json"]
    assert worst["most_peak_reserved_bytes"] == 65e9


def test_a_job_that_prepared_sharing_counts_as_a_sharer_until_it_held_the_gpu_alone(tmp_path):
    r = tmp_path / "results"
    write(r, "preflight/small.json", "preflight", "small", "shared", 0, 1, total_bytes=150e9,
          environment={"cuda_visible_devices": GPU}, job_bytes={"timing": 3e9})
    write(r, "timing/small.json", "timing", "small", "exclusive", 2, 30, peak=2e9)
    data = json.loads((r / "timing/small.json").read_text())
    data["gpu"]["lock"].update(shared_until=stamp(8), alone_since=stamp(12), shared_peak_allocated_bytes=1.5e9)
    (r / "timing/small.json").write_text(json.dumps(data))
    jobs, _, _ = sharers(r)
    (timing,) = [j for j in jobs if j["step"] == "timing"]
    assert timing["parts"] == 1 and timing["estimate_bytes"] == 3e9
    assert (timing["start"].second, timing["end"].second) == (2, 8) and timing["peak_over_estimate"] == 0.5
