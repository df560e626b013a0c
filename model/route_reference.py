"""Route `reference`: the contract's own forward (model/reference.py), on the model's own parameters."""
from __future__ import annotations

from .config import parameter_count
from .memory import element_bytes, estimate_memory_bytes, io_bytes
from .reference import BaselineTransformer


class ReferenceForward:
    uses_weights = False  # reads the parameters themselves: no derived weights to keep in step

    def __init__(self, route):
        self.route = route

    def __call__(self, model, x, mask):
        return BaselineTransformer.forward(model, x, mask)


def runner(model, route):
    return ReferenceForward(route)


def working_set(config, dtype, route) -> int:
    """The reference's own estimate (five [B, H, S, S] score tensors at the peak) less its weights, input and
    output."""
    inp, out = io_bytes(config, dtype)
    weights = parameter_count(config.d_model, config.ffn_dim, config.num_layers) * element_bytes(dtype)
    return estimate_memory_bytes(config, dtype, "reference") - weights - inp - out


def switches(route) -> set:
    return set()
