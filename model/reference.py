"""The reference pre-LayerNorm Transformer, its inputs and its comparator.

Everything here is plain PyTorch and follows the contract literally: explicit attention scores,
softmax in fp32, exact GELU, LayerNorm with eps 1e-5, causal and padding masks, invalid rows zeroed.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields

import torch
import torch.nn.functional as F
from torch import nn

CONFIG_FIELDS = ("batch_size", "seq_len", "d_model", "num_heads", "ffn_dim", "num_layers", "causal")

TOLERANCES = {
    "official": {"atol": 2e-3, "rtol": 2e-2},
    "strict": {"atol": 1e-3, "rtol": 1e-2},
}


@dataclass(frozen=True)
class TransformerConfig:
    batch_size: int
    seq_len: int
    d_model: int
    num_heads: int
    ffn_dim: int
    num_layers: int
    causal: bool = True

    @property
    def head_dim(self) -> int:
        return self.d_model // self.num_heads

    @property
    def tokens(self) -> int:
        return self.batch_size * self.seq_len

    def validate(self) -> "TransformerConfig":
        for name in CONFIG_FIELDS[:-1]:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"TransformerConfig.{name} must be an int, got {type(value).__name__} {value!r}")
            if value <= 0:
                raise ValueError(f"TransformerConfig.{name} must be positive, got {value}")
        if self.d_model % self.num_heads != 0:
            raise ValueError(
                f"TransformerConfig: d_model ({self.d_model}) must be divisible by num_heads ({self.num_heads})"
            )
        if not isinstance(self.causal, bool):
            raise TypeError(f"TransformerConfig.causal must be a bool, got {self.causal!r}")
        return self

    @classmethod
    def from_any(cls, config) -> "TransformerConfig":
        """Copy the seven contract fields from any object that has them (e.g. another harness's config)."""
        if isinstance(config, cls):
            return config.validate()
        missing = [name for name in CONFIG_FIELDS if not hasattr(config, name)]
        if missing:
            raise TypeError(f"config object {type(config).__name__} lacks field(s) {', '.join(missing)}")
        values = {name: getattr(config, name) for name in CONFIG_FIELDS}
        return cls(**values).validate()

    def as_dict(self) -> dict:
        return asdict(self)


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
        self.norm1 = nn.LayerNorm(config.d_model)
        self.attention = ReferenceAttention(config.d_model, config.num_heads, config.causal)
        self.norm2 = nn.LayerNorm(config.d_model)
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
        self.final_norm = nn.LayerNorm(self.config.d_model)

    def forward(self, x: torch.Tensor, valid_token_mask=None) -> torch.Tensor:
        check_inputs(self.config, x, valid_token_mask)
        for layer in self.layers:
            x = layer(x, valid_token_mask)
        x = self.final_norm(x)
        if valid_token_mask is not None:
            x = x.masked_fill(~valid_token_mask[..., None], 0.0)
        return x


# ----------------------------------------------------------------------------------------------
# Memory-lean reference for shapes whose [B, H, S, S] score tensor cannot exist (official row 14)
# ----------------------------------------------------------------------------------------------
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
    tf32_before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        h = x.to(compute_dtype)

        def linear(t, name):
            return F.linear(t, params[name + ".weight"], params[name + ".bias"])

        def layer_norm(t, name):
            return F.layer_norm(t, (d,), params[name + ".weight"], params[name + ".bias"], 1e-5)

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
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32_before


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
    weights = L * (4 * d * d + 2 * d * f + 9 * d) * elem + 2 * d * elem
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


# ----------------------------------------------------------------------------------------------
# Inputs and comparison
# ----------------------------------------------------------------------------------------------
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
        low = max(1, round(S * (1.0 - padding_ratio)))
        lengths = torch.randint(low, S + 1, (B,), generator=gen, device=where)
        mask = torch.arange(S, device=where)[None, :] < lengths[:, None]
        x = x.masked_fill(~mask[..., None], 0.0)
        mask = mask.to(device)
    return x.to(device=device, dtype=dtype), mask


@dataclass(frozen=True)
class Comparison:
    passed: bool
    total_elements: int
    failed_elements: int
    max_abs_error: float
    max_rel_error: float
    mean_abs_error: float
    worst_index: tuple

    def as_dict(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["worst_index"] = list(self.worst_index)
        return out


def compare_outputs(reference: torch.Tensor, optimized: torch.Tensor, rtol: float, atol: float) -> Comparison:
    """Element passes if both are finite and |opt - ref| <= atol or |opt - ref| <= rtol * |ref|."""
    if reference.shape != optimized.shape:
        raise ValueError(f"compare_outputs: reference shape {tuple(reference.shape)} != optimized shape "
                         f"{tuple(optimized.shape)}")
    ref = reference.detach().to(torch.float64)
    opt = optimized.detach().to(device=ref.device, dtype=torch.float64)
    diff = (opt - ref).abs()
    finite = torch.isfinite(ref) & torch.isfinite(opt)
    ok = finite & ((diff <= atol) | (diff <= rtol * ref.abs()))
    total = ref.numel()
    failed = int(total - ok.sum().item())
    diff_finite = torch.where(finite, diff, torch.zeros_like(diff))
    rel = diff_finite / ref.abs().clamp_min(1e-12)
    # the worst element: a failing one with the largest error, else the largest error overall
    badness = torch.where(finite, diff, torch.full_like(diff, math.inf)) + (~ok).to(torch.float64) * 1e300
    worst_flat = int(torch.argmax(badness).item()) if total else 0
    worst = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst_flat), ref.shape)) if total else ()
    return Comparison(
        passed=failed == 0,
        total_elements=int(total),
        failed_elements=failed,
        max_abs_error=float(diff_finite.max().item()) if total else 0.0,
        max_rel_error=float(rel.max().item()) if total else 0.0,
        mean_abs_error=float(diff_finite.mean().item()) if total else 0.0,
        worst_index=worst,
    )
