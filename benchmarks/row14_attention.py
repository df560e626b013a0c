"""Official row 14's attention: our kernel's tiles against cuDNN's SDPA on one batch element, causal, fp16.

Usage (CUDA machine): python -m benchmarks.row14_attention [OUT.json] [--configs BM/BN/WARPS/STAGES,...]
                      [--gluon BM/BN/STAGES/CONSUMERS/PINGPONG[/EXP2_POLY],...|none]

The model streams row 14 in chunks of one batch element, and cuDNN's attention is most of its GPU time
(docs/performance.md), so the row's target rests on an attention faster than cuDNN's on this shape. q, k, v are
strided views of a packed QKV projection, as the model passes them. Per candidate tile: the median of 3 calls
after one that compiles (the timing job's timer), TFLOP/s counting the causal half (4 * S^2 * d_head * heads / 2)
and the largest difference from cuDNN's output. The best tile also runs with an all-True mask and its prefix
summary (what the official call runs). On a Hopper GPU the Gluon kernel (kernels/attention_hopper.py: TMA,
wgmma, a producer warp and ping-ponging consumer warpgroups) is timed the same way at each launch of `--gluon`
(default GLUON_CONFIGS, its default for head_dim 64 first; `none` skips it), under "gluon" with the same fields,
its best launch and best / cuDNN. A launch's optional sixth field, EXP2_POLY, is how many of a score block's
BLOCK_N columns take their exp2 from a polynomial on the FMA pipes instead of MUFU's ex2 (0, all ex2, when left
out). OUT.json is written after every candidate.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from benchmarks.common import CUDA, device_name, median_ms, parser, require_cuda, write_json
from shapewise.kernels import attention_hopper
from shapewise.kernels.attention import LONG_SEQUENCE_TILES, flash_attention
from shapewise.kernels.mask import prefix_lengths

S, H, D = 100_000, 16, 64
FLOP = 4 * S * S * D * H / 2
DEFAULT_CONFIGS = "128/64/8/3,128/128/8/3,128/64/8/4,128/128/8/2,64/128/4/3,128/64/4/3"
# The Gluon kernel's launches: BLOCK_M (query rows a consumer warpgroup) / BLOCK_N (keys a ring slot) / STAGES /
# CONSUMERS / PINGPONG (1 on) [/ EXP2_POLY: score columns of a block whose exp2 take the polynomial, 0 if left
# out]; its head-dim-64 default first, then the same with an eighth, a quarter and a half of the exp2s off MUFU
# (whose ex2 takes about as many cycles as the wgmmas at head_dim 64), 2 and 4 slots, 64 keys a slot with two and
# three consumers, ping-pong off, and 128 rows a consumer (which spills at 240 registers: timed to show its cost)
GLUON_CONFIGS = ("64/128/3/2/1,64/128/3/2/1/16,64/128/3/2/1/32,64/128/3/2/1/64,64/128/2/2/1,64/128/4/2/1,"
                 "64/64/3/2/1,64/64/4/3/1,64/128/3/2/0,128/128/2/2/1")


def ms(fn, n=3):
    """Median of n calls after one that compiles, each timed by its own CUDA event pair (the timing job's timer)."""
    fn()
    return median_ms(fn, CUDA, n)


def entry(t):
    return {"ms": t, "tflop_per_s": FLOP / t / 1e9}


def gluon_config(text):
    """`hopper_attention`'s config from "BM/BN/STAGES/CONSUMERS/PINGPONG[/EXP2_POLY]" (EXP2_POLY 0 if left out)."""
    fields = [int(p) for p in text.split("/")]
    if len(fields) not in (5, 6):
        raise ValueError(f"a Gluon launch is BM/BN/STAGES/CONSUMERS/PINGPONG[/EXP2_POLY], got {text!r}")
    bm, bn, stages, consumers, pingpong, poly = fields + [0] * (6 - len(fields))
    return {"BLOCK_M": bm, "BLOCK_N": bn, "STAGES": stages, "CONSUMERS": consumers, "PINGPONG": bool(pingpong),
            "EXP2_POLY": poly}


def time_gluon(out, q, k, v, ref, texts, save):
    """The Gluon kernel at each launch of `texts` into out["gluon"], then its best and best / cuDNN."""
    out["gluon"], best = {}, None
    for text in texts.split(","):
        cfg = gluon_config(text)
        try:
            run = lambda cfg=cfg: attention_hopper.hopper_attention(q, k, v, causal=True, config=cfg)  # noqa: E731
            t = ms(run)
            got = run()
            err = float((got.float() - ref).abs().max())
            out["gluon"][text] = dict(entry(t), max_abs_diff_vs_cudnn=err, nan=bool(got.isnan().any()))
            if best is None or t < out["gluon"][best]["ms"]:
                best = text
        except Exception as exc:  # a launch that does not compile or fit is recorded
            out["gluon"][text] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
        print("gluon", text, out["gluon"][text], flush=True)
        save()
    if best is not None:
        out["gluon_best"] = best
        out["gluon_best_over_cudnn"] = out["gluon"][best]["ms"] / out["cudnn"]["ms"]
        print("gluon best", best, "gluon / cudnn", out["gluon_best_over_cudnn"], flush=True)
        save()


def main():
    ap = parser(__doc__, "row14-attention.json")
    ap.add_argument("--configs", default=DEFAULT_CONFIGS, help="our tiles: BLOCK_M/BLOCK_N/num_warps/num_stages,...")
    ap.add_argument("--gluon", default=GLUON_CONFIGS,
                    help="the Gluon kernel's launches: BLOCK_M/BLOCK_N/STAGES/CONSUMERS/PINGPONG[/EXP2_POLY],... "
                         "or none")
    args = ap.parse_args()
    require_cuda()
    torch.manual_seed(0)
    qkv = torch.randn(1, S, 3, H, D, device="cuda", dtype=torch.float16)
    q, k, v = qkv.unbind(2)
    mask = torch.ones(1, S, dtype=torch.bool, device="cuda")
    prefix = prefix_lengths(mask)
    out = {"device": device_name(CUDA), "shape": [1, S, H, D], "flop": FLOP,
           "committed_long_sequence_tiles": LONG_SEQUENCE_TILES, "ours": {},
           "gluon_unsupported": attention_hopper.why_unsupported(D, torch.float16, CUDA)}
    save = lambda: write_json(args.out, out)  # noqa: E731
    with torch.inference_mode():
        from torch.nn.attention import SDPBackend, sdpa_kernel

        qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            out["cudnn"] = entry(ms(lambda: F.scaled_dot_product_attention(qh, kh, vh, is_causal=True)))
        print("cudnn", out["cudnn"], flush=True)
        save()
        ref = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True).transpose(1, 2).float()
        best = None
        for text in args.configs.split(","):
            bm, bn, warps, stages = (int(p) for p in text.split("/"))
            cfg = {"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": warps, "num_stages": stages}
            try:
                t = ms(lambda: flash_attention(q, k, v, causal=True, config=cfg))
                err = float((flash_attention(q, k, v, causal=True, config=cfg).float() - ref).abs().max())
                out["ours"][text] = dict(entry(t), max_abs_diff_vs_cudnn=err)
                if best is None or t < out["ours"][best]["ms"]:
                    best = text
            except Exception as exc:  # a tile that does not compile or fit is recorded
                out["ours"][text] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
            print(text, out["ours"][text], flush=True)
            save()
        if best is not None:
            bm, bn, warps, stages = (int(p) for p in best.split("/"))
            cfg = {"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": warps, "num_stages": stages}
            out["best"] = best
            out["best_all_true_mask"] = entry(ms(lambda: flash_attention(
                q, k, v, causal=True, key_mask=mask, mask_prefix_lengths=prefix, config=cfg)))
            out["best_over_cudnn"] = out["ours"][best]["ms"] / out["cudnn"]["ms"]
            print("best", best, out["best_all_true_mask"], "ours / cudnn", out["best_over_cudnn"], flush=True)
            save()
        if args.gluon != "none" and out["gluon_unsupported"] is None:
            time_gluon(out, q, k, v, ref, args.gluon, save)
        elif args.gluon != "none":
            print("gluon skipped:", out["gluon_unsupported"], flush=True)


if __name__ == "__main__":
    main()
