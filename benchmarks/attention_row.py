"""One official row's attention per layer: our Triton kernel as the split layer calls it against the Gluon kernel.

Usage (CUDA machine): python -m benchmarks.attention_row [OUT.json] [--row 13]
                      [--gluon BM/BN/STAGES/CONSUMERS/PINGPONG[/EXP2_POLY],...] [--reps 50]

q, k, v are the [B, S, 3, H, D] views of a packed QKV projection (fp16), as the split layer passes them. Timed as
CUDA-graph replays of ten calls (the kernel alone, `benchmarks.common.graph_ms`): our Triton attention
(`kernels/attention.py`, autotuned) with the official call's all-True mask and its prefix summary, and without a
mask; the Gluon kernel (`kernels/attention_hopper.py`) at each launch of `--gluon`, unmasked, then its fastest
launch with the all-True mask and its summary (the official call's attention) and with a mask that is no prefix
(holes, read on every block); SDPA's cuDNN and flash backends for scale. Each output's largest difference from
fp64 attention on the first two batch elements; TFLOP/s counting the causal half (4 S^2 D H B / 2).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from benchmarks.common import CUDA, device_name, graph_ms, official, parser, require_cuda, write_json
from benchmarks.row14_attention import gluon_config
from shapewise.kernels import attention_hopper
from shapewise.kernels.attention import attention_reference, flash_attention
from shapewise.kernels.mask import prefix_lengths

GLUON_CONFIGS = ("64/128/3/2/1,64/128/3/2/1/16,64/128/3/2/1/32,64/128/3/2/1/64,64/64/4/2/1,64/64/4/2/1/16,"
                 "64/64/3/3/1,64/64/3/3/1/16,64/128/3/2/0")


def main():
    ap = parser(__doc__, "attention-row.json")
    ap.add_argument("--row", type=int, default=13, help="official row (causal, its seq_len, heads, head_dim)")
    ap.add_argument("--gluon", default=GLUON_CONFIGS,
                    help="the Gluon kernel's launches: BLOCK_M/BLOCK_N/STAGES/CONSUMERS/PINGPONG[/EXP2_POLY],...")
    ap.add_argument("--reps", type=int, default=50, help="graph replays per median")
    args = ap.parse_args()
    require_cuda()
    r = official(args.row)
    B, S, H = r["batch_size"], r["seq_len"], r["num_heads"]
    D = r["d_model"] // H
    flop = 4 * S * S * D * H * B / 2
    torch.manual_seed(0)
    qkv = torch.randn(B, S, 3, H, D, device="cuda", dtype=torch.float16)
    q, k, v = qkv.unbind(2)
    mask = torch.ones(B, S, dtype=torch.bool, device="cuda")
    prefix = prefix_lengths(mask)
    want = attention_reference(q[:2], k[:2], v[:2], causal=True, dtype=torch.float64)
    out = {"device": device_name(CUDA), "row": r["id"], "shape": [B, S, H, D], "flop": flop, "reps": args.reps,
           "gluon_unsupported": attention_hopper.why_unsupported(D, torch.float16, CUDA), "runs": {}}

    def record(name, fn, expected=want):
        try:
            t = graph_ms(fn, args.reps)
            got = fn()[:2].double()
            out["runs"][name] = {"us": t * 1e3, "tflop_per_s": flop / t / 1e9,
                                 "max_abs_diff_vs_fp64": float((got - expected).abs().max()),
                                 "finite": bool(torch.isfinite(got).all())}
        except Exception as exc:  # a launch that does not compile or fit is recorded
            out["runs"][name] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
        print(name, out["runs"][name], flush=True)
        write_json(args.out, out)

    with torch.inference_mode():
        record("triton all-true mask", lambda: flash_attention(q, k, v, causal=True, key_mask=mask,
                                                               mask_prefix_lengths=prefix))
        record("triton unmasked", lambda: flash_attention(q, k, v, causal=True))
        if out["gluon_unsupported"] is None:
            for text in args.gluon.split(","):
                cfg = gluon_config(text)
                record(f"gluon {text}", lambda cfg=cfg: attention_hopper.hopper_attention(q, k, v, causal=True,
                                                                                          config=cfg))
            fastest = min((n for n in out["runs"] if n.startswith("gluon") and "us" in out["runs"][n]),
                          key=lambda n: out["runs"][n]["us"], default=None)
            if fastest is not None:
                cfg = gluon_config(fastest.split()[1])
                out["gluon_fastest"] = fastest
                record(f"{fastest} all-true mask", lambda: attention_hopper.hopper_attention(
                    q, k, v, causal=True, config=cfg, key_mask=mask, mask_prefix_lengths=prefix))
                holes = torch.rand(B, S, device="cuda", generator=torch.Generator("cuda").manual_seed(1)) < 0.9
                holes[:, 0] = True
                record(f"{fastest} holes mask", lambda: attention_hopper.hopper_attention(
                    q, k, v, causal=True, config=cfg, key_mask=holes), attention_reference(
                    q[:2], k[:2], v[:2], causal=True, key_mask=holes[:2], dtype=torch.float64))
        from torch.nn.attention import SDPBackend, sdpa_kernel

        qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))
        for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION):
            def sdpa(backend=backend):
                with sdpa_kernel(backend):
                    return F.scaled_dot_product_attention(qh, kh, vh, is_causal=True).transpose(1, 2)
            record(f"sdpa {backend.name.lower()}", sdpa)
    best = min((n for n in out["runs"] if "us" in out["runs"][n]), key=lambda n: out["runs"][n]["us"], default=None)
    out["best"] = best
    write_json(args.out, out)
    print("best", best, flush=True)


if __name__ == "__main__":
    main()
