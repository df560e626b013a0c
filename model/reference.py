"""The reference pre-LayerNorm Transformer of the contract, in plain PyTorch.

Explicit attention scores, softmax in fp32, exact GELU, LayerNorm with eps LAYER_NORM_EPS, causal and padding
masks, invalid rows zeroed.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import TransformerConfig

LAYER_NORM_EPS = 1e-5  # the contract's LayerNorm epsilon: every LayerNorm of every route uses it


def check_inputs(config: TransformerConfig, x: torch.Tensor, valid_token_mask) -> None:
    """Raise a clear error for inputs the model cannot take."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 3:
        raise ValueError(f"x must have rank 3 [batch, seq, d_model], got shape {tuple(x.shape)}")
    if x.shape[-1] != config.d_model:
        raise ValueError(f"x has width {x.shape[-1]}, expected d_model={config.d_model}")
    if not x.is_floating_point():
        raise TypeError(f"x must be floating point, got {x.dtype}")
    if x.shape[0] == 0 or x.shape[1] == 0:
        raise ValueError(f"x must have at least one batch element and one position, got shape {tuple(x.shape)}")
    if valid_token_mask is None:
        return
    if not isinstance(valid_token_mask, torch.Tensor):
        raise TypeError(f"valid_token_mask must be a torch.Tensor or None, got {type(valid_token_mask).__name__}")
    if valid_token_mask.dtype != torch.bool:
        raise TypeError(f"valid_token_mask must have dtype torch.bool, got {valid_token_mask.dtype}")
    if tuple(valid_token_mask.shape) != tuple(x.shape[:2]):
        raise ValueError(
            f"valid_token_mask has shape {tuple(valid_token_mask.shape)}, expected [batch, seq] = {tuple(x.shape[:2])}"
        )
    if valid_token_mask.device != x.device:
        raise ValueError(f"valid_token_mask is on {valid_token_mask.device} but x is on {x.device}")


def check_parameters_match(model: nn.Module, x: torch.Tensor, supported: str = "") -> None:
    """Raise a clear error, before any work, when x is not in the dtype or not on the device of `model`'s parameters
    (its final LayerNorm's weight stands for them all: a model converted with .to() holds them alike), naming both;
    `supported` ends the dtype error with what the caller serves. Without it a mix fails deep inside the math
    ("mixed dtype (CPU)", "not on the expected device meta")."""
    weight = model._modules["final_norm"]._parameters["weight"]  # past nn.Module.__getattr__ (~1 µs a call)
    if x.dtype != weight.dtype:
        raise TypeError(f"{type(model).__name__}: x is {x.dtype} but the model's parameters are {weight.dtype}; pass "
                        f"x in the parameters' dtype or convert the model with .to(dtype)"
                        + (f". {supported}" if supported else ""))
    if x.device != weight.device:
        held = " (a meta tensor holds no values)" if x.device.type == "meta" else ""
        raise ValueError(f"{type(model).__name__}: x is on {x.device}{held} but the model's parameters are on "
                         f"{weight.device}; pass x on {weight.device} or move the model with .to({str(x.device)!r})")


class ReferenceAttention(nn.Module):
    def __init__(self, d_model: int, num_heads: int, causal: bool):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = d_model // num_heads
        self.causal = causal
        self.q_proj = nn.Linear(d_model, d_model)
        self.k_proj = nn.Linear(d_model, d_model)
        self.v_proj = nn.Linear(d_model, d_model)
        self.out_proj = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor, valid_token_mask=None) -> torch.Tensor:
        B, S, d = x.shape

        def heads(t):
            return t.view(B, S, self.num_heads, self.head_dim).transpose(1, 2)

        q, k, v = heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x))
        scores = torch.matmul(q, k.transpose(-1, -2)) * self.head_dim**-0.5
        if self.causal:
            future = torch.ones(S, S, dtype=torch.bool, device=x.device).triu(1)
            scores = scores.masked_fill(future, float("-inf"))
        if valid_token_mask is not None:
            scores = scores.masked_fill(~valid_token_mask[:, None, None, :], float("-inf"))
        probs = torch.softmax(scores.float(), dim=-1).to(x.dtype)
        out = torch.matmul(probs, v).transpose(1, 2).reshape(B, S, d)
        out = self.out_proj(out)
        if valid_token_mask is not None:
            out = out.masked_fill(~valid_token_mask[..., None], 0.0)
        return out


class ReferenceBlock(nn.Module):
    def __init__(self, config: TransformerConfig):
        super().__init__()
        self.norm1 = nn.LayerNorm(config.d_model, eps=LAYER_NORM_EPS)
        self.attention = ReferenceAttention(config.d_model, config.num_heads, config.causal)
        self.norm2 = nn.LayerNorm(config.d_model, eps=LAYER_NORM_EPS)
        self.ffn_in = nn.Linear(config.d_model, config.ffn_dim)
        self.ffn_out = nn.Linear(config.ffn_dim, config.d_model)

    def forward(self, x: torch.Tensor, valid_token_mask=None) -> torch.Tensor:
        x = x + self.attention(self.norm1(x), valid_token_mask)
        x = x + self.ffn_out(F.gelu(self.ffn_in(self.norm2(x)), approximate="none"))
        if valid_token_mask is not None:
            x = x.masked_fill(~valid_token_mask[..., None], 0.0)
        return x


class BaselineTransformer(nn.Module):
    """The reference model of the contract."""

    def __init__(self, config):
        super().__init__()
        self.config = TransformerConfig.from_any(config)
        self.layers = nn.ModuleList(ReferenceBlock(self.config) for _ in range(self.config.num_layers))
        self.final_norm = nn.LayerNorm(self.config.d_model, eps=LAYER_NORM_EPS)

    def forward(self, x: torch.Tensor, valid_token_mask=None) -> torch.Tensor:
        check_inputs(self.config, x, valid_token_mask)
        check_parameters_match(self, x)
        for layer in self.layers:
            x = layer(x, valid_token_mask)
        x = self.final_norm(x)
        if valid_token_mask is not None:
            x = x.masked_fill(~valid_token_mask[..., None], 0.0)
        return x
