"""Offline sm_90a (no GPU): registers, spills, SASS instructions and barriers of official rows 7 and 12's fused layer
at the policy's launch, without a mask, with the summary written (layer 0) and given (layers 1-3), each with
kernels.fused_layer's FULL_BRANCH off and on (session 13; the row-mask branch on, as committed), and layer 0 with
MASK_TILES (session 14's DEFER_SUMMARY: the mask read into the tiles, the summary written after the rows).

Usage: PYTHONPATH=.:workflow python3 experiments/fused_full_branch_sass.py OUT.json
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
# (label, HAS_MASK, PREFIX_IN, PREFIX_OUT, FULL_BRANCH, MASK_TILES)
VARIANTS = (("unmasked", False, False, False, False, False),
            ("written", True, False, True, False, False), ("written+full", True, False, True, True, False),
            ("given", True, True, False, False, False), ("given+full", True, True, False, True, False),
            ("written+tiles", True, False, True, False, True))


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
        for label, has_mask, given, write, full, tiles in VARIANTS:
            consts = constexprs(row, block_m, False, has_mask=has_mask, summary_given=given)
            consts.update(PREFIX_OUT=write, ROW_MASK_BRANCH=True, FULL_BRANCH=full, MASK_TILES=tiles)
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
