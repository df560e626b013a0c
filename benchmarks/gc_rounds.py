"""What the stable protocol's collection before each round costs, with and without the job's objects frozen.

Usage (CUDA machine): python -m benchmarks.gc_rounds [OUT.json] [--rows 1,9] [--rounds 30] [--pairs 2]

Per official row, in one process holding the row's reference and optimized models as a timing job does (the
official call, the pipeline's stable protocol with its CPU pinning and core pick): the time of one full
collection (gc.collect) with everything the process holds unfrozen, then frozen (gc.freeze, as run_rounds does
before its first round); then `pairs` pairs of `rounds` timed rounds (min_rounds = max_rounds = rounds, so both
arms run the same rounds and calls), one with gc.freeze made a no-op (every round's collection walks the whole
heap) and one as the protocol runs, alternating. Reported: collection ms, objects tracked, and per arm the wall
seconds of the rounds and each model's median, which the freeze must not move.
"""
from __future__ import annotations

import gc
import statistics
import time

import torch

from benchmarks.common import CUDA, device_name, official, parser, require_cuda, row_numbers, setup, write_json
from shapewise.inputs import paths
from shapewise.inputs.limits import load_yaml
from shapewise.jobs import timing


def collect_ms(times=5):
    out = []
    for _ in range(times):
        t0 = time.perf_counter()
        gc.collect()
        out.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(out)


def arm(calls, protocol, frozen):
    saved = gc.freeze, gc.unfreeze
    if not frozen:
        gc.freeze = gc.unfreeze = lambda: None
    try:
        t0 = time.perf_counter()
        rounds, _, stopping = timing.run_rounds(calls, CUDA, "stable", protocol)
        seconds = time.perf_counter() - t0
    finally:
        gc.freeze, gc.unfreeze = saved
    medians = {k: statistics.median(t for r in v for t in r) for k, v in rounds.items()}
    return {"frozen": frozen, "seconds": round(seconds, 3), "rounds": stopping["rounds_run"],
            "median_ms": {k: round(v, 5) for k, v in medians.items()}}


def measure(shape_row, rounds, pairs):
    _, ref, model, x, mask = setup(shape_row, CUDA)
    protocol = dict(load_yaml(paths.CONFIG_FILE, "config file")["timing"]["stable"], min_rounds=rounds,
                    max_rounds=rounds)
    calls = {"reference": lambda: ref(x, mask), "optimized": lambda: model(x, mask)}
    with torch.inference_mode():
        for fn in calls.values():
            for _ in range(protocol["warmup"]):
                fn()
        torch.cuda.synchronize()
        out = {"row": shape_row["id"], "objects_tracked": len(gc.get_objects()), "collect_ms": round(collect_ms(), 2)}
        gc.freeze()
        out["collect_ms_frozen"] = round(collect_ms(), 3)
        gc.unfreeze()
        out["arms"] = [arm(calls, protocol, frozen) for _ in range(pairs) for frozen in (False, True)]
    for frozen in (False, True):
        secs = [a["seconds"] for a in out["arms"] if a["frozen"] == frozen]
        out[f"seconds_{'frozen' if frozen else 'unfrozen'}"] = round(statistics.median(secs), 3)
    return out


def main():
    p = parser(__doc__, "gc-rounds.json")
    p.add_argument("--rows", default="1,9", help="official rows")
    p.add_argument("--rounds", type=int, default=30, help="rounds per arm (the stable protocol's cap)")
    p.add_argument("--pairs", type=int, default=2, help="pairs of arms, alternating")
    args = p.parse_args()
    require_cuda()
    result = {"device": device_name(CUDA), "torch": torch.__version__, "rows": {}}
    for n in row_numbers(args.rows):
        rec = measure(official(n), args.rounds, args.pairs)
        result["rows"][n] = rec
        print(f"official row {n}: collect {rec['collect_ms']} ms ({rec['objects_tracked']} objects), frozen "
              f"{rec['collect_ms_frozen']} ms; {args.rounds} rounds {rec['seconds_unfrozen']} s unfrozen, "
              f"{rec['seconds_frozen']} s frozen", flush=True)
        write_json(args.out, result)


if __name__ == "__main__":
    main()
