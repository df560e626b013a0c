"""The Hopper forward kernel alone on the official rows it serves: accuracy and GPU time per call of each variant,
beside the optimized model as routed without it.

Usage (sm_90 GPU): python -m benchmarks.hopper_forward [OUT.json] [--rows 1,5,6,...] [--reps 100]
    [--variants duo=True overlap=True] [--unmasked] [--kernel-only]

Per official row, on the pipeline's weights and first-trial inputs (the official call's all-True mask): the
reference in fp32 (TF32 off); then `hopper_forward` in each of VARIANTS (`overlap`: a head's q, k, v projections
issued back to back before one wait, or each waited for alone; `producer`: a loader warp fills the weight ring;
`pair`: two 4-warp programs a sequence, on causal rows of 65 to 128 tokens only, on one `pair_scratch` allocated
outside the timed calls; both; `duo`: the two halves as two warpgroups of one program, where the kernel serves
it): its output against the reference at the official and strict tolerances, and its median GPU time per call
(a CUDA graph of 10 launches replayed `reps` times, each replay between its own pair of CUDA events, divided by 10);
with `--unmasked` also its time without a mask (the `model(x)` call) and the mask's cost, the ratio less 1.
Then (unless `--kernel-only`) the model called as the official harness calls it, with route `hopper` forced and as routed with the
hopper_forward switch off: the median of `reps` calls, each between its own pair of CUDA events (the timing job's
timer), the two alternating over 3 rounds.
OUT.json is written after every row.
"""
from __future__ import annotations

import json

import torch

from benchmarks.common import (accuracy, alternating_rounds, device_name, graph_ms, kernel_weights, official, parser,
                               pooled_median, reference_output, row_numbers, setup, write_json)
from shapewise.jobs.device import time_calls
from shapewise.kernels import hopper_forward as hf
from shapewise.model import UserOptimizedTransformer
from shapewise.model.reference import LAYER_NORM_EPS
from shapewise.model.weights import layer_weights, per_layer

ROWS = "1,5,6,2,9,10,12,11,7,3,4"
# the kernel's variants timed alone: hopper_forward's keyword arguments (the route runs its defaults)
VARIANTS = {"overlap=True": {"overlap": True}, "overlap=False": {"overlap": False}, "producer=True": {"producer": True},
            "pair=True": {"pair": True}, "pair=True,producer=True": {"pair": True, "producer": True},
            "duo=True": {"duo": True}}


def row_result(shape_row, reps, variants=VARIANTS, unmasked=False, kernel_only=False):
    cfg, ref, model, x, mask = setup(shape_row, torch.device("cuda"), disable=("hopper_forward",))
    want = reference_output(ref, x, mask)
    del ref
    out = {"row": shape_row["id"], "launch": hf.launch_config(cfg.seq_len, cfg.d_model, cfg.num_heads, cfg.ffn_dim)}
    w = per_layer(model, torch.float32)
    packed = hf.pack_weights([layer_weights(w, i) for i in range(cfg.num_layers)], (w["final_w"], w["final_b"]),
                             cfg.num_heads)
    desc = hf.weight_descriptor(packed["stream"], out["launch"]["HD"])
    y = torch.empty_like(x)
    with torch.inference_mode():
        for name, variant in variants.items():
            if variant.get("pair") or variant.get("duo"):
                why = hf.why_unsupported(cfg.seq_len, cfg.d_model, cfg.num_heads, cfg.ffn_dim, causal=cfg.causal,
                                         pair=bool(variant.get("pair")), duo=bool(variant.get("duo")))
                if why:
                    out[name] = {"skipped": why}
                    continue
            if variant.get("pair"):
                variant = {**variant, "scratch": hf.pair_scratch(cfg.batch_size, cfg.num_layers, cfg.num_heads,
                                                                 out["launch"]["HD"], x.device)}

            def fn(variant=variant, mask=mask):
                hf.hopper_forward(x, packed, num_heads=cfg.num_heads, causal=cfg.causal, mask=mask, out=y,
                                  desc=desc, eps=LAYER_NORM_EPS, **variant)

            fn()
            out[name] = {"accuracy": accuracy(want, y), "gpu_ms": graph_ms(fn, reps)}
            if unmasked:
                out[name]["unmasked_gpu_ms"] = graph_ms(lambda variant=variant: fn(variant, None), reps)
                out[name]["mask_cost"] = out[name]["gpu_ms"] / out[name]["unmasked_gpu_ms"] - 1
        if kernel_only:
            return out
        hopper = UserOptimizedTransformer(cfg, route="hopper")
        hopper.load_state_dict(model.state_dict(), strict=True)
        hopper = hopper.to(x.device).eval()
        out["model_hopper_accuracy"] = accuracy(want, hopper(x, mask))
        calls = {"model_hopper": lambda: hopper(x, mask), "model_routed_without": lambda: model(x, mask)}
        for fn in calls.values():
            time_calls(fn, x.device, 20)
        times = alternating_rounds(calls, x.device, 3, reps)
        for name, rounds in times.items():
            out[name] = {"median_ms": pooled_median(rounds)}
        out["model_routed_without"]["route"] = str(model.last_route)
    return out


def seeded_weights(d, ffn, num_heads, num_layers):
    """`pack_weights` of `num_layers` copies of one seeded layer (benchmarks.common.kernel_weights; the final norm
    its LayerNorm 1): for timing the kernel, whose time does not depend on the values."""
    layer = kernel_weights(d, ffn, "cuda")[1]
    return hf.pack_weights([layer] * num_layers, (layer["n1_w"], layer["n1_b"]), num_heads)


def sweep(batches, layers, reps):
    """GPU time per call of the kernel alone at official row 1's width (d 128, 4 heads, ffn 128, S 128, all-True
    mask) for each batch size and layer count: how its time grows with the sequences per program and the layers."""
    d, H = 128, 4
    gen = torch.Generator().manual_seed(0)
    out = []
    for L in layers:
        packed = seeded_weights(d, d, H, L)
        for B in batches:
            x = torch.randn(B, 128, d, generator=gen).cuda()
            mask = torch.ones(B, 128, dtype=torch.bool).cuda()
            ms = graph_ms(lambda: hf.hopper_forward(x, packed, num_heads=H, causal=True, eps=LAYER_NORM_EPS, mask=mask),
                          reps)
            waves = -(-B // torch.cuda.get_device_properties(0).multi_processor_count)
            out.append({"layers": L, "batch": B, "gpu_ms": ms, "us_per_wave_and_layer": ms * 1e3 / waves / L})
            print(json.dumps(out[-1]), flush=True)
    return out


def main():
    p = parser(__doc__, "hopper-forward.json")
    p.add_argument("--rows", default=ROWS, help="official rows, in the order run")
    p.add_argument("--reps", type=int, default=100)
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), help="VARIANTS' names")
    p.add_argument("--unmasked", action="store_true", help="each variant also without a mask: the mask's cost")
    p.add_argument("--kernel-only", action="store_true", help="the kernel alone, not the model as routed")
    p.add_argument("--sweep", default=None, help="BATCHES/LAYERS, e.g. 1,132,1320/1,4: the kernel alone at row "
                                                 "1's width instead of the rows")
    a = p.parse_args()
    torch.set_float32_matmul_precision("high")
    if a.sweep:
        batches, layers = ([int(v) for v in part.split(",")] for part in a.sweep.split("/"))
        write_json(a.out, {"device": device_name("cuda"), "torch": torch.__version__,
                           "sweep": sweep(batches, layers, a.reps)})
        return 0
    names = a.variants
    unknown = sorted(set(names) - set(VARIANTS))
    if unknown:
        p.error(f"--variants: unknown {unknown}; known: {list(VARIANTS)}")
    results = []
    for n in row_numbers(a.rows):
        try:
            rec = row_result(official(n), a.reps, {v: VARIANTS[v] for v in names}, a.unmasked, a.kernel_only)
        except Exception as e:  # one row's failure is a result too; the next rows still run
            rec = {"row": f"official-{n:02d}", "error": f"{type(e).__name__}: {str(e)[:300]}"}
        results.append(rec)
        brief = {k: v.get("gpu_ms", v.get("median_ms")) if isinstance(v, dict) and ("gpu_ms" in v or "median_ms" in v)
                 else v for k, v in rec.items() if k not in ("launch",) and "accuracy" not in k}
        brief["failed"] = [v["accuracy"]["official"]["failed_elements"] for v in rec.values()
                           if isinstance(v, dict) and "accuracy" in v]
        print(json.dumps(brief), flush=True)
        write_json(a.out, {"device": device_name("cuda"), "torch": torch.__version__, "rows": results})
        torch.cuda.empty_cache()
    return 1 if any("error" in r for r in results) else 0


if __name__ == "__main__":
    raise SystemExit(main())
