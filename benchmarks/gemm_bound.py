"""How far the speedup can go on GEMM-bound shapes: reference against optimized, with the GEMMs' fp16 and TF32 rates.

Usage (CUDA machine): python -m benchmarks.gemm_bound [OUT.json]

The reference is timed with TF32 matmuls (the timing protocol), the optimized model runs fp16 operands. Where the
GEMMs are most of the reference's time, the speedup tends to the ratio of fp16 to TF32 GEMM throughput, whatever
the rest costs. Per shape: one accuracy trial (the pipeline's weights and first-trial inputs, the all-True mask,
against the reference in fp32 with TF32 off, every tolerance); then the official protocol (config/config.yaml
`timing.official`: its warm-up calls of each model, then its alternating rounds by the timing job's
shapewise.jobs.timing.run_rounds, a CUDA event pair per call, pooled medians) of `model(x, mask)`; and torch.mm
at the shape's largest GEMM (tokens x d_model by d_model x ffn_dim) in fp16 and in TF32, 20 calls each.
Shapes: contract-wide (shapes/contract.yaml) and one twice as wide (d_model 4096, ffn 16384), in no manifest.
"""
from __future__ import annotations

import statistics

import torch
import yaml

from benchmarks.common import (CUDA, ROOT, accuracy, contract, device_name, parser, pooled_median,
                               reference_output, require_cuda, row, setup, write_json)
from shapewise.inputs.manifest import SIZE_FIELDS
from shapewise.jobs.device import time_calls
from shapewise.jobs.timing import run_rounds

# the official harness's protocol, as the pipeline's timing job reads it
PROTOCOL = yaml.safe_load((ROOT / "config" / "config.yaml").read_text())["timing"]["official"]


def shapes():
    wide = contract("contract-wide")
    return {"contract-wide": row("contract-wide", **{f: wide[f] for f in SIZE_FIELDS}),
            "wide-4096": row("wide-4096", batch_size=4, seq_len=512, d_model=4096, num_heads=32, ffn_dim=16384,
                             num_layers=2)}


def gemm_tflops(m, k, n, dtype, tf32):
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = tf32
    try:
        a = torch.randn(m, k, device=CUDA, dtype=dtype)
        b = torch.randn(k, n, device=CUDA, dtype=dtype)
        for _ in range(5):
            a @ b
        ms = statistics.median(time_calls(lambda: a @ b, CUDA, 20))
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before
    return 2 * m * k * n / ms / 1e9


def measure(shape_row):
    _, ref, opt, x, mask = setup(shape_row, CUDA)
    out = {"shape": {f: shape_row[f] for f in SIZE_FIELDS}}
    want = reference_output(ref, x, mask)
    with torch.inference_mode():
        got = opt(x, mask)
        out["accuracy"] = accuracy(want, got)
        out["route"] = str(opt.last_route)
        del want, got
        calls = {"reference": lambda: ref(x, mask), "optimized": lambda: opt(x, mask)}
        for fn in calls.values():
            time_calls(fn, CUDA, PROTOCOL["warmup"])
        rounds, _, _ = run_rounds(calls, CUDA, "official", PROTOCOL)
    medians = {k: pooled_median(v) for k, v in rounds.items()}
    out.update(reference_ms=medians["reference"], optimized_ms=medians["optimized"],
               speedup=medians["reference"] / medians["optimized"])
    m, k, n = shape_row["batch_size"] * shape_row["seq_len"], shape_row["d_model"], shape_row["ffn_dim"]
    out["gemm_tflop_per_s"] = {"fp16": gemm_tflops(m, k, n, torch.float16, False),
                               "tf32": gemm_tflops(m, k, n, torch.float32, True)}
    return out


def main():
    args = parser(__doc__, "gemm-bound.json").parse_args()
    require_cuda()
    result = {"device": device_name(CUDA), "torch": torch.__version__, "shapes": {}}
    for name, shape_row in shapes().items():
        result["shapes"][name] = rec = measure(shape_row)
        print(f"{name}: {rec['speedup']:.2f}x ({rec['reference_ms']:.3f} against {rec['optimized_ms']:.3f} ms), "
              f"fp16 / TF32 GEMM {rec['gemm_tflop_per_s']['fp16']:.0f} / {rec['gemm_tflop_per_s']['tf32']:.0f} "
              f"TFLOP/s, failed {rec['accuracy']['official']['failed_elements']}", flush=True)
        write_json(args.out, result)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
