"""Route `reference`: the contract's own forward (model/reference.py), on the model's own parameters."""
from __future__ import annotations

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
    """The explicit attention's peak, about five [B, H, S, S] tensors: its scores, the causal-masked and the
    padded-masked copies and the probabilities cast back in the input dtype (e bytes), and the softmax in fp32;
    plus e * (6d + 2f) per token of the layer's activations."""
    e = dtype.itemsize
    scores = config.batch_size * config.num_heads * config.seq_len * config.seq_len
    return scores * (3 * e + 4 + e) + config.tokens * (6 * config.d_model + 2 * config.ffn_dim) * e


def switches(route) -> set:
    return set()
