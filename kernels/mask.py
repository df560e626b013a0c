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
_NONE = tl.constexpr(2147483647)  # "no invalid position": larger than any position (a constexpr: kernels read it)


@triton.jit
def first_mask_block(row, seq_len, BLOCK: tl.constexpr, active):
    """The first BLOCK values of one mask row (int8, unit stride), 0 past seq_len and everywhere where `active` is
    False: the first step of prefix_length_of_row, which a kernel that summarizes a row on the side loads early,
    with its own tiles (fused_layer._ln_kv_fwd), so that its latency hides behind theirs."""
    offs = tl.arange(0, BLOCK)
    return tl.load(row + offs, mask=(offs < seq_len) & active, other=0)


@triton.jit
def prefix_length_of_row(row, seq_len, first, BLOCK: tl.constexpr):
    """The prefix length of one mask row (int8, unit stride, 1 = valid) or -1 where it is no prefix: the summary
    of one batch element, for this kernel and for kernels that compute it on the side. `first`: the row's first
    BLOCK values, as first_mask_block loads them; the rest of the row is read here."""
    offs = tl.arange(0, BLOCK)
    valid = first != 0
    count = valid.to(tl.int32)
    first_invalid = tl.where((offs < seq_len) & ~valid, offs, _NONE)
    for start in range(BLOCK, seq_len, BLOCK):
        pos = start + offs
        inside = pos < seq_len
        valid = tl.load(row + pos, mask=inside, other=0) != 0
        count += valid.to(tl.int32)
        first_invalid = tl.minimum(first_invalid, tl.where(inside & ~valid, pos, _NONE))
    n_valid = tl.sum(count, 0)
    first_bad = tl.min(first_invalid, 0)
    # a prefix: every valid token comes before the first invalid one (or there is no invalid one)
    is_prefix = (first_bad == _NONE) | (first_bad == n_valid)
    return tl.where(is_prefix, n_valid, -1)


@triton.jit
def _prefix_lengths_fwd(
    Mask,  # pointer to int8 [B, S] (a bool mask viewed as int8), 1 = valid token
    Out,  # pointer to int32 [B]
    stride_mb,  # mask stride between batch elements (elements); unit stride along S
    seq_len,
    BLOCK: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    row = Mask + b * stride_mb
    tl.store(Out + b, prefix_length_of_row(row, seq_len, first_mask_block(row, seq_len, BLOCK, True), BLOCK))


def summary_block(seq_len: int) -> int:
    """Mask positions read per step of prefix_length_of_row."""
    return min(1024, max(16, triton.next_power_of_2(seq_len)))


# ----------------------------------------------------------------------------------------------
# Launcher and public function
# ----------------------------------------------------------------------------------------------
def check_summary(caller: str, name: str, summary, batch: int, device) -> None:
    """A launcher's check of a prefix summary it is given or fills (`name`): int32 [batch] on `device`."""
    if summary.shape != (batch,) or summary.dtype != torch.int32 or summary.device != device:
        raise ValueError(f"{caller}: {name} must be int32 [B]={batch} on {device}, got {summary.dtype} "
                         f"{tuple(summary.shape)} on {summary.device}")


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
    block = summary_block(S)
    _prefix_lengths_fwd[(B,)](m, out, m.stride(0), S, BLOCK=block, num_warps=4 if block >= 512 else 1)
    return out
