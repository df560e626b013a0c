"""The host's time of the optimized forward's own path before its runner, and of its weight check, on the CPU.

Usage (any machine): python -m benchmarks.weight_check [OUT.json] [--rows 1,9,12] [--calls 20000] [--repeats 7]

That path is host code only (input checks, the memory plan's lookup, the weight check, the route's lookup), so a CPU
measures it as the GPU machine's host runs it, up to the two hosts' speeds. Per official row (the pipeline's
model and first-trial inputs, on the CPU), with a derived weight table built as the CUDA routes build theirs (so the
parameters are watched, model/weights.py) and the route's runner replaced by one that returns x: `repeats` batches
of `calls` calls, the fastest batch's wall time per call, of
- `before_runner`: model(x, mask), the forward's path up to its runner;
- `weight_check`: DerivedWeights.refresh alone (nothing moved: the comparison of the weights' identity);
- `identity`: DerivedWeights.now alone (reading that identity).
The code measured is the `shapewise` this process imports (the installed one), and the file records its commit.
"""
from __future__ import annotations

import subprocess
import time
from pathlib import Path

import torch

import shapewise
from benchmarks.common import ReturnsInput, official, parser, row_numbers, setup, write_json
from shapewise.model.weights import per_layer


def fastest_us(fn, calls, repeats):
    """The fastest of `repeats` batches of `calls` calls, µs per call (after one batch that warms)."""
    for _ in range(calls):
        fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls)
    return round(best * 1e6, 3)


def measure(shape_row, calls, repeats):
    _, _, model, x, mask = setup(shape_row, torch.device("cpu"), reference=False)
    out = {"row": shape_row["id"], "parameters": sum(1 for _ in model.parameters())}
    with torch.inference_mode():
        model._weights.table(model, "fp16", per_layer)  # watched parameters, as under a CUDA route's tables
        model(x, mask)
        key = (x.shape, x.dtype, x.device, mask is None)
        model._paths[key] = ReturnsInput(model._paths[key].route)
        out["before_runner"] = fastest_us(lambda: model(x, mask), calls, repeats)
        out["weight_check"] = fastest_us(lambda: model._weights.refresh(model), calls, repeats)
        out["identity"] = fastest_us(lambda: model._weights.now(model), calls, repeats)
    return out


def checkout_commit():
    """The commit of the checkout whose `shapewise` is imported (and whether its tree differs from it)."""
    where = Path(shapewise.__file__).resolve().parent
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=where, capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "model", "workflow"], cwd=where.parent.parent,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return head.stdout.strip() + ("+uncommitted" if dirty else "")


def main():
    p = parser(__doc__, "weight-check.json")
    p.add_argument("--rows", default="1,9,12", help="official rows")
    p.add_argument("--calls", type=int, default=20000, help="calls per batch")
    p.add_argument("--repeats", type=int, default=7, help="batches per part")
    args = p.parse_args()
    result = {"device": "cpu", "torch": torch.__version__, "commit": checkout_commit(), "rows": {}}
    for n in row_numbers(args.rows):
        rec = result["rows"][n] = measure(official(n), args.calls, args.repeats)
        print(f"official row {n}: " + ", ".join(f"{k} {rec[k]} us" for k in
                                                ("before_runner", "weight_check", "identity")), flush=True)
        write_json(args.out, result)


if __name__ == "__main__":
    main()
