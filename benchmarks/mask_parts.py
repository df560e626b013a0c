"""Where the official call's all-True mask costs time, kernel by kernel: each kernel it reaches, without and with it.

Usage (CUDA machine): python -m benchmarks.mask_parts [OUT.json] [--rows 1,5,10,13,6,8,7,12]
       [--setting fused_layer.NAME=VALUE[,...]] ...

Per official row, each kernel timed as a CUDA graph of 10 launches (no host launch cost), in µs per launch:
- attention: unmasked (`attention_unmasked`); the all-True mask with its prefix summary, what the model runs
  (`attention_mask_prefix`); key lengths equal to S, the prefix path without a mask (`attention_key_lengths`);
- the mask's summary alone (`prefix_lengths`, one launch per forward where no other kernel writes it);
- on rows the routing policy runs fused: one fused layer at the policy's launch, unmasked, with the mask, with the
  summary written (as layer 0 runs it) and given (as layers 1 and later run it);
- on other rows up to the split layer's d_model the layer tail unmasked and with the mask; above it the unfused
  route's add+LayerNorm without and with its row mask.
The autotuner's choice for each attention key is recorded (`attention_configs`). --setting (repeatable) times
every kernel again while the named constants of shapewise.kernels modules hold the given values (suffix
`@<setting>`). OUT.json is written after every row.
"""
from __future__ import annotations

import torch

from benchmarks.common import (CUDA, applied, device_name, graph_ms, kernel_weights, parse_settings, parser,
                               row_numbers, shape_of, write_json)
from shapewise.kernels import attention as attention_module
from shapewise.kernels.attention import flash_attention
from shapewise.kernels.fused_layer import MAX_D_MODEL, fused_layer, ln_qkv
from shapewise.kernels.layer_tail import layer_tail
from shapewise.kernels.layernorm import add_layernorm
from shapewise.kernels.mask import prefix_lengths
from shapewise.model.reference import LAYER_NORM_EPS
from shapewise.model.config import TransformerConfig
from shapewise.model.routing import select_route


def tuned_configs():
    """The attention autotuner's choice per key so far: {key: config} (empty where the autotuner keeps none)."""
    cache = getattr(attention_module._attention_fwd_tuned, "cache", {})
    return {str(k): str(v) for k, v in cache.items()}


def kernel_runs(number):
    """({name: fn} of the row's kernels with and without the mask, the route the policy picks for the row)."""
    B, S, d, H, ffn = shape_of(number)
    g = torch.Generator("cuda").manual_seed(number)
    x = torch.randn(B, S, d, device="cuda", generator=g)
    mask = torch.ones(B, S, dtype=torch.bool, device="cuda")
    prefix = prefix_lengths(mask)
    lengths = torch.full((B,), S, dtype=torch.int32, device="cuda")
    q, k, v = (torch.randn(B, S, H, d // H, device="cuda", generator=g).half() for _ in range(3))
    runs = {
        "attention_unmasked": lambda: flash_attention(q, k, v, causal=True),
        "attention_mask_prefix": lambda: flash_attention(q, k, v, causal=True, key_mask=mask,
                                                         mask_prefix_lengths=prefix),
        "attention_key_lengths": lambda: flash_attention(q, k, v, causal=True, key_lengths=lengths),
        "prefix_lengths": lambda: prefix_lengths(mask),
    }
    route = select_route(TransformerConfig(B, S, d, H, ffn, 4, True), torch.float32, CUDA, "general")
    w, _ = kernel_weights(d, ffn, "cuda")
    if route.name == "fused":
        block_m, warps, stages = route.launch
        launch = dict(num_heads=H, causal=True, eps=LAYER_NORM_EPS, block_m=block_m, num_warps=warps, num_stages=stages,
                      kv_precompute=route.kv_precompute)
        written = torch.empty(B, dtype=torch.int32, device="cuda")
        runs.update({
            "fused_unmasked": lambda: fused_layer(x, w, **launch),
            "fused_mask": lambda: fused_layer(x, w, mask=mask, **launch),
            "fused_mask_summary_written": lambda: fused_layer(x, w, mask=mask, prefix_out=written, **launch),
            "fused_mask_summary_given": lambda: fused_layer(x, w, mask=mask, mask_prefix_lengths=prefix, **launch),
        })
    elif d <= MAX_D_MODEL:
        o = ln_qkv(x, w, eps=LAYER_NORM_EPS)[..., :d].contiguous()
        runs["tail_unmasked"] = lambda: layer_tail(o, x, w, eps=LAYER_NORM_EPS)
        runs["tail_mask"] = lambda: layer_tail(o, x, w, eps=LAYER_NORM_EPS, mask=mask)
    else:
        branch = torch.randn(B, S, d, device="cuda", generator=g).half()
        nw, nb = torch.ones(d, device="cuda"), torch.zeros(d, device="cuda")
        ln = dict(eps=LAYER_NORM_EPS, out_dtype=torch.float16)
        runs["add_ln_unmasked"] = lambda: add_layernorm(x, branch, nw, nb, **ln)
        runs["add_ln_row_mask"] = lambda: add_layernorm(x, branch, nw, nb, **ln, row_mask=mask)
    return runs, route


def main():
    p = parser(__doc__, "mask-parts.json")
    p.add_argument("--rows", default="1,5,10,13,6,8,7,12", help="official rows")
    p.add_argument("--setting", action="append", default=[], help="MODULE.NAME=VALUE[,...] of shapewise.kernels")
    args = p.parse_args()
    settings = {"": {}, **{f"@{name}": change for name, change in parse_settings(args.setting).items()}}
    out = {"device": device_name(CUDA), "sm_count": torch.cuda.get_device_properties(0).multi_processor_count,
           "rows": []}
    with torch.inference_mode():
        for number in row_numbers(args.rows):
            B, S, d, H, ffn = shape_of(number)
            runs, route = kernel_runs(number)
            rec = {"row": number, "shape": [B, S, d, H, ffn], "route": str(route)}
            reps = 5 if B * S > 10**6 else 30
            for suffix, change in settings.items():
                with applied(change):
                    for name, fn in runs.items():
                        rec[f"{name}_us{suffix}"] = graph_ms(fn, reps) * 1000
                        print(number, name + suffix, round(rec[f"{name}_us{suffix}"], 2), flush=True)
            rec["attention_configs"] = tuned_configs()
            out["rows"].append(rec)
            write_json(args.out, out)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
