"""Programmatic dependent launch on and off, per official row: time per call of `model(x, mask)`, and the same bits.

Usage (CUDA machine): python -m benchmarks.pdl [OUT.json] [--rows 1,2,...] [--rounds 5] [--calls 100]
                                             [--release end|start]
       (CPU, a check of this script: TRITON_INTERPRET=1 python -m benchmarks.pdl [OUT.json] --tiny)

Per row: the optimized model as routed (with `pdl` where its route takes it) and a second one on the same weights
with the `pdl` switch off (`--release`: where a PDL kernel lets the next one launch, kernels/pdl.py's RELEASE), on the
pipeline's weights and first-trial inputs (the official call's all-True mask).
Checked: the two outputs are equal bit for bit, and the first passes the official tolerance against the reference
(fp32, TF32 off). Timed: 20 warm-up calls of each, then `rounds` rounds alternating the two, `calls` calls each, a
CUDA event pair per call (the timing job's timer); pooled medians and each round's median. OUT.json is written after
every row.
"""
from __future__ import annotations

import json

import torch

from benchmarks.common import (accuracy, alternating_rounds, device_name, official, parser, pooled_median,
                               reference_output, row, row_numbers, setup, write_json)
from shapewise import stats
from shapewise.jobs.device import time_calls
from shapewise.kernels import pdl
from shapewise.model import UserOptimizedTransformer

TINY = {"batch_size": 2, "seq_len": 33, "d_model": 64, "num_heads": 4, "ffn_dim": 96, "num_layers": 2}
WARMUP = 20


def row_result(shape_row, device, rounds, calls):
    cfg, ref, on, x, mask = setup(shape_row, device)
    off = UserOptimizedTransformer(cfg, route=on.route, disable=("pdl",))
    off.load_state_dict(on.state_dict(), strict=True)
    off = off.to(x.device).eval()
    out = {"row": shape_row["id"]}
    want = reference_output(ref, x, mask) if ref is not None else None
    with torch.inference_mode():
        y_on, y_off = on(x, mask), off(x, mask)
        out["route"], out["route_off"] = str(on.last_route), str(off.last_route)
        out["pdl"] = on.last_route.pdl
        out["bitwise_equal"] = bool(torch.equal(y_on, y_off))
        if want is not None:
            out["accuracy"] = accuracy(want, y_on)
        del y_on, y_off
        fns = {"pdl": lambda: on(x, mask), "no_pdl": lambda: off(x, mask)}
        for fn in fns.values():
            time_calls(fn, device, WARMUP if device.type == "cuda" else 1)
        times = alternating_rounds(fns, device, rounds, calls)
    for name, rounds_ms in times.items():
        out[f"{name}_median_ms"] = pooled_median(rounds_ms)
        out[f"{name}_round_medians_ms"] = stats.round_medians(rounds_ms)
    out["pdl_over_no_pdl"] = out["pdl_median_ms"] / out["no_pdl_median_ms"]
    out["saved_us"] = (out["no_pdl_median_ms"] - out["pdl_median_ms"]) * 1e3
    return out


def main():
    p = parser(__doc__, "pdl.json")
    p.add_argument("--rows", default="1,2,3,4,5,7,9,10,11,12,13,8,6", help="official rows, in the order run")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--calls", type=int, default=100)
    p.add_argument("--release", choices=("end", "start"), default=pdl.RELEASE,
                   help=f"where a kernel lets the next one launch (default: {pdl.RELEASE})")
    p.add_argument("--tiny", action="store_true", help="a small stand-in row on the CPU instead (checks the script)")
    a = p.parse_args()
    pdl.RELEASE = a.release
    torch.set_float32_matmul_precision("high")
    device = torch.device("cpu" if a.tiny else "cuda")
    rows = [row("tiny", **TINY, route="triton")] if a.tiny else [official(n) for n in row_numbers(a.rows)]
    rounds, calls = (2, 2) if a.tiny else (a.rounds, a.calls)
    results = []
    for shape_row in rows:
        try:
            rec = row_result(shape_row, device, rounds, calls)
        except Exception as e:  # one row's failure is a result too; the next rows still run
            rec = {"row": shape_row["id"], "error": f"{type(e).__name__}: {str(e)[:300]}"}
        results.append(rec)
        print(json.dumps({k: v for k, v in rec.items() if "round" not in k and k != "accuracy"}), flush=True)
        write_json(a.out, {"device": device_name(device), "torch": torch.__version__, "release": pdl.RELEASE,
                           "rows": results})
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return 1 if any("error" in r or not r.get("bitwise_equal", False) for r in results) else 0


if __name__ == "__main__":
    raise SystemExit(main())
