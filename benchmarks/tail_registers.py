"""Registers, spills and shared memory of the layer tail kernels on sm_90a, from ptxas: no GPU needed.

Usage: python -m benchmarks.tail_registers [OUT.json]

At d_model and ffn_dim 128 (the official d_model-128 rows), with a mask, for each launch: `_layer_tail_fwd` (a
program per token block, its weights loaded by every program; with and without the next layer's QKV folded in) and
`_layer_tail_persistent_fwd` (a program per SM, the weights loaded once; shared memory then holds them), compiled as
a launch specializes them (pointers divisible by 16), through the ptxas that ships with Triton (`-v`), as
`benchmarks.attention_registers` does for attention.
"""
from __future__ import annotations

import argparse

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from benchmarks.attention_registers import usage
from benchmarks.common import write_json
from shapewise.kernels import layer_tail

POINTERS = {"O": "*fp16", "X": "*fp32", "Y": "*fp32", "Mask": "*i8", "Wo": "*fp16", "Bo": "*fp16", "Win": "*fp16",
            "Bin": "*fp16", "Wout": "*fp16", "Bout": "*fp16", "N2w": "*fp32", "N2b": "*fp32", "NFw": "*fp32",
            "NFb": "*fp32", "Wqkv": "*fp16", "Bqkv": "*fp16", "N1w": "*fp32", "N1b": "*fp32", "QKV": "*fp16"}
# (kernel, BLOCK_M, num_warps, fold): the per-block launches the split layer runs (tail_block_m: 16, 32, 64 tokens,
# 4 warps), 8 warps, and the persistent tail's
LAUNCHES = [("per-block", bm, w, fold) for bm in (16, 32, 64) for w in (4, 8) for fold in (False, True)]
LAUNCHES += [("persistent", bm, w, False) for bm, w in ((32, 8), (32, 4), (64, 8))]


def compile_tail(kind, block_m, num_warps, fold):
    fn = layer_tail._layer_tail_fwd if kind == "per-block" else layer_tail._layer_tail_persistent_fwd
    names = fn.arg_names
    consts = dict(BLOCK_M=block_m, BLOCK_D=128, HAS_MASK=True, FINAL_NORM=False, PDL=1)
    if kind == "per-block":
        consts.update(BLOCK_F=32, NEXT_QKV=fold, BLOCK_N=64)
        stages = 3
    else:
        consts.update(BLOCK_F=128, STAGES=layer_tail.PERSISTENT_STAGES)
        stages = layer_tail.PERSISTENT_STAGES
    sig = {n: POINTERS.get(n, "fp32" if n == "eps" else "constexpr" if n in consts else "i32") for n in names}
    src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in consts.items()},
                    attrs={(names.index(n),): [["tt.divisibility", 16]] for n in names if n in POINTERS})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps, num_stages=stages))


def main():
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument("out", nargs="?", help="JSON file to write (default: print only)")
    args = p.parse_args()
    out = []
    for kind, block_m, num_warps, fold in LAUNCHES:
        rec = {"kernel": kind, "block_m": block_m, "num_warps": num_warps, "next_qkv": fold,
               **usage(compile_tail(kind, block_m, num_warps, fold), num_warps)}
        out.append(rec)
        print(rec, flush=True)
    if args.out:
        write_json(args.out, {"target": "sm_90a", "d_model": 128, "ffn_dim": 128, "triton": triton.__version__,
                              "launches": out})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
