"""Our Hopper linear layer (kernels/linear_hopper.py) against cuBLAS on the GEMM shapes of the wide rows, each
epilogue against the unfused pair it would replace.

Usage (CUDA machine, sm_90): python -m benchmarks.linear_hopper [OUT.json] [--shapes row8,row14,wide] [--reps 30]

Shapes (M tokens; N, K of each GEMM): official row 8 (M 8 192: the QKV projection 3 072 x 1 024, the out-projection
and both FFN GEMMs 1 024 x 1 024), one chunk of row 14 (M 100 000, the same N and K) and contract-wide (M 2 048,
d 2 048, FFN 8 192). Per shape, each timed as a CUDA graph of ten calls (the host's launch cost left out, the
median replay over --reps): `bias` (fp16 out) against cuBLAS's `F.linear` with its bias epilogue; `gelu` against
`F.gelu(F.linear(...))`; `residual` (fp32 out) against `residual + F.linear(...)`; TFLOP/s of the GEMM
(2 M N K), ours / cuBLAS's time, and the largest difference of each output from an fp32 computation of the same
(fp16 operands). `--stages 2,3,4,5`: each epilogue also at each of these ring depths that fits (`stages_ms`; the
kernel's default is `stages_for` its output dtype). OUT.json is written after every shape.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from benchmarks.common import CUDA, device_name, graph_ms, parser, require_cuda, write_json
from shapewise.kernels import linear_hopper as lh

SHAPES = {
    "row8": (8192, ((3072, 1024), (1024, 1024))),
    "row14": (100_000, ((3072, 1024), (1024, 1024))),
    "wide": (2048, ((6144, 2048), (2048, 2048), (8192, 2048), (2048, 8192))),
}


def compare(M, N, K, reps, stages=()):
    """{epilogue: {ours_ms, cublas_ms, ratio, tflop_per_s, cublas_tflop_per_s, max_abs_diff, cublas_max_abs_diff}}."""
    g = torch.Generator(device=CUDA).manual_seed(0)
    a = torch.randn(M, K, device=CUDA, generator=g).half()
    w = (torch.randn(N, K, device=CUDA, generator=g) * K**-0.5).half()
    b = torch.randn(N, device=CUDA, generator=g).half()
    r = torch.randn(M, N, device=CUDA, generator=g)
    exact = a.float() @ w.float().t() + b.float()
    truth = {"bias": exact, "gelu": F.gelu(exact), "residual": r + exact}
    cublas = {"bias": lambda: F.linear(a, w, b), "gelu": lambda: F.gelu(F.linear(a, w, b)),
              "residual": lambda: r + F.linear(a, w, b)}
    flop = 2 * M * N * K
    done = {}
    for epilogue in lh.EPILOGUES:
        ours = lambda e=epilogue: lh.linear_hopper(a, w, b, epilogue=e, residual=r)  # noqa: E731
        got, ref = ours().float(), cublas[epilogue]().float()
        ms, ref_ms = graph_ms(ours, reps), graph_ms(cublas[epilogue], reps)
        done[epilogue] = {"ours_ms": ms, "cublas_ms": ref_ms, "ratio": ms / ref_ms,
                          "tflop_per_s": flop / ms * 1e-9, "cublas_tflop_per_s": flop / ref_ms * 1e-9,
                          "max_abs_diff": (got - truth[epilogue]).abs().max().item(),
                          "cublas_max_abs_diff": (ref - truth[epilogue]).abs().max().item()}
        print(f"M={M} N={N} K={K} {epilogue}: ours {ms * 1e3:.1f} us ({done[epilogue]['tflop_per_s']:.0f} TFLOP/s), "
              f"cuBLAS {ref_ms * 1e3:.1f} us, ratio {done[epilogue]['ratio']:.3f}, max |diff| "
              f"{done[epilogue]['max_abs_diff']:.2e} (cuBLAS {done[epilogue]['cublas_max_abs_diff']:.2e})", flush=True)
        out_dtype = torch.float32 if epilogue == "residual" else a.dtype
        fits = [s for s in stages if lh.ring_fits(out_dtype, s)]
        done[epilogue]["stages_ms"] = {s: graph_ms(lambda e=epilogue, s=s: lh.linear_hopper(  # noqa: E731
            a, w, b, epilogue=e, residual=r, stages=s), reps) for s in fits}
        if fits:
            depths = done[epilogue]["stages_ms"].items()
            print("  by ring depth: " + ", ".join(f"{s} {t * 1e3:.1f} us" for s, t in depths), flush=True)
    return done


def main():
    p = parser(__doc__, "linear-hopper.json")
    p.add_argument("--shapes", default=",".join(SHAPES), help=f"of {', '.join(SHAPES)}")
    p.add_argument("--reps", type=int, default=30, help="graph replays per timing (median)")
    p.add_argument("--stages", default="", help="ring depths to time each epilogue at as well, e.g. 2,3,4,5")
    args = p.parse_args()
    require_cuda()
    why = lh.why_unsupported(torch.zeros(8, 8, dtype=torch.float16), torch.zeros(8, 8, dtype=torch.float16), "bias",
                             CUDA)
    if why:
        raise SystemExit(f"linear_hopper: {why}")
    out = {"device": device_name(CUDA), "shapes": {}}
    stages = [int(s) for s in args.stages.split(",") if s]
    for name in args.shapes.split(","):
        M, gemms = SHAPES[name]
        for N, K in gemms:
            out["shapes"][f"{name} M={M} N={N} K={K}"] = compare(M, N, K, args.reps, stages)
            write_json(args.out, out)


if __name__ == "__main__":
    main()
