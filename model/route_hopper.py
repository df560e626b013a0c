"""Route `hopper`: the whole forward in one Gluon kernel on Hopper (kernels/hopper_forward.py), weights as one
stream of [head_dim, d] fp16 tiles brought in by TMA."""
from __future__ import annotations

from dataclasses import replace

import torch

from ..kernels import OPERAND_DTYPES
from .reference import LAYER_NORM_EPS
from .route import RouteUnavailable
from .weights import layer_weights, per_layer


def packed(model, dtype) -> dict:
    """The kernel's layout (kernels.hopper_forward.pack_weights): the weight stream in `dtype`, vectors fp32."""
    from shapewise.kernels.hopper_forward import pack_weights  # deferred: triton loads when the route runs

    w = per_layer(model, torch.float32)
    layers = [layer_weights(w, i) for i in range(model.config.num_layers)]
    return pack_weights(layers, (w["final_w"], w["final_b"]), model.config.num_heads, operand_dtype=dtype)


class HopperForward:
    uses_weights = True

    def __init__(self, model, route):
        from shapewise.kernels import hopper_forward as kernel  # deferred: triton loads when the route runs

        self.hopper_forward, self.prepared_launch = kernel.hopper_forward, kernel.PreparedLaunch
        self.route = route
        self.weights = model._weights.table(model, route.precision, packed)
        # the stream is refreshed in place (model/weights.py): its descriptor stays valid across weight edits
        self.hd = kernel.head_dim_padded(model.config.head_dim)
        self.desc = kernel.weight_descriptor(self.weights["stream"], self.hd)
        self.pair_scratch = kernel.pair_scratch
        self.scratch = None  # the pair's k, v exchange and flags: one per runner (one signature), made on first use
        self.launch = None  # the signature's PreparedLaunch (route.prepared_launch), made on its first call with the
        # layout the kernel is specialized on

    def __call__(self, model, x, mask):
        launch = self.launch
        if launch is not None and launch.serves(x, mask):  # a runner serves one signature: the layout is what varies
            return launch(x, mask)  # outside no_grad: a launch into a fresh output records nothing for autograd
        return self._launch(model, x, mask)

    @torch.no_grad()
    def _launch(self, model, x, mask):
        if x.stride(-1) != 1:  # a view sliced along d_model: the kernel reads rows with unit stride
            x = x.contiguous()
        cfg = model.config
        pair = self.route.pair
        if pair and self.scratch is None:  # before any capture: a graph replays the launch on this scratch
            self.scratch = self.pair_scratch(x.shape[0], cfg.num_layers, cfg.num_heads, self.hd, x.device)
        keywords = dict(num_heads=cfg.num_heads, causal=cfg.causal, eps=LAYER_NORM_EPS, mask=mask, desc=self.desc,
                        pair=pair, producer=self.route.producer, duo=self.route.duo, scratch=self.scratch)
        if self.route.prepared_launch and self.launch is None and self.prepared_launch.serves(x, mask):
            self.launch = self.prepared_launch(x, self.weights, direct=self.route.direct_launch, **keywords)
            return self.launch(x, mask)
        return self.hopper_forward(x, self.weights, **keywords)


def runner(model, route):
    return HopperForward(model, route)


def why_unsupported(shape) -> str | None:
    from shapewise.kernels.hopper_forward import why_unsupported  # deferred: triton loads when the route is asked

    return why_unsupported(shape.seq_len, shape.d_model, shape.num_heads, shape.ffn_dim)


def settle(route, x, disabled):
    """The Hopper forward needs its switch and fp16 operands (its wgmma tiles are fp16): a forced route without
    them is refused, an automatic one runs as graph instead."""
    if "hopper_forward" in disabled:  # select_route picks it unasked only with the switch on
        raise RouteUnavailable("route 'hopper' was forced, but the hopper_forward optimization is disabled")
    if route.pair and "hopper_pair" in disabled:
        route = replace(route, pair=False, reason=route.reason + "; hopper_pair disabled")
    if route.producer and "hopper_producer" in disabled:
        route = replace(route, producer=False, reason=route.reason + "; hopper_producer disabled")
    if route.precision != "fp16":
        if route.forced:
            raise RouteUnavailable(f"route 'hopper' needs fp16 operands, not {route.precision}")
        route = replace(route, name="graph", eager=False, reason=route.reason + (
            f"; the Hopper forward needs fp16 operands, not {route.precision}"))
    return route


def switches(route) -> set:
    return ({"hopper_forward"} | ({"hopper_pair"} if route.pair else set())
            | ({"hopper_producer"} if route.producer else set()) | ({"hopper_duo"} if route.duo else set()))


def working_set(config, dtype, route) -> int:
    """The packed weights (the kernel's packer says their bytes) and, with two programs a sequence, their scratch:
    no activations beside the input and output."""
    from shapewise.kernels.hopper_forward import head_dim_padded, packed_bytes, pair_scratch_bytes  # deferred: triton

    weights = packed_bytes(config.num_layers, config.d_model, config.num_heads, config.ffn_dim,
                           operand_dtype=OPERAND_DTYPES[route.precision])
    if not route.pair:
        return weights
    return weights + pair_scratch_bytes(config.batch_size, config.num_layers, config.num_heads,
                                        head_dim_padded(config.head_dim))
