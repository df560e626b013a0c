"""The split layer against the model's current route, per official row: is it faster, and does it pass?

Usage (CUDA machine): python -m experiments.h200_split_layer OUT.json [--rows 6,13,...]
       (CPU, a check of this script: TRITON_INTERPRET=1 python -m experiments.h200_split_layer OUT.json --tiny)

The split layer is three kernels per layer: `fused_layer.ln_qkv` (LayerNorm 1 and the packed QKV projection),
our flash attention, and `layer_tail.layer_tail` (out-projection, residual, LayerNorm 2, FFN, residual, invalid
rows zeroed; the final LayerNorm in the last layer). Its global traffic per layer is the residual stream read
twice and written once, q/k/v written and read, and the attention output written and read: on row 6 about
4.6 GB per layer against about 10 GB on the triton route (cuBLAS GEMMs, add+LayerNorm and GELU passes).
Predicted (experiments/NOTES.md, session 7): row 6 12.65 -> 6-8 ms, row 13 0.97 -> 0.55-0.7 ms.

Per row (d_model <= 128 only): the optimized model with its split_layer optimization off (the route the policy
takes without it) on the reference's weights (seed 0), x from generate_random_case (seed 1234) and the official
call's all-True mask, against a second optimized model on the same weights with the policy's split_layer.max_d_model
set for this process (the model's own split-layer path,
`UserOptimizedTransformer._forward_split`), its route forced to `graph` where the first one's is fused or graph
and to `triton` where it is triton: the same host path either way. Accuracy: both against the reference (fp32,
TF32 off) at the official and strict tolerances. Timing: 20 warm-up calls of each, then 5 rounds alternating the
two, 100 calls each, a CUDA event pair per call (the timing job's timer); medians. OUT.json is written after
every row.
"""
from __future__ import annotations

import argparse
import json
import statistics

import torch

from experiments.h200_mask_cost import build, official
from shapewise.jobs.device import time_calls
from shapewise.kernels.fused_layer import MAX_D_MODEL
from shapewise.model import (
    TOLERANCES,
    BaselineTransformer,
    UserOptimizedTransformer,
    compare_outputs,
    generate_random_case,
    routing,
)

# --tiny: a small stand-in row on the CPU (Triton's interpreter, route triton), a few calls: checks the script.
TINY = {"id": "tiny", "batch_size": 2, "seq_len": 33, "d_model": 64, "num_heads": 4, "ffn_dim": 96, "num_layers": 2}
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


def accuracy(ref_out, out):
    """Failed elements and errors at the official and strict tolerances (model.tolerance)."""
    return {name: compare_outputs(ref_out, out, **tol).as_dict() for name, tol in TOLERANCES.items()}


def row_result(n, row, device, route="auto"):
    # the model without the split layer: since session 9 the policy splits every row up to d_model 128 itself
    cfg, opt = build(row, device, route, disable=("split_layer",))
    x, _ = generate_random_case(cfg, device.type, torch.float32, 1234)
    mask = torch.ones(x.shape[:2], dtype=torch.bool, device=device)
    out = {"row": n}
    with torch.inference_mode():
        y_model = opt(x, mask)
        out["route"] = str(opt.last_route)
        split, y_split = split_model(opt, cfg, x, mask)
        out["route_split"] = str(split.last_route)
        ref = BaselineTransformer(cfg).to(device).eval()
        ref.load_state_dict(opt.state_dict(), strict=True)
        before = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = False
        y_ref = ref(x, mask)
        torch.backends.cuda.matmul.allow_tf32 = before
        out["accuracy_model"] = accuracy(y_ref, y_model)
        out["accuracy_split"] = accuracy(y_ref, y_split)
        warmup, rounds, calls_per_round = COUNTS[device.type]
        calls = {"model": lambda: opt(x, mask), "split": lambda: split(x, mask)}
        for fn in calls.values():
            time_calls(fn, device, warmup)
        times = {k: [] for k in calls}
        for _ in range(rounds):
            for k, fn in calls.items():
                times[k] += time_calls(fn, device, calls_per_round)
    for k, v in times.items():
        out[f"{k}_median_ms"] = statistics.median(v)
        out[f"{k}_round_medians_ms"] = [statistics.median(v[i:i + calls_per_round])
                                        for i in range(0, len(v), calls_per_round)]
    out["split_over_model"] = out["split_median_ms"] / out["model_median_ms"]
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--rows", default="6,13,2,5,11,9,10,1,3,4,12", help="official rows, in the order run (default: "
                   "the rows behind the best public solution first)")
    p.add_argument("--tiny", action="store_true", help="a small stand-in row on the CPU instead (checks the script)")
    a = p.parse_args()
    torch.set_float32_matmul_precision("high")
    device = torch.device("cpu" if a.tiny else "cuda")
    rows = {0: TINY} if a.tiny else official()
    results = []
    for n in [0] if a.tiny else [int(r) for r in a.rows.split(",")]:
        if rows[n]["d_model"] > MAX_D_MODEL:
            continue
        try:
            rec = row_result(n, rows[n], device, route="triton" if a.tiny else "auto")
        except Exception as e:  # one row's failure is a result too; the next rows still run
            rec = {"row": n, "error": f"{type(e).__name__}: {str(e)[:300]}"}
        results.append(rec)
        print(json.dumps(rec)[:600], flush=True)
        with open(a.out, "w") as f:
            name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
            json.dump({"device": name, "rows": results}, f, indent=1)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return 1 if any("error" in r for r in results) else 0


if __name__ == "__main__":
    raise SystemExit(main())
