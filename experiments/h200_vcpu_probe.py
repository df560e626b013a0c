"""Issue #14: where the reference's between-process spread comes from on the lent H200 node.

The node is a KVM guest: 32 vCPUs shown as 32 cores of one socket, so the guest cannot see which physical core
(or hyperthread, shared with whom) backs a vCPU. The host-bound reference's median moved by up to 2x between
processes of one machine while staying steady inside a process, and some processes switched between two levels
round by round. Hypothesis: the cost of issuing a CUDA launch depends on which vCPU the Python thread runs on,
and a process that is free to move between vCPUs lands on a fast or a slow one.

Usage (CUDA machine, about four device minutes): python -m experiments.h200_vcpu_probe OUT_DIR [ROW ...]
1. Launch cost per vCPU: this process pinned to one vCPU at a time issues 1000 tiny kernels without waiting;
   host microseconds per launch, median of 3 repeats. Repeated between the rows (passes 0..N) to see whether a
   vCPU's speed holds over minutes.
2. For each row (default 1, 4, 11: host-bound reference), fresh processes that time the reference and the
   optimized model (20 warm-up calls, 8 alternating rounds of 50, CUDA events per call, median): three free to
   use every vCPU, three pinned to the fastest vCPU of pass 0, two pinned to the slowest.
Writes OUT_DIR/vcpu_probe.json and prints a summary.
`python -m experiments.h200_vcpu_probe --summarize OUT_DIR/vcpu_probe.json` prints, per launch-cost pass, how many
vCPUs were on the slow level (above SLOW_US) and the range, and how many vCPUs changed level between passes.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROWS = (1, 4, 11)
SLOW_US = 8.0  # between the two levels the passes show (6.3-7.2 and 8.1-10.9 µs per launch on session 6's node)
WARMUP, ROUNDS, CALLS = 20, 8, 50


def child(row_number: int, cpus: str) -> dict:
    """One fresh process: pin (before torch starts its threads), build both models, time alternating rounds."""
    if cpus != "free":
        os.sched_setaffinity(0, {int(c) for c in cpus.split(",")})
    import torch

    from experiments.h200_mask_cost import build, official, timed
    from shapewise.model import BaselineTransformer, generate_random_case

    torch.set_float32_matmul_precision("high")
    row = official()[row_number]
    cfg, opt = build(row)
    torch.manual_seed(0)
    ref = BaselineTransformer(cfg)
    ref.load_state_dict(opt.state_dict(), strict=True)
    ref = ref.to("cuda").eval()
    x, mask = generate_random_case(cfg, "cuda", torch.float32, 1234)
    if mask is None:  # the official call: an all-True bool mask when padding_ratio is 0
        mask = torch.ones(x.shape[:2], dtype=torch.bool, device="cuda")
    calls = {"reference": lambda: ref(x, mask), "optimized": lambda: opt(x, mask)}
    seen = set()
    out = {"row": row_number, "cpus": cpus, "pid": os.getpid()}
    with torch.inference_mode():
        for fn in calls.values():
            timed(fn, WARMUP)
        rounds = {k: [] for k in calls}
        for _ in range(ROUNDS):
            for k, fn in calls.items():
                rounds[k].append(statistics.median(timed(fn, CALLS)))
                seen.add(int(Path('/proc/self/stat').read_text().rsplit(')', 1)[1].split()[36]))  # field 39: last CPU
    for k, v in rounds.items():
        out[f"{k}_median_ms"] = statistics.median(v)
        out[f"{k}_round_medians_ms"] = v
    out["vcpus_seen"] = sorted(seen)
    return out


def launch_pass(cpus) -> dict:
    """Host microseconds per tiny-kernel launch on each vCPU (this process pinned to it in turn)."""
    import torch

    y = torch.zeros(16, device="cuda")
    per_cpu = {}
    for cpu in cpus:
        os.sched_setaffinity(0, {cpu})
        time.sleep(0.002)
        samples = []
        for _ in range(3):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(1000):
                y.add_(1.0)
            samples.append((time.perf_counter() - t0) * 1e3)  # ms per 1000 launches = µs per launch
            torch.cuda.synchronize()
        per_cpu[cpu] = statistics.median(samples)
    os.sched_setaffinity(0, set(cpus))
    return per_cpu


def run_child(row_number, cpus):
    cmd = [sys.executable, "-m", "experiments.h200_vcpu_probe", "--child", str(row_number), cpus]
    t0 = time.time()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        return {"row": row_number, "cpus": cpus, "error": done.stderr[-2000:]}
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["wall_s"] = round(time.time() - t0, 1)
    return result


def main(out_dir: str, rows) -> None:
    import torch

    torch.cuda.init()
    cpus = sorted(os.sched_getaffinity(0))
    report = {"cpus": cpus, "passes": [], "children": [], "started": time.time()}
    first = launch_pass(cpus)
    report["passes"].append({"at_s": 0.0, "us_per_launch": first})
    order = sorted(first, key=first.get)
    fastest, slowest = order[0], order[-1]
    report["fastest"], report["slowest"] = fastest, slowest
    print(f"pass 0: µs per launch min {first[fastest]:.2f} (vCPU {fastest}), median "
          f"{statistics.median(first.values()):.2f}, max {first[slowest]:.2f} (vCPU {slowest})", flush=True)
    for row_number in rows:
        plan = ["free"] * 3 + [str(fastest)] * 3 + [str(slowest)] * 2
        for cpus_spec in plan:
            result = run_child(row_number, cpus_spec)
            report["children"].append(result)
            if "error" in result:
                print(f"row {row_number} cpus {cpus_spec}: ERROR {result['error'][-300:]}", flush=True)
                continue
            print(f"row {row_number} cpus {cpus_spec:>4}: reference {result['reference_median_ms']:.3f} ms, "
                  f"optimized {result['optimized_median_ms']:.4f} ms, vCPUs seen {result['vcpus_seen']}, "
                  f"ref rounds {[round(r, 2) for r in result['reference_round_medians_ms']]}", flush=True)
        again = launch_pass(cpus)
        report["passes"].append({"at_s": round(time.time() - report["started"], 1), "us_per_launch": again})
        print(f"pass {len(report['passes']) - 1}: fastest-of-pass-0 vCPU {fastest} {again[fastest]:.2f} µs, "
              f"slowest-of-pass-0 vCPU {slowest} {again[slowest]:.2f} µs, range "
              f"{min(again.values()):.2f}-{max(again.values()):.2f}", flush=True)
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    (Path(out_dir) / "vcpu_probe.json").write_text(json.dumps(report, indent=1))


def summarize(path: str) -> None:
    passes = json.loads(Path(path).read_text())["passes"]
    for p in passes:
        cost = p["us_per_launch"]
        slow = sum(v > SLOW_US for v in cost.values())
        print(f"pass at {p['at_s']:6.1f} s: {slow} of {len(cost)} vCPUs above {SLOW_US} µs per launch, range "
              f"{min(cost.values()):.2f}-{max(cost.values()):.2f} µs")
    levels = {cpu: [p["us_per_launch"][cpu] > SLOW_US for p in passes] for cpu in passes[0]["us_per_launch"]}
    changed = sum(len(set(v)) > 1 for v in levels.values())
    print(f"vCPUs that changed level between passes: {changed} of {len(levels)}")


if __name__ == "__main__":
    if sys.argv[1] == "--summarize":
        summarize(sys.argv[2])
    elif sys.argv[1] == "--child":
        print(json.dumps(child(int(sys.argv[2]), sys.argv[3])))
    else:
        main(sys.argv[1], [int(r) for r in sys.argv[2:]] or ROWS)
