"""The device a job runs on: setup, synchronization, per-call timers, memory readings."""

from __future__ import annotations

import math
import statistics
import time

import torch


def setup(device, threads=None):
    if threads:
        torch.set_num_threads(int(threads))
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("device cuda was chosen but torch sees no CUDA GPU (set SHAPEWISE_DEVICE=cpu?)")
    return torch.device(device)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def time_calls(fn, device, count):
    """Milliseconds of each of `count` calls: a CUDA event pair per call on a
    GPU (the GPU time between the two events, launch gaps included), or
    time.perf_counter around each call on the CPU."""
    if count <= 0:
        return []
    if device.type == "cuda":
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(count)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(count)]
        for start, end in zip(starts, ends):
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize()
        return [s.elapsed_time(e) for s, e in zip(starts, ends)]
    times = []
    for _ in range(count):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def first_call_ms(fn, device):
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return (time.perf_counter() - t0) * 1e3


def summarize(times_ms):
    if not times_ms:
        return None
    ordered = sorted(times_ms)
    p90_index = min(len(ordered) - 1, math.ceil(0.9 * len(ordered)) - 1)
    return {
        "count": len(ordered),
        "median_ms": statistics.median(ordered),
        "p90_ms": ordered[p90_index],
        "min_ms": ordered[0],
        "max_ms": ordered[-1],
        "mean_ms": statistics.fmean(ordered),
    }


def peak_memory_reset(device):
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def peak_memory_bytes(device):
    if device.type == "cuda":
        torch.cuda.synchronize()
        return int(torch.cuda.max_memory_allocated())
    return None


def free_memory_bytes(device):
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info()
        return int(free), int(total)
    available = total = None
    with open("/proc/meminfo") as fh:
        for line in fh:
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
            elif line.startswith("MemTotal:"):
                total = int(line.split()[1]) * 1024
    return available, total
