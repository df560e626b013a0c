"""The fused-epilogue/prologue GEMM (kernels/fused_linear.py) against cuBLAS and the unfused kernels it replaces.

Usage (CUDA machine): python -m benchmarks.fused_linear OUT_DIR [--configs BM/BN/BK/WARPS/STAGES[/tma],...]

Shapes: official row 8's GEMMs (M = 8192 tokens) and a 65 536-token slice of row 14 (both d_model 1024, ffn 1024),
N and K each 1024 or 3072. Per shape: (1) cuBLAS `F.linear` in fp16 alone and (2) `fused_linear` without prologue
or epilogue extras, at the default launch and each of `--configs` (`/tma`: tiles by TMA descriptors), with TFLOP/s
and its rate against cuBLAS. At the model's own GEMMs (QKV: N 3072, K 1024; the others N = K = 1024) the pairs a
fused call replaces, once with pointer loads and once with TMA: (3a) F.linear + F.gelu against
`fused_linear(gelu=True)`; (3b) F.linear + `add_layernorm` (residual add, LayerNorm 2: the new fp32 residual and the
fp16 normalized rows) against `fused_linear(residual=, stats_out=)` + `layernorm_stats` (the statistics the next
call's prologue reads); (3c) `layer_norm` to fp16 + F.linear against `fused_linear(ln=)` (gamma and beta folded; the
statistics given); (3d) a layer's FFN half from LayerNorm 2 to the next residual and its statistics, both ways. Each
fused result is checked against the unfused one (max abs difference). Times: CUDA event pairs per call
(shapewise.jobs.device.time_calls), after WARMUP calls, ROUNDS rounds of CALLS calls, the median of the rounds'
medians (each round's median kept). OUT_DIR/fused-linear.json is written after every record, with the device, torch
and triton versions and the commit.
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

from benchmarks.common import CUDA, ROOT, device_name, require_cuda, write_json
from shapewise.jobs.device import time_calls
from shapewise.kernels import fused_linear as fl
from shapewise.kernels.layernorm import add_layernorm
from shapewise.model.reference import LAYER_NORM_EPS

TOKENS = {"row8": 8192, "row14-slice": 65536}
WIDTHS = (1024, 3072)
WARMUP, ROUNDS, CALLS = 10, 5, 10
D, FFN = 1024, 1024  # rows 8 and 14: d_model, ffn_dim


def timed(fn):
    """{"ms": median of the rounds' medians, "rounds_ms": each round's median}, after WARMUP calls."""
    time_calls(fn, CUDA, WARMUP)
    rounds = [statistics.median(time_calls(fn, CUDA, CALLS)) for _ in range(ROUNDS)]
    return {"ms": statistics.median(rounds), "rounds_ms": rounds}


def max_abs(a, b):
    return (a.float() - b.float()).abs().max().item()


def commit():
    done = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True,
                           text=True).stdout.strip()
    return (done.stdout.strip() or None), bool(dirty)


def operands(m, n, k, seed):
    g = torch.Generator(device=CUDA).manual_seed(seed)
    a = torch.randn(m, k, device=CUDA, generator=g).half()
    w = (torch.randn(n, k, device=CUDA, generator=g) / k**0.5).half()
    b = (0.1 * torch.randn(n, device=CUDA, generator=g)).half()  # cuBLAS's bias; the fused call gets it in fp32
    return a, w, b


def layer_norm_params(d, seed):
    g = torch.Generator(device=CUDA).manual_seed(seed)
    return 1 + 0.1 * torch.randn(d, device=CUDA, generator=g), 0.1 * torch.randn(d, device=CUDA, generator=g)


def plain(m, n, k, configs):
    """(1) and (2): cuBLAS against fused_linear without extras at each launch."""
    a, w, b = operands(m, n, k, seed=m + n + k)
    bf = b.float()
    flop = 2 * m * n * k
    rec = {"m": m, "n": n, "k": k, "cublas": timed(lambda: F.linear(a, w, b))}
    rec["cublas"]["tflop_per_s"] = flop / rec["cublas"]["ms"] / 1e9
    want = F.linear(a, w, b)
    rec["fused"] = {}
    for name, kw in configs:
        try:
            got = fl.fused_linear(a, w, bf, **kw)
            t = timed(lambda: fl.fused_linear(a, w, bf, **kw))
        except Exception as e:  # a launch that does not fit this GPU (shared memory, registers) is recorded
            rec["fused"][name] = {"error": f"{type(e).__name__}: {e}"[:300]}
            continue
        t.update(tflop_per_s=flop / t["ms"] / 1e9, rate_vs_cublas=rec["cublas"]["ms"] / t["ms"],
                 max_abs_vs_cublas=max_abs(got, want))
        rec["fused"][name] = t
    return rec


def pairs(m, launch):
    """(3a-d) at the model's GEMMs for m tokens, every fused_linear call with the keywords `launch`."""
    out = {}
    res = torch.randn(m, D, device=CUDA, generator=torch.Generator(device=CUDA).manual_seed(1)) + 0.5
    gamma, beta = layer_norm_params(D, seed=2)
    eps = LAYER_NORM_EPS

    # (3a) FFN in: linear + exact GELU
    h, w_in, b_in = operands(m, FFN, D, seed=3)
    unfused = lambda: F.gelu(F.linear(h, w_in, b_in), approximate="none")  # noqa: E731
    fused = lambda: fl.fused_linear(h, w_in, b_in.float(), gelu=True, **launch)  # noqa: E731
    out["linear_gelu"] = {"m": m, "n": FFN, "k": D, "unfused": timed(unfused), "fused": timed(fused),
                          "max_abs_fused_vs_unfused": max_abs(fused(), unfused())}

    # (3b) out-projection (or FFN out): linear, residual add, LayerNorm 2
    o, w_o, b_o = operands(m, D, D, seed=4)
    st = torch.empty(fl.stats_shape(m, D), device=CUDA)

    def unfused_b():
        return add_layernorm(res, F.linear(o, w_o, b_o), gamma, beta, eps=eps, out_dtype=torch.float16)

    def fused_b():
        y = fl.fused_linear(o, w_o, b_o.float(), residual=res, stats_out=st, out_dtype=torch.float32, **launch)
        return y, fl.layernorm_stats(st, D, eps=eps)

    (r_u, _), (r_f, (mean, rstd)) = unfused_b(), fused_b()
    r64 = r_f.double()
    out["linear_residual_layernorm"] = {
        "m": m, "n": D, "k": D, "unfused": timed(unfused_b), "fused": timed(fused_b),
        "max_abs_fused_vs_unfused": max_abs(r_f, r_u),
        "max_abs_mean_vs_torch": (mean.double() - r64.mean(-1)).abs().max().item(),
        "max_rel_rstd_vs_torch": ((rstd.double() * torch.sqrt(r64.var(-1, unbiased=False) + eps)) - 1)
        .abs().max().item()}

    # (3c) LayerNorm 1 + QKV and LayerNorm 2 + FFN in: the normalized rows in fp16, then the linear
    for name, n in (("layernorm_qkv", 3 * D), ("layernorm_ffn_in", FFN)):
        _, w_x, b_x = operands(m, n, D, seed=5 + n)
        w_f, b_f = fl.fold_layernorm(w_x, b_x, gamma, beta)
        mean, rstd = (t.float() for t in fl.layernorm_stats_reference(res, eps=eps))

        def unfused_c(w_x=w_x, b_x=b_x):
            _, hn = add_layernorm(res, None, gamma, beta, eps=eps, out_dtype=torch.float16, write_residual=False)
            return F.linear(hn, w_x, b_x)

        def fused_c(w_f=w_f, b_f=b_f, mean=mean, rstd=rstd):
            return fl.fused_linear(res, w_f, b_f, ln=(mean, rstd), **launch)

        out[name] = {"m": m, "n": n, "k": D, "unfused": timed(unfused_c), "fused": timed(fused_c),
                     "max_abs_fused_vs_unfused": max_abs(fused_c(), unfused_c())}

    # (3d) the FFN half of a layer, from the residual after attention to the next residual and its LayerNorm
    _, w_out, b_out = operands(m, D, FFN, seed=7)
    w_in_f, b_in_f = fl.fold_layernorm(w_in, b_in, gamma, beta)
    st2 = torch.empty_like(st)

    def unfused_d():
        r1, h1 = add_layernorm(res, F.linear(o, w_o, b_o), gamma, beta, eps=eps, out_dtype=torch.float16)
        f = F.gelu(F.linear(h1, w_in, b_in), approximate="none")
        return add_layernorm(r1, F.linear(f, w_out, b_out), gamma, beta, eps=eps, out_dtype=torch.float16)

    def fused_d():
        r1 = fl.fused_linear(o, w_o, b_o.float(), residual=res, stats_out=st, out_dtype=torch.float32, **launch)
        f = fl.fused_linear(r1, w_in_f, b_in_f, ln=fl.layernorm_stats(st, D, eps=eps), gelu=True, **launch)
        r2 = fl.fused_linear(f, w_out, b_out.float(), residual=r1, stats_out=st2, out_dtype=torch.float32,
                             **launch)
        return r2, fl.layernorm_stats(st2, D, eps=eps)

    (r_u, _), (r_f, _) = unfused_d(), fused_d()
    out["ffn_half_layer"] = {"m": m, "d": D, "ffn": FFN, "unfused": timed(unfused_d), "fused": timed(fused_d),
                             "max_abs_fused_vs_unfused": max_abs(r_f, r_u)}
    for rec in out.values():
        rec["saved_ms"] = rec["unfused"]["ms"] - rec["fused"]["ms"]
    return out


def parse_configs(text):
    """[(name, fused_linear's launch keywords)], the default launch first, from "128/256/64/8/3,128/128/64/8/4/tma"."""
    configs = [("default", {})]
    for item in filter(None, (s.strip() for s in text.split(","))):
        parts = item.split("/")
        tma = parts[5:] == ["tma"]
        if len(parts) not in (5, 6) or (len(parts) == 6 and not tma) or not all(p.isdigit() for p in parts[:5]):
            raise SystemExit(f"--configs {item!r}: expected BM/BN/BK/WARPS/STAGES[/tma], e.g. 128/256/64/8/3/tma")
        kw = dict(zip(("block_m", "block_n", "block_k", "num_warps", "num_stages"), map(int, parts[:5])), tma=tma)
        configs.append((item, kw))
    return configs


def main():
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument("out_dir", help="directory to write fused-linear.json into")
    p.add_argument("--configs", default="128/128/64/8/4/tma,128/256/64/8/3,128/256/64/8/3/tma,128/128/64/4/4",
                   help="fused_linear launches timed beside the default, BM/BN/BK/WARPS/STAGES[/tma]")
    args = p.parse_args()
    require_cuda()
    configs = parse_configs(args.configs)
    sha, dirty = commit()
    path = Path(args.out_dir) / "fused-linear.json"
    result = {"device": device_name(CUDA), "torch": torch.__version__, "triton": triton.__version__,
              "commit": sha, "uncommitted_changes": dirty, "eps": LAYER_NORM_EPS,
              "default_launch": dict(block_m=fl.BLOCK_M, block_n=fl.BLOCK_N, block_k=fl.BLOCK_K,
                                     num_warps=fl.NUM_WARPS, num_stages=fl.NUM_STAGES, group_m=fl.GROUP_M),
              "protocol": dict(warmup=WARMUP, rounds=ROUNDS, calls_per_round=CALLS, timer="CUDA event pair per call"),
              "tokens": TOKENS, "gemm": [], "pairs": {}}
    with torch.inference_mode():
        for label, m in TOKENS.items():
            for n in WIDTHS:
                for k in WIDTHS:
                    rec = plain(m, n, k, configs)
                    rec["shape"] = label
                    result["gemm"].append(rec)
                    best = max((v["rate_vs_cublas"], name) for name, v in rec["fused"].items() if "error" not in v)
                    print(f"{label} {m}x{n}x{k}: cuBLAS {rec['cublas']['ms']:.3f} ms, fused default "
                          f"{rec['fused']['default'].get('rate_vs_cublas', float('nan')):.2f}, best {best[1]} "
                          f"{best[0]:.2f} of cuBLAS", flush=True)
                    write_json(path, result)
            for loads, launch in (("pointers", {}), ("tma", {"tma": True})):
                result["pairs"][f"{label}/{loads}"] = rec = pairs(m, launch)
                for name, r in rec.items():
                    print(f"{label} {loads} {name}: unfused {r['unfused']['ms']:.3f} ms, fused "
                          f"{r['fused']['ms']:.3f} ms, max abs {r['max_abs_fused_vs_unfused']:.2e}", flush=True)
                write_json(path, result)
            torch.cuda.empty_cache()
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
