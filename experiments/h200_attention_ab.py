"""The attention kernel against an earlier version of itself, same process, same inputs (session 11).

Usage (CUDA machine): python -m experiments.h200_attention_ab OUT.json BASELINE.py [--rows 11,9,10,1,13,6]

BASELINE.py is an earlier kernels/attention.py, e.g. `git show 7ebcfe6:kernels/attention.py > /tmp/base.py` (the
node has no .git: make it here and let the call carry it). It is loaded as a sibling module of kernels.attention,
so its relative imports resolve. Per official row's attention shape (fp16 q, k, v, causal), each of the fixed
tiles 64x64x4x3 and 64x32x4x2 and the autotuner's choice, unmasked and with the all-True mask and its prefix
summary (what the model runs), timed as a CUDA graph of 10 launches (experiments.h200_probe.graph_ms), for the
baseline and for the current kernel. Written after every row.
"""
from __future__ import annotations

import argparse
import importlib.util
import json

import torch
from shapewise.kernels import attention as current
from shapewise.kernels.mask import prefix_lengths

from experiments.h200_probe import graph_ms
from experiments.h200_sweep import shape_of

TILES = {"64x64x4x3": dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3),
         "64x32x4x2": dict(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=2), "tuned": None}


def load_baseline(path):
    spec = importlib.util.spec_from_file_location("shapewise.kernels._attention_baseline", path)
    module = importlib.util.module_from_spec(spec)
    module.__package__ = "shapewise.kernels"
    spec.loader.exec_module(module)
    return module


def row_ab(row, baseline):
    B, S, d, H, _ = shape_of(row)
    D = d // H
    g = torch.Generator("cuda").manual_seed(row)
    q, k, v = (torch.randn(B, S, H, D, device="cuda", generator=g).half() for _ in range(3))
    mask = torch.ones(B, S, dtype=torch.bool, device="cuda")
    prefix = prefix_lengths(mask)
    reps = 5 if B * S > 10**6 else 30
    rec = {"row": row, "shape": [B, S, H, D]}
    for tile, cfg in TILES.items():
        for masked in (False, True):
            for name, module in (("baseline", baseline), ("current", current)):
                kwargs = dict(causal=True, config=cfg)
                if masked:
                    kwargs.update(key_mask=mask, mask_prefix_lengths=prefix)
                key = f"{tile}_{'mask' if masked else 'unmasked'}_{name}_us"
                rec[key] = graph_ms(lambda m=module, kw=kwargs: m.flash_attention(q, k, v, **kw), reps) * 1000
                print(row, key, round(rec[key], 2), flush=True)
    return rec


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("baseline")
    ap.add_argument("--rows", default="11,9,10,1,13,6")
    args = ap.parse_args()
    baseline = load_baseline(args.baseline)
    out = {"device": torch.cuda.get_device_name(), "baseline": args.baseline, "rows": []}
    with torch.inference_mode():
        for row in (int(r) for r in args.rows.split(",")):
            out["rows"].append(row_ab(row, baseline))
            with open(args.out, "w") as f:
                json.dump(out, f, indent=1)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
