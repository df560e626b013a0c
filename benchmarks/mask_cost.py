"""What the official call's all-True mask costs: `model(x, mask)` against `model(x)` per official row, paired by round.

Usage (CUDA machine): python -m benchmarks.mask_cost [OUT.json] [--rows 1,2,...,13] [--rounds 20] [--calls 100]
       [--setting fused_layer.NAME=VALUE[,...]] ... [--row14]

Per row: the optimized model on the pipeline's weights and first-trial inputs, captured by its first call and 20
warm-up calls of each kind; then `rounds` rounds, each timing `model(x, mask)` and `model(x)` `calls` times back to
back (a CUDA event pair per call, the timing job's timer). The cost is the timing job's estimator
(shapewise.analysis.stats.paired_round_ratio: the median over rounds of the ratio of the two round medians) minus 1,
with its bootstrap interval over rounds. The two calls' outputs must agree (an all-True mask changes nothing): their
largest difference is recorded, with the route each call took.

--setting (repeatable) is an A/B of kernel constants: one more model per setting, built and captured while the
named constants of shapewise.kernels modules hold the given values, timed in the same rounds as the committed one;
its masked output's largest difference from the committed setting's is recorded (0: the same to the bit).
--row14: official row 14 (3 s a call): the first call, 2 timed calls with the mask and 1 without, peak memory.
"""
from __future__ import annotations

import time

import torch

from benchmarks.common import (CUDA, alternating_rounds, applied, device_name, official, parse_settings, parser,
                               pooled_median, row_numbers, setup, write_json)
from shapewise.analysis import stats


def row_cost(shape_row, settings, rounds, calls):
    models, outputs, out = {}, {}, {"settings": {name: {f"{m.__name__}.{a}": v for (m, a), v in change.items()}
                                                 for name, change in settings.items()}}
    inputs = None  # every setting's model is called on the same tensors (a captured graph reads them in place)
    with torch.inference_mode():
        for name, change in settings.items():
            with applied(change):
                _, _, model, x, mask = setup(shape_row, CUDA, reference=False)
                inputs = inputs or (x, mask)
                x, mask = inputs
                t0 = time.perf_counter()
                outputs[name] = model(x, mask).float()
                torch.cuda.synchronize()
                out.setdefault(name, {})["first_call_s"] = time.perf_counter() - t0
                out[name]["route_mask"] = str(model.last_route)
                plain = model(x).float()
                out[name]["route_nomask"] = str(model.last_route)
                out[name]["mask_vs_nomask_max_abs_diff"] = float((outputs[name] - plain).abs().max())
                for fn in (lambda: model(x, mask), lambda: model(x)):  # captures the graphs of both calls
                    for _ in range(20):
                        fn()
            models[name] = model
        calls_by_name = {}
        for name, model in models.items():
            calls_by_name[(name, "mask")] = lambda model=model: model(x, mask)
            calls_by_name[(name, "nomask")] = lambda model=model: model(x)
        times = alternating_rounds(calls_by_name, CUDA, rounds, calls)
    for name in settings:
        masked, plain = times[(name, "mask")], times[(name, "nomask")]
        paired = stats.paired_round_ratio(masked, plain, ("mask", "nomask"))
        ci = paired["interval"]
        out[name].update(mask_cost=paired["ratio"] - 1, mask_cost_ci=[ci["low"] - 1, ci["high"] - 1],
                         mask_median_ms=pooled_median(masked), nomask_median_ms=pooled_median(plain),
                         mask_round_medians_ms=stats.round_medians(masked),
                         nomask_round_medians_ms=stats.round_medians(plain),
                         max_abs_diff_from_committed=float((outputs[name] - outputs["committed"]).abs().max()))
    out.update(rounds=rounds, calls=calls)
    return out


def row14():
    _, _, model, x, mask = setup(official(14), CUDA, reference=False)
    out = {}
    with torch.inference_mode():
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        model(x, mask)
        torch.cuda.synchronize()
        out["first_call_s"] = time.perf_counter() - t0
        out["route_mask"] = str(model.last_route)
        out["mask_ms"] = alternating_rounds({"mask": lambda: model(x, mask)}, CUDA, 1, 2)["mask"][0]
        out["nomask_ms"] = alternating_rounds({"nomask": lambda: model(x)}, CUDA, 1, 1)["nomask"][0]
        out["peak_memory_bytes"] = torch.cuda.max_memory_allocated()
    return out


def main():
    p = parser(__doc__, "mask-cost.json")
    p.add_argument("--rows", default=",".join(map(str, range(1, 14))), help="official rows 1-13")
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--calls", type=int, default=100, help="calls of each kind per round")
    p.add_argument("--setting", action="append", default=[], help="MODULE.NAME=VALUE[,...] of shapewise.kernels")
    p.add_argument("--row14", action="store_true", help="also official row 14, a few calls")
    args = p.parse_args()
    if 14 in row_numbers(args.rows):
        p.error("--rows: row 14 takes --row14 (a call takes seconds, so it runs a few calls only)")
    settings = {"committed": {}, **parse_settings(args.setting)}
    torch.set_float32_matmul_precision("high")
    result = {"device": device_name(CUDA), "torch": torch.__version__, "rows": {}}
    for n in row_numbers(args.rows):
        result["rows"][n] = rec = row_cost(official(n), settings, args.rounds, args.calls)
        for name in settings:
            r = rec[name]
            print(f"row {n:2d} {name}: mask cost {r['mask_cost'] * 100:+.2f} % [{r['mask_cost_ci'][0] * 100:+.2f}, "
                  f"{r['mask_cost_ci'][1] * 100:+.2f}], mask {r['mask_median_ms'] * 1e3:.2f} us, nomask "
                  f"{r['nomask_median_ms'] * 1e3:.2f} us, {r['route_mask'][:60]}", flush=True)
        write_json(args.out, result)
    if args.row14:
        result["row14"] = row14()
        print("row 14:", result["row14"], flush=True)
        write_json(args.out, result)


if __name__ == "__main__":
    main()
