"""How much device memory one forward needs: the one owner of "what fits"."""
from __future__ import annotations

import torch

from .config import TransformerConfig, parameter_count


def estimate_memory_bytes(config, dtype: torch.dtype, which: str) -> int:
    """Peak device memory estimate (bytes) of one forward, for preflight checks.

    `which="reference"`: the explicit attention holds scores, the causal-masked copy, the padded-masked copy,
    the fp32 softmax and the probabilities cast back: about five `[B, H, S, S]` tensors at the peak.
    `which="optimized"`: activations of one layer (residual fp32, normalized, qkv, attention, ffn) only.
    Both add the weights and the input/output.
    """
    cfg = TransformerConfig.from_any(config)
    elem = torch.empty((), dtype=dtype).element_size()
    B, S, d, H, f, L = cfg.batch_size, cfg.seq_len, cfg.d_model, cfg.num_heads, cfg.ffn_dim, cfg.num_layers
    tokens = B * S
    weights = parameter_count(d, f, L) * elem
    io = 2 * tokens * d * elem
    if which == "reference":
        scores = B * H * S * S
        peak_scores = scores * (3 * elem + 4 + elem)  # scores, masked copy, softmax fp32, probs
        acts = tokens * (6 * d + 2 * f) * elem
        return int(weights + io + peak_scores + acts)
    if which == "optimized":
        acts = tokens * (4 * d * 4 + 3 * d * 2 + d * 2 + f * 2 * 2)  # fp32 residual x2, fp16 qkv/attn/ffn
        return int(weights * 2 + io + acts)
    raise ValueError(f"estimate_memory_bytes: which must be 'reference' or 'optimized', got {which!r}")
