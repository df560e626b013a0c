"""Where the Hopper forward's warps wait: Nsight Compute's warp-state sampling of one launch per official row.

Usage (sm_90 GPU with `ncu`): python -m benchmarks.hopper_stalls OUT_DIR [--rows 1,9] [--batch B] [--producer] [--duo]
       [--split tail|ln_qkv]
Then, offline, again from the CSVs it left: python -m benchmarks.hopper_stalls OUT_DIR --summarize

Per row: `ncu --clock-control none` (the clocks as the timing jobs see them) profiles the third launch of
`_hopper_forward_fwd` of a process that builds the row's weights and input (seeded random weights: the kernel's time
does not depend on their values) and calls `hopper_forward`; the launch's SASS-level source page (warp-state samples
per instruction) and its details page (duration, issue and stall summaries) are exported as CSV. The summary
(`OUT_DIR/summary.json`) gives per row the kernel's duration, the samples by stall reason, the samples by opcode, and
the instructions that hold the most samples. `--batch` replaces the row's batch size (e.g. 132: one sequence per SM);
`--producer`: the kernel with a loader warp (`hopper_forward(..., producer=True)`); `--duo`: a sequence's halves as two
warpgroups beside the loader warp (`duo=True`). `--split tail` or `--split ln_qkv`: instead, one layer of the row's
split layer on Hopper, `layer_tail_hopper` or `ln_qkv_hopper` (seeded random weights and inputs, as
`benchmarks.split_parts` builds them).
"""
from __future__ import annotations

import argparse
import csv
import glob
import json
import os
import re
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

KERNEL = "_hopper_forward_fwd"
SPLIT_KERNELS = {"tail": "_layer_tail_hopper_fwd", "ln_qkv": "_ln_qkv_hopper_fwd"}  # --split: the kernel sampled
SKIP = 2  # launches of the kernel left unprofiled: the first compiles, the second finds every cache warm
TOP = 60  # instructions listed per row


def ncu_path() -> str:
    found = shutil.which("ncu") or sorted(glob.glob("/opt/nvidia/nsight-compute/*/ncu"))
    if not found:
        raise SystemExit("hopper_stalls: no `ncu` on PATH or under /opt/nvidia/nsight-compute")
    return found if isinstance(found, str) else found[-1]


def launch_split(row: int, batch: int | None, split: str) -> None:
    """The profiled process of `--split`: one layer's Hopper tail or LayerNorm + QKV at the row's shape, launched
    SKIP + 1 times."""
    import torch

    from benchmarks.common import kernel_weights, official
    from shapewise.kernels import layer_tail_hopper, ln_qkv_hopper
    from shapewise.model.reference import LAYER_NORM_EPS

    r = official(row)
    B, S, d = (batch or r["batch_size"]), r["seq_len"], r["d_model"]
    w, _ = kernel_weights(d, r["ffn_dim"], "cuda")
    g = torch.Generator().manual_seed(1)
    x = torch.randn(B, S, d, generator=g).cuda()
    o = torch.randn(B, S, d, generator=g).cuda().half()
    mask = torch.ones(B, S, dtype=torch.bool, device="cuda")
    for _ in range(SKIP + 1):
        if split == "tail":
            layer_tail_hopper.layer_tail_hopper(o, x, w, eps=LAYER_NORM_EPS, mask=mask)
        else:
            ln_qkv_hopper.ln_qkv_hopper(x, w, eps=LAYER_NORM_EPS)
    torch.cuda.synchronize()


def launch(row: int, batch: int | None, producer: bool = False, duo: bool = False) -> None:
    """The profiled process: the row's kernel launched SKIP + 1 times."""
    import torch

    from benchmarks.common import official
    from benchmarks.hopper_forward import seeded_weights
    from shapewise.kernels import hopper_forward as hf
    from shapewise.model.reference import LAYER_NORM_EPS

    r = official(row)
    B, S, d, H = (batch or r["batch_size"]), r["seq_len"], r["d_model"], r["num_heads"]
    packed = seeded_weights(d, r["ffn_dim"], H, r["num_layers"])
    x = torch.randn(B, S, d, generator=torch.Generator().manual_seed(1)).cuda()
    mask = torch.ones(B, S, dtype=torch.bool, device="cuda")
    out = torch.empty_like(x)
    for _ in range(SKIP + 1):
        hf.hopper_forward(x, packed, num_heads=H, causal=True, mask=mask, out=out, eps=LAYER_NORM_EPS,
                          producer=producer, duo=duo)
    torch.cuda.synchronize()


def profile(out_dir: Path, row: int, batch: int | None, producer: bool = False, duo: bool = False,
            split: str | None = None) -> None:
    ncu = ncu_path()
    rep = out_dir / f"row{row:02d}"
    inner = [sys.executable, "-m", "benchmarks.hopper_stalls", str(out_dir), "--launch", str(row)]
    if batch:
        inner += ["--batch", str(batch)]
    if producer:
        inner += ["--producer"]
    if duo:
        inner += ["--duo"]
    if split:
        inner += ["--split", split]
    kernel = SPLIT_KERNELS[split] if split else KERNEL
    cmd = [ncu, "--clock-control", "none", "--kernel-name", f"regex:{kernel}", "--launch-skip", str(SKIP),
           "--launch-count", "1", "--section", "SpeedOfLight", "--section", "LaunchStats", "--section",
           "WarpStateStats", "--section", "SourceCounters", "--section", "SchedulerStats", "-f", "-o", str(rep)] + inner
    subprocess.run(cmd, check=True)
    for page, extra in (("source", ["--print-source", "sass"]), ("details", [])):
        with open(out_dir / f"row{row:02d}-{page}.csv", "w") as f:
            subprocess.run([ncu, "-i", f"{rep}.ncu-rep", "--page", page, "--csv", *extra], stdout=f, check=True)


def _number(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def summarize_row(out_dir: Path, row: str) -> dict:
    """The summary of one row from its two CSVs."""
    result: dict = {"row": row}
    with open(out_dir / f"{row}-details.csv", newline="") as f:
        for rec in csv.DictReader(f):
            name, value, unit = rec.get("Metric Name", ""), rec.get("Metric Value", ""), rec.get("Metric Unit", "")
            if name in ("Duration", "Registers Per Thread", "Issue Slots Busy", "Issued Warp Per Scheduler",
                        "No Eligible", "Active Warps Per Scheduler", "Eligible Warps Per Scheduler",
                        "Warp Cycles Per Issued Instruction", "Compute (SM) Throughput", "Memory Throughput",
                        "Elapsed Cycles", "Executed Ipc Active"):
                result[f"{name} [{unit}]" if unit else name] = _number(value)
    with open(out_dir / f"{row}-source.csv", newline="") as f:
        lines = f.read().splitlines()
    start = next(i for i, line in enumerate(lines) if "Source" in line and "Address" in line)
    records = list(csv.DictReader(lines[start:]))
    stall_cols = [c for c in records[0] if c.startswith("stall_") or ("Stall" in c and "Samples" in c)]
    total_col = next((c for c in records[0] if c.startswith("Warp Stall Sampling (All")), None)
    by_reason, by_opcode, top = Counter(), Counter(), []
    for rec in records:
        sass = rec.get("Source", "").strip()
        opcode = re.sub(r"^@!?U?P\w+\s+", "", sass).split(" ")[0].split(".")[0]
        samples = _number(rec.get(total_col, "0")) if total_col else 0.0
        by_opcode[opcode] += samples
        for c in stall_cols:
            if c != total_col:
                by_reason[c] += _number(rec.get(c, "0"))
        top.append((samples, rec.get("# Address", rec.get("Address", "")), sass))
    total = sum(by_opcode.values())
    result["samples"] = total
    result["samples_by_reason"] = dict(by_reason.most_common())
    result["samples_by_opcode"] = {k: v for k, v in by_opcode.most_common(40) if v}
    result["top_instructions"] = [{"samples": s, "share": round(s / total, 4) if total else 0, "address": a,
                                   "sass": t} for s, a, t in sorted(top, key=lambda r: -r[0])[:TOP]]
    return result


def summarize(out_dir: Path, kernel: str = KERNEL) -> dict:
    rows = sorted(p.name[:-len("-source.csv")] for p in out_dir.glob("row*-source.csv"))
    summary = {"kernel": kernel, "rows": [summarize_row(out_dir, r) for r in rows]}
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", type=Path)
    p.add_argument("--rows", default="1,9")
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--producer", action="store_true", help="the kernel with a loader warp")
    p.add_argument("--duo", action="store_true", help="the kernel with the warpgroup duo")
    p.add_argument("--split", choices=sorted(SPLIT_KERNELS), help="one layer's Hopper tail or LayerNorm + QKV "
                   "instead of the whole forward")
    p.add_argument("--launch", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--summarize", action="store_true", help="only summarize the CSVs already in OUT_DIR")
    a = p.parse_args()
    if a.launch is not None:
        if a.split:
            launch_split(a.launch, a.batch, a.split)
        else:
            launch(a.launch, a.batch, a.producer, a.duo)
        return 0
    a.out.mkdir(parents=True, exist_ok=True)
    if not a.summarize:
        for n in (int(v) for v in a.rows.split(",")):
            profile(a.out, n, a.batch, a.producer, a.duo, a.split)
    print(json.dumps(summarize(a.out, SPLIT_KERNELS[a.split] if a.split else KERNEL), indent=1)[:6000])
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    raise SystemExit(main())
