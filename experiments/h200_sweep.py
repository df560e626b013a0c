"""Launch-configuration sweep of our kernels on official shapes, with a correctness check per configuration.

Usage (CUDA machine): python -m experiments.h200_sweep OUT.json [--fused-only]   (--fused-only: skip the attention
kernel's part, which takes most of the sweep's time on row 14's shape)
For the fused layer kernel (rows 1, 2, 5, 6, 7, 11, 12) and the attention kernel (row 13's and row 14's
attention shapes) it runs each configuration, compares against the kernel's fp64 torch reference, and times it
(CUDA events, median of N calls). shapewise tune writes the winners into model/routing_policy.json.
"""
from __future__ import annotations

import json
import sys

import torch

from experiments.h200_probe import graph_ms, median_ms
from shapewise.kernels.attention import attention_reference, flash_attention
from shapewise.kernels.fused_layer import fused_layer, fused_layer_reference
from shapewise.model import TransformerConfig, UserOptimizedTransformer

from shapewise.manifest import official_rows

OFFICIAL = official_rows()


def shape_of(n):
    """(batch_size, seq_len, d_model, num_heads, ffn_dim) of official row n."""
    return tuple(OFFICIAL[n][k] for k in ("batch_size", "seq_len", "d_model", "num_heads", "ffn_dim"))


# every official row the fused route serves or could serve (row 2 left out: one sequence, the graph route wins)
FUSED_ROWS = {n: shape_of(n) for n in (1, 3, 4, 5, 6, 7, 9, 10, 11, 12)}
# The first configuration is the accuracy baseline `shapewise tune` holds every other one to.
# block_m 64 and 128 ended in an illegal memory access on the H200 (reports/h200/session2/sweep-attempt1.json),
# which poisons the CUDA context for everything after it: kernels/fused_layer.py refuses them.
# (block_m, num_warps, num_stages, kv_precompute[, key_block, ffn_block]): kv_precompute computes keys and values
# once per layer in a second kernel instead of in every program; key_block (with it) runs the softmax over key
# blocks, ffn_block sets the FFN columns per step (kernels/fused_layer.py; absent: the kernel's defaults)
# Session 7: the committed policy's launches, then the key-blocked ones ptxas compiles without spills (32-key blocks;
# 16-key blocks spilled more on rows 9 and 10, experiments/NOTES.md), kept few so that ten rows fit one call.
FUSED_CONFIGS = [(32, 4, 1, False), (32, 4, 2, False), (16, 4, 3, False), (32, 4, 2, True), (16, 4, 3, True),
                 (32, 4, 2, True, 32, 32), (16, 4, 3, True, 32, 32), (32, 8, 2, True, 32, 32)]
ATTN_SHAPES = {"row13": (64, 1024, 4, 32), "row14-b4": (4, 100000, 16, 64)}
ATTN_CONFIGS = [(64, 64, 4, 3), (128, 64, 8, 3), (128, 64, 8, 4), (128, 128, 8, 3), (64, 32, 4, 2), (128, 32, 4, 3)]


def weights(d, ffn, dev):
    g = torch.Generator().manual_seed(0)
    w = {"qkv_w": torch.randn(3 * d, d, generator=g) / d**0.5, "qkv_b": 0.1 * torch.randn(3 * d, generator=g),
         "o_w": torch.randn(d, d, generator=g) / d**0.5, "o_b": 0.1 * torch.randn(d, generator=g),
         "in_w": torch.randn(ffn, d, generator=g) / d**0.5, "in_b": 0.1 * torch.randn(ffn, generator=g),
         "out_w": torch.randn(d, ffn, generator=g) / ffn**0.5, "out_b": 0.1 * torch.randn(d, generator=g),
         "n1_w": 1 + 0.1 * torch.randn(d, generator=g), "n1_b": 0.1 * torch.randn(d, generator=g),
         "n2_w": 1 + 0.1 * torch.randn(d, generator=g), "n2_b": 0.1 * torch.randn(d, generator=g)}
    op = {k: (v.half() if not k.startswith("n") else v).to(dev) for k, v in w.items()}
    ref = {k: v.float() for k, v in op.items()}  # the reference sees the same fp16-rounded weights
    return op, ref


def fused_case(row, B, S, d, H, ffn, dev="cuda"):
    """Inputs and fp64 reference outputs for one fused-kernel row: the plain case (reference on the first 64
    sequences) and a mask with holes (not a prefix) on 8 sequences, the first fully masked."""
    w, wref = weights(d, ffn, dev)
    x = torch.randn(B, S, d, device=dev, generator=torch.Generator(dev).manual_seed(row))
    mask = torch.rand(min(B, 8), S, device=dev, generator=torch.Generator(dev).manual_seed(1)) > 0.3
    mask[0] = False
    xm = x[:mask.shape[0]].contiguous()
    sample = slice(0, min(B, 64))
    return {"w": w, "x": x, "xm": xm, "mask": mask, "sample": sample, "num_heads": H,
            "want": fused_layer_reference(x[sample], wref, num_heads=H, causal=True),
            "want_masked": fused_layer_reference(xm, wref, num_heads=H, causal=True, mask=mask)}


def measure_fused(case, **launch):
    """Max abs errors (plain, masked) of fused_layer(**launch) against the fp64 reference and, on a GPU, the
    time of one launch: graph replays of 10 back-to-back launches / 10, so Triton's host-side launch cost
    (tens of µs, more than these kernels take; session 2's sweep timed eager calls) is left out."""
    run = dict(num_heads=case["num_heads"], causal=True, **launch)
    y = fused_layer(case["x"], case["w"], **run)
    ym = fused_layer(case["xm"], case["w"], mask=case["mask"], **run)
    rec = {"max_abs_error": (y[case["sample"]].double() - case["want"]).abs().max().item(),
           "max_abs_error_masked": (ym.double() - case["want_masked"]).abs().max().item()}
    if case["x"].is_cuda:
        rec["ms"] = graph_ms(lambda: fused_layer(case["x"], case["w"], **run),
                             5 if case["x"].shape[0] > 1000 else 30)
        rec["timer"] = "graph replay of 10 launches / 10"
    return rec


def save(out):  # after every record: a run stopped at its time limit keeps what it measured
    with open(sys.argv[1], "w") as f:
        json.dump(out, f, indent=1)


def main():
    out = {"device": torch.cuda.get_device_name(), "fused": [], "attention": []}
    for row, (B, S, d, H, ffn) in FUSED_ROWS.items():
        case = fused_case(row, B, S, d, H, ffn)
        x = case["x"]
        for bm, warps, stages, kv, *blocks in FUSED_CONFIGS:
            key_block, ffn_block = blocks or (None, None)
            rec = {"row": row, "block_m": bm, "num_warps": warps, "num_stages": stages, "kv_precompute": kv,
                   "key_block": key_block, "ffn_block": ffn_block}
            try:
                rec.update(measure_fused(case, block_m=bm, num_warps=warps, num_stages=stages, kv_precompute=kv,
                                         key_block=key_block, ffn_block=ffn_block))
            except Exception as e:  # a configuration that does not compile is a result too
                rec["error"] = f"{type(e).__name__}: {str(e)[:200]}"
            out["fused"].append(rec)
            print("fused", rec, flush=True)
            save(out)
        if row == 6:  # the unfused alternative for the largest fused row: one layer on the triton route
            cfg = TransformerConfig(B, S, d, H, ffn, 1, True)
            model = UserOptimizedTransformer(cfg, route="triton").cuda().eval()
            with torch.inference_mode():
                out["row6_triton_layer_ms"] = median_ms(lambda: model(x), warmup=2, iters=20)
            print("row 6, one layer on the triton route:", out["row6_triton_layer_ms"], "ms", flush=True)
            save(out)
            del model
    if "--fused-only" in sys.argv[2:]:
        return
    for name, (B, S, H, D) in ATTN_SHAPES.items():
        qkv = torch.randn(B, S, 3, H, D, device="cuda", dtype=torch.float16)
        q, k, v = qkv.unbind(2)
        flops = 4 * B * H * S * S * D / 2
        check = slice(0, 1)
        want = attention_reference(q[check, :2048], k[check, :2048], v[check, :2048], causal=True)
        for bm, bn, warps, stages in ATTN_CONFIGS:
            cfg = {"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": warps, "num_stages": stages}
            rec = {"shape": name, **cfg}
            try:
                y = flash_attention(q[check, :2048], k[check, :2048], v[check, :2048], causal=True, config=cfg)
                rec["max_abs_error"] = (y.double() - want).abs().max().item()
                ms = median_ms(lambda: flash_attention(q, k, v, causal=True, config=cfg), warmup=1,
                               iters=3 if S > 10000 else 30)
                rec["ms"], rec["tflops"] = ms, flops / ms / 1e9
            except Exception as e:
                rec["error"] = f"{type(e).__name__}: {str(e)[:200]}"
            out["attention"].append(rec)
            print("attention", rec, flush=True)
            save(out)
        qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))
        ms = median_ms(lambda: torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, is_causal=True),
                       warmup=1, iters=3 if S > 10000 else 30)
        out["attention"].append({"shape": name, "backend": "torch sdpa", "ms": ms, "tflops": flops / ms / 1e9})
        print("attention sdpa", name, ms, flush=True)
        save(out)


if __name__ == "__main__":
    main()
