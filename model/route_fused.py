"""Route `fused`: one Triton kernel per layer (kernels/fused_layer.py), the mask summarized by layer 0 on the side."""
from __future__ import annotations

from dataclasses import replace

import torch

from ..kernels import OPERAND_DTYPES
from .config import parameter_count
from .reference import LAYER_NORM_EPS
from .route import RouteUnavailable
from .weights import layer_weights, per_layer


class FusedForward:
    uses_weights = True

    def __init__(self, model, route):
        from shapewise.kernels.fused_layer import fused_layer  # deferred: triton loads when the route runs

        self.fused_layer = fused_layer
        self.route = route
        w = model._weights.table(model, route.precision, per_layer)
        self.layers = [layer_weights(w, i) for i in range(model.config.num_layers)]
        self.final = (w["final_w"], w["final_b"])
        block_m, num_warps, num_stages = route.launch
        self.launch = dict(eps=LAYER_NORM_EPS, block_m=block_m, num_warps=num_warps, num_stages=num_stages,
                           kv_precompute=route.kv_precompute, key_block=route.key_block or None,
                           ffn_block=route.ffn_block or None)

    @torch.no_grad()
    def __call__(self, model, x, mask):
        if x.stride(-1) != 1:  # a view sliced along d_model: the kernel reads rows with unit stride
            x = x.contiguous()
        cfg = model.config
        # With a mask, layer 0 summarizes it (prefix length or -1 per sequence) on the side and the later layers read
        # that one value instead of the mask, which costs them no mask reads (docs/decisions.md#fused-mask-summary).
        prefix = torch.empty(x.shape[0], dtype=torch.int32, device=x.device) if mask is not None else None
        res = x
        for i, wi in enumerate(self.layers):
            last = i == cfg.num_layers - 1
            summary = {} if mask is None else {"prefix_out": prefix} if i == 0 else {"mask_prefix_lengths": prefix}
            res = self.fused_layer(res, wi, num_heads=cfg.num_heads, causal=cfg.causal, mask=mask,
                                   final=self.final if last else None, out_dtype=x.dtype, **self.launch, **summary,
                                   pdl=self.route.pdl and i > 0)  # every layer's kernels but the first layer's
        return res


def runner(model, route):
    return FusedForward(model, route)


def why_unsupported(shape) -> str | None:
    from shapewise.kernels.fused_layer import why_unsupported  # deferred: triton loads when the route is asked

    return why_unsupported(shape.seq_len, shape.d_model, shape.num_heads)


def settle(route, x, disabled):
    """Fused layers need their switch and fp16/bf16 operands: a forced route without them is refused, an automatic
    one runs as graph (CUDA) or triton instead."""
    if "fused_layer" in disabled:  # select_route picks fused unasked only with the switch on
        raise RouteUnavailable("route 'fused' was forced, but the fused_layer optimization is disabled")
    if route.precision not in ("fp16", "bf16"):
        if route.forced:
            raise RouteUnavailable(f"route 'fused' needs fp16 or bf16 operands, not {route.precision}")
        route = replace(route, name="graph" if x.is_cuda else "triton", launch=(), kv_precompute=False,
                        key_block=0, ffn_block=0,
                        reason=route.reason + f"; fused layers need fp16/bf16 operands, not {route.precision}")
    return route


def switches(route) -> set:
    return {"fused_layer"}


def working_set(config, dtype, route) -> int:
    """Per token e * 2d (the layer's input and output residual), + a * 2d with precomputed keys/values, e the input
    dtype's bytes and a the operands'; plus the weight copies in operand precision."""
    e, a, d = dtype.itemsize, OPERAND_DTYPES[route.precision].itemsize, config.d_model
    acts = config.tokens * (2 * d * e + (2 * d * a if route.kv_precompute else 0))
    return acts + parameter_count(d, config.ffn_dim, config.num_layers) * a
