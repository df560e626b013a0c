"""Offline sm_90a (no GPU): registers, spills, SASS instructions and barriers of official rows 7 and 12's fused layer
at the policy's launch, without a mask, with the summary written (layer 0) and given (layers 1-3), each with
kernels.fused_layer's FULL_BRANCH off and on (session 13; the row-mask branch on, as committed).

Usage: PYTHONPATH=.:workflow python3 experiments/fused_full_branch_sass.py OUT.json
"""
import json
import os
import re
import subprocess
import sys
import tempfile

import triton
from experiments.fused_ttgir import _compile
from experiments.fused_ptxas import constexprs, ptxas_usage
from shapewise.kernels.fused_layer import _fused_layer_fwd
from shapewise.model.routing import Shape, fused_launch
from shapewise.manifest import MODEL_FIELDS, official_rows
CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
rows = official_rows()
out = []
for n in (7, 12):
    row = rows[n]
    block_m, warps, stages = fused_launch(Shape(**{f: row[f] for f in MODEL_FIELDS}))
    for label, has_mask, given, write, full in (("unmasked", False, False, False, False),
                                                ("written", True, False, True, False), ("written+full", True, False, True, True),
                                                ("given", True, True, False, False), ("given+full", True, True, False, True)):
        c = constexprs(row, block_m, False, has_mask=has_mask, summary_given=given)
        c.update(PREFIX_OUT=write, ROW_MASK_BRANCH=True, FULL_BRANCH=full)
        k = _compile(_fused_layer_fwd, c, warps, stages)
        use = ptxas_usage(k.asm["ptx"])
        with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
            f.write(k.asm["cubin"]); path = f.name
        sass = subprocess.run([CUOBJDUMP, "-sass", path], capture_output=True, text=True).stdout
        instr = len(re.findall(r"^\s+/\*[0-9a-f]{4,}\*/\s", sass, re.M))
        bars = len(re.findall(r"\bBAR\.SYNC", sass))
        rec = dict(row=n, variant=label, launch=[block_m, warps, stages], instructions=instr, barriers=bars, **use)
        print(rec); out.append(rec)
json.dump(out, open(sys.argv[1], "w"), indent=1)
