"""Route `megakernel`: the whole forward in one Triton kernel (kernels/megakernel.py), weights stacked over layers."""
from __future__ import annotations

from dataclasses import replace

import torch

from .config import parameter_count
from .memory import operand_bytes
from .routing import RouteUnavailable
from .weights import layer_weights, per_layer

# The launch fields of Route.launch for this route, in order (the policy's megakernel.launch entry names them).
LAUNCH_FIELDS = ("block_m", "block_n", "block_a", "block_f", "block_c", "num_warps", "num_stages", "programs_per_sm")
# A bound on the persistent programs of one launch (kernels.megakernel.programs_for: at most two per SM) for the
# memory plan, which sees no device: 512 SMs' worth.
MAX_PROGRAMS = 1024


def stacked(model, dtype) -> dict:
    """The megakernel's layout: per_layer's tensors stacked over layers (kernels.megakernel.stack_layers)."""
    from shapewise.kernels.megakernel import stack_layers

    w = per_layer(model, dtype)
    return stack_layers([layer_weights(w, i) for i in range(model.config.num_layers)], (w["final_w"], w["final_b"]))


class MegakernelForward:
    uses_weights = True

    def __init__(self, model, route):
        from shapewise.kernels.megakernel import megakernel

        self.megakernel = megakernel
        self.route = route
        self.weights = model._weights.table(model, route.precision, stacked)
        self.launch = dict(zip(LAUNCH_FIELDS, route.launch))

    @torch.no_grad()
    def __call__(self, model, x, mask):
        if x.stride(-1) != 1:  # a view sliced along d_model: the kernel reads rows with unit stride
            x = x.contiguous()
        cfg = model.config
        return self.megakernel(x, self.weights, num_heads=cfg.num_heads, causal=cfg.causal, mask=mask,
                               out_dtype=x.dtype, **self.launch)


def runner(model, route):
    return MegakernelForward(model, route)


def why_unsupported(shape) -> str | None:
    from shapewise.kernels.megakernel import why_unsupported  # the kernel owns its limits (imported here: triton)

    return why_unsupported(shape.seq_len, shape.d_model, shape.num_heads)


def settle(route, x, disabled):
    """The megakernel needs its switch and fp16/bf16 operands: a forced route without them is refused, an automatic
    one runs as graph (CUDA) or triton instead."""
    if "megakernel" in disabled:  # select_route picks it unasked only with the switch on
        raise RouteUnavailable("route 'megakernel' was forced, but the megakernel optimization is disabled")
    if route.precision not in ("fp16", "bf16"):
        if route.forced:
            raise RouteUnavailable(f"route 'megakernel' needs fp16 or bf16 operands, not {route.precision}")
        route = replace(route, name="graph" if x.is_cuda else "triton", launch=(),
                        reason=route.reason + f"; the megakernel needs fp16/bf16 operands, not {route.precision}")
    return route


def switches(route) -> set:
    return {"megakernel"}


def working_set(config, dtype, route) -> int:
    """The per-program scratch (an fp32 residual, q/k/v and the attention output in operand precision: (4 + 4a)
    bytes per token and model column, a the operands' bytes) for at most MAX_PROGRAMS sequences, plus the weight
    copies in operand precision."""
    a, d = operand_bytes(route.precision), config.d_model
    programs = min(config.batch_size, MAX_PROGRAMS)
    return programs * config.seq_len * d * (4 + 4 * a) + parameter_count(d, config.ffn_dim, config.num_layers) * a

