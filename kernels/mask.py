"""Per-batch summary of a valid-token mask (Triton): its prefix length, or -1 where it is not a prefix.

`prefix_lengths(mask)[b]` is the number of valid tokens of batch element b when its valid tokens are exactly
positions `0 .. n-1` (an all-True row gives S, an all-False row 0), and -1 otherwise (left padding, holes).
Computed on the device in one launch, so a model can pick a cheaper path per batch element inside its kernels
without a host synchronization: attention over a prefix needs only the length, never the mask itself.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


# ----------------------------------------------------------------------------------------------
# Plain torch reference
# ----------------------------------------------------------------------------------------------
def prefix_lengths_reference(mask: torch.Tensor) -> torch.Tensor:
    mask = mask.to(torch.bool)
    lengths = mask.sum(1)
    prefix = torch.arange(mask.shape[1], device=mask.device)[None, :] < lengths[:, None]
    return torch.where((mask == prefix).all(1), lengths, torch.full_like(lengths, -1)).to(torch.int32)


# ----------------------------------------------------------------------------------------------
# Triton kernel
# ----------------------------------------------------------------------------------------------
@triton.jit
def _prefix_lengths_fwd(
    Mask,  # pointer to int8 [B, S] (a bool mask viewed as int8), 1 = valid token
    Out,  # pointer to int32 [B]
    stride_mb,  # mask stride between batch elements (elements); unit stride along S
    seq_len,
    BLOCK: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    count = tl.zeros([BLOCK], dtype=tl.int32)
    first_invalid = tl.full([BLOCK], 2147483647, dtype=tl.int32)
    for start in range(0, seq_len, BLOCK):
        pos = start + offs
        inside = pos < seq_len
        valid = tl.load(Mask + b * stride_mb + pos, mask=inside, other=0) != 0
        count += valid.to(tl.int32)
        first_invalid = tl.minimum(first_invalid, tl.where(inside & ~valid, pos, 2147483647))
    n_valid = tl.sum(count, 0)
    first = tl.min(first_invalid, 0)
    # a prefix: every valid token comes before the first invalid one (or there is no invalid one)
    is_prefix = (first == 2147483647) | (first == n_valid)
    tl.store(Out + b, tl.where(is_prefix, n_valid, -1))


# ----------------------------------------------------------------------------------------------
# Launcher and public function
# ----------------------------------------------------------------------------------------------
def prefix_lengths(mask: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """int32 `[B]`: the prefix length of each row of the bool mask `[B, S]`, or -1 where the row is no prefix."""
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or mask.dim() != 2:
        raise ValueError(f"prefix_lengths: mask must be a bool [B, S] tensor, got "
                         f"{getattr(mask, 'dtype', type(mask).__name__)} {tuple(getattr(mask, 'shape', ()))}")
    B, S = mask.shape
    if out is None:
        out = torch.empty(B, dtype=torch.int32, device=mask.device)
    elif out.shape != (B,) or out.dtype != torch.int32 or out.device != mask.device:
        raise ValueError(f"prefix_lengths: out must be int32 [{B}] on {mask.device}")
    if B == 0:
        return out
    m = mask if mask.stride(-1) == 1 else mask.contiguous()
    m = m.view(torch.int8)
    block = min(1024, max(16, triton.next_power_of_2(S)))
    _prefix_lengths_fwd[(B,)](m, out, m.stride(0), S, BLOCK=block, num_warps=4 if block >= 512 else 1)
    return out
