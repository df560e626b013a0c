"""The host time of one forward call on the captured-graph routes, before the graph's replay (no GPU needed).

Usage: PYTHONPATH=.:workflow python3 -m experiments.host_path [ROW ...]   (default rows 2 3 7 12)

On the launch-bound official rows the GPU runs a forward in ~50 us; when the host's path through `forward`
(input checks, the memory plan's lookup, the weight-version check, the route's lookup) plus the graph's launch
takes longer, the call is host-bound and its median follows the host (session 13: a slow host timed row 2 at
97-100 us, experiments/h200/session13/). This builds the row's optimized model on the CPU, stands a no-op in for
the graph replay, and times `model(x, mask)` (the official call) with timeit: the Python that precedes every
replay, per call (min over interleaved repeats; against it, the same with nn.Module.__setattr__ for the two plain
attributes forward sets, as before session 13), and its top functions (cProfile).
"""
from __future__ import annotations

import cProfile
import pstats
import sys
import timeit
from dataclasses import replace

import torch

from shapewise.manifest import MODEL_FIELDS, official_rows
from shapewise.model import UserOptimizedTransformer, optimized
from shapewise.model.config import TransformerConfig

setters = {"committed": optimized._set_plain, "module_setattr": torch.nn.Module.__setattr__}


def host_us(row, calls=20000):
    cfg = TransformerConfig(**{f: row[f] for f in MODEL_FIELDS})
    model = UserOptimizedTransformer(cfg).eval()
    x = torch.randn(cfg.batch_size, cfg.seq_len, cfg.d_model)
    mask = torch.ones(cfg.batch_size, cfg.seq_len, dtype=torch.bool)
    model(x[:1, :1], mask[:1, :1])  # builds the parameter list and the weight versions once
    key = (x.shape, x.dtype, x.device, False)
    model._memory_plan(x, mask)
    route = model._select(x, mask)
    model._routes[key] = replace(route, name="graph")
    model._captures = lambda route, x: True  # the captured-graph path, with the replay stood in for
    model._forward_graph = lambda x, mask, route: x
    model._refresh_weights()
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


def main():
    rows = official_rows()
    for n in [int(a) for a in sys.argv[1:]] or [2, 3, 7, 12]:
        best, prof = host_us(rows[n])
        print(f"official row {n}: us of Python per model(x, mask) before the replay: "
              + ", ".join(f"{k} {v:.2f}" for k, v in best.items()))
        pstats.Stats(prof).sort_stats("tottime").print_stats(6)


if __name__ == "__main__":
    main()
