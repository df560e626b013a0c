"""How far past 3x a GEMM-bound shape can go (issue #12 item 6): reference against optimized, one process.

Usage (CUDA machine): python -m experiments.h200_gemm_bound OUT.json

The reference is timed with TF32 matmuls (the timing protocol), the optimized model runs fp16 operands. Where the
GEMMs are most of the reference's time, the speedup tends to the ratio of fp16 to TF32 GEMM throughput, whatever
the rest costs. Per shape: one accuracy trial (seed 1234, all-True mask, against the reference in fp32 with TF32
off, the official tolerance); then the official protocol (config/config.yaml `timing.official`: its warm-up calls
of each model, then its alternating rounds by the timing job's shapewise.jobs.timing.run_rounds, a CUDA event pair
per call, pooled medians), `model(x, mask)`; and torch.mm at the shape's largest GEMM
(tokens x d_model by d_model x ffn_dim) in fp16 and in TF32, 20 calls each (median TFLOP/s).
Shapes: contract-wide (shapes/contract.yaml) and one twice as wide (d_model 4096, ffn 16384), not in a manifest.
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
import yaml

from shapewise.jobs.device import time_calls
from shapewise.jobs.timing import run_rounds
from shapewise.model import BaselineTransformer, TransformerConfig, UserOptimizedTransformer, generate_random_case
from shapewise.manifest import load_manifest
from shapewise.model.tolerance import TOLERANCES, compare_outputs

CUDA = torch.device("cuda")
ROOT = Path(__file__).resolve().parent.parent
# the official harness's protocol, as the pipeline's timing job reads it
PROTOCOL = yaml.safe_load((ROOT / "config" / "config.yaml").read_text())["timing"]["official"]
FIELDS = ("batch_size", "seq_len", "d_model", "num_heads", "ffn_dim", "num_layers")
WIDE = {r["id"]: r for r in load_manifest(ROOT / "shapes" / "contract.yaml")}["contract-wide"]
SHAPES = {"contract-wide": {f: WIDE[f] for f in FIELDS},
          "wide-4096": dict(batch_size=4, seq_len=512, d_model=4096, num_heads=32, ffn_dim=16384, num_layers=2)}


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
        out["accuracy"] = compare_outputs(want, got, **TOLERANCES["official"]).as_dict()
        out["route"] = str(opt.last_route)
        torch.set_float32_matmul_precision("high")
        calls = {"reference": lambda: ref(x, mask), "optimized": lambda: opt(x, mask)}
        for fn in calls.values():
            time_calls(fn, CUDA, PROTOCOL["warmup"])
        rounds, _, _ = run_rounds(calls, CUDA, "official", PROTOCOL)
    medians = {k: statistics.median(t for r in v for t in r) for k, v in rounds.items()}
    out.update(reference_ms=medians["reference"], optimized_ms=medians["optimized"],
               speedup=medians["reference"] / medians["optimized"])
    m, k, n = shape["batch_size"] * shape["seq_len"], shape["d_model"], shape["ffn_dim"]
    out["gemm_tflop_per_s"] = {"fp16": gemm_tflops(m, k, n, torch.float16, False),
                               "tf32": gemm_tflops(m, k, n, torch.float32, True)}
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
