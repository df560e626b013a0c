"""What the official harness's call costs: `model(x, all-True mask)` against `model(x)`, per official row, one process.

Usage (CUDA machine): python -m experiments.h200_mask_cost OUT.json [--rows 1,2,...] [--row14] [--sdpa]
       [--switch-ab 7,12]

Per row 1-13: the optimized model on the reference's weights (seed 0), x from generate_random_case (seed 1234);
20 warm-up calls of each call kind, then 5 rounds alternating the two kinds, 100 calls each, every call timed by
its own CUDA event pair (the official protocol's timer); median per kind and the ratio. The outputs of the two
calls are compared (they must agree: an all-True mask changes nothing), and the route each call took is recorded.
--row14: official row 14 (batch 32) with the all-True mask: the first call (wall clock, synchronized) and 2 timed
calls, then 1 timed call without mask. --sdpa: PyTorch SDPA backends on row 14's attention (batch 4 of 32).
--switch-ab ROWS (session 14): per row, one model per setting of kernels.fused_layer's mask switches (committed, and
SWITCH_SETTINGS: at 7c15e89 DEFER_SUMMARY, FULL_MASK_BRANCH_MAX_D_MODEL at the row's d_model and both,
experiments/h200/session14/call1/switch-ab.json; at 8aa2a3b UNMASKED_FIRST_MAX_D_MODEL, call2/; at 7b9ff0b
KEY_MASK_BRANCH off, experiments/h200/session15/call1/switch-ab.json), each set while the model's graphs are
captured (first call and 20 warm-up calls of each kind); then 40 rounds, each timing every setting's model(x, mask)
and model(x), 100 calls each, back to back; per setting the paired mask cost (median over rounds of the ratio of
the two round medians, shapewise.stats.paired_round_ratio, the timing job's estimator) and the masked output's
largest difference from the committed setting's (0: the same to the bit).
Reads shapes/official.yaml with plain YAML (no pipeline code), writes OUT.json after every row.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import yaml

from shapewise.jobs.device import time_calls
from shapewise.model import BaselineTransformer, TransformerConfig, UserOptimizedTransformer, generate_random_case

CUDA = torch.device("cuda")
FIELDS = ("batch_size", "seq_len", "d_model", "num_heads", "ffn_dim", "num_layers")


def official():
    rows = yaml.safe_load((Path(__file__).resolve().parent.parent / "shapes" / "official.yaml").read_text())
    return {int(r["id"].rsplit("-", 1)[1]): r for r in rows}


def build(row, device="cuda", route="auto", disable=()):
    """The row's config and the optimized model (route `route`, optimizations `disable` off) on the reference's
    weights (seed 0), on `device`."""
    cfg = TransformerConfig(**{f: row[f] for f in FIELDS}, causal=row.get("causal", True))
    torch.manual_seed(0)
    ref = BaselineTransformer(cfg)
    opt = UserOptimizedTransformer(cfg, route=route, disable=disable)
    opt.load_state_dict(ref.state_dict(), strict=True)
    return cfg, opt.to(device).eval()


def timed(fn, n):
    """Milliseconds of each of n calls, a CUDA event pair per call: the timing job's own timer."""
    return time_calls(fn, CUDA, n)


def row_cost(n, row):
    cfg, opt = build(row)
    x, _ = generate_random_case(cfg, "cuda", torch.float32, 1234)
    mask = torch.ones(x.shape[:2], dtype=torch.bool, device="cuda")
    calls = {"nomask": lambda: opt(x), "mask": lambda: opt(x, mask)}
    out = {}
    with torch.inference_mode():
        t0 = time.perf_counter()
        y_mask = calls["mask"]()
        torch.cuda.synchronize()
        out["first_call_mask_s"] = time.perf_counter() - t0
        out["route_mask"] = str(opt.last_route)
        y_plain = calls["nomask"]()
        out["route_nomask"] = str(opt.last_route)
        out["max_abs_diff"] = float((y_mask.float() - y_plain.float()).abs().max())
        for fn in calls.values():
            timed(fn, 20)
        times = {k: [] for k in calls}
        for _ in range(5):
            for k, fn in calls.items():
                times[k] += timed(fn, 100)
    for k, v in times.items():
        out[f"{k}_median_ms"] = statistics.median(v)
        out[f"{k}_round_medians_ms"] = [statistics.median(v[i:i + 100]) for i in range(0, len(v), 100)]
    out["mask_over_nomask"] = out["mask_median_ms"] / out["nomask_median_ms"]
    return out


# The settings --switch-ab times beside the committed one: {name: {kernels.fused_layer attribute: value, or a
# function of the row}}. Empty on main: the switches it measured were slower and are gone (the docstring).
SWITCH_SETTINGS = {}


def switch_ab(row, rounds=40, calls=100):
    from shapewise import stats
    from shapewise.kernels import fused_layer as fused_module

    settings = {"committed": {}, **{name: {k: v(row) if callable(v) else v for k, v in attrs.items()}
                                    for name, attrs in SWITCH_SETTINGS.items()}}
    models, outputs, out = {}, {}, {"settings": settings, "rounds": rounds, "calls": calls}
    with torch.inference_mode():
        for name, attrs in settings.items():
            before = {k: getattr(fused_module, k) for k in attrs}
            for k, v in attrs.items():
                setattr(fused_module, k, v)
            try:
                cfg, opt = build(row)
                if name == "committed":
                    x, _ = generate_random_case(cfg, "cuda", torch.float32, 1234)
                    mask = torch.ones(x.shape[:2], dtype=torch.bool, device="cuda")
                outputs[name] = opt(x, mask).float()
                for fn in (lambda: opt(x, mask), lambda: opt(x)):  # captures the copy and the direct graphs
                    timed(fn, 20)
                out[f"route_{name}"] = str(opt.last_route)
            finally:
                for k, v in before.items():
                    setattr(fused_module, k, v)
            models[name] = opt
        times = {name: {"mask": [], "nomask": []} for name in settings}
        for _ in range(rounds):
            for name, opt in models.items():
                times[name]["mask"].append(timed(lambda: opt(x, mask), calls))
                times[name]["nomask"].append(timed(lambda: opt(x), calls))
    for name in settings:
        paired = stats.paired_round_ratio(times[name]["mask"], times[name]["nomask"], ("mask", "nomask"))
        ci = paired["interval"]
        out[name] = {"mask_cost": paired["ratio"] - 1, "mask_cost_ci": [ci["low"] - 1, ci["high"] - 1],
                     "mask_median_ms": statistics.median(t for r in times[name]["mask"] for t in r),
                     "nomask_median_ms": statistics.median(t for r in times[name]["nomask"] for t in r),
                     "mask_round_medians_ms": stats.round_medians(times[name]["mask"]),
                     "nomask_round_medians_ms": stats.round_medians(times[name]["nomask"]),
                     "max_abs_diff_from_committed": float((outputs[name] - outputs["committed"]).abs().max())}
        r = out[name]
        print(f"  {name:14s} mask cost {r['mask_cost'] * 100:+.2f} % [{r['mask_cost_ci'][0] * 100:+.2f}, "
              f"{r['mask_cost_ci'][1] * 100:+.2f}], mask {r['mask_median_ms'] * 1e3:.2f} us, nomask "
              f"{r['nomask_median_ms'] * 1e3:.2f} us, diff {r['max_abs_diff_from_committed']:.1e}", flush=True)
    return out


def row14(row):
    cfg, opt = build(row)
    x, _ = generate_random_case(cfg, "cuda", torch.float32, 1234, generator_device="device")
    mask = torch.ones(x.shape[:2], dtype=torch.bool, device="cuda")
    out = {}
    with torch.inference_mode():
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        opt(x, mask)
        torch.cuda.synchronize()
        out["first_call_mask_s"] = time.perf_counter() - t0
        out["route_mask"] = str(opt.last_route)
        out["mask_ms"] = timed(lambda: opt(x, mask), 2)
        out["nomask_ms"] = timed(lambda: opt(x), 1)
        out["peak_memory_bytes"] = torch.cuda.max_memory_allocated()
    return out


def sdpa_backends(row, batch=4):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    H, S, D = row["num_heads"], row["seq_len"], row["d_model"] // row["num_heads"]
    q, k, v = (torch.randn(batch, H, S, D, device="cuda", dtype=torch.float16) for _ in range(3))
    flop = 4 * batch * H * S * S * D / 2
    out = {}
    for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION),
                          ("efficient", SDPBackend.EFFICIENT_ATTENTION)):
        try:
            with sdpa_kernel(backend):
                fn = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
                fn()
                ms = statistics.median(timed(fn, 3))
            out[name] = {"ms": ms, "tflop_per_s": flop / ms / 1e9}
        except Exception as exc:  # noqa: BLE001 - a backend that refuses is recorded
            out[name] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
        print(name, out[name], flush=True)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--rows", default=",".join(map(str, range(1, 14))))
    ap.add_argument("--row14", action="store_true")
    ap.add_argument("--sdpa", action="store_true")
    ap.add_argument("--switch-ab", default="", help="rows: the fused layer's mask switches, whole model")
    args = ap.parse_args()
    torch.set_float32_matmul_precision("high")
    rows = official()
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": {}}
    save = lambda: Path(args.out).write_text(json.dumps(result, indent=1))  # noqa: E731
    if args.sdpa:
        result["sdpa_row14_attention"] = sdpa_backends(rows[14])
        save()
    for n in (int(r) for r in args.switch_ab.split(",") if r):
        print(f"row {n}: switch A/B", flush=True)
        result.setdefault("switch_ab", {})[n] = switch_ab(rows[n])
        save()
    for n in (int(r) for r in args.rows.split(",") if r):
        result["rows"][n] = row_cost(n, rows[n])
        r = result["rows"][n]
        print(f"row {n:2d}: nomask {r['nomask_median_ms']:.4f} ms, mask {r['mask_median_ms']:.4f} ms, "
              f"ratio {r['mask_over_nomask']:.3f}, diff {r['max_abs_diff']:.2e}, first {r['first_call_mask_s']:.1f} s, "
              f"{r['route_mask'][:60]}", flush=True)
        save()
    if args.row14:
        result["row14"] = row14(rows[14])
        print("row 14:", json.dumps(result["row14"]), flush=True)
        save()


if __name__ == "__main__":
    main()
