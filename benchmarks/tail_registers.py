"""Registers, spills and shared memory of the layer tail kernel on sm_90a, from ptxas: no GPU needed.

Usage: python -m benchmarks.tail_registers [OUT.json]

At d_model and ffn_dim 128 (the official d_model-128 rows), with a mask, for each launch: `_layer_tail_fwd` (a
program per token block, its weights loaded by every program), compiled as a launch specializes it (pointers
divisible by 16), through the ptxas that ships with Triton (`-v`), as `benchmarks.attention_registers` does for
attention.
"""
from __future__ import annotations

import argparse

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from benchmarks.attention_registers import usage
from benchmarks.common import write_json
from shapewise.kernels import layer_tail

POINTERS = {"Att": "*fp16", "X": "*fp32", "Y": "*fp32", "Mask": "*i8", "Wo": "*fp16", "Bo": "*fp16", "Win": "*fp16",
            "Bin": "*fp16", "Wout": "*fp16", "Bout": "*fp16", "N2w": "*fp32", "N2b": "*fp32", "NFw": "*fp32",
            "NFb": "*fp32"}
# (BLOCK_M, num_warps): the launches the split layer runs (tail_block_m: 16, 32, 64 tokens, 4 warps), and 8 warps
LAUNCHES = [(bm, w) for bm in (16, 32, 64) for w in (4, 8)]


def compile_tail(block_m, num_warps):
    fn = layer_tail._layer_tail_fwd
    names = fn.arg_names
    consts = dict(BLOCK_M=block_m, BLOCK_D=128, BLOCK_F=32, HAS_MASK=True, FINAL_NORM=False, PDL=1)
    sig = {n: POINTERS.get(n, "fp32" if n == "eps" else "constexpr" if n in consts else "i32") for n in names}
    src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in consts.items()},
                    attrs={(names.index(n),): [["tt.divisibility", 16]] for n in names if n in POINTERS})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps, num_stages=3))


def main():
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument("out", nargs="?", help="JSON file to write (default: print only)")
    args = p.parse_args()
    out = []
    for block_m, num_warps in LAUNCHES:
        rec = {"kernel": "per-block", "block_m": block_m, "num_warps": num_warps,
               **usage(compile_tail(block_m, num_warps), num_warps)}
        out.append(rec)
        print(rec, flush=True)
    if args.out:
        write_json(args.out, {"target": "sm_90a", "d_model": 128, "ffn_dim": 128, "triton": triton.__version__,
                              "launches": out})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
