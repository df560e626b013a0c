"""The contract's inputs: `x = randn(B, S, d) * input_scale` from a seeded generator, and padding masks."""
from __future__ import annotations

import torch

from .config import TransformerConfig


def padding_lengths(seq_len: int, padding_ratio: float, batch_size: int, generator, device=None):
    """Valid lengths per batch element, drawn in `[max(1, round(S * (1 - p))), S]`: the contract's length rule."""
    low = max(1, round(seq_len * (1.0 - padding_ratio)))
    return torch.randint(low, seq_len + 1, (batch_size,), generator=generator, device=device)


def generate_random_case(config, device, dtype=torch.float32, seed: int = 1234, padding_ratio: float = 0.0,
                         input_scale: float = 1.0, generator_device: str = "cpu"):
    """`x = randn(B, S, d) * input_scale` from a seeded generator, plus a prefix mask when padding_ratio > 0.

    Lengths are drawn in `[max(1, round(S * (1 - p))), S]`; padded rows of x are zeroed. The mask is None
    without padding. generator_device: "cpu" (default) draws on a CPU generator, so a seed gives the same case
    on every device; "device" draws with a generator on `device` itself, which is fast for huge inputs (a
    CPU draw of official row 14's 3.3e9 elements is estimated at about 20 s) but gives other numbers than the
    CPU draw on a GPU.
    """
    cfg = TransformerConfig.from_any(config)
    if not 0.0 <= padding_ratio < 1.0:
        raise ValueError(f"padding_ratio must be in [0, 1), got {padding_ratio}")
    if generator_device not in ("cpu", "device"):
        raise ValueError(f"generator_device must be 'cpu' or 'device', got {generator_device!r}")
    where = torch.device("cpu") if generator_device == "cpu" else torch.device(device)
    gen = torch.Generator(device=where).manual_seed(int(seed))
    B, S, d = cfg.batch_size, cfg.seq_len, cfg.d_model
    x = torch.randn(B, S, d, generator=gen, dtype=torch.float32, device=where)
    if input_scale != 1.0:  # x * 1.0 == x exactly: skip a pass over the whole input
        x = x * input_scale
    mask = None
    if padding_ratio > 0:
        lengths = padding_lengths(S, padding_ratio, B, gen, device=where)
        mask = torch.arange(S, device=where)[None, :] < lengths[:, None]
        x = x.masked_fill(~mask[..., None], 0.0)
        mask = mask.to(device)
    return x.to(device=device, dtype=dtype), mask
