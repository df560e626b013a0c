"""What a call of the Hopper forward costs the GPU beyond its kernel: launched eagerly against replayed from a CUDA
graph, back to back against timed as the official harness times it.

Usage (sm_90 GPU): python -m benchmarks.launch_gap [OUT.json] [--rows 5,1,9,12,7] [--rounds 3]

Per official row, on the pipeline's weights and first-trial inputs, the kernel as its route launches it (the route's
flags: duo, loader warp) through one `PreparedLaunch`, timed five ways, each `rounds` times in turn (µs a call):
- `eager_batch`: 50 prepared launches back to back between one CUDA event pair, the median of 5 batches
  (`benchmarks.host_path`'s GPU time a call);
- `graph1_batch`: a CUDA graph of one launch, replayed 50 times likewise;
- `graph10`: a graph of 10 launches, each replay between its own event pair, the median / 10
  (`benchmarks.hopper_forward`'s kernel time, `graph_ms`);
- `eager_official`, `graph1_official`: 100 calls, an event pair around each and no synchronization between them
  (the timing job's timer, as the official harness times), the median.
"""
from __future__ import annotations

import torch

from benchmarks.common import (CUDA, device_name, graph_ms, median_ms, official, parser, require_cuda, row_numbers,
                               setup, write_json)
from benchmarks.host_path import per_call_us
from shapewise.kernels import hopper_forward as hf
from shapewise.model.reference import LAYER_NORM_EPS
from shapewise.model.weights import layer_weights, per_layer

WAYS = ("eager_batch", "graph1_batch", "graph10", "eager_official", "graph1_official")
BATCH, BATCHES, OFFICIAL_CALLS, REPLAYS = 50, 5, 100, 100


def row_result(shape_row, rounds):
    cfg, _, model, x, mask = setup(shape_row, CUDA, reference=False)
    with torch.inference_mode():
        model(x, mask)
        route = model.last_route
        w = per_layer(model, torch.float32)
        packed = hf.pack_weights([layer_weights(w, i) for i in range(cfg.num_layers)], (w["final_w"], w["final_b"]),
                                 cfg.num_heads)
        launch = hf.PreparedLaunch(x, packed, num_heads=cfg.num_heads, causal=cfg.causal, eps=LAYER_NORM_EPS,
                                   mask=mask, duo=route.duo, producer=route.producer)

        def eager():
            return launch(x, mask)

        for _ in range(20):
            eager()
        one = torch.cuda.CUDAGraph()
        with torch.cuda.graph(one):
            eager()
        ways = {"eager_batch": lambda: per_call_us(eager, BATCH, BATCHES)[1],
                "graph1_batch": lambda: per_call_us(one.replay, BATCH, BATCHES)[1],
                "graph10": lambda: graph_ms(eager, REPLAYS) * 1e3,
                "eager_official": lambda: median_ms(eager, CUDA, OFFICIAL_CALLS) * 1e3,
                "graph1_official": lambda: median_ms(one.replay, CUDA, OFFICIAL_CALLS) * 1e3}
        out = {"row": shape_row["id"], "route": str(route), **{way: [] for way in WAYS}}
        for _ in range(rounds):
            for way in WAYS:
                out[way].append(ways[way]())
    return out


def main():
    p = parser(__doc__, "launch-gap.json")
    p.add_argument("--rows", default="5,1,9,12,7", help="official rows the Hopper forward serves")
    p.add_argument("--rounds", type=int, default=3, help="times each way is timed, in turn")
    args = p.parse_args()
    require_cuda()
    result = {"device": device_name(CUDA), "torch": torch.__version__, "rows": []}
    for n in row_numbers(args.rows):
        rec = row_result(official(n), args.rounds)
        result["rows"].append(rec)
        write_json(args.out, result)
        print(rec["row"], {way: [round(t, 1) for t in rec[way]] for way in WAYS}, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
