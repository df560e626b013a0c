"""Host time per call against GPU time per call of the official call `model(x, mask)`, per official row.

Usage (CUDA machine): python -m benchmarks.host_path [OUT.json] [--rows 2,3,7,12] [--calls 50] [--repeats 20]
                          [--sweeps 1] [--official] [--policy SECTION.KEY=JSON ...] [--label TEXT]

A call is host-bound when the host needs longer to issue it than the GPU needs to run it: then the GPU waits and
the call's median follows the host. Per row (the launch-bound rows by default), after 20 calls that compile and
capture: `repeats` batches of `calls` back-to-back `model(x, mask)` calls, each batch started right after a
synchronize so that the launch queue never fills and blocks the host. Per batch, the host's time is the wall time
until the last call returns (perf_counter), the GPU's the time between a CUDA event pair around the same calls;
the medians over batches, per call, are `host_us` and `gpu_us`, and `host_bound` is host_us > gpu_us. Nothing is
synchronized inside a batch. The models and inputs are the pipeline's (the row's weights and its first trial).
A host's launch cost changes level within minutes, so a row timed once can land on a slow spell that its neighbours
miss: `--sweeps S` prepares every row first, then runs S sweeps over the rows, each timing `repeats` batches of
every row in turn; the medians pool all S x repeats batches of a row, and `host_us_sweeps` keeps each sweep's.

`--official` also times each row as the official harness does: the reference and the optimized model, 20 warm-up
calls each, then 3 rounds alternating them, 100 calls of each a round, a CUDA event pair around every call and no
synchronization between calls; `official_ms` holds each model's median over its 300 calls and the speedup.
`--policy` sets a routing-policy entry for the run; `--label` names the code measured (a commit) in the file.
"""
from __future__ import annotations

import statistics
import time

import torch

from benchmarks.common import (CUDA, alternating_rounds, device_name, official, parser, pooled_median, require_cuda,
                               row_numbers, setup, write_json)
from benchmarks.official_harness import PROTOCOL as OFFICIAL
from benchmarks.switch_ab import policy_change, set_policy


def batch_times(fn, calls, repeats):
    """([host µs], [GPU µs]) per call of `fn` in each of `repeats` batches of `calls` back-to-back calls, each batch
    started right after a synchronize: the host's wall time until the last call returns, the GPU's between a CUDA
    event pair around the same calls."""
    host, gpu = [], []
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(repeats):
        torch.cuda.synchronize()
        start.record()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        t1 = time.perf_counter()
        end.record()
        torch.cuda.synchronize()
        host.append((t1 - t0) / calls * 1e6)
        gpu.append(start.elapsed_time(end) / calls * 1e3)
    return host, gpu


def per_call_us(fn, calls, repeats):
    """(host µs, GPU µs) per call of `fn`: the medians over the batches of `batch_times`."""
    host, gpu = batch_times(fn, calls, repeats)
    return statistics.median(host), statistics.median(gpu)


class Row:
    """One official row's models and inputs, compiled and captured by 20 calls, and its batches so far."""

    def __init__(self, shape_row, official_protocol):
        _, self.reference, self.model, self.x, self.mask = setup(shape_row, CUDA, reference=official_protocol)
        self.record = {"row": shape_row["id"]}
        self.host, self.gpu, self.host_sweeps = [], [], []
        with torch.inference_mode():
            for _ in range(20):
                self.call()
        self.record["route"] = str(self.model.last_route)

    def call(self):
        return self.model(self.x, self.mask)

    def sweep(self, calls, repeats):
        with torch.inference_mode():
            host, gpu = batch_times(self.call, calls, repeats)
        self.host += host
        self.gpu += gpu
        self.host_sweeps.append(round(statistics.median(host), 2))

    def official_ms(self):
        """The official harness's medians of the reference and this row's model, and the speedup."""
        fns = {"reference": lambda: self.reference(self.x, self.mask), "optimized": self.call}
        with torch.inference_mode():
            for fn in fns.values():
                for _ in range(OFFICIAL["warmup"]):
                    fn()
            times = alternating_rounds(fns, CUDA, OFFICIAL["rounds"], OFFICIAL["calls"])
        out = {name: pooled_median(rounds) for name, rounds in times.items()}
        out["speedup"] = out["reference"] / out["optimized"]
        return out

    def result(self, calls, repeats):
        rec = {**self.record, "calls": calls, "repeats": repeats, "sweeps": len(self.host_sweeps),
               "host_us": statistics.median(self.host), "gpu_us": statistics.median(self.gpu),
               "host_us_sweeps": self.host_sweeps}
        rec["host_bound"] = rec["host_us"] > rec["gpu_us"]
        return rec


def main():
    p = parser(__doc__, "host-path.json")
    p.add_argument("--rows", default="2,3,7,12", help="official rows (default: the launch-bound ones)")
    p.add_argument("--calls", type=int, default=50, help="calls per batch")
    p.add_argument("--repeats", type=int, default=20, help="batches per row and sweep")
    p.add_argument("--sweeps", type=int, default=1, help="sweeps over the rows, each timing every row in turn")
    p.add_argument("--official", action="store_true", help="also the official harness's medians (and the reference's)")
    p.add_argument("--policy", action="append", default=[], help="SECTION.KEY=JSON: a routing-policy entry set")
    p.add_argument("--label", default="", help="what code is measured (a commit), recorded in the file")
    args = p.parse_args()
    require_cuda()
    set_policy(policy_change(args.policy))
    result = {"device": device_name(CUDA), "torch": torch.__version__, "label": args.label, "policy": args.policy,
              "official_protocol": OFFICIAL if args.official else None, "rows": {}}
    rows = {n: Row(official(n), args.official) for n in row_numbers(args.rows)}
    for _ in range(args.sweeps):
        for row in rows.values():
            row.sweep(args.calls, args.repeats)
    for n, row in rows.items():
        rec = result["rows"][n] = row.result(args.calls, args.repeats)
        if args.official:
            rec["official_ms"] = row.official_ms()
        median = f", official median {rec['official_ms']['optimized'] * 1e3:.1f} us" if args.official else ""
        print(f"official row {n}: host {rec['host_us']:.1f} us (sweeps {rec['host_us_sweeps']}), GPU "
              f"{rec['gpu_us']:.1f} us per call{median}{' (host-bound)' if rec['host_bound'] else ''}; "
              f"{rec['route']}", flush=True)
        write_json(args.out, result)


if __name__ == "__main__":
    main()
