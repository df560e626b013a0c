"""Why official row 6 runs slower without a mask than with an all-True one (session 5, 15.5 against 12.5 ms).

Usage (CUDA machine): python -m experiments.h200_row6_attention
Times our attention kernel alone on row 6's shape ([10000, 128, 4, 32] fp16 views of a packed QKV, causal):
no mask, and an all-True mask with its prefix summary; prints the configuration the autotuner chose for each and
the time of every candidate configuration forced by hand.
"""
import statistics

import torch

from shapewise.kernels.attention import _attention_fwd_tuned, _configs, flash_attention
from shapewise.kernels.mask import prefix_lengths


def ms(fn, n=20):
    fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(n):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        out.append(s.elapsed_time(e))
    return statistics.median(out)


B, S, H, D = 10000, 128, 4, 32
qkv = torch.randn(B, S, 3, H, D, device="cuda", dtype=torch.float16)
q, k, v = qkv.unbind(2)
mask = torch.ones(B, S, dtype=torch.bool, device="cuda")
plen = prefix_lengths(mask)
calls = {"nomask": lambda cfg=None: flash_attention(q, k, v, causal=True, config=cfg),
         "mask": lambda cfg=None: flash_attention(q, k, v, causal=True, key_mask=mask, mask_prefix_lengths=plen,
                                                  config=cfg)}
for name, fn in calls.items():
    print(f"{name}: autotuned {ms(fn):.3f} ms", flush=True)
print("autotuner choices:", {str(key): str(cfg) for key, cfg in _attention_fwd_tuned.cache.items()}, flush=True)
for c in _configs():
    cfg = {**c.kwargs, "num_warps": c.num_warps, "num_stages": c.num_stages}
    if cfg["BLOCK_M"] > 128 or cfg["BLOCK_N"] > 128:
        continue
    times = {name: ms(lambda: fn(cfg)) for name, fn in calls.items()}
    print(cfg, {k: round(t, 3) for k, t in times.items()}, flush=True)
