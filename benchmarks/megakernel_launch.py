"""The megakernel's launch options on the official rows it may serve: accuracy and GPU time per call of each.

Usage: python -m benchmarks.megakernel_launch OUT.json [--rows 1,2,...] [--configs all|policy] [--jobs N]

Per official row: the reference in fp32 (TF32 off) on one seeded case with the official all-True mask, then every
launch of LAUNCHES the row's shape admits: its output against the reference at the official and strict tolerances,
and its median GPU time per call (a CUDA graph of one launch replayed 3 x 100 times, each replay between its own
pair of CUDA events). The optimized model as it routes today is timed beside it, called as the official harness
calls it. Kernels compile first in parallel worker processes (one per shape) that fill Triton's cache, so the
timing process only loads them. MEGAKERNEL_MODULE=<module> times another module with the same `megakernel`
function (a variant under test) in place of shapewise.kernels.megakernel.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import sys
import time

import torch

# block_m, block_n, block_a, block_f, block_c, num_warps, num_stages, programs_per_sm
LAUNCHES = (
    (64, 64, 64, 64, 128, 8, 2, 1),
    (64, 32, 64, 64, 128, 8, 2, 1),
    (32, 32, 32, 128, 128, 8, 2, 1),
    (32, 32, 32, 64, 64, 4, 2, 2),
    (64, 32, 64, 64, 128, 4, 2, 2),
)
MODULE = os.environ.get("MEGAKERNEL_MODULE", "shapewise.kernels.megakernel")
ROWS = (1, 2, 3, 4, 5, 6, 7, 9, 10, 11, 12)
OFFICIAL = {"atol": 2e-3, "rtol": 2e-2}
STRICT = {"atol": 1e-3, "rtol": 1e-2}


def _config(row):
    from shapewise.model.config import TransformerConfig

    return TransformerConfig(row["batch_size"], row["seq_len"], row["d_model"], row["num_heads"], row["ffn_dim"],
                             row["num_layers"], row.get("causal", True))


def stacked_weights(model, op):
    """The megakernel's stacked weights from a reference model's parameters, operands in `op`."""
    from shapewise.kernels.megakernel import stack_layers

    layers = []
    for layer in model.layers:
        a = layer.attention
        lw = {"qkv_w": torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]),
              "qkv_b": torch.cat([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias]),
              "o_w": a.out_proj.weight, "o_b": a.out_proj.bias, "in_w": layer.ffn_in.weight,
              "in_b": layer.ffn_in.bias, "out_w": layer.ffn_out.weight, "out_b": layer.ffn_out.bias,
              "n1_w": layer.norm1.weight, "n1_b": layer.norm1.bias, "n2_w": layer.norm2.weight,
              "n2_b": layer.norm2.bias}
        layers.append({k: (v.to(op) if k.endswith("_w") and k[:2] not in ("n1", "n2") else v.float()).detach()
                       for k, v in lw.items()})
    return stack_layers(layers, (model.final_norm.weight.detach(), model.final_norm.bias.detach()))


def _launch_kwargs(launch):
    bm, bn, ba, bf, bc, nw, ns, pps = launch
    return dict(block_m=bm, block_n=bn, block_a=ba, block_f=bf, block_c=bc, num_warps=nw, num_stages=ns,
                programs_per_sm=pps)


def _kernel_resources(mod):
    """(registers, spill bytes) of every compiled variant of the kernel in this process, where Triton says."""
    try:
        caches = mod._megakernel_fwd.device_caches
        return sorted({(k.n_regs, k.n_spills) for cache in caches.values() for k in cache[0].values()})
    except Exception as exc:  # noqa: BLE001 - informational
        return repr(exc)[:200]


def _compile_worker(args):
    """Compile (by running once on a tiny batch) every launch for one shape; returns the failures."""
    shape, launches = args
    import importlib

    mod = importlib.import_module(MODULE)
    megakernel = mod.megakernel
    from shapewise.model.reference import BaselineTransformer

    S, d, H, ffn, L = shape
    from shapewise.model.config import TransformerConfig

    torch.manual_seed(0)
    model = BaselineTransformer(TransformerConfig(2, S, d, H, ffn, L, True)).cuda()
    w = stacked_weights(model, torch.float16)
    x = torch.randn(2, S, d, device="cuda")
    mask = torch.ones(2, S, dtype=torch.bool, device="cuda")
    failed = {}
    for launch in launches:
        try:
            megakernel(x, w, num_heads=H, causal=True, mask=mask, **_launch_kwargs(launch))
        except Exception as exc:  # noqa: BLE001 - reported per launch
            failed[str(launch)] = repr(exc)[:500]
    torch.cuda.synchronize()
    failed["resources"] = _kernel_resources(mod)
    return shape, failed


def _time_graph(fn, rounds=3, calls=100, warmup=20):
    """Median GPU ms per call of `fn` captured in a CUDA graph and replayed, each replay in its own events."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(warmup):
        graph.replay()
    times = []
    for _ in range(rounds):
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(calls)]
        for start, stop in events:
            start.record()
            graph.replay()
            stop.record()
        torch.cuda.synchronize()
        times += [start.elapsed_time(stop) for start, stop in events]
    return statistics.median(times), times


def _time_calls(fn, rounds=3, calls=100, warmup=20):
    """Median ms per call of `fn` called eagerly, each call between its own pair of CUDA events (the official
    protocol's per-call timing)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(rounds):
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(calls)]
        for start, stop in events:
            start.record()
            fn()
            stop.record()
        torch.cuda.synchronize()
        times += [start.elapsed_time(stop) for start, stop in events]
    return statistics.median(times)


def _errors(out, ref):
    diff = (out.double() - ref.double()).abs()
    finite = torch.isfinite(out) & torch.isfinite(ref)

    def failed(tol):
        ok = finite & ((diff <= tol["atol"]) | (diff <= tol["rtol"] * ref.double().abs()))
        return int((~ok).sum())

    return {"failed": failed(OFFICIAL), "strict_failed": failed(STRICT),
            "max_abs_error": float(torch.where(finite, diff, torch.zeros_like(diff)).max())}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--rows", default=",".join(map(str, ROWS)))
    ap.add_argument("--jobs", type=int, default=8)
    ap.add_argument("--no-model", action="store_true", help="do not time the optimized model's own route")
    args = ap.parse_args(argv)
    import importlib

    megakernel = importlib.import_module(MODULE).megakernel
    from shapewise.kernels.megakernel import why_unsupported
    from shapewise.model import generate_random_case
    from shapewise.model.reference import BaselineTransformer

    import yaml  # the official table as written (the manifest checker needs jsonschema, absent on some GPU nodes)

    from shapewise.paths import ROOT

    table = {int(r["id"].rsplit("-", 1)[1]): r for r in yaml.safe_load((ROOT / "shapes" / "official.yaml").read_text())}
    rows = [int(r) for r in args.rows.split(",") if r]
    shapes = {}
    for r in rows:
        row = table[r]
        if why_unsupported(row["seq_len"], row["d_model"], row["num_heads"]):
            continue
        shape = (row["seq_len"], row["d_model"], row["num_heads"], row["ffn_dim"], row["num_layers"])
        shapes.setdefault(shape, []).append(r)
    t0 = time.time()
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(min(args.jobs, len(shapes))) as pool:
        compiled = dict(pool.map(_compile_worker, [(s, LAUNCHES) for s in shapes]))
    print(f"compiled {len(shapes)} shapes x {len(LAUNCHES)} launches in {time.time() - t0:.0f} s", flush=True)

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "module": MODULE,
              "launches": LAUNCHES, "launch_fields": ["block_m", "block_n", "block_a", "block_f", "block_c",
                                                      "num_warps", "num_stages", "programs_per_sm"],
              "resources": {str(k): v.get("resources") for k, v in compiled.items()}, "rows": {}}
    for r in rows:
        row = table[r]
        cfg = _config(row)
        shape = (row["seq_len"], row["d_model"], row["num_heads"], row["ffn_dim"], row["num_layers"])
        if shape not in shapes:
            result["rows"][r] = {"skip": why_unsupported(row["seq_len"], row["d_model"], row["num_heads"])}
            continue
        torch.manual_seed(0)
        model = BaselineTransformer(cfg).cuda().eval()
        x, _ = generate_random_case(cfg, "cuda", seed=1234)
        mask = torch.ones(x.shape[:2], dtype=torch.bool, device="cuda")
        with torch.no_grad():
            ref = model(x, mask)
        w = stacked_weights(model, torch.float16)
        entry = {"launches": {}}
        for launch in LAUNCHES:
            key = str(launch)
            if key in compiled[shape] and key != "resources":
                entry["launches"][key] = {"error": compiled[shape][key]}
                continue
            kw = _launch_kwargs(launch)
            try:
                out = megakernel(x, w, num_heads=cfg.num_heads, causal=cfg.causal, mask=mask, **kw)
                again = megakernel(x, w, num_heads=cfg.num_heads, causal=cfg.causal, mask=mask, **kw)
                rec = _errors(out, ref)
                rec["deterministic"] = bool(torch.equal(out, again))
                med, times = _time_graph(lambda: megakernel(x, w, num_heads=cfg.num_heads, causal=cfg.causal,
                                                            mask=mask, **kw))
                rec["median_ms"] = med
                rec["p10_ms"], rec["p90_ms"] = (statistics.quantiles(times, n=10)[i] for i in (0, -1))
            except Exception as exc:  # noqa: BLE001 - reported per launch
                rec = {"error": repr(exc)[:500]}
            entry["launches"][key] = rec
        if not args.no_model:
            from shapewise.model.optimized import UserOptimizedTransformer

            opt = UserOptimizedTransformer(cfg).cuda()
            opt.load_state_dict(model.state_dict())
            with torch.no_grad():
                entry["model_median_ms"] = _time_calls(lambda: opt(x, mask))
                entry["model_route"] = str(opt.last_route)
                entry["model_errors"] = _errors(opt(x, mask), ref)
        ok = {k: v for k, v in entry["launches"].items() if "median_ms" in v and v["failed"] == 0}
        best = min(ok, key=lambda k: ok[k]["median_ms"]) if ok else None
        entry["best"] = best
        result["rows"][r] = entry
        print(f"row {r}: best {best} {ok[best]['median_ms'] * 1000 if best else float('nan'):.1f} us"
              f" (strict {ok[best]['strict_failed'] if best else '-'}); model "
              f"{entry.get('model_median_ms', float('nan')) * 1000:.1f} us", flush=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    print(f"done in {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
