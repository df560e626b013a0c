"""Offline sm_90a (no GPU): registers, spills, SASS instructions and barriers of official rows 7 and 12's fused layer
at the policy's launch, without a mask, with the summary written (layer 0) and given (layers 1-3), each with
kernels.fused_layer's UNMASKED_FIRST off and on (session 14, UNMASKED_FIRST_MAX_D_MODEL: the unmasked layer first,
the summary after its rows, the masked layer only where the summary says not every token is valid; the row-mask
branch on, as committed). Session 13's FULL_BRANCH and session 14's MASK_TILES, both measured slower on the H200 and
removed, are in git history (7c15e89), their figures in experiments/data/fused_full_branch_sass-sm90.json (this
script's earlier version, experiments/fused_full_branch_sass.py at 7c15e89).

Usage: PYTHONPATH=.:workflow python3 experiments/fused_unmasked_first_sass.py OUT.json
"""
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
# (label, HAS_MASK, PREFIX_IN, PREFIX_OUT, UNMASKED_FIRST)
VARIANTS = (("unmasked", False, False, False, False),
            ("written", True, False, True, False), ("written+unmasked_first", True, False, True, True),
            ("given", True, True, False, False), ("given+unmasked_first", True, True, False, True))


def sass_counts(cubin: bytes) -> tuple:
    """(instructions, BAR.SYNC barriers) of a cubin's SASS."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([CUOBJDUMP, "-sass", f.name], capture_output=True, text=True, check=True).stdout
    return len(re.findall(r"^\s+/\*[0-9a-f]{4,}\*/\s", sass, re.M)), len(re.findall(r"\bBAR\.SYNC", sass))


def main(path):
    rows = official_rows()
    out = []
    for n in (7, 12):
        row = rows[n]
        block_m, warps, stages = fused_launch(Shape(**{f: row[f] for f in MODEL_FIELDS}))
        for label, has_mask, given, write, first in VARIANTS:
            consts = constexprs(row, block_m, False, has_mask=has_mask, summary_given=given)
            consts.update(PREFIX_OUT=write, ROW_MASK_BRANCH=True, UNMASKED_FIRST=first)
            kernel = _compile(_fused_layer_fwd, consts, warps, stages)
            instructions, barriers = sass_counts(kernel.asm["cubin"])
            rec = dict(row=n, variant=label, launch=[block_m, warps, stages], instructions=instructions,
                       barriers=barriers, **ptxas_usage(kernel.asm["ptx"]))
            print(rec)
            out.append(rec)
    with open(path, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
