"""How far past 3x a GEMM-bound shape can go (issue #12 item 6): reference against optimized, one process.

Usage (CUDA machine): python -m experiments.h200_gemm_bound OUT.json

The reference is timed with TF32 matmuls (the timing protocol), the optimized model runs fp16 operands. Where the
GEMMs are most of the reference's time, the speedup tends to the ratio of fp16 to TF32 GEMM throughput, whatever
the rest costs. Per shape: one accuracy trial (seed 1234, all-True mask, against the reference in fp32 with TF32
off, the official tolerance); then the official protocol (20 warm-up calls of each model, 3 alternating rounds of
100 calls, a CUDA event pair per call, medians), `model(x, mask)`; and torch.mm at the shape's largest GEMM
(tokens x d_model by d_model x ffn_dim) in fp16 and in TF32, 20 calls each (median TFLOP/s).
Shapes: contract-wide (shapes/contract.yaml) and one twice as wide (d_model 4096, ffn 16384), not in a manifest.
"""
from __future__ import annotations

import argparse
import json
import statistics

import torch

from shapewise.jobs.device import time_calls
from shapewise.model import BaselineTransformer, TransformerConfig, UserOptimizedTransformer, generate_random_case
from shapewise.model.compare import compare_outputs

CUDA = torch.device("cuda")
SHAPES = {"contract-wide": dict(batch_size=4, seq_len=512, d_model=2048, num_heads=16, ffn_dim=8192, num_layers=2),
          "wide-4096": dict(batch_size=4, seq_len=512, d_model=4096, num_heads=32, ffn_dim=16384, num_layers=2)}


def gemm_tflops(m, k, n, dtype, tf32):
    torch.backends.cuda.matmul.allow_tf32 = tf32
    a = torch.randn(m, k, device=CUDA, dtype=dtype)
    b = torch.randn(k, n, device=CUDA, dtype=dtype)
    for _ in range(5):
        a @ b
    ms = statistics.median(time_calls(lambda: a @ b, CUDA, 20))
    return 2 * m * k * n / ms / 1e9


def measure(name, shape):
    cfg = TransformerConfig(**shape, causal=True)
    torch.manual_seed(0)
    ref = BaselineTransformer(cfg).to(CUDA).eval()
    opt = UserOptimizedTransformer(cfg)
    opt.load_state_dict(ref.state_dict(), strict=True)
    opt = opt.to(CUDA).eval()
    x, _ = generate_random_case(cfg, CUDA, seed=1234)
    x = x.to(CUDA)
    mask = torch.ones(x.shape[:2], dtype=torch.bool, device=CUDA)
    out = {"shape": shape}
    with torch.inference_mode():
        torch.set_float32_matmul_precision("highest")
        want = ref(x, mask)
        got = opt(x, mask)
        out["accuracy"] = compare_outputs(want, got, rtol=0.02, atol=0.002).as_dict()
        out["route"] = str(opt.last_route)
        torch.set_float32_matmul_precision("high")
        for model in (ref, opt):
            time_calls(lambda: model(x, mask), CUDA, 20)
        times = {"reference": [], "optimized": []}
        for _ in range(3):
            times["reference"] += time_calls(lambda: ref(x, mask), CUDA, 100)
            times["optimized"] += time_calls(lambda: opt(x, mask), CUDA, 100)
    medians = {k: statistics.median(v) for k, v in times.items()}
    out.update(reference_ms=medians["reference"], optimized_ms=medians["optimized"],
               speedup=medians["reference"] / medians["optimized"])
    m, k, n = shape["batch_size"] * shape["seq_len"], shape["d_model"], shape["ffn_dim"]
    out["gemm_tflop_per_s"] = {"fp16": gemm_tflops(m, k, n, torch.float16, False),
                               "tf32": gemm_tflops(m, k, n, torch.float32, True)}
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.set_float32_matmul_precision("high")
    print(name, json.dumps({k: v for k, v in out.items() if k != "accuracy"}), out["accuracy"]["failed_elements"],
          flush=True)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    args = ap.parse_args()
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "shapes": {}}
    for name, shape in SHAPES.items():
        result["shapes"][name] = measure(name, shape)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
