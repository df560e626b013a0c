"""One-call H200 probe: accuracy per operand precision and quick timings per official row.

Usage (on a CUDA machine): python -m experiments.h200_probe OUT.json [--rows 1,2,...] [--row14]
Writes one JSON with, per row and precision, the official/strict comparison of one trial and the
median latency (short protocol: 10 warm-up, 50 timed calls, CUDA events) of the reference and the
optimized routes. It informs model/routing_policy.json; the pipeline's timing job is the measurement.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from shapewise.model import TOLERANCES, BaselineTransformer, TransformerConfig, UserOptimizedTransformer
from shapewise.model import compare_outputs, generate_random_case

OFFICIAL = {
    1: (64, 128, 128, 4, 128, 4), 2: (1, 128, 128, 4, 128, 4), 3: (4, 128, 128, 4, 128, 4),
    4: (16, 128, 128, 4, 128, 4), 5: (128, 128, 128, 4, 128, 4), 6: (10000, 128, 128, 4, 128, 4),
    7: (64, 128, 32, 4, 32, 4), 8: (64, 128, 1024, 4, 1024, 4), 9: (64, 128, 128, 1, 128, 4),
    10: (64, 128, 128, 2, 128, 4), 11: (64, 128, 128, 16, 128, 4), 12: (64, 32, 128, 4, 128, 4),
    13: (64, 1024, 128, 4, 128, 4), 14: (32, 100000, 1024, 16, 1024, 2),
}


def median_ms(fn, warmup=10, iters=50):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def graph_ms(fn, reps):
    """Median time of one `fn()` without the host's launch cost: a CUDA graph of 10 back-to-back calls (captured
    after one eager call that compiles and warms), replayed `reps` times, / 10."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(10):
            fn()
    return median_ms(graph.replay, warmup=2, iters=reps) / 10


def probe_row(row, precisions, routes, log):
    cfg = TransformerConfig(*OFFICIAL[row], causal=True)
    torch.manual_seed(0)
    ref = BaselineTransformer(cfg).cuda().eval()
    x, mask = generate_random_case(cfg, "cuda", torch.float32, 1234)
    out = {"row": row, "config": cfg.as_dict(), "variants": []}
    with torch.inference_mode():
        torch.backends.cuda.matmul.allow_tf32 = False
        want = ref(x, mask)
        torch.set_float32_matmul_precision("high")
        out["reference_ms"] = median_ms(lambda: ref(x, mask), warmup=5, iters=20 if row in (6, 13) else 50)
        for route in routes:
            for prec in precisions:
                t0 = time.perf_counter()
                opt = UserOptimizedTransformer(cfg, route=route, precision=prec)
                opt.load_state_dict(ref.state_dict(), strict=True)
                opt = opt.cuda().eval()
                got = opt(x, mask)
                torch.cuda.synchronize()
                first = time.perf_counter() - t0
                cmp = {name: compare_outputs(want, got, **tol).as_dict() for name, tol in TOLERANCES.items()}
                ms = median_ms(lambda: opt(x, mask))
                rec = {"route": route, "precision": prec, "first_call_s": first, "median_ms": ms,
                       "official_failed": cmp["official"]["failed_elements"],
                       "strict_failed": cmp["strict"]["failed_elements"],
                       "max_abs_error": cmp["official"]["max_abs_error"], "taken": str(opt.last_route)}
                if opt._graphs:
                    graph = next(iter(opt._graphs.values()))[0]
                    rec["replay_only_ms"] = median_ms(graph.replay)
                out["variants"].append(rec)
                log(f"row {row:2d} {route:6s} {prec:5s} ref {out['reference_ms']:.3f} ms  opt {ms:.3f} ms  "
                    f"x{out['reference_ms'] / ms:.1f}  fail {rec['official_failed']}/{rec['strict_failed']}  "
                    f"err {rec['max_abs_error']:.2e}  first {first:.1f}s  replay {rec.get('replay_only_ms', 0):.3f}")
                del opt, got
    del ref, want, x
    torch.cuda.empty_cache()
    return out


def probe_row14(log):
    from shapewise.kernels.attention import flash_attention

    res = {}
    B, S, H, D = 4, 100000, 16, 64
    qkv = torch.randn(B, S, 3, H, D, device="cuda", dtype=torch.float16)
    q, k, v = qkv.unbind(2)
    flops = 4 * B * H * S * S * D / 2
    for prec in ("fp16",):
        t0 = time.perf_counter()
        flash_attention(q, k, v, causal=True, precision=prec)
        torch.cuda.synchronize()
        first = time.perf_counter() - t0
        ms = median_ms(lambda: flash_attention(q, k, v, causal=True, precision=prec), warmup=1, iters=3)
        res[f"triton_{prec}"] = {"ms": ms, "tflops": flops / ms / 1e9, "first_s": first}
        log(f"attn S=100k B={B} {prec}: {ms:.1f} ms, {flops / ms / 1e9:.0f} TFLOP/s (first {first:.1f}s)")
    qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))
    ms = median_ms(lambda: torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, is_causal=True),
                   warmup=1, iters=3)
    res["sdpa_fp16"] = {"ms": ms, "tflops": flops / ms / 1e9}
    log(f"attn S=100k B={B} sdpa: {ms:.1f} ms, {flops / ms / 1e9:.0f} TFLOP/s")
    return res


def probe_row14_full(log):
    cfg = TransformerConfig(*OFFICIAL[14], causal=True)
    torch.manual_seed(0)
    opt = UserOptimizedTransformer(cfg).cuda().eval()
    x, mask = generate_random_case(cfg, "cuda", torch.float32, 1234)
    torch.set_float32_matmul_precision("high")
    torch.cuda.reset_peak_memory_stats()
    with torch.inference_mode():
        t0 = time.perf_counter()
        y = opt(x, mask)
        torch.cuda.synchronize()
        first = time.perf_counter() - t0
        del y
        ms = median_ms(lambda: opt(x, mask), warmup=0, iters=2)
    res = {"first_s": first, "median_ms": ms, "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
           "route": str(opt.last_route)}
    log(f"row 14 full: {ms:.0f} ms (first {first:.1f}s), peak {res['peak_gib']:.1f} GiB, {res['route']}")
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--rows", default="1,2,3,4,5,6,7,8,9,10,11,12,13")
    ap.add_argument("--precisions", default="tf32,fp16")
    ap.add_argument("--routes", default="graph,triton")
    ap.add_argument("--row14", action="store_true")
    ap.add_argument("--row14-full", action="store_true", help="time whole row-14 forwards (auto route)")
    args = ap.parse_args()
    lines = []

    def log(msg):
        print(msg, flush=True)
        lines.append(msg)

    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": []}
    for row in [int(r) for r in args.rows.split(",") if r]:
        try:
            result["rows"].append(probe_row(row, args.precisions.split(","), args.routes.split(","), log))
        except Exception as e:  # keep what was measured for the other rows
            log(f"row {row}: FAILED {type(e).__name__}: {e}")
            result["rows"].append({"row": row, "error": f"{type(e).__name__}: {e}"})
        json.dump(result, open(args.out, "w"), indent=1)
    if args.row14:
        result["row14_attention"] = probe_row14(log)
    if args.row14_full:
        result["row14_full"] = probe_row14_full(log)
    result["log"] = lines
    json.dump(result, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
