"""What a call of the Hopper forward costs the GPU beyond its kernel: launched eagerly against replayed from a CUDA
graph, back to back against timed as the official harness times it.

Usage (sm_90 GPU): python -m benchmarks.launch_gap [OUT.json] [--rows 5,1,9,12,7] [--rounds 3]

Per official row, on the pipeline's weights and first-trial inputs, the kernel as its route launches it (the route's
flags: duo, loader warp) through one `PreparedLaunch`, timed five ways, each `rounds` times in turn (µs a call):
- `eager_batch`: 50 prepared launches back to back between one CUDA event pair (median of 5 batches);
- `graph1_batch`: a CUDA graph of one launch, replayed 50 times likewise;
- `graph10`: a graph of 10 launches replayed, divided by 10 (`benchmarks.hopper_forward`'s kernel time);
- `eager_official`, `graph1_official`: 100 calls, an event pair around each and no synchronization between them
  (the official harness's timer), the median.
"""
from __future__ import annotations

import statistics

import torch

from benchmarks.common import CUDA, device_name, official, parser, require_cuda, row_numbers, setup, write_json
from shapewise.kernels import hopper_forward as hf
from shapewise.model.reference import LAYER_NORM_EPS
from shapewise.model.weights import layer_weights, per_layer

WAYS = ("eager_batch", "graph1_batch", "graph10", "eager_official", "graph1_official")


def batch_us(fn, calls=50, batches=5):
    """µs a call of `fn` called `calls` times back to back between one event pair, the median of `batches`."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(batches):
        torch.cuda.synchronize()
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / calls * 1e3)
    return statistics.median(times)


def official_us(fn, calls=100):
    """The median µs of `calls` calls of `fn`, each between its own event pair, nothing synchronized between them."""
    pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(calls)]
    torch.cuda.synchronize()
    for start, end in pairs:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) * 1e3 for start, end in pairs)


def captured(fn, launches, stream):
    """A CUDA graph of `launches` calls of `fn`, captured on `stream`."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        for _ in range(launches):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    return graph


def row_result(shape_row, rounds):
    cfg, _, model, x, mask = setup(shape_row, CUDA, reference=False)
    with torch.inference_mode():
        model(x, mask)
        route = model.last_route
        w = per_layer(model, torch.float32)
        packed = hf.pack_weights([layer_weights(w, i) for i in range(cfg.num_layers)], (w["final_w"], w["final_b"]),
                                 cfg.num_heads)
        hd = hf.launch_config(cfg.seq_len, cfg.d_model, cfg.num_heads, cfg.ffn_dim)["HD"]
        launch = hf.PreparedLaunch(x, packed, num_heads=cfg.num_heads, causal=cfg.causal, eps=LAYER_NORM_EPS,
                                   mask=mask, desc=hf.weight_descriptor(packed["stream"], hd), duo=route.duo,
                                   producer=route.producer)

        def eager():
            return launch(x, mask)

        for _ in range(20):
            eager()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        one, ten = captured(eager, 1, side), captured(eager, 10, side)
        torch.cuda.synchronize()
        ways = {"eager_batch": lambda: batch_us(eager), "graph1_batch": lambda: batch_us(one.replay),
                "graph10": lambda: batch_us(ten.replay, calls=10) / 10,
                "eager_official": lambda: official_us(eager), "graph1_official": lambda: official_us(one.replay)}
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
