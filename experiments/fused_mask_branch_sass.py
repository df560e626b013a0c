"""Offline sm_90a (no GPU): registers, spills, SASS instructions (with the opcodes that differ most) and barriers of
official rows 7 and 12's fused layer at the policy's launch, without a mask, and with the summary written (layer
0) and given (layers 1-3), each with kernels.fused_layer's KEY_MASK_BRANCH on (committed: the keys' mask loaded in
a branch on "no prefix") and off (predicated off for a prefix); the row-mask branch on, as committed (session 14).
Session 13's version of this script (experiments/fused_full_branch_sass.py at 7c15e89) measured switches since
removed (experiments/data/fused_full_branch_sass-sm90.json).

Usage: PYTHONPATH=.:workflow python3 experiments/fused_mask_branch_sass.py OUT.json
"""
import collections
import json
import os
import re
import subprocess
import sys
import tempfile

import triton
from experiments.fused_ptxas import constexprs, ptxas_usage
from experiments.fused_ttgir import _compile

from shapewise.kernels.fused_layer import _fused_layer_fwd
from shapewise.manifest import MODEL_FIELDS, official_rows
from shapewise.model.routing import Shape, fused_launch

CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
# (label, HAS_MASK, PREFIX_IN, PREFIX_OUT, KEY_MASK_BRANCH)
VARIANTS = (("unmasked", False, False, False, True),
            ("written", True, False, True, True), ("written+key_predicated", True, False, True, False),
            ("given", True, True, False, True), ("given+key_predicated", True, True, False, False))
OPCODE = re.compile(r"^\s+/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", re.M)


def sass_opcodes(cubin: bytes) -> collections.Counter:
    """Opcode counts of a cubin's SASS."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([CUOBJDUMP, "-sass", f.name], capture_output=True, text=True, check=True).stdout
    return collections.Counter(OPCODE.findall(sass))


def main(path):
    rows = official_rows()
    out = []
    for n in (7, 12):
        row = rows[n]
        block_m, warps, stages = fused_launch(Shape(**{f: row[f] for f in MODEL_FIELDS}))
        unmasked = None
        for label, has_mask, given, write, key_branch in VARIANTS:
            consts = constexprs(row, block_m, False, has_mask=has_mask, summary_given=given)
            consts.update(PREFIX_OUT=write, ROW_MASK_BRANCH=True, KEY_MASK_BRANCH=key_branch)
            kernel = _compile(_fused_layer_fwd, consts, warps, stages)
            ops = sass_opcodes(kernel.asm["cubin"])
            unmasked = unmasked or ops
            more = sorted(ops, key=lambda o: -abs(ops[o] - unmasked[o]))[:6]
            rec = dict(row=n, variant=label, launch=[block_m, warps, stages], instructions=sum(ops.values()),
                       barriers=ops["BAR"],
                       over_unmasked={o: ops[o] - unmasked[o] for o in more if ops[o] != unmasked[o]},
                       **ptxas_usage(kernel.asm["ptx"]))
            print(rec)
            out.append(rec)
    with open(path, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
