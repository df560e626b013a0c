"""The host time of one forward call on the captured-graph routes, before the graph's replay (no GPU needed).

Usage: PYTHONPATH=.:workflow python3 -m experiments.host_path [ROW ...]   (default rows 2 3 7 12)
       PYTHONPATH=.:workflow python3 -m experiments.host_path --cuda OUT.json [ROW ...]   (on a GPU)

On the launch-bound official rows the GPU runs a forward in ~50 us; when the host's path through `forward`
(input checks, the memory plan's lookup, the weight-version check, the route's lookup) plus the graph's launch
takes longer, the call is host-bound and its median follows the host (session 13: a slow host timed row 2 at
97-100 us, experiments/h200/session13/). This builds the row's optimized model on the CPU, stands a no-op in for
the graph replay, and times `model(x, mask)` (the official call) with timeit: the Python that precedes every
replay, per call (min over interleaved repeats; against it, the same with nn.Module.__setattr__ for the two plain
attributes forward sets, as before session 13), and its top functions (cProfile). With --cuda, on a GPU, the real
captured route: the host's and the GPU's time per call side by side (cuda_host_and_gpu_us), into OUT.json.
"""
from __future__ import annotations

import cProfile
import json
import pstats
import statistics
import sys
import time
import timeit
from dataclasses import replace

import torch

from shapewise.manifest import MODEL_FIELDS, official_rows
from shapewise.model import UserOptimizedTransformer, optimized
from shapewise.model.config import TransformerConfig

setters = {"committed": optimized._set_plain, "module_setattr": torch.nn.Module.__setattr__}


class _Replay:
    """Stands in for a captured route's runner (model/captured.py): what it does on a replay is not timed."""

    uses_weights = True

    def __init__(self, route):
        self.route = route

    def __call__(self, model, x, mask):
        return x


def host_us(row, calls=20000):
    cfg = TransformerConfig(**{f: row[f] for f in MODEL_FIELDS})
    model = UserOptimizedTransformer(cfg).eval()
    x = torch.randn(cfg.batch_size, cfg.seq_len, cfg.d_model)
    mask = torch.ones(cfg.batch_size, cfg.seq_len, dtype=torch.bool)
    model(x[:1, :1], mask[:1, :1])  # builds the parameter list and the weight versions once
    key = (x.shape, x.dtype, x.device, False)
    model._plan_memory(key, x, mask)
    model._paths[key] = _Replay(replace(model._select(x, mask), name="graph"))  # the captured route's runner
    model._weights.refresh(model)
    with torch.no_grad():
        model(x, mask)
        # min over interleaved repeats, the committed path against nn.Module.__setattr__ for its two plain
        # attributes (before session 13): paired, so that this machine's drift falls on both
        best = {"committed": float("inf"), "module_setattr": float("inf")}
        for _ in range(9):
            for name in best:
                optimized._set_plain = setters[name]
                best[name] = min(best[name], timeit.timeit(lambda: model(x, mask), number=calls) / calls * 1e6)
        optimized._set_plain = setters["committed"]
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(calls // 4):
            model(x, mask)
        prof.disable()
    return best, prof


def cuda_host_and_gpu_us(row, calls=50, repeats=20):
    """On a GPU, the real route (the captured graph, replayed in place): per call, the host's time to return from
    `model(x, mask)` (perf_counter over `calls` calls issued right after a synchronize, so the launch queue never
    fills and blocks the host) and the GPU's time between a CUDA event pair around the same calls; the median of
    `repeats` such batches each, with the committed path and with nn.Module.__setattr__ (interleaved). A call is
    host-bound where the first exceeds the second."""
    cfg = TransformerConfig(**{f: row[f] for f in MODEL_FIELDS})
    model = UserOptimizedTransformer(cfg).cuda().eval()
    g = torch.Generator("cuda").manual_seed(0)
    x = torch.randn(cfg.batch_size, cfg.seq_len, cfg.d_model, device="cuda", generator=g)
    mask = torch.ones(cfg.batch_size, cfg.seq_len, dtype=torch.bool, device="cuda")
    torch.set_float32_matmul_precision("high")
    out = {"route": None}
    with torch.no_grad():
        for _ in range(20):  # compile, capture, and the in-place graph for these addresses
            model(x, mask)
        torch.cuda.synchronize()
        out["route"] = str(model.last_route)
        samples = {name: {"host_us": [], "gpu_us": []} for name in setters}
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for _ in range(repeats):
            for name, rec in samples.items():
                optimized._set_plain = setters[name]
                torch.cuda.synchronize()
                start.record()
                t0 = time.perf_counter()
                for _ in range(calls):
                    model(x, mask)
                t1 = time.perf_counter()
                end.record()
                torch.cuda.synchronize()
                rec["host_us"].append((t1 - t0) / calls * 1e6)
                rec["gpu_us"].append(start.elapsed_time(end) / calls * 1e3)
        optimized._set_plain = setters["committed"]
    for name, rec in samples.items():
        out[name] = {k: statistics.median(v) for k, v in rec.items()}
    return out


def main():
    rows = official_rows()
    args = sys.argv[1:]
    if args and args[0] == "--cuda":  # on the device: python -m experiments.host_path --cuda OUT.json [ROW ...]
        path, numbers = args[1], [int(a) for a in args[2:]] or [2, 3, 7, 12]
        result = {"device": torch.cuda.get_device_name(), "rows": {}}
        for n in numbers:
            result["rows"][n] = cuda_host_and_gpu_us(rows[n])
            print(f"official row {n}: {result['rows'][n]}")
            with open(path, "w") as f:
                json.dump(result, f, indent=1)
        return
    for n in [int(a) for a in args] or [2, 3, 7, 12]:
        best, prof = host_us(rows[n])
        print(f"official row {n}: us of Python per model(x, mask) before the replay: "
              + ", ".join(f"{k} {v:.2f}" for k, v in best.items()))
        pstats.Stats(prof).sort_stats("tottime").print_stats(6)


if __name__ == "__main__":
    main()
