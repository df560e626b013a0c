"""Where the official call's all-True mask costs time, kernel by kernel (issue #12 item 2).

Usage (CUDA machine): python -m experiments.h200_mask_parts OUT.json [--rows 1,5,10,13,6,8,7,12]
       [--cap-ab] [--own-loop] [--fused-switches]

experiments/h200/session9/mask-after.json measured model(x, all-True mask) 2-5 % slower than model(x) on rows 1, 5,
6 and 8 (rows 1-13 on the routes of cba9ddd). Per row, each kernel the mask touches, timed as a CUDA graph of 10
launches (experiments.h200_probe.graph_ms), without and with the mask as the model passes it:
- attention: unmasked; key_mask with its prefix summary (what the model runs); key_lengths = S (the prefix path
  without a mask), and the autotuner's choice for each (Triton's cache of `_attention_fwd_tuned`);
- the mask's prefix summary (`prefix_lengths`, one launch per forward);
- the split layer's tail (rows with d_model <= 128) or the unfused route's add+LayerNorm with its row mask (row 8);
- rows the policy runs fused (7, 12, session 10): one fused layer at the policy's launch, without and with the mask
  (session 11: the mask's summary computed in the kernel, also written as layer 0 does, and given as the later layers
  read it: `fused_mask`, `fused_mask_summary_written`, `fused_mask_summary_given`);
- --cap-ab (session 11): on rows whose head_dim has a MASKED_MAX_REGISTERS entry for the 64x64 tile, that tile fixed
  (no autotuning) without a mask and with the mask under the register cap never, as the launcher decides (at
  a5dfab5 from the grid: `cap_by_grid`; since, always: `cap_launcher`), and always (`attention_tile_*`);
- --own-loop (session 12): attention with the all-True and a left-padded mask, one stage-2 loop for both kinds of
  mask against a loop of its own for a mask that is no prefix (`attention_mask_{prefix,left}_{one,own}_loop`);
- --fused-switches (session 12, fused rows): the layer with its summary written and given (`fused_mask_summary_*`,
  the committed switches) and with ROW_MASK_BRANCH off and on (`*_off_row_mask_branch`, `*_row_mask_branch`; on
  since session 13), then the unmasked layer timed again last (`fused_unmasked_again`: the drift). Flags for
  switches measured slower and removed (their A/B the same way): --full-branch (session 13's
  FULL_MASK_BRANCH_MAX_D_MODEL) and --defer-summary (DEFER_SUMMARY), run at 7c15e89
  (experiments/h200/session14/call1/mask-parts.json); --key-mask-branch (KEY_MASK_BRANCH, the keys' mask
  predicated off for a prefix), run at 7b9ff0b (experiments/h200/session15/call1/mask-parts.json:
  `*_off_key_mask_predicated` the committed branch); --unmasked-first (UNMASKED_FIRST_MAX_D_MODEL), run at
  8aa2a3b (session14/call2/); session 12's call 7 ran --fused-switches at 94b1010, when ROW_MASK_BRANCH was off and
  `fused_mask_summary_*` was its off setting, with a switch SUMMARY_ONE_REDUCTION (`*_one_reduction`, `*_both`),
  removed after it measured no better.
OUT.json is written after every row.
"""
from __future__ import annotations

import argparse
import json

import torch
from shapewise.kernels import attention as attention_module
from shapewise.kernels import fused_layer as fused_module
from shapewise.kernels.attention import flash_attention
from shapewise.kernels.fused_layer import MAX_D_MODEL, fused_layer, ln_qkv
from shapewise.kernels.layer_tail import layer_tail
from shapewise.kernels.layernorm import add_layernorm
from shapewise.kernels.mask import prefix_lengths
from shapewise.model.routing import Shape, select_route

from experiments.h200_probe import graph_ms
from experiments.h200_sweep import shape_of, weights


def tuned_configs():
    """The attention autotuner's choice per key so far: {key: config}."""
    cache = getattr(attention_module._attention_fwd_tuned, "cache", {})
    return {str(k): str(v) for k, v in cache.items()}


def switched(module, fn, **attrs):
    """fn run with `module`'s attributes set to `attrs` (a launcher rule or a kernel switch), restored after."""
    def call():
        before = {k: getattr(module, k) for k in attrs}
        for k, v in attrs.items():
            setattr(module, k, v)
        try:
            return fn()
        finally:
            for k, v in before.items():
                setattr(module, k, v)
    return call


def cap_ab_runs(q, k, v, mask, prefix):
    """The 64x64 tile with the masked kernel's register cap never, as the launcher decides, always; {} without one."""
    D = q.shape[-1]
    block_d = max(16, 1 << (D - 1).bit_length())
    key = next((key for key in attention_module.MASKED_MAX_REGISTERS if key[:3] == (64, 64, block_d)), None)
    if key is None:
        return {}
    cfg = {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": key[3], "num_stages": key[4]}
    launcher = attention_module.masked_register_cap
    cap = attention_module.MASKED_MAX_REGISTERS[key][0]

    def masked(rule):
        return switched(attention_module, lambda: flash_attention(q, k, v, causal=True, key_mask=mask,
                                                                  mask_prefix_lengths=prefix, config=cfg),
                        masked_register_cap=rule)

    return {"attention_tile_unmasked": lambda: flash_attention(q, k, v, causal=True, config=cfg),
            "attention_tile_mask_cap_never": masked(lambda *a: None),
            "attention_tile_mask_cap_launcher": masked(launcher),
            "attention_tile_mask_cap_always": masked(lambda *a: cap)}


def own_loop_runs(q, k, v, mask, prefix):
    """Session 12: the mask's own stage-2 loop (attention.MASK_OWN_LOOP_MAX_BLOCK_D 64) against one loop, on the
    all-True mask and on a left-padded one (a tenth of each row invalid: no prefix, the loop the switch moves)."""
    B, S = mask.shape
    left = torch.arange(S, device=mask.device)[None, :].expand(B, S) >= S // 10
    left_prefix = prefix_lengths(left)

    def run(m, p, bound):
        return switched(attention_module, lambda: flash_attention(q, k, v, causal=True, key_mask=m,
                                                                  mask_prefix_lengths=p),
                        MASK_OWN_LOOP_MAX_BLOCK_D=bound)

    return {"attention_mask_prefix_one_loop": run(mask, prefix, None),
            "attention_mask_prefix_own_loop": run(mask, prefix, 64),
            "attention_mask_left_one_loop": run(left, left_prefix, None),
            "attention_mask_left_own_loop": run(left, left_prefix, 64)}


def row_parts(row, cap_ab=False, own_loop=False, fused_switches=False):
    B, S, d, H, ffn = shape_of(row)
    D = d // H
    reps = 5 if B * S > 10**6 else 30
    g = torch.Generator("cuda").manual_seed(row)
    x = torch.randn(B, S, d, device="cuda", generator=g)
    mask = torch.ones(B, S, dtype=torch.bool, device="cuda")
    prefix = prefix_lengths(mask)
    lengths = torch.full((B,), S, dtype=torch.int32, device="cuda")
    q, k, v = (torch.randn(B, S, H, D, device="cuda", generator=g).half() for _ in range(3))
    rec = {"row": row, "shape": [B, S, d, H, ffn]}
    runs = {
        "attention_unmasked": lambda: flash_attention(q, k, v, causal=True),
        "attention_mask_prefix": lambda: flash_attention(q, k, v, causal=True, key_mask=mask,
                                                         mask_prefix_lengths=prefix),
        "attention_key_lengths": lambda: flash_attention(q, k, v, causal=True, key_lengths=lengths),
        "prefix_lengths": lambda: prefix_lengths(mask),
    }
    route = select_route(Shape(B, S, d, H, ffn, 4, True), torch.float32, torch.device("cuda"), "general")
    rec["route"] = str(route)
    if route.name == "fused":
        w, _ = weights(d, ffn, "cuda")
        block_m, warps, stages = route.launch
        launch = dict(num_heads=H, causal=True, block_m=block_m, num_warps=warps, num_stages=stages,
                      kv_precompute=route.kv_precompute)
        runs["fused_unmasked"] = lambda: fused_layer(x, w, **launch)
        runs["fused_mask"] = lambda: fused_layer(x, w, mask=mask, **launch)
        written = torch.empty(B, dtype=torch.int32, device="cuda")
        runs["fused_mask_summary_written"] = lambda: fused_layer(x, w, mask=mask, prefix_out=written, **launch)
        runs["fused_mask_summary_given"] = lambda: fused_layer(x, w, mask=mask, mask_prefix_lengths=prefix, **launch)
        # the summary layers under a switch off and on (each against the committed default of the others)
        ab = []
        if fused_switches:  # session 12: the output rows' mask read in a branch
            ab.append(("_row_mask_branch", "ROW_MASK_BRANCH", False, True))
        for name in ("fused_mask_summary_written", "fused_mask_summary_given") if ab else ():
            default = runs[name]
            for suffix, attr, off, on in ab:
                runs[name + suffix.replace("_", "_off_", 1)] = switched(fused_module, default, **{attr: off})
                runs[name + suffix] = switched(fused_module, default, **{attr: on})
        if ab:
            runs["fused_unmasked_again"] = runs["fused_unmasked"]
    elif d <= MAX_D_MODEL:
        w, _ = weights(d, ffn, "cuda")
        o = ln_qkv(x, w)[..., :d].contiguous()
        runs["tail_unmasked"] = lambda: layer_tail(o, x, w)
        runs["tail_mask"] = lambda: layer_tail(o, x, w, mask=mask)
    else:
        branch = torch.randn(B, S, d, device="cuda", generator=g).half()
        nw, nb = torch.ones(d, device="cuda"), torch.zeros(d, device="cuda")
        runs["add_ln_unmasked"] = lambda: add_layernorm(x, branch, nw, nb, out_dtype=torch.float16)
        runs["add_ln_row_mask"] = lambda: add_layernorm(x, branch, nw, nb, out_dtype=torch.float16, row_mask=mask)
    if cap_ab:
        runs.update(cap_ab_runs(q, k, v, mask, prefix))
    if own_loop:
        runs.update(own_loop_runs(q, k, v, mask, prefix))
    for name, fn in runs.items():
        rec[name + "_us"] = graph_ms(fn, reps) * 1000
        print(row, name, round(rec[name + "_us"], 2), flush=True)
    rec["attention_configs"] = tuned_configs()
    return rec


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--rows", default="1,5,10,13,6,8,7,12")
    ap.add_argument("--cap-ab", action="store_true", help="the 64x64 tile with the register cap never/by grid/always")
    ap.add_argument("--own-loop", action="store_true", help="the mask's own stage-2 loop against one loop")
    ap.add_argument("--fused-switches", action="store_true", help="fused rows: session 12's summary switches")
    args = ap.parse_args()
    out = {"device": torch.cuda.get_device_name(), "sm_count": torch.cuda.get_device_properties(0).multi_processor_count,
           "masked_max_registers": {str(k): v for k, v in attention_module.MASKED_MAX_REGISTERS.items()},
           "rows": []}
    with torch.inference_mode():
        for row in (int(r) for r in args.rows.split(",")):
            out["rows"].append(row_parts(row, args.cap_ab, args.own_loop, args.fused_switches))
            with open(args.out, "w") as f:
                json.dump(out, f, indent=1)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
