"""This device's ceilings: copy bandwidth, GEMM throughput, launch latency.

GPU: device-to-device copy (GB/s, bytes read + bytes written), square GEMMs
in fp32 with TF32 off, TF32, fp16 and bf16 (TFLOP/s, 2 n^3 per product),
and the latency of a tiny kernel launched eagerly (host time per launch) and
replayed inside a CUDA graph (GPU time per kernel). On a GPU each number is
the median of triton.testing.do_bench (its warm-up and repetitions are set in
milliseconds, below; `repeats` is not used there); on a CPU the median of
`repeats` time.perf_counter-timed repetitions after warm-up.
CPU: copy bandwidth and fp32 GEMM; the GPU-only entries are marked not
applicable.
"""

from __future__ import annotations

import json
import statistics
import time

import torch

from shapewise.analysis.roofline import PEAK_ENTRIES
from shapewise.jobs.device import setup
from shapewise.jobs.io import header, log, write_result


# triton.testing.do_bench runs a function for about DO_BENCH_WARMUP_MS, then times it (one CUDA event pair per
# call, L2 cache flushed between calls) for about DO_BENCH_REP_MS; both are milliseconds of GPU time, not counts.
DO_BENCH_WARMUP_MS = 25
DO_BENCH_REP_MS = 100
GPU_TIMER = (f"triton.testing.do_bench(warmup={DO_BENCH_WARMUP_MS} ms, rep={DO_BENCH_REP_MS} ms, "
             "return_mode='median')")
CPU_TIMER = "median of `repeats` time.perf_counter-timed calls after 2 warm-up calls"


def _median_ms(fn, device, repeats, warmup=2):
    """Median milliseconds of one call of fn: do_bench on a GPU, perf_counter on a CPU (do_bench needs CUDA)."""
    if device.type == "cuda":
        from triton.testing import do_bench  # deferred: triton, on a GPU only

        return float(do_bench(fn, warmup=DO_BENCH_WARMUP_MS, rep=DO_BENCH_REP_MS, return_mode="median"))
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def copy_bandwidth(device, mib, repeats):
    nbytes = mib * 1024 * 1024
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    ms = _median_ms(lambda: dst.copy_(src), device, repeats)
    return {"bytes_per_copy": nbytes, "median_ms": ms, "gb_per_s": 2 * nbytes / (ms * 1e-3) / 1e9,
            "counting": "bytes read + bytes written"}


def gemm_throughput(device, n, dtype, repeats, tf32):
    torch.backends.cuda.matmul.allow_tf32 = bool(tf32)
    torch.set_float32_matmul_precision("high" if tf32 else "highest")
    gen = torch.Generator(device="cpu").manual_seed(0)
    a = torch.randn(n, n, generator=gen).to(device=device, dtype=dtype)
    b = torch.randn(n, n, generator=gen).to(device=device, dtype=dtype)
    out = torch.empty(n, n, device=device, dtype=dtype)
    ms = _median_ms(lambda: torch.matmul(a, b, out=out), device, repeats)
    flop = 2 * n ** 3
    return {"n": n, "median_ms": ms, "tflop_per_s": flop / (ms * 1e-3) / 1e12}


def launch_latency(launches):
    t = torch.zeros(1, device="cuda")
    for _ in range(100):
        t.add_(1)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(launches):
        t.add_(1)
    torch.cuda.synchronize()
    eager_us = (time.perf_counter() - t0) / launches * 1e6

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        t.add_(1)  # warm-up on the side stream before capture
        with torch.cuda.graph(graph):
            for _ in range(launches):
                t.add_(1)
    torch.cuda.current_stream().wait_stream(stream)
    graph.replay()
    torch.cuda.synchronize()
    graph_us = _median_ms(graph.replay, torch.device("cuda"), repeats=None) * 1e3 / launches
    return {
        "launches": launches,
        "eager_us_per_launch": eager_us,
        "eager_method": "host wall time of N back-to-back launches of a 1-element add, then one sync, / N",
        "graph_us_per_kernel": graph_us,
        "graph_method": f"{GPU_TIMER} of one replay of a graph holding N such kernels, / N",
    }


def main(args):
    device = setup(args.device, args.threads)
    settings = json.loads(args.settings)[args.device]
    result = header("microbench", None, args.device, args)
    result["settings"] = settings
    result["timer"] = GPU_TIMER if device.type == "cuda" else CPU_TIMER
    na = {"applicable": False, "reason": "needs a CUDA GPU"}
    log(f"copy bandwidth, {settings['copy_mib']} MiB")
    result["copy"] = copy_bandwidth(device, settings["copy_mib"], settings["repeats"])
    gemm = {}
    if device.type == "cuda":
        for name, dtype, tf32 in (("fp32", torch.float32, False), ("tf32", torch.float32, True),
                                  ("fp16", torch.float16, False), ("bf16", torch.bfloat16, False)):
            log(f"GEMM {name}, n={settings['gemm_n']}")
            gemm[name] = gemm_throughput(device, settings["gemm_n"], dtype, settings["repeats"], tf32)
        log(f"launch latency, {settings['launches']} launches")
        result["launch"] = launch_latency(max(1, settings["launches"]))
    else:
        log(f"GEMM fp32, n={settings['gemm_n']}")
        gemm["fp32"] = gemm_throughput(device, settings["gemm_n"], torch.float32, settings["repeats"], False)
        gemm["tf32"] = gemm["fp16"] = gemm["bf16"] = na
        result["launch"] = na
    result["gemm"] = gemm
    torch.set_float32_matmul_precision("highest")
    write_result(args.out, result)
    return 0


def peaks(microbench, dtype_name):
    """(peak FLOP/s, bandwidth B/s) for a row's dtype, or (None, None)."""
    names = PEAK_ENTRIES[dtype_name]
    if microbench["device"] == "cpu" and dtype_name == "float32":
        names = ("fp32",)  # no TF32 or fast fp16 GEMM on a CPU
    rates = [microbench["gemm"].get(n, {}).get("tflop_per_s") for n in names]
    peak = max((r for r in rates if r), default=None)
    bandwidth = microbench["copy"]["gb_per_s"]
    return (peak * 1e12 if peak else None), (bandwidth * 1e9 if bandwidth else None)
