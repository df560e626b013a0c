"""Registers and spills of the fused layer kernel on sm_90, per official row, from ptxas (no GPU needed).

Usage: python -m experiments.fused_ptxas [OUT.json]

For the official rows the fused route serves (1, 3, 4, 5, 7, 9, 10, 11, 12) it compiles `_fused_layer_fwd`
with the constexprs `kernels.fused_layer.fused_layer` would pass for that row, at the launch the committed
policy picks (model/routing_policy.json) in each of VARIANTS (kv_precompute on and off, key and FFN blocks), then
runs the ptxas that ships with Triton (`-v`, sm_90a) on the PTX and records registers per thread and spill bytes.
Rows whose kernel spills are the first suspects when their per-layer time is out of line with their FLOPs
(docs/performance.md).
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile

import triton
from experiments.fused_ttgir import _compile

from shapewise.kernels.fused_layer import _fused_layer_fwd
from shapewise.model.routing import Shape, fused_launch
from shapewise.manifest import MODEL_FIELDS, official_rows

FUSED_ROWS = (1, 3, 4, 5, 7, 9, 10, 11, 12)
PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")


# The committed kernels, then the key-blocked ones (fused_layer's key_block/ffn_block; num_warps: instead of the
# policy's). Each is compiled without a mask and with one (the official harness always passes a mask).
VARIANTS = ({"kv_precompute": False}, {"kv_precompute": True},
            {"kv_precompute": True, "key_block": 32, "ffn_block": 32},
            {"kv_precompute": True, "key_block": 32, "ffn_block": 32, "num_warps": 8})


def constexprs(row, block_m, kv_global, key_block=None, ffn_block=None, has_mask=False, summary_given=False):
    """The constexprs fused_layer passes for an official row (mirrors its launcher)."""
    S, d, H, ffn = row["seq_len"], row["d_model"], row["num_heads"], row["ffn_dim"]
    hd = d // H
    block_s = max(16, triton.next_power_of_2(S))
    ffn_pad = max(16, triton.next_power_of_2(ffn))
    return dict(NUM_HEADS=H, HEAD_DIM=hd, BLOCK_HD=max(16, triton.next_power_of_2(hd)),
                BLOCK_D=max(16, triton.next_power_of_2(d)), BLOCK_F=min(ffn_block or 64, ffn_pad),
                BLOCK_M=min(block_s, block_m), BLOCK_S=block_s, IS_CAUSAL=True, HAS_MASK=has_mask, FINAL_NORM=False,
                KV_GLOBAL=kv_global, BLOCK_N=min(key_block or block_s, block_s), PREFIX_IN=summary_given,
                PREFIX_OUT=False, ROW_MASK_BRANCH=False)


def ptxas_usage(ptx: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        done = subprocess.run([PTXAS, "-v", "--gpu-name", "sm_90a", src, "-o", os.path.join(tmp, "k.cubin")],
                              capture_output=True, text=True, check=True)
    text = done.stdout + done.stderr
    regs = re.search(r"Used (\d+) registers", text)
    stores = re.search(r"(\d+) bytes spill stores", text)
    loads = re.search(r"(\d+) bytes spill loads", text)
    return {"registers": int(regs[1]) if regs else None, "spill_store_bytes": int(stores[1]) if stores else None,
            "spill_load_bytes": int(loads[1]) if loads else None}


def main():
    rows = official_rows()
    out = []
    for n in FUSED_ROWS:
        row = rows[n]
        block_m, num_warps, num_stages = fused_launch(Shape(**{f: row[f] for f in MODEL_FIELDS}))
        for variant in VARIANTS:
            kv, key_block, ffn_block = (variant["kv_precompute"], variant.get("key_block"),
                                        variant.get("ffn_block"))
            warps = variant.get("num_warps", num_warps)
            for has_mask in (False, True):
                kernel = _compile(_fused_layer_fwd, constexprs(row, block_m, kv, key_block, ffn_block, has_mask),
                                  warps, num_stages)
                rec = {"row": n, "head_dim": row["d_model"] // row["num_heads"], "num_heads": row["num_heads"],
                       "block_m": block_m, "num_warps": warps, "num_stages": num_stages, "kv_precompute": kv,
                       "key_block": key_block, "ffn_block": ffn_block, "mask": has_mask,
                       "shared_bytes": kernel.metadata.shared, **ptxas_usage(kernel.asm["ptx"])}
                out.append(rec)
                print(json.dumps(rec), flush=True)
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            version = subprocess.run([PTXAS, "--version"], capture_output=True, text=True).stdout.strip().splitlines()
            json.dump({"ptxas": "triton/backends/nvidia/bin/ptxas: " + version[-1], "triton": triton.__version__,
                       "target": "sm_90a", "kernels": out}, f, indent=1)


if __name__ == "__main__":
    main()
