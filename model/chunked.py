"""A memory-lean reference for shapes whose `[B, H, S, S]` score tensor cannot exist (official row 14)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import TransformerConfig
from .precision import cublas_fp32
from .reference import LAYER_NORM_EPS, check_inputs


@torch.no_grad()
def chunked_reference_forward(
    model: nn.Module,
    x: torch.Tensor,
    valid_token_mask=None,
    query_block: int = 1024,
    compute_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """The reference's math in `compute_dtype`, attention one query block at a time.

    Reads the weights of any model with the reference's parameter names. Peak extra memory is one
    `[B, H, query_block, S]` score block, never `[B, H, S, S]`. Matmuls run with TF32 disabled.
    Returns the output in `compute_dtype`.
    """
    cfg = TransformerConfig.from_any(model.config)
    check_inputs(cfg, x, valid_token_mask)
    params = {name: p.detach().to(compute_dtype) for name, p in model.named_parameters()}
    B, S, d = x.shape
    H, D = cfg.num_heads, cfg.head_dim
    with cublas_fp32(False):
        h = x.to(compute_dtype)

        def linear(t, name):
            return F.linear(t, params[name + ".weight"], params[name + ".bias"])

        def layer_norm(t, name):
            return F.layer_norm(t, (d,), params[name + ".weight"], params[name + ".bias"], LAYER_NORM_EPS)

        keep = None if valid_token_mask is None else valid_token_mask[..., None]
        for i in range(cfg.num_layers):
            p = f"layers.{i}."
            n1 = layer_norm(h, p + "norm1")
            q = linear(n1, p + "attention.q_proj").view(B, S, H, D).transpose(1, 2)
            k = linear(n1, p + "attention.k_proj").view(B, S, H, D).transpose(1, 2)
            v = linear(n1, p + "attention.v_proj").view(B, S, H, D).transpose(1, 2)
            del n1
            attn = torch.empty(B, H, S, D, dtype=compute_dtype, device=x.device)
            key_pos = torch.arange(S, device=x.device)
            for start in range(0, S, query_block):
                stop = min(S, start + query_block)
                kv_stop = stop if cfg.causal else S  # causal blocks never look past their last query
                scores = torch.matmul(q[:, :, start:stop], k[:, :, :kv_stop].transpose(-1, -2)) * D**-0.5
                if cfg.causal:
                    future = key_pos[None, :kv_stop] > torch.arange(start, stop, device=x.device)[:, None]
                    scores.masked_fill_(future, float("-inf"))
                if valid_token_mask is not None:
                    scores.masked_fill_(~valid_token_mask[:, None, None, :kv_stop], float("-inf"))
                probs = torch.softmax(scores.float(), dim=-1).to(compute_dtype)
                attn[:, :, start:stop] = torch.matmul(probs, v[:, :, :kv_stop])
                del scores, probs
            del q, k, v
            out = linear(attn.transpose(1, 2).reshape(B, S, d), p + "attention.out_proj")
            del attn
            if keep is not None:
                out = out.masked_fill(~keep, 0.0)
            h = h + out
            del out
            f = F.gelu(linear(layer_norm(h, p + "norm2"), p + "ffn_in"), approximate="none")
            h = h + linear(f, p + "ffn_out")
            del f
            if keep is not None:
                h = h.masked_fill(~keep, 0.0)
        h = layer_norm(h, "final_norm")
        if keep is not None:
            h = h.masked_fill(~keep, 0.0)
        return h
