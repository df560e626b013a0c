"""Where the host's time per call of a captured route goes: the forward's own checks, the weight check, the replay of
the CUDA graph and the copy of its output, each timed alone.

Usage (CUDA machine): python -m benchmarks.host_parts [OUT.json] [--rows 1,9,12] [--calls 50] [--repeats 20]

Per official row whose route is captured (graph, fused, hopper), after 20 calls that compile and capture (the caller's
x and mask at fixed addresses, so the graph that reads them in place is the one replayed, as in the timing job):
`repeats` batches of `calls` back-to-back calls of each part, each batch started right after a synchronize (the
launch queue never fills), the host's wall time per call, median over batches:
- `call`: model(x, mask), the whole call;
- `before_runner`: model(x, mask) with the route's runner replaced by one that returns x (input checks, the memory
  plan's lookup, the weight check, the route's lookup);
- `weight_check`: the weight check alone (DerivedWeights.refresh: every parameter's address and version);
- `runner`: the captured runner alone (the addresses check, the replay, the output's copy);
- `replay`: CUDAGraph.replay() of the graph that reads the inputs in place;
- `copy_out`: the clone of the graph's output buffer;
- `eager`: the route's runner without its graph (its launches and its output's allocation, as `cuda_graph` off runs it;
  on route `hopper` the signature's prepared launch);
- on a route launched through its signature's prepared launch (route `hopper` with `prepared_launch`): `prepared`,
  the PreparedLaunch's call alone (the output's allocation and one launch), and `empty`, the output's allocation
  alone (torch.empty of the output's shape).
`gpu_us`: the GPU's time per call of the whole call in the same batches (CUDA events), as benchmarks.host_path
measures it.
"""
from __future__ import annotations

import torch

from benchmarks.common import (CUDA, ReturnsInput, device_name, official, parser, require_cuda, row_numbers, setup,
                               write_json)
from benchmarks.host_path import per_call_us
from benchmarks.switch_ab import policy_change, set_policy


def host_us(fn, calls, repeats):
    """The host's µs per call of `fn` (benchmarks.host_path.per_call_us), rounded."""
    return round(per_call_us(fn, calls, repeats)[0], 2)


def parts(shape_row, calls, repeats):
    _, _, model, x, mask = setup(shape_row, CUDA, reference=False)
    out = {"row": shape_row["id"], "calls": calls, "repeats": repeats}
    with torch.inference_mode():
        for _ in range(20):
            model(x, mask)
        out["route"] = str(model.last_route)
        key = (x.shape, x.dtype, x.device, mask is None)
        runner = model._paths[key]
        direct = getattr(runner, "direct", None)
        call, gpu = per_call_us(lambda: model(x, mask), calls, repeats)
        out["call"], out["gpu_us"] = round(call, 2), round(gpu, 2)
        model._paths[key] = ReturnsInput(runner.route)
        try:
            out["before_runner"] = host_us(lambda: model(x, mask), calls, repeats)
        finally:
            model._paths[key] = runner
        out["weight_check"] = host_us(lambda: model._weights.refresh(model), calls, repeats)
        out["runner"] = host_us(lambda: runner(model, x, mask), calls, repeats)
        launch = getattr(runner, "launch", None)
        if launch is not None:
            out["prepared"] = host_us(lambda: launch(x, mask), calls, repeats)
            out["empty"] = host_us(lambda: torch.empty(x.shape, dtype=x.dtype, device=x.device), calls, repeats)
        if direct is not None:
            graph, _, static_out = direct
            out["replay"] = host_us(graph.replay, calls, repeats)
            out["copy_out"] = host_us(static_out.clone, calls, repeats)
            out["eager"] = host_us(lambda: runner.inner(model, x, mask), calls, repeats)
    return out


def main():
    p = parser(__doc__, "host-parts.json")
    p.add_argument("--rows", default="1,9,12", help="official rows (captured routes)")
    p.add_argument("--calls", type=int, default=50, help="calls per batch")
    p.add_argument("--repeats", type=int, default=20, help="batches per part")
    p.add_argument("--policy", action="append", default=[], help="SECTION.KEY=JSON: a routing-policy entry set")
    args = p.parse_args()
    require_cuda()
    set_policy(policy_change(args.policy))
    result = {"device": device_name(CUDA), "torch": torch.__version__, "policy": args.policy, "rows": {}}
    for n in row_numbers(args.rows):
        rec = parts(official(n), args.calls, args.repeats)
        result["rows"][n] = rec
        parts_us = ("call", "gpu_us", "before_runner", "weight_check", "runner", "replay", "copy_out", "eager",
                    "prepared", "empty")
        print(f"official row {n}: " + ", ".join(f"{k} {rec[k]} us" for k in parts_us if k in rec)
              + f"; {rec['route']}", flush=True)
        write_json(args.out, result)


if __name__ == "__main__":
    main()
