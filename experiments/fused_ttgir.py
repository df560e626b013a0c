"""Compile the fused layer kernel for sm_90 on any machine (no GPU needed) and list how each dot is lowered.

Usage: python -m experiments.fused_ttgir [--kv-global] [BLOCK_M NUM_WARPS NUM_STAGES ...]
       (default configurations: 32 4 1 64 4 1; --kv-global: the
       KV_GLOBAL variant, which reads keys and values written by _ln_kv_fwd, compiled too)

For each launch configuration (official row 1's shape: d_model 128, 4 heads, S 128, ffn 128, causal) it prints
the shared memory the kernel takes and, per dot, whether Triton lowered it to a Hopper wgmma
(`ttng.warp_group_dot`) or to an mma.sync (`tt.dot`), with the layout of its B operand. This is the
offline half of the block_m >= 64 investigation (experiments/h200/session2/README.md); the device half is
experiments/h200_fused_isolation.py.
"""
from __future__ import annotations

import re
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from shapewise.kernels.fused_layer import _fused_layer_fwd, _ln_kv_fwd

FP16_POINTERS = ("Wqkv", "Bqkv", "Wo", "Bo", "Win", "Bin", "Wout", "Bout", "KV")
INTS = ("stride_xb", "stride_xs", "stride_yb", "stride_ys", "stride_mb", "stride_kvb", "stride_kvs", "seq_len",
        "first_col", "n_cols",
        "d_model", "ffn_dim")


def _compile(fn, consts, num_warps, num_stages):
    names = fn.arg_names
    sig = {n: ("*fp16" if n in FP16_POINTERS else "*i8" if n == "Mask" else "*i32" if n == "Prefix"
               else "i32" if n in INTS
               else "fp32" if n in ("qk_scale", "eps") else "constexpr" if n in consts else "*fp32") for n in names}
    src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in consts.items()})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": num_warps, "num_stages": num_stages})


def compile_for_sm90(block_m, num_warps, num_stages, kv_global=False):
    consts = dict(NUM_HEADS=4, HEAD_DIM=32, BLOCK_HD=32, BLOCK_D=128, BLOCK_F=64, BLOCK_M=block_m, BLOCK_S=128,
                  IS_CAUSAL=True, HAS_MASK=False, FINAL_NORM=False, KV_GLOBAL=kv_global, BLOCK_N=128, PREFIX_IN=False,
                  PREFIX_OUT=False, ROW_MASK_BRANCH=False)
    return _compile(_fused_layer_fwd, consts, num_warps, num_stages)


def compile_ln_kv_for_sm90():
    """_ln_kv_fwd as fused_layer launches it for official row 1 (64-token blocks, d 128, 64 columns a step)."""
    return _compile(_ln_kv_fwd, dict(BLOCK_T=64, BLOCK_D=128, BLOCK_N=64), 4, 1)


def main():
    flags = {"--kv-global"}
    kv_global = "--kv-global" in sys.argv[1:]
    args = [int(a) for a in sys.argv[1:] if a not in flags] or [32, 4, 1, 64, 4, 1]
    if kv_global:
        kernel = compile_ln_kv_for_sm90()
        print(f"_ln_kv_fwd: shared memory {kernel.metadata.shared} B, {kernel.asm['ptx'].count('mma')} mma lines")
    for i in range(0, len(args), 3):
        cfg = tuple(args[i:i + 3])
        kernel = compile_for_sm90(*cfg, kv_global=kv_global)
        ttgir = kernel.asm["ttgir"]
        print(f"block_m={cfg[0]} num_warps={cfg[1]} num_stages={cfg[2]}"
              f"{' KV_GLOBAL' if kv_global else ''}: shared memory {kernel.metadata.shared} B")
        for line in ttgir.splitlines():
            m = re.search(r"(%\w+) = (ttng\.warp_group_dot|tt\.dot) (%\w+), (%\w+).*: (tensor<[^>]*>[^*]*)\* ([^-]*)->",
                          line)
            if m:
                kind = "wgmma" if m[2].startswith("ttng") else "mma.sync"
                b = "B from shared memory" if "memdesc" in m[6] else "B from registers"
                source = re.search(rf"{re.escape(m[4])} = (\S+)", ttgir)
                print(f"  {m[1]:<14} {kind:<9} A {m[5].split(',')[0].strip()}  {b} ({m[4]} = "
                      f"{source[1] if source else '?'})")


if __name__ == "__main__":
    main()
