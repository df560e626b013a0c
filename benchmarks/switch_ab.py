"""One optimization switch on and off, per official row: time per call of `model(x, mask)`, and the two outputs.

Usage (CUDA machine): python -m benchmarks.switch_ab [OUT.json] [--switch pdl|none] [--policy KEY=JSON ...]
                          [--policy-on KEY=JSON ...] [--rows 1,2,...] [--rounds 5] [--calls 100]
                          [--release end|start]
       (CPU, a check of this script: TRITON_INTERPRET=1 python -m benchmarks.switch_ab [OUT.json] --tiny)

Per row: the optimized model as routed and a second one on the same weights with `--switch` (a name of
`optimized.OPTIMIZATIONS`) off, on the pipeline's weights and first-trial inputs (the official call's all-True mask).
`--policy split_layer.min_tokens=1024` sets a routing-policy entry for the run (both models), so a switch that
the committed policy leaves off can be measured on; `--policy-on hopper.eager_min_batch=1` sets one only while the first
model picks its routes (its first call), so the two differ by that entry (with `--switch none`, by it alone).
`--release`: where a kernel launched with PDL lets the next one
launch (kernels/pdl.py's RELEASE). Checked: whether the two outputs are equal bit for bit, their largest difference,
and that the first passes the official tolerance against the reference (fp32, TF32 off). Timed: 20 warm-up calls of
each, then `rounds` rounds alternating the two, `calls` calls each, a CUDA event pair per call (the timing job's
timer); pooled medians ("on", "off") and each round's median. OUT.json is written after every row.
"""
from __future__ import annotations

import json

import torch

from benchmarks.common import (accuracy, alternating_rounds, device_name, official, parser, pooled_median,
                               reference_output, row, row_numbers, setup, write_json)
from shapewise.analysis import stats
from shapewise.jobs.device import time_calls
from shapewise.kernels import pdl
from shapewise.model import UserOptimizedTransformer, routing
from shapewise.model.optimized import OPTIMIZATIONS

TINY = {"batch_size": 2, "seq_len": 33, "d_model": 64, "num_heads": 4, "ffn_dim": 96, "num_layers": 2}
WARMUP = 20


def row_result(shape_row, device, switch, rounds, calls, policy_on=()):
    cfg, ref, on, x, mask = setup(shape_row, device)
    off = UserOptimizedTransformer(cfg, route=on.route, disable=() if switch == "none" else (switch,))
    off.load_state_dict(on.state_dict(), strict=True)
    off = off.to(x.device).eval()
    out = {"row": shape_row["id"]}
    want = reference_output(ref, x, mask) if ref is not None else None
    with torch.inference_mode():
        base = dict(routing.POLICY)
        try:  # a model keeps the route of its first call: `policy_on` reaches the first model alone
            set_policy(policy_on)
            y_on = on(x, mask)
        finally:
            routing.POLICY.clear()
            routing.POLICY.update(base)
        y_off = off(x, mask)
        out["route"], out["route_off"] = str(on.last_route), str(off.last_route)
        out["bitwise_equal"] = bool(torch.equal(y_on, y_off))
        out["max_abs_difference"] = (y_on.float() - y_off.float()).abs().max().item()
        if want is not None:
            out["accuracy"] = accuracy(want, y_on)
        del y_on, y_off
        fns = {"on": lambda: on(x, mask), "off": lambda: off(x, mask)}
        for fn in fns.values():
            time_calls(fn, device, WARMUP if device.type == "cuda" else 1)
        times = alternating_rounds(fns, device, rounds, calls)
    for name, rounds_ms in times.items():
        out[f"{name}_median_ms"] = pooled_median(rounds_ms)
        out[f"{name}_round_medians_ms"] = stats.round_medians(rounds_ms)
    out["on_over_off"] = out["on_median_ms"] / out["off_median_ms"]
    out["saved_us"] = (out["off_median_ms"] - out["on_median_ms"]) * 1e3
    return out


def policy_change(texts):
    """[(section, key, value)] from "split_layer.min_tokens=1024" texts (values JSON)."""
    changes = []
    for text in texts:
        target, sep, value = text.partition("=")
        section, dot, key = target.strip().partition(".")
        if not sep or not dot or section not in routing.POLICY or not isinstance(routing.POLICY[section], dict):
            raise SystemExit(f"--policy {text!r}: expected SECTION.KEY=JSON with SECTION one of "
                             f"{sorted(k for k, v in routing.POLICY.items() if isinstance(v, dict))}")
        try:
            changes.append((section, key, json.loads(value)))
        except ValueError:
            raise SystemExit(f"--policy {text!r}: {value!r} is not JSON") from None
    return changes


def set_policy(changes):
    """Set each (section, key, value) of `policy_change` in the routing policy this process reads."""
    for section, key, value in changes:
        routing.POLICY[section] = {**routing.POLICY[section], key: value}


def main():
    p = parser(__doc__, "switch-ab.json")
    p.add_argument("--switch", default="pdl", choices=OPTIMIZATIONS + ("none",),
                   help="the switch turned off in the second model (default pdl; none: no switch)")
    p.add_argument("--policy", action="append", default=[], help="SECTION.KEY=JSON: a routing-policy entry set")
    p.add_argument("--policy-on", action="append", default=[],
                   help="SECTION.KEY=JSON: a routing-policy entry set while the first model picks its routes")
    p.add_argument("--rows", default="1,2,3,4,5,7,9,10,11,12,13,8,6", help="official rows, in the order run")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--calls", type=int, default=100)
    p.add_argument("--release", choices=("end", "start"), default=pdl.RELEASE,
                   help=f"where a kernel lets the next one launch (default: {pdl.RELEASE})")
    p.add_argument("--tiny", action="store_true", help="a small stand-in row on the CPU instead (checks the script)")
    a = p.parse_args()
    pdl.RELEASE = a.release
    set_policy(policy_change(a.policy))
    policy_on = policy_change(a.policy_on)
    if a.switch == "none" and not policy_on:
        raise SystemExit("--switch none compares two models that differ by --policy-on alone: give one")
    torch.set_float32_matmul_precision("high")
    device = torch.device("cpu" if a.tiny else "cuda")
    rows = [row("tiny", **TINY, route="triton")] if a.tiny else [official(n) for n in row_numbers(a.rows)]
    rounds, calls = (2, 2) if a.tiny else (a.rounds, a.calls)
    results = []
    for shape_row in rows:
        try:
            rec = row_result(shape_row, device, a.switch, rounds, calls, policy_on)
        except Exception as e:  # one row's failure is a result too; the next rows still run
            rec = {"row": shape_row["id"], "error": f"{type(e).__name__}: {str(e)[:300]}"}
        results.append(rec)
        print(json.dumps({k: v for k, v in rec.items() if "round" not in k and k != "accuracy"}), flush=True)
        write_json(a.out, {"device": device_name(device), "torch": torch.__version__, "switch": a.switch,
                           "policy": a.policy, "policy_on": a.policy_on, "release": pdl.RELEASE, "rows": results})
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return 1 if any("error" in r for r in results) else 0


if __name__ == "__main__":
    raise SystemExit(main())
