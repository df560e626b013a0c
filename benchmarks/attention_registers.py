"""Registers, spills and shared memory of the attention kernel on sm_90a, from ptxas: no GPU needed.

Usage: python -m benchmarks.attention_registers [OUT.json]

For each launch (tile, warps, stages) the autotuner picks on the H200 and each head size, it compiles
`kernels.attention._attention_fwd` for sm_90a with key lengths (the prefix path without a mask) and with a key
mask (what the official call's all-True mask runs), specialized as a launch specializes it (pointers and the
packed projection's strides divisible by 16), runs the ptxas that ships with Triton (`-v`) and records registers
per thread, spill bytes, shared memory and the programs an SM holds by registers; for the masked kernel also under
the cap `kernels.attention.MASKED_MAX_REGISTERS` gives it. Where the mask alone costs an SM a program, the cap
belongs in that table (docs/decisions.md#attention-register-cap).
"""
from __future__ import annotations

import argparse
import json

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from benchmarks.common import write_json
from benchmarks.sm90 import ptxas_report
from shapewise.kernels import attention

POINTERS = {"Q": "*fp16", "K": "*fp16", "V": "*fp16", "Out": "*fp16", "KeyLen": "*i32", "KeyMask": "*i8"}
# (BLOCK_M, BLOCK_N, num_warps, num_stages): the tiles the autotuner picked on the H200 (64x64 for most rows, 64x32
# for head_dim 256, 32x32 for sequences of 32, 128x64 for long sequences)
LAUNCHES = ((64, 64, 4, 3), (64, 32, 4, 2), (32, 32, 4, 2), (128, 64, 8, 3))
HEAD_DIMS = (16, 32, 64, 128, 256)
REGISTERS_PER_SM = 65536


def compile_attention(head_dim, block_m, block_n, num_warps, num_stages, key_mask, maxnreg=None):
    names = attention._attention_fwd.arg_names
    block_d = max(16, triton.next_power_of_2(head_dim))
    own_loop = attention.MASK_OWN_LOOP_MAX_BLOCK_D
    mask_loop = own_loop is not None and block_d <= own_loop  # as the launcher decides it
    consts = dict(HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_M=block_m,
                  BLOCK_N=block_n, IS_CAUSAL=True, HAS_KEY_LEN=True, HAS_KEY_MASK=key_mask, EVEN_N=True, PRECISION=2,
                  MASK_LOOP=key_mask and mask_loop)
    sig = {n: POINTERS.get(n, "fp32" if n == "qk_scale" else "constexpr" if n in consts else "i32") for n in names}
    divisible = [n for n in names if n in POINTERS or (n.startswith("stride_") and n != "stride_mb")]
    src = ASTSource(fn=attention._attention_fwd, signature=sig,
                    constexprs={(names.index(k),): v for k, v in consts.items()},
                    attrs={(names.index(n),): [["tt.divisibility", 16]] for n in divisible})
    options = {"num_warps": num_warps, "num_stages": num_stages}
    if maxnreg is not None:
        options["maxnreg"] = maxnreg
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def usage(kernel, num_warps):
    report = ptxas_report(kernel)
    regs = report.registers
    allocated = -(-regs // 8) * 8  # registers are allocated per warp in steps of 8 per thread
    return {"registers": regs, "spill_store_bytes": report.spill_store_bytes,
            "shared_bytes": kernel.metadata.shared,
            "programs_per_sm_by_registers": REGISTERS_PER_SM // (allocated * 32 * num_warps)}


def main():
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument("out", nargs="?", help="JSON file to write (default: print only)")
    args = p.parse_args()
    out = []
    for head_dim in HEAD_DIMS:
        for bm, bn, warps, stages in LAUNCHES:
            if head_dim >= 128 and bm * bn > 128 * 64:
                continue
            rec = {"head_dim": head_dim, "launch": [bm, bn, warps, stages],
                   "key_lengths": usage(compile_attention(head_dim, bm, bn, warps, stages, False), warps),
                   "key_mask": usage(compile_attention(head_dim, bm, bn, warps, stages, True), warps)}
            cap = attention.masked_register_cap(bm, bn, max(16, triton.next_power_of_2(head_dim)), warps, stages)
            if cap is not None:
                rec["key_mask_capped"] = dict(usage(compile_attention(head_dim, bm, bn, warps, stages, True, cap),
                                                    warps), maxnreg=cap)
            out.append(rec)
            print(json.dumps(rec), flush=True)
    if args.out:
        write_json(args.out, {"triton": triton.__version__, "target": "sm_90a", "kernels": out})


if __name__ == "__main__":
    main()
