"""Route `sdpa`: packed QKV and PyTorch's fused attention, eager, on the model's own parameters."""
from __future__ import annotations

import torch
import torch.nn.functional as F


class SdpaForward:
    uses_weights = False  # concatenates the QKV weight from the parameters on every call

    def __init__(self, route):
        self.route = route

    def __call__(self, model, x, mask):
        cfg = model.config
        B, S, d = x.shape
        H, D = cfg.num_heads, cfg.head_dim
        keep = None if mask is None else mask[..., None]
        with torch.no_grad():
            for layer in model.layers:
                a = layer.attention
                h = layer.norm1(x)
                qkv = F.linear(h, torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]),
                               torch.cat([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias])).view(B, S, 3, H, D)
                q, k, v = qkv.unbind(2)
                o = sdpa_attention(q, k, v, cfg.causal, mask).reshape(B, S, d)
                o = a.out_proj(o)
                if keep is not None:
                    o = o.masked_fill(~keep, 0.0)
                x = x + o
                x = x + layer.ffn_out(F.gelu(layer.ffn_in(layer.norm2(x)), approximate="none"))
                if keep is not None:
                    x = x.masked_fill(~keep, 0.0)
            x = model.final_norm(x)
            if keep is not None:
                x = x.masked_fill(~keep, 0.0)
        return x


def sdpa_attention(q, k, v, causal, key_mask):
    """PyTorch SDPA on [B, S, H, D] views with the contract's masks; keyless and invalid query rows give 0."""
    B, S, H, D = q.shape
    qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))
    if key_mask is None:
        o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=causal)
    else:
        allowed = key_mask[:, None, None, :]
        if causal:
            allowed = allowed & torch.ones(S, S, dtype=torch.bool, device=q.device).tril()
        o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=allowed)
        o = o.masked_fill(~key_mask[:, None, :, None], 0.0)  # invalid queries (the only keyless ones)
    return o.transpose(1, 2)


def runner(model, route):
    return SdpaForward(route)


def working_set(config, dtype, route) -> int:
    """Per token e * (8d + 2f) (residual, normalized, packed qkv, attention out and its reshape, projection, FFN),
    e the input dtype's bytes, and the packed QKV weight concatenated on every call."""
    e, d = dtype.itemsize, config.d_model
    return config.tokens * e * (8 * d + 2 * config.ffn_dim) + 3 * (d * d + d) * e


def sdpa_gets_mask(route, disabled) -> bool:
    """A masked forward hands SDPA the mask."""
    return True


def switches(route) -> set:
    return set()
