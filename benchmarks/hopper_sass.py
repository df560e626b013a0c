"""The Hopper forward kernel built for sm_90 offline (no GPU): registers, spills, shared memory, SASS instructions.

Usage: python -m benchmarks.hopper_sass [OUT.json] [--rows 1,12,7] [--pair] [--producer] [--duo] [--unmasked]

Per official row it serves, `_hopper_forward_fwd` compiled as the route launches it (fp32 input, the row's causal
flag, a mask (none with `--unmasked`: the `model(x)` call), `overlap` on; `--pair`, `--producer`, `--duo`: those
variants, `pair` and `duo` (a sequence's two halves in two programs, or in two warpgroups of one) on the rows they
serve) through the ptxas that ships with Triton: ptxas's registers and spills
(`benchmarks.attention_registers.usage`), the SASS instructions of the whole kernel by opcode (cuobjdump; its layer
loop is not unrolled, so the count is about one layer's and one sequence's prologue and epilogue), and the TMA loads
in its Triton IR (one per ring slot to start, then one per weight tile of a layer; with a loader warp, one per
allocation of the ring's barriers).
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import tempfile

import torch
import triton

from benchmarks.attention_registers import usage
from benchmarks.common import official, row_numbers, write_json
from benchmarks.sm90 import compile_sm90
from shapewise.kernels import hopper_forward as hf

CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
TMA_LOAD = "ttng.async_tma_copy_global_to_local"
SASS_LINE = re.compile(r"^\s+/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)")


def compile_hopper(S, d, H, F, causal=True, masked=True, pair=False, producer=False, duo=False):
    """The kernel compiled for sm_90 at this shape (with `pair`: two programs a sequence; with `producer`: a loader
    warp fills the weight ring), and its launch_config."""
    cfg = hf.launch_config(S, d, H, F, pair=pair, duo=duo)
    stream = torch.zeros(hf.stream_tiles(H, F, cfg["HD"]) * cfg["HD"], d, dtype=torch.float16)
    fn = hf._hopper_forward_fwd
    consts = dict(S_PAD=cfg["S_PAD"], D=d, HD=cfg["HD"], NUM_HEADS=H, F_CHUNKS=cfg["F_CHUNKS"],
                  NUM_SLOTS=cfg["NUM_SLOTS"], RING_GROUPS=cfg["RING_GROUPS"], V_PAD=cfg["V_PAD"], IS_CAUSAL=causal,
                  HAS_MASK=masked, OVERLAP=True,
                  PAIR=pair, PRODUCER=producer or duo, DUO=duo, num_warps=cfg["num_warps"])
    args = {n: hf.weight_descriptor(stream, cfg["HD"]) if n == "w_desc" else "*i8" if n == "Mask"
            else "*fp16" if n == "KV" else "*i32" if n == "Flags" else "fp32" if n in ("qk_scale", "eps")
            else "*fp32" if n[0].isupper() else "i32" for n in fn.arg_names if n not in consts}
    # the pair's scratch 16-byte aligned, as a launch specializes it (its copies move 16 bytes)
    attrs = {(fn.arg_names.index("KV"),): [["tt.divisibility", 16]]} if pair else None
    return compile_sm90(fn, consts, args, dict(num_warps=cfg["num_warps"]), attrs), cfg


def sass_opcodes(kernel):
    """{opcode: count} of the kernel's SASS."""
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "k.cubin")
        with open(cubin, "wb") as f:
            f.write(kernel.asm["cubin"])
        text = subprocess.run([CUOBJDUMP, "-sass", cubin], capture_output=True, text=True, check=True).stdout
    return collections.Counter(m[1] for m in map(SASS_LINE.match, text.splitlines()) if m)


def main():
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument("out", nargs="?", help="JSON file to write (default: print only)")
    p.add_argument("--rows", default="1,12,7", help="official rows")
    p.add_argument("--pair", action="store_true", help="the kernel with `pair` on, on the rows it serves")
    p.add_argument("--producer", action="store_true", help="the kernel with `producer` on (a loader warp)")
    p.add_argument("--duo", action="store_true", help="the kernel with `duo` on (two warpgroups a sequence)")
    p.add_argument("--unmasked", action="store_true", help="the kernel without a mask (HAS_MASK off)")
    args = p.parse_args()
    out = []
    for n in row_numbers(args.rows):
        r = official(n)
        S, d, H, F = r["seq_len"], r["d_model"], r["num_heads"], r["ffn_dim"]
        causal = r.get("causal", True)
        if hf.why_unsupported(S, d, H, F, causal=causal, pair=args.pair, duo=args.duo):
            continue
        kernel, cfg = compile_hopper(S, d, H, F, causal=causal, masked=not args.unmasked, pair=args.pair,
                                     producer=args.producer, duo=args.duo)
        ops = sass_opcodes(kernel)
        rec = {"row": r["id"], "launch": cfg, "pair": args.pair, "producer": args.producer, "duo": args.duo,
               "masked": not args.unmasked,
               **usage(kernel, cfg["num_warps"]),
               "sass_instructions": sum(ops.values()), "sass_by_opcode": dict(ops.most_common(20)),
               "tma_loads_in_ir": kernel.asm["ttgir"].count(TMA_LOAD)}
        out.append(rec)
        print({k: v for k, v in rec.items() if k != "sass_by_opcode"}, flush=True)
    if args.out:
        write_json(args.out, {"target": "sm_90", "triton": triton.__version__, "rows": out})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
