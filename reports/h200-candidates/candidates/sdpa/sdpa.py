"""The reference with PyTorch's scaled_dot_product_attention in place of its explicit attention.

What a user reaches for first instead of writing kernels: the same model, the attention math handed to
torch.nn.functional.scaled_dot_product_attention (flash or memory-efficient kernels on a GPU where they apply).
The padding mask becomes SDPA's boolean attn_mask (combined with the causal triangle); without a mask a causal
layer asks for is_causal. Everything else, and every parameter name, is the reference's.

    snakemake --cores all --config candidates=sdpa=candidates/sdpa.py
"""

import torch
import torch.nn.functional as F

from shapewise.model import BaselineTransformer
from shapewise.model.reference import ReferenceAttention


class SdpaAttention(ReferenceAttention):
    def forward(self, x, valid_token_mask=None):
        B, S, d = x.shape

        def heads(t):
            return t.view(B, S, self.num_heads, self.head_dim).transpose(1, 2)

        q, k, v = heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x))
        if valid_token_mask is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        else:
            allowed = valid_token_mask[:, None, None, :]  # True: the key may be attended to
            if self.causal:
                allowed = allowed & torch.ones(S, S, dtype=torch.bool, device=x.device).tril()
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
        out = self.out_proj(out.transpose(1, 2).reshape(B, S, d))
        if valid_token_mask is not None:  # a padded query attends to nothing: its row is zero, as the reference's
            out = out.masked_fill(~valid_token_mask[..., None], 0.0)
        return out


class UserOptimizedTransformer(BaselineTransformer):
    def __init__(self, config):
        super().__init__(config)
        for layer in self.layers:
            layer.attention = SdpaAttention(self.config.d_model, self.config.num_heads, self.config.causal)
