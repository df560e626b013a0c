"""The split layer's three kernels timed one by one, and the launch configurations of ln_qkv and the layer tail.

Usage (CUDA machine): python -m benchmarks.split_parts [OUT.json] [--rows 6,13,10] [--tail BM/FB/WARPS/STAGES,...]
       [--ln BLOCK_T/COL_BLOCKS/WARPS,...] [--programs 0,66]

Per official row: one layer's `ln_qkv` under each launch of LN_CONFIGS (0 or None: the launcher's default), then
`ln_qkv`, `flash_attention` (with the all-True mask and without) at their default launches, the attention with
one (batch, head) pair a group of its launch order against `attention.L2_GROUP_BYTES`, and `layer_tail`
under each configuration of TAIL_CONFIGS, each timed as a CUDA graph of 10 launches (replay time / 10, median),
with the bytes it moves and its GB/s; each tail configuration's max abs error against the tail's fp64 reference on
the first 64 sequences. On sm_90 also the Hopper LayerNorm + QKV (`kernels/ln_qkv_hopper.py`) and the Hopper tail
(`kernels/layer_tail_hopper.py`), each at its default launch and, with `--programs`, other persistent grids: its
time, and its largest difference from the Triton kernel's output (the tail's error against fp64 too). The bytes per
layer (x in fp32 read twice and written once, q/k/v in fp16 written and read, the attention output written and read)
set the layer's floor at the copy bandwidth. OUT.json is written after every record.
"""
from __future__ import annotations

import torch
from shapewise.kernels import attention
from shapewise.kernels.attention import flash_attention
from shapewise.kernels.fused_layer import ln_qkv
from shapewise.kernels import layer_tail_hopper as th
from shapewise.kernels import ln_qkv_hopper as qh
from shapewise.kernels.layer_tail import layer_tail, layer_tail_reference
from shapewise.model.reference import LAYER_NORM_EPS

from benchmarks.common import device_name, graph_ms, kernel_weights, parser, row_numbers, shape_of, write_json

# (block_m, ffn_block, num_warps, num_stages); the first is the launcher's default (block_m None: by token count)
TAIL_CONFIGS = [(None, 32, 4, 3), (32, 32, 8, 2), (64, 32, 8, 2), (64, 64, 8, 2), (128, 32, 8, 2), (64, 32, 4, 2),
                (16, 32, 4, 2), (32, 128, 8, 2), (64, 128, 8, 1)]


# ln_qkv launches (block_t, col_blocks, num_warps); None: the launcher's default (kernels/fused_layer.py)
LN_CONFIGS = [(None, None, 4), (64, 1, 4), (64, 3, 4), (64, 6, 4), (32, 1, 4), (32, 3, 4), (32, 6, 4), (16, 6, 4),
              (16, 3, 4), (64, 6, 2)]


def parts(row, tail_configs, out, save, ln_configs=LN_CONFIGS, programs=(None,)):
    B, S, d, H, ffn = shape_of(row)
    w, wref = kernel_weights(d, ffn, "cuda")
    x = torch.randn(B, S, d, device="cuda", generator=torch.Generator("cuda").manual_seed(row))
    mask = torch.ones(B, S, dtype=torch.bool, device="cuda")
    reps = 5 if B * S > 10**6 else 30
    N = B * S
    qkv = ln_qkv(x, w, eps=LAYER_NORM_EPS)
    q, k, v = qkv.view(B, S, 3, H, d // H).unbind(2)
    o = flash_attention(q, k, v, causal=True, key_mask=mask).reshape(B, S, d).contiguous()
    rec = {"row": row, "shape": [B, S, d, H, ffn], "ln_qkv_launches": []}
    for block_t, col_blocks, warps in ln_configs:
        t = {"block_t": block_t, "col_blocks": col_blocks, "num_warps": warps}
        try:
            run = dict(eps=LAYER_NORM_EPS, block_t=block_t, col_blocks=col_blocks, num_warps=warps)
            t["max_abs_diff_to_default"] = (ln_qkv(x, w, **run).float() - qkv.float()).abs().max().item()
            t["ms"] = graph_ms(lambda: ln_qkv(x, w, **run), reps)
            t["GB_per_s"] = (N * d * 4 + N * 3 * d * 2) / t["ms"] / 1e6
        except Exception as e:  # a configuration that does not compile is a result too
            t["error"] = f"{type(e).__name__}: {str(e)[:200]}"
        rec["ln_qkv_launches"].append(t)
        print(row, "ln_qkv", t, flush=True)
    for name, fn, nbytes in (
            ("ln_qkv", lambda: ln_qkv(x, w, eps=LAYER_NORM_EPS), N * d * 4 + N * 3 * d * 2),
            ("attention", lambda: flash_attention(q, k, v, causal=True, key_mask=mask), N * 4 * d * 2),
            ("attention_unmasked", lambda: flash_attention(q, k, v, causal=True), N * 4 * d * 2)):
        ms = graph_ms(fn, reps)
        rec[name] = {"ms": ms, "bytes": nbytes, "GB_per_s": nbytes / ms / 1e6}
        print(row, name, rec[name], flush=True)
    # the attention's launch order: one (batch, head) pair a group against kernels.attention.L2_GROUP_BYTES, in
    # alternation, each output against the default launch's bit for bit
    default_bytes = attention.L2_GROUP_BYTES
    want_o = flash_attention(q, k, v, causal=True, key_mask=mask)
    rec["attention_order"] = []
    try:
        for budget in (0, default_bytes, 0, default_bytes):
            attention.L2_GROUP_BYTES = budget
            t = {"l2_group_bytes": budget, "pairs_per_group": attention.pairs_per_group(B * H, S, d // H, 2, True),
                 "bitwise_equal": torch.equal(flash_attention(q, k, v, causal=True, key_mask=mask), want_o),
                 "ms": graph_ms(lambda: flash_attention(q, k, v, causal=True, key_mask=mask), reps)}
            rec["attention_order"].append(t)
            print(row, "attention_order", t, flush=True)
    finally:
        attention.L2_GROUP_BYTES = default_bytes
    rec["tail"] = []
    sample = slice(0, min(B, 64))
    want = layer_tail_reference(o[sample], x[sample], wref, eps=LAYER_NORM_EPS, mask=mask[sample])
    tail_bytes = N * d * (2 + 4 + 4)
    for bm, fb, warps, stages in tail_configs:
        t = {"block_m": bm, "ffn_block": fb, "num_warps": warps, "num_stages": stages}
        try:
            run = dict(eps=LAYER_NORM_EPS, mask=mask, block_m=bm, ffn_block=fb, num_warps=warps, num_stages=stages)
            got = layer_tail(o, x, w, **run)
            t["max_abs_error"] = (got[sample].double() - want).abs().max().item()
            t["ms"] = graph_ms(lambda: layer_tail(o, x, w, **run), reps)
            t["GB_per_s"] = tail_bytes / t["ms"] / 1e6
        except Exception as e:  # a configuration that does not compile is a result too
            t["error"] = f"{type(e).__name__}: {str(e)[:200]}"
        rec["tail"].append(t)
        print(row, "tail", t, flush=True)
        save()
    if qh.why_unsupported(d, x.device) is None:
        rec["hopper_ln_qkv"] = []
        for n in programs:  # None: one program per SM
            t = {"num_programs": n}
            run = dict(eps=LAYER_NORM_EPS, num_programs=n)
            t["max_abs_diff_to_ln_qkv"] = (qh.ln_qkv_hopper(x, w, **run).float() - qkv.float()).abs().max().item()
            t["ms"] = graph_ms(lambda: qh.ln_qkv_hopper(x, w, **run), reps)
            t["GB_per_s"] = (N * d * 4 + N * 3 * d * 2) / t["ms"] / 1e6
            rec["hopper_ln_qkv"].append(t)
            print(row, "hopper_ln_qkv", t, flush=True)
            save()
    if th.why_unsupported(d, ffn, x.device) is None:
        rec["hopper_tail"] = []
        triton_tail = layer_tail(o, x, w, eps=LAYER_NORM_EPS, mask=mask)
        vecs = th.tail_vectors(w)
        for n in programs:  # None: one program per SM
            t = {"num_programs": n}
            run = dict(eps=LAYER_NORM_EPS, mask=mask, vecs=vecs, num_programs=n)
            got = th.layer_tail_hopper(o, x, w, **run)
            t["max_abs_error"] = (got[sample].double() - want).abs().max().item()
            t["max_abs_diff_to_triton_tail"] = (got - triton_tail).abs().max().item()
            t["ms"] = graph_ms(lambda: th.layer_tail_hopper(o, x, w, **run), reps)
            t["GB_per_s"] = tail_bytes / t["ms"] / 1e6
            rec["hopper_tail"].append(t)
            print(row, "hopper_tail", t, flush=True)
            save()
    out["rows"].append(rec)
    save()


def main():
    ap = parser(__doc__, "split-parts.json")
    ap.add_argument("--rows", default="6,13,10")
    ap.add_argument("--tail", help="tail configurations instead of TAIL_CONFIGS: bm/fb/warps/stages,... "
                    "(bm 0: the default)")
    ap.add_argument("--ln", help="ln_qkv launches instead of LN_CONFIGS: block_t/col_blocks/warps,... (0: default)")
    ap.add_argument("--programs", default="0", help="the Hopper tail's persistent grids, comma separated (0: one "
                    "program per SM)")
    args = ap.parse_args()
    configs = ([tuple(int(v) or (None if i == 0 else 0) for i, v in enumerate(c.split("/")))
                for c in args.tail.split(",")] if args.tail else TAIL_CONFIGS)
    ln_configs = ([tuple(int(v) or None for v in c.split("/")) for c in args.ln.split(",")] if args.ln
                  else LN_CONFIGS)
    out = {"device": device_name("cuda"), "tail_configs": configs, "ln_configs": ln_configs, "rows": []}

    def save():
        write_json(args.out, out)

    with torch.inference_mode():
        for row in row_numbers(args.rows):
            parts(row, configs, out, save, ln_configs, [int(n) or None for n in args.programs.split(",")])


if __name__ == "__main__":
    main()
