"""Launch configurations of the fused layer and attention kernels on official shapes, each with a correctness check.

Usage (CUDA machine): python -m benchmarks.launch_sweep [OUT.json] [--fused-only]
       (--fused-only: skip the attention kernel's part, which takes most of the sweep's time on row 14's shape)

For the fused layer kernel (every official row it serves or could serve) and the attention kernel (row 13's and
row 14's attention shapes) it runs each configuration, compares it against the kernel's fp64 torch reference, and
times it: a fused layer as a CUDA graph of 10 launches (no host launch cost), attention by the timing job's timer.
On row 6 it also times one layer of the unfused triton route, the fused route's alternative. `shapewise tune
OUT.json` writes the winners into model/routing_policy.json.
"""
from __future__ import annotations

import torch

from benchmarks.common import (CUDA, device_name, graph_ms, kernel_weights, median_ms, parser, setup,
                               shape_of, write_json)
from benchmarks.common import row as row_spec
from shapewise.kernels.attention import attention_reference, flash_attention
from shapewise.kernels.fused_layer import fused_layer, fused_layer_reference
from shapewise.model.reference import LAYER_NORM_EPS

# every official row the fused route serves or could serve (row 2 left out: one sequence, the graph route wins)
FUSED_ROWS = {n: shape_of(n) for n in (1, 3, 4, 5, 6, 7, 9, 10, 11, 12)}
# (block_m, num_warps, num_stages, kv_precompute[, key_block, ffn_block]): kv_precompute computes keys and values
# once per layer in a second kernel instead of in every program; key_block (with it) runs the softmax over key
# blocks, ffn_block sets the FFN columns per step (kernels/fused_layer.py; absent: the kernel's defaults). The first
# is the accuracy baseline `shapewise tune` holds every other one to; block_m stays within fused_layer.MAX_BLOCK_M
# (docs/decisions.md#fused-block-m; benchmarks/fused_block_m.py probes larger ones in processes of their own).
FUSED_CONFIGS = [(32, 4, 1, False), (32, 4, 2, False), (16, 4, 3, False), (32, 4, 2, True), (16, 4, 3, True),
                 (32, 4, 2, True, 32, 32), (16, 4, 3, True, 32, 32), (32, 8, 2, True, 32, 32)]
ATTN_SHAPES = {"row13": (64, 1024, 4, 32), "row14-b4": (4, 100000, 16, 64)}
ATTN_CONFIGS = [(64, 64, 4, 3), (128, 64, 8, 3), (128, 64, 8, 4), (128, 128, 8, 3), (64, 32, 4, 2), (128, 32, 4, 3)]


def fused_case(row, B, S, d, H, ffn, dev="cuda"):
    """Inputs and fp64 reference outputs for one fused-kernel row: the plain case (reference on the first 64
    sequences) and a mask with holes (not a prefix) on 8 sequences, the first fully masked."""
    w, wref = kernel_weights(d, ffn, dev)
    x = torch.randn(B, S, d, device=dev, generator=torch.Generator(dev).manual_seed(row))
    mask = torch.rand(min(B, 8), S, device=dev, generator=torch.Generator(dev).manual_seed(1)) > 0.3
    mask[0] = False
    xm = x[:mask.shape[0]].contiguous()
    sample = slice(0, min(B, 64))
    return {"w": w, "x": x, "xm": xm, "mask": mask, "sample": sample, "num_heads": H,
            "want": fused_layer_reference(x[sample], wref, num_heads=H, causal=True, eps=LAYER_NORM_EPS),
            "want_masked": fused_layer_reference(xm, wref, num_heads=H, causal=True, eps=LAYER_NORM_EPS, mask=mask)}


def measure_fused(case, **launch):
    """Max abs errors (plain, masked) of fused_layer(**launch) against the fp64 reference and, on a GPU, the
    time of one launch: graph replays of 10 back-to-back launches / 10, so Triton's host-side launch cost
    (tens of µs, more than these kernels take) is left out."""
    run = dict(num_heads=case["num_heads"], causal=True, eps=LAYER_NORM_EPS, **launch)
    y = fused_layer(case["x"], case["w"], **run)
    ym = fused_layer(case["xm"], case["w"], mask=case["mask"], **run)
    rec = {"max_abs_error": (y[case["sample"]].double() - case["want"]).abs().max().item(),
           "max_abs_error_masked": (ym.double() - case["want_masked"]).abs().max().item()}
    if case["x"].is_cuda:
        rec["ms"] = graph_ms(lambda: fused_layer(case["x"], case["w"], **run),
                             5 if case["x"].shape[0] > 1000 else 30)
        rec["timer"] = "graph replay of 10 launches / 10"
    return rec


def main():
    p = parser(__doc__, "launch-sweep.json")
    p.add_argument("--fused-only", action="store_true", help="the fused layer's configurations only")
    args = p.parse_args()
    out = {"device": device_name(CUDA), "fused": [], "attention": []}

    def save():
        write_json(args.out, out)

    for row, (B, S, d, H, ffn) in FUSED_ROWS.items():
        case = fused_case(row, B, S, d, H, ffn)
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
            save()
        if row == 6:  # the unfused alternative for the largest fused row: one layer on the triton route
            one_layer = row_spec("row6-one-layer", batch_size=B, seq_len=S, d_model=d, num_heads=H, ffn_dim=ffn,
                                 num_layers=1, pass_mask=False, route="triton")
            _, _, model, x1, _ = setup(one_layer, CUDA, reference=False)
            with torch.inference_mode():
                for _ in range(2):
                    model(x1)
                out["row6_triton_layer_ms"] = median_ms(lambda: model(x1), CUDA, 20)
            print("row 6, one layer on the triton route:", out["row6_triton_layer_ms"], "ms", flush=True)
            save()
            del model
    if args.fused_only:
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
                fn = lambda: flash_attention(q, k, v, causal=True, config=cfg)  # noqa: E731
                fn()
                ms = median_ms(fn, CUDA, 3 if S > 10000 else 30)
                rec["ms"], rec["tflops"] = ms, flops / ms / 1e9
            except Exception as e:
                rec["error"] = f"{type(e).__name__}: {str(e)[:200]}"
            out["attention"].append(rec)
            print("attention", rec, flush=True)
            save()
        qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))
        fn = lambda: torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, is_causal=True)  # noqa: E731
        fn()
        ms = median_ms(fn, CUDA, 3 if S > 10000 else 30)
        out["attention"].append({"shape": name, "backend": "torch sdpa", "ms": ms, "tflops": flops / ms / 1e9})
        print("attention sdpa", name, ms, flush=True)
        save()


if __name__ == "__main__":
    main()
