"""The split layer against the route the model takes without it, per official row: is it faster, and does it pass?

Usage (CUDA machine): python -m benchmarks.split_layer [OUT.json] [--rows 6,13,...]
       (CPU, a check of this script: TRITON_INTERPRET=1 python -m benchmarks.split_layer [OUT.json] --tiny)

The split layer is three kernels per layer: `fused_layer.ln_qkv` (LayerNorm 1 and the packed QKV projection),
our flash attention, and `layer_tail.layer_tail` (out-projection, residual, LayerNorm 2, FFN, residual, invalid
rows zeroed; the final LayerNorm in the last layer). Per row (d_model up to fused_layer.MAX_D_MODEL): the
optimized model with its `split_layer` optimization off (the route the policy takes without it) on the
pipeline's weights and first-trial inputs (the official call's all-True mask), against a second optimized model
on the same weights with the policy's split_layer.max_d_model set for its first call, its route forced to `graph`
where the first one's is fused or graph and to `triton` where it is triton: the same host path either way.
Accuracy: both against the reference (fp32, TF32 off) at every tolerance. Timing: warm-up calls of each, then
rounds alternating the two, a CUDA event pair per call (the timing job's timer); medians. OUT.json is written
after every row.
"""
from __future__ import annotations

import json

import torch

from benchmarks.common import (accuracy, alternating_rounds, device_name, official, parser, pooled_median,
                               reference_output, row, row_numbers, setup, write_json)
from shapewise.analysis import stats
from shapewise.jobs.device import time_calls
from shapewise.kernels.fused_layer import MAX_D_MODEL
from shapewise.model import UserOptimizedTransformer, routing

# --tiny: a small stand-in row on the CPU (Triton's interpreter, route triton), a few calls: checks the script.
TINY = {"batch_size": 2, "seq_len": 33, "d_model": 64, "num_heads": 4, "ffn_dim": 96, "num_layers": 2}
COUNTS = {"cuda": (20, 5, 100), "cpu": (1, 2, 2)}  # warm-up calls, rounds, calls per round


def split_model(opt, cfg, x, mask):
    """A second model on opt's weights whose route runs split layers, and its first output. The policy's
    split_layer.max_d_model is set only for that first call (which picks and keeps the route of this input
    signature); the route is forced to `graph` where opt's is fused or graph, else `triton` (eager, as opt's)."""
    other = UserOptimizedTransformer(cfg, route="triton" if opt.last_route.name == "triton" else "graph")
    other.load_state_dict(opt.state_dict(), strict=True)
    other = other.to(x.device).eval()
    before = routing.POLICY["split_layer"]
    routing.POLICY["split_layer"] = {"max_d_model": MAX_D_MODEL}
    try:
        y = other(x, mask)
    finally:
        routing.POLICY["split_layer"] = before
    return other, y


def row_result(shape_row, device):
    cfg, ref, opt, x, mask = setup(shape_row, device, disable=("split_layer",))
    out = {"row": shape_row["id"]}
    want = reference_output(ref, x, mask)
    with torch.inference_mode():
        y_model = opt(x, mask)
        out["route"] = str(opt.last_route)
        split, y_split = split_model(opt, cfg, x, mask)
        out["route_split"] = str(split.last_route)
        out["accuracy_model"] = accuracy(want, y_model)
        out["accuracy_split"] = accuracy(want, y_split)
        warmup, rounds, per_round = COUNTS[device.type]
        calls = {"model": lambda: opt(x, mask), "split": lambda: split(x, mask)}
        for fn in calls.values():
            time_calls(fn, device, warmup)
        times = alternating_rounds(calls, device, rounds, per_round)
    for name, rounds_ms in times.items():
        out[f"{name}_median_ms"] = pooled_median(rounds_ms)
        out[f"{name}_round_medians_ms"] = stats.round_medians(rounds_ms)
    out["split_over_model"] = out["split_median_ms"] / out["model_median_ms"]
    return out


def main():
    p = parser(__doc__, "split-layer.json")
    p.add_argument("--rows", default="6,13,2,5,11,9,10,1,3,4,12", help="official rows, in the order run")
    p.add_argument("--tiny", action="store_true", help="a small stand-in row on the CPU instead (checks the script)")
    a = p.parse_args()
    torch.set_float32_matmul_precision("high")
    device = torch.device("cpu" if a.tiny else "cuda")
    rows = [row("tiny", **TINY, route="triton")] if a.tiny else [official(n) for n in row_numbers(a.rows)]
    results = []
    for shape_row in rows:
        if shape_row["d_model"] > MAX_D_MODEL:
            continue
        try:
            rec = row_result(shape_row, device)
        except Exception as e:  # one row's failure is a result too; the next rows still run
            rec = {"row": shape_row["id"], "error": f"{type(e).__name__}: {str(e)[:300]}"}
        results.append(rec)
        print(json.dumps(rec)[:600], flush=True)
        write_json(a.out, {"device": device_name(device), "rows": results})
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return 1 if any("error" in r for r in results) else 0


if __name__ == "__main__":
    raise SystemExit(main())
