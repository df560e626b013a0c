"""Which fp16 rounding of the fused route costs the strict tolerance? An fp64 emulation on the CPU.

Usage: python -m experiments.precision_budget [ROW] [TRIALS]   (default: official row 1, 5 trials; about a minute)

The fused route (kernels/fused_layer.py) rounds to fp16 at fixed points: the LayerNorm outputs and the weights
that enter each dot, q, k and v, the unnormalized softmax probabilities, the attention output and the GELU
output; everything else (accumulation, softmax statistics, the residual stream) stays fp32. This script
replays that math in fp64 with each rounding point switchable, on the official row's shape, weights
(`torch.manual_seed(0)`, `BaselineTransformer`) and inputs (seeds 1234 + trial), and compares with the fp64
reference using the strict and official comparators. It prints, per configuration, failed elements and the
max abs error: all points rounded (what the H200 runs, up to fp32 accumulation order), each point alone kept
exact, and each point alone rounded. The answer says where extra mantissa bits would buy the strict tolerance.
"""
from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from shapewise.model import TOLERANCES, BaselineTransformer, compare_outputs, generate_random_case
from shapewise.jobs.models import model_config
from shapewise.manifest import official_rows

POINTS = ("ln1_out", "qkv_w", "qkv_out", "probs", "attn_out", "o_w", "ln2_out", "in_w", "gelu_out", "out_w")
WEIGHTS = ("qkv_w", "o_w", "in_w", "out_w")


def forward(model, x, rounded):
    """The fused route's math in fp64, rounding to fp16 at the points in `rounded`."""
    def r(t, point):
        return t.half().double() if point in rounded else t

    cfg = model.config
    B, S, d = x.shape
    H, D = cfg.num_heads, d // cfg.num_heads
    p = {k: v.detach().double() for k, v in model.named_parameters()}
    causal = torch.ones(S, S, dtype=torch.bool).triu(1)
    h = x.double()
    for i in range(cfg.num_layers):
        n = f"layers.{i}."
        n1 = r(F.layer_norm(h, (d,), p[n + "norm1.weight"], p[n + "norm1.bias"], 1e-5), "ln1_out")
        qkv = []
        for proj in ("q_proj", "k_proj", "v_proj"):
            w = r(p[n + f"attention.{proj}.weight"], "qkv_w")
            qkv.append(r(n1 @ w.t() + p[n + f"attention.{proj}.bias"], "qkv_out").view(B, S, H, D).transpose(1, 2))
        q, k, v = qkv
        s = (q @ k.transpose(-1, -2)) * D**-0.5
        if cfg.causal:
            s = s.masked_fill(causal, float("-inf"))
        m = s.amax(-1, keepdim=True)
        e = torch.exp(s - m)  # the kernel's unnormalized probabilities, rounded before the PV dot
        o = (r(e, "probs") @ v) / e.sum(-1, keepdim=True)
        o = r(o.transpose(1, 2).reshape(B, S, d), "attn_out")
        h = h + o @ r(p[n + "attention.out_proj.weight"], "o_w").t() + p[n + "attention.out_proj.bias"]
        n2 = r(F.layer_norm(h, (d,), p[n + "norm2.weight"], p[n + "norm2.bias"], 1e-5), "ln2_out")
        t = F.gelu(n2 @ r(p[n + "ffn_in.weight"], "in_w").t() + p[n + "ffn_in.bias"])
        h = h + r(t, "gelu_out") @ r(p[n + "ffn_out.weight"], "out_w").t() + p[n + "ffn_out.bias"]
    return F.layer_norm(h, (d,), p["final_norm.weight"], p["final_norm.bias"], 1e-5)


def main():
    row_id = int(sys.argv[1]) if len(sys.argv) > 1 else 1
    trials = int(sys.argv[2]) if len(sys.argv) > 2 else 5
    row = official_rows()[row_id]
    cfg = model_config(row)
    torch.manual_seed(0)
    model = BaselineTransformer(cfg).eval()
    configs = {"all rounded (the fused route)": set(POINTS)}
    configs.update({f"all but {pt}": set(POINTS) - {pt} for pt in POINTS})
    configs.update({f"only {pt}": {pt} for pt in POINTS})
    configs["weights exact (fp16 hi+lo)"] = set(POINTS) - set(WEIGHTS)
    configs["only the weights rounded"] = set(WEIGHTS)
    totals = {name: [0, 0, 0.0] for name in configs}  # strict failed, official failed, max abs
    elements = 0
    with torch.no_grad():
        for t in range(trials):
            x, _ = generate_random_case(cfg, "cpu", torch.float32, 1234 + t)
            ref = forward(model, x, set())
            elements += ref.numel()
            for name, rounded in configs.items():
                out = forward(model, x, rounded)
                strict = compare_outputs(ref, out, **TOLERANCES["strict"])
                official = compare_outputs(ref, out, **TOLERANCES["official"])
                tot = totals[name]
                tot[0] += strict.failed_elements
                tot[1] += official.failed_elements
                tot[2] = max(tot[2], strict.max_abs_error)
    print(f"official row {row_id} {tuple(row[k] for k in ('batch_size', 'seq_len', 'd_model', 'num_heads'))}, "
          f"{trials} trials, {elements} elements, against the fp64 reference")
    print(f"{'configuration':34s} {'strict failed':>14s} {'official failed':>16s} {'max abs':>10s}")
    for name, (strict, official, max_abs) in totals.items():
        print(f"{name:34s} {strict:14d} {official:16d} {max_abs:10.3e}")


if __name__ == "__main__":
    main()
