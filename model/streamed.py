"""A forward whose working set does not fit (or exceeds memory.CHUNK_WORKSPACE_BYTES) streams batch chunks: the plan
(model/memory.py decides, from each chunk's route) and the chunked forward."""
from __future__ import annotations

from dataclasses import replace

import torch

from .config import TransformerConfig
from .memory import io_bytes, plan_chunks, working_set_bytes
from .routing import route_module


def plan(model, x, mask, budget, source, resident_input):
    """memory.plan_chunks for a forward of `x` (and `mask`) on `model`, each pass on the route its size takes."""
    cfg = model.config
    B, S = x.shape[0], x.shape[1]

    def working_set(b):
        route = model._select(x[:b], None if mask is None else mask[:b])
        shape = TransformerConfig(b, S, cfg.d_model, cfg.num_heads, cfg.ffn_dim, cfg.num_layers, cfg.causal)
        return working_set_bytes(shape, x.dtype, route, sdpa_mask=sdpa_may_get_mask(route, mask, model.disabled),
                                 captured=model._captured(route, x)), str(route)

    inp, out = io_bytes(TransformerConfig(B, S, cfg.d_model, cfg.num_heads, cfg.ffn_dim, cfg.num_layers, cfg.causal),
                        x.dtype)
    return plan_chunks((B, S, cfg.d_model), x.dtype, inp, out, working_set, budget, source, resident_input)


def sdpa_may_get_mask(route, mask, disabled) -> bool:
    """Whether a forward on this route may hand the mask to SDPA (which then builds a dense mask): its module says.
    A plan reads no mask contents, so it takes the worst case."""
    gets = getattr(route_module(route.name), "sdpa_gets_mask", None)
    return mask is not None and gets is not None and gets(route, disabled)


def forward_streamed(model, x, mask, plan):
    """The batch in `plan.chunks()`, each through the route its own shape takes, into one output."""
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    routes = []
    model._streaming = True  # each chunk runs as planned, never planned again
    # one host read of the mask per call: a chunk's route reads this instead of synchronizing on its slice
    model._chunks_all_valid = mask is not None and bool(mask.all())
    try:
        with torch.no_grad():
            for start, stop in plan.chunks():
                out[start:stop].copy_(model.forward(x[start:stop], None if mask is None else mask[start:stop]))
                if not routes or routes[-1][1] != model.last_route:
                    routes.append((stop - start, model.last_route))
    finally:
        model._streaming = False
        model._chunks_all_valid = False
    first = routes[0][1]
    other = "".join(f"; chunks of {b}: {r}" for b, r in routes[1:])
    model.last_route = replace(first, reason=f"{first.reason}; {plan.reason}{other}")
    return out
