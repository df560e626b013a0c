"""CPU cores of GPU slots (shapewise.execution.cpus): whole physical cores per slot, from fake sysfs trees; every GPU
job of the local lock pool pins itself at start and records it (`cpu_affinity`)."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from shapewise.execution import cpus, gpuslots

ROOT = Path(__file__).resolve().parent.parent


def fake_sysfs(root, places):
    """A sysfs cpu tree: places = {logical CPU: (package, core_id)}."""
    for cpu, (package, core) in places.items():
        topo = root / f"cpu{cpu}" / "topology"
        topo.mkdir(parents=True)
        (topo / "physical_package_id").write_text(f"{package}\n")
        (topo / "core_id").write_text(f"{core}\n")
    return root


def assert_whole_cores(places, shares):
    """Every slot gets whole physical cores (no sibling pair split), the shares are disjoint and cover all."""
    owner = {}
    for index, share in enumerate(shares):
        for cpu in share:
            owner.setdefault(places[cpu], set()).add(index)
    assert all(len(slots) == 1 for slots in owner.values()), owner
    assert sorted(c for share in shares for c in share) == sorted(places)


@pytest.fixture
def restore_affinity(monkeypatch):
    original, threads = os.sched_getaffinity(0), torch.get_num_threads()
    monkeypatch.setattr(cpus, "_JOB_START", None)
    yield sorted(original)
    os.sched_setaffinity(0, original)
    torch.set_num_threads(threads)


def test_siblings_k_and_k_plus_16_stay_together(tmp_path):
    places = {cpu: (0, cpu % 16) for cpu in range(32)}
    root = fake_sysfs(tmp_path, places)
    shares = [cpus.slot_cores(range(32), k, 2, root) for k in range(2)]
    assert [s["cores"] for s in shares] == [list(range(8)) + list(range(16, 24)),
                                             list(range(8, 16)) + list(range(24, 32))]
    assert [(s["physical_cores"], s["allowed_physical_cores"], s["topology"]) for s in shares] == [
        (8, 16, "sysfs"), (8, 16, "sysfs")]
    assert_whole_cores(places, [s["cores"] for s in shares])


def test_siblings_2k_and_2k_plus_1_stay_together(tmp_path):
    places = {cpu: (0, cpu // 2) for cpu in range(32)}
    root = fake_sysfs(tmp_path, places)
    shares = [cpus.slot_cores(range(32), k, 2, root)["cores"] for k in range(2)]
    assert shares == [list(range(16)), list(range(16, 32))]
    assert_whole_cores(places, shares)
    # a cgroup that allows one sibling of a core: that core is still one core, of one slot
    allowed = [c for c in range(32) if c != 5]
    shares = [cpus.slot_cores(allowed, k, 2, root)["cores"] for k in range(2)]
    assert shares == [[0, 1, 2, 3, 4, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15], list(range(16, 32))]


def test_two_packages_a_slot_stays_on_one_package(tmp_path):
    # 2 packages x 8 cores x 2 threads; core ids repeat on each package, siblings k and k+16
    places = {}
    for package in range(2):
        for core in range(8):
            places[package * 8 + core] = places[package * 8 + core + 16] = (package, core)
    root = fake_sysfs(tmp_path, places)
    two = [cpus.slot_cores(range(32), k, 2, root)["cores"] for k in range(2)]
    assert two == [list(range(8)) + list(range(16, 24)), list(range(8, 16)) + list(range(24, 32))]
    four = [cpus.slot_cores(range(32), k, 4, root)["cores"] for k in range(4)]
    assert_whole_cores(places, four)
    assert [{places[c][0] for c in share} for share in four] == [{0}, {0}, {1}, {1}]


def test_missing_sysfs_counts_each_cpu_as_a_core_and_says_so(tmp_path):
    share = cpus.slot_cores([0, 1, 2, 3], 1, 2, tmp_path / "no-sysfs")
    assert share["cores"] == [2, 3] and share["physical_cores"] == 2
    assert share["topology"].startswith("unknown: cannot read ")
    assert str(tmp_path / "no-sysfs" / "cpu0" / "topology" / "physical_package_id") in share["topology"]
    # one CPU whose core_id is unreadable is enough: no half-read topology
    root = fake_sysfs(tmp_path / "sys", {0: (0, 0), 1: (0, 0)})
    (root / "cpu1" / "topology" / "core_id").write_text("garbage\n")
    assert cpus.slot_cores([0, 1], 0, 2, root)["cores"] == [0]


def test_three_slots_over_four_cores(tmp_path):
    places = {cpu: (0, cpu // 2) for cpu in range(8)}
    root = fake_sysfs(tmp_path, places)
    shares = [cpus.slot_cores(range(8), k, 3, root) for k in range(3)]
    assert [s["cores"] for s in shares] == [[0, 1], [2, 3], [4, 5, 6, 7]]
    assert [s["physical_cores"] for s in shares] == [1, 1, 2]
    with pytest.raises(cpus.CpuSlotError, match="slot index 3 is not among the 3 slots"):
        cpus.slot_cores(range(8), 3, 3, root)


def test_more_slots_than_cores_gives_no_core_of_its_own(tmp_path, restore_affinity):
    places = {cpu: (0, cpu // 2) for cpu in range(4)}  # 2 cores, 4 logical CPUs
    root = fake_sysfs(tmp_path, places)
    assert [cpus.slot_cores(range(4), k, 3, root)["cores"] for k in range(3)] == [[], [], []]
    env = {gpuslots.SOURCE_VAR: "lock", gpuslots.POOL_VAR: "0,1,2", gpuslots.SLOT_VAR: "2"}
    record = cpus.place_slot("per-slot", range(4), env, root)
    assert record["applied"] is False and record["cores"] == restore_affinity
    assert record["reason"] == "2 physical cores for 3 GPUs: no core of its own, left as they were"


def machine_sysfs(root, allowed):
    """A fake tree for this machine's own CPUs, each its own core (the tests really pin the process)."""
    return fake_sysfs(root, {cpu: (0, cpu) for cpu in allowed})


def test_job_start_pins_only_a_lock_pool_slot(tmp_path, restore_affinity):
    allowed = restore_affinity
    root = machine_sysfs(tmp_path, allowed)
    for source in ("slurm", "user", "none"):
        env = {gpuslots.SOURCE_VAR: source, gpuslots.POOL_VAR: "0,1", gpuslots.SLOT_VAR: "1"}
        record = cpus.pin_job(env, root)
        assert record["applied"] is False and record["cores"] == allowed, record
        assert "cores left as they were" in record["reason"]
    # a pool of one GPU: its slot gets every allowed core
    record = cpus.pin_job({gpuslots.SOURCE_VAR: "lock", gpuslots.POOL_VAR: "3", gpuslots.SLOT_VAR: "3"}, root)
    assert record["applied"] and record["cores"] == allowed and record["physical_cores"] == len(allowed)
    with pytest.raises(cpus.CpuSlotError, match="SHAPEWISE_PIPELINE_GPU_SLOT='5' is not in the pool"):
        cpus.pin_job({gpuslots.SOURCE_VAR: "lock", gpuslots.POOL_VAR: "0,3", gpuslots.SLOT_VAR: "5"}, root)
    if len(allowed) < 2:
        pytest.skip("one CPU: nothing to split")
    env = {gpuslots.SOURCE_VAR: "lock", gpuslots.POOL_VAR: "0,3", gpuslots.SLOT_VAR: "3"}
    record = cpus.pin_job(env, root)
    second_half = allowed[len(allowed) // 2:]
    assert record == {"requested": "per-slot", "allowed": allowed, "cores": second_half, "applied": True,
                      "topology": "sysfs", "physical_cores": len(second_half),
                      "reason": f"slot 2 of 2: pinned to {len(second_half)} of {len(allowed)} physical cores "
                                f"({len(second_half)} of {len(allowed)} logical CPUs)"}
    assert sorted(os.sched_getaffinity(0)) == second_half and cpus.job_start() == record


def test_timing_cpus_apply_on_top_of_the_job_start(tmp_path, monkeypatch, restore_affinity):
    from shapewise.jobs import device as dev

    allowed = restore_affinity
    if len(allowed) < 2:
        pytest.skip("one CPU: nothing to split")
    monkeypatch.setattr(cpus, "SYSFS_ROOT", str(machine_sysfs(tmp_path, allowed)))
    for name, value in ((gpuslots.SOURCE_VAR, "lock"), (gpuslots.POOL_VAR, "0,1"), (gpuslots.SLOT_VAR, "1")):
        monkeypatch.setenv(name, value)
    started = cpus.pin_job()
    second_half = allowed[len(allowed) // 2:]
    assert started["cores"] == second_half
    # every result's header: the job-start record, torch threads capped at its cores
    torch.set_num_threads(len(allowed))
    header = dev.job_cpu_affinity()
    assert header["cores"] == second_half and header["torch_threads"] == len(second_half)
    # inherit = as the job started: its slot's cores, and the record says so
    inherit = dev.pin_cpus("inherit")
    assert (inherit["requested"], inherit["cores"], inherit["allowed"]) == ("inherit", second_half, allowed)
    assert inherit["reason"].startswith("left as the job started (slot 2 of 2: pinned to")
    # per-slot again: the same share of the cores the job was allowed at its start, not half of the half
    again = dev.pin_cpus("per-slot")
    assert again["applied"] and again["cores"] == second_half and again["allowed"] == allowed
    # a list may name any core the job was allowed at its start
    listed = dev.pin_cpus([allowed[0]])
    assert listed["cores"] == [allowed[0]] and sorted(os.sched_getaffinity(0)) == [allowed[0]]
    assert listed["physical_cores"] == 1 and listed["topology"] == "sysfs"


DRIVER = textwrap.dedent("""
    import importlib, json, os, sys
    from types import SimpleNamespace

    from shapewise import cli
    from shapewise.execution import cpus

    cpus.SYSFS_ROOT = sys.argv[1]
    seen = {}
    real_import = importlib.import_module


    def import_job_module(name, *rest):
        # the job module is imported right after the slot is taken: note what the process is then, and give
        # this CPU machine's torch the fake slot's GPU
        if name.startswith("shapewise.jobs.") and not seen:
            seen["torch_imported"] = "torch" in sys.modules
            seen["affinity"] = sorted(os.sched_getaffinity(0))
            import torch

            props = SimpleNamespace(name="fake GPU", uuid="fake-0", total_memory=2**30, multi_processor_count=1,
                                    major=9, minor=0)
            torch.cuda.is_available = lambda: True
            torch.cuda.current_device = lambda: 0
            torch.cuda.get_device_properties = lambda index: props
        return real_import(name, *rest)


    importlib.import_module = import_job_module
    code = cli.main(sys.argv[2:])
    print("SEEN " + json.dumps(seen))
    raise SystemExit(code)
""")


def test_cli_gpu_job_pins_its_slot_before_torch_and_records_it(tmp_path):
    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < 2:
        pytest.skip("one CPU: nothing to split")
    root = machine_sysfs(tmp_path / "sys", allowed)
    env = dict(os.environ)
    for name in [n for n in env if n.startswith("SHAPEWISE_") or n in ("CUDA_VISIBLE_DEVICES", "SLURM_JOB_ID")]:
        del env[name]
    env.update({"PYTHONPATH": str(ROOT / "workflow"), gpuslots.FAKE_VAR: "2", gpuslots.POOL_VAR: "0,1"})
    out = tmp_path / "fp.json"
    done = subprocess.run([sys.executable, "-c", DRIVER, str(root), "job", "fingerprint", "--kind", "environment",
                           "--device", "cuda", "--dag-digest", "x", "--root", str(ROOT), "--out", str(out)],
                          env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    seen = json.loads(next(line[5:] for line in done.stdout.splitlines() if line.startswith("SEEN ")))
    result = json.loads(out.read_text())
    slot = result["environment"]["shapewise_variables"][gpuslots.SLOT_VAR]
    index = ["0", "1"].index(slot)
    share = allowed[index * len(allowed) // 2:(index + 1) * len(allowed) // 2]
    record = result["cpu_affinity"]
    assert (record["requested"], record["allowed"], record["cores"], record["applied"]) == (
        "per-slot", allowed, share, True)
    assert (record["topology"], record["physical_cores"], record["torch_threads"]) == ("sysfs", len(share),
                                                                                        len(share))
    assert record["reason"].startswith(f"slot {index + 1} of 2: pinned to {len(share)} of {len(allowed)} ")
    assert seen == {"torch_imported": False, "affinity": share}
