"""Host (CPU) time of one optimized forward, piece by piece, on the small official rows.

Usage (CUDA machine, about one device minute): python -m experiments.h200_host_probe OUT.json [ROW ...]

docs/performance.md suspects that rows 2, 3, 7 and 12 wait on the host: their timing median exceeds the GPU time
of their profile by up to 24 µs. For each row (default 1, 2, 3, 7, 12; auto route, float32 input) this measures:
- `forward_host_us`: wall time per call of N back-to-back `forward` calls without synchronizing (the queue
  stays far below its depth, so this is the host's issue time per call);
- `forward_events_us`: the timing protocol's per-call CUDA-event median, for comparison;
- `replay_gpu_us`: CUDA-event time per call of N back-to-back graph replays (the GPU time alone);
- the host time of each step of the graph path on its own: input checks, the weight-version check, the input
  copy, the replay and the output clone.
"""
from __future__ import annotations

import json
import statistics
import sys
import time

import torch

from experiments.h200_probe import median_ms
from shapewise.model import BaselineTransformer, UserOptimizedTransformer
from shapewise.model.reference import check_inputs
from shapewise.jobs.models import model_config
from shapewise.manifest import official_rows

N = 200


def host_us(fn, n=N):
    """Median over 5 repeats of the host wall time per call of n back-to-back calls, synchronized only between
    repeats."""
    samples = []
    for _ in range(5):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        samples.append((time.perf_counter() - t0) / n * 1e6)
        torch.cuda.synchronize()
    return statistics.median(samples)


def events_us(fn, n=N):
    """The timing protocol's per-call CUDA-event median, in µs."""
    return median_ms(fn, warmup=0, iters=n) * 1e3


def probe(n, row):
    cfg = model_config(row)
    torch.manual_seed(0)
    ref = BaselineTransformer(cfg).cuda().eval()
    model = UserOptimizedTransformer(cfg).cuda().eval()
    model.load_state_dict(ref.state_dict(), strict=True)
    x = torch.randn(cfg.batch_size, cfg.seq_len, cfg.d_model, device="cuda")
    with torch.inference_mode():
        for _ in range(20):
            model(x)
        route = model.last_route
        out = {"row": n, "route": str(route), "forward_host_us": host_us(lambda: model(x)),
               "forward_events_us": events_us(lambda: model(x))}
        if not model._graphs:  # a route without a CUDA graph: only the whole-forward numbers apply
            print(json.dumps(out), flush=True)
            return out
        graph, static_x, _, static_out = next(iter(model._graphs.values()))["copy"]  # the copy-in capture
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(N):
            graph.replay()
        end.record()
        end.synchronize()
        out["replay_gpu_us"] = start.elapsed_time(end) * 1e3 / N
        out["steps_host_us"] = {
            "check_inputs": host_us(lambda: check_inputs(model.config, x, None)),
            "refresh_weights": host_us(model._refresh_weights),
            "copy_in": host_us(lambda: static_x.copy_(x)),
            "replay": host_us(graph.replay),
            "clone_out": host_us(static_out.clone),
        }
    print(json.dumps(out), flush=True)
    return out


def main():
    out_path = sys.argv[1]
    rows = [int(a) for a in sys.argv[2:]] or [1, 2, 3, 7, 12]
    torch.set_float32_matmul_precision("high")
    official = official_rows()
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "calls": N, "rows": []}
    for n in rows:
        results["rows"].append(probe(n, official[n]))
        with open(out_path, "w") as f:  # rewritten after each row: a time limit keeps what finished
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
