"""Fused residual add + LayerNorm (Triton).

`new_residual = residual + branch` (fp32), rows of invalid tokens zeroed when a row mask is given, then
`LayerNorm(new_residual)` with fp32 statistics, written in the next GEMM's operand dtype. One pass over
the rows: the residual stream is read once and written once.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import launch_options, pdl_release_end, pdl_release_start, pdl_wait


# ----------------------------------------------------------------------------------------------
# Triton kernel
# ----------------------------------------------------------------------------------------------
@triton.jit
def _add_layernorm_fwd(
    R,  # pointer to the residual [n_rows, n_cols] (any float dtype)
    Br,  # pointer to the branch output [n_rows, n_cols]; read when HAS_BRANCH
    W, Bias,  # pointers to the LayerNorm weight and bias [n_cols]
    RowMask,  # pointer to int8 [n_rows]: 0 = invalid token; read when HAS_ROW_MASK
    ResOut,  # pointer to the new fp32 residual [n_rows, n_cols]; written when WRITE_RESIDUAL (may alias R)
    Out,  # pointer to the normalized output [n_rows, n_cols] in the operand dtype
    stride_r, stride_b, stride_ro, stride_o,  # row strides (elements) of R, Br, ResOut, Out
    n_rows, n_cols, eps,
    BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr,
    HAS_BRANCH: tl.constexpr, HAS_ROW_MASK: tl.constexpr, WRITE_RESIDUAL: tl.constexpr,
    PDL: tl.constexpr,  # programmatic dependent launch (kernels/pdl.py)
):
    pdl_release_start(PDL)
    pdl_wait(PDL)
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.arange(0, BLOCK_D)
    row_ok = rows < n_rows
    col_ok = cols < n_cols
    ok = row_ok[:, None] & col_ok[None, :]
    rows64 = rows.to(tl.int64)
    x = tl.load(R + rows64[:, None] * stride_r + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    if HAS_BRANCH:
        x += tl.load(Br + rows64[:, None] * stride_b + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    if HAS_ROW_MASK:
        keep = tl.load(RowMask + rows, mask=row_ok, other=0) != 0
        x = tl.where(keep[:, None], x, 0.0)
    if WRITE_RESIDUAL:
        tl.store(ResOut + rows64[:, None] * stride_ro + cols[None, :], x, mask=ok)
    mean = tl.sum(x, 1) / n_cols
    xc = tl.where(col_ok[None, :], x - mean[:, None], 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, 1) / n_cols + eps)
    w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
    b = tl.load(Bias + cols, mask=col_ok, other=0.0).to(tl.float32)
    y = xc * rstd[:, None] * w[None, :] + b[None, :]
    if HAS_ROW_MASK:
        y = tl.where(keep[:, None], y, 0.0)
    tl.store(Out + rows64[:, None] * stride_o + cols[None, :], y.to(Out.dtype.element_ty), mask=ok)
    pdl_release_end(PDL)


# ----------------------------------------------------------------------------------------------
# Launcher and public functions
# ----------------------------------------------------------------------------------------------
def _rows(name, t, n_cols):
    if t.dim() < 1 or t.shape[-1] != n_cols:
        raise ValueError(f"add_layernorm: {name} must end in width {n_cols}, got shape {tuple(t.shape)}")
    if t.stride(-1) != 1:
        raise ValueError(f"add_layernorm: {name} must have unit stride in its last dimension, got {t.stride()}")
    t2 = t.reshape(-1, n_cols)
    if t2.dim() == 2 and t2.shape[0] > 1 and t2.stride(1) != 1:
        raise ValueError(f"add_layernorm: {name} rows are not contiguous")
    return t2


def add_layernorm(residual, branch, weight, bias, *, eps, out_dtype=torch.float32, row_mask=None,
                  residual_out=None, write_residual=True, out=None, pdl=False):
    """Return `(new_residual_fp32 or None, layer_norm(new_residual) in out_dtype)`.

    residual: `[..., d]`; branch: same shape, or None (plain LayerNorm of the residual). eps: the LayerNorm's
    epsilon (the model's, model/reference.py: a kernel owns no constant of the contract).
    row_mask: bool `[...]` (residual's dimensions but its last); rows where it is False become 0 in both outputs.
    residual_out: fp32 tensor for the new residual (may be `residual` itself: in place).
    write_residual=False skips writing the residual (the model's final norm).
    pdl: launch with programmatic dependent launch (kernels/pdl.py), for a kernel that follows another of the same
    forward.
    """
    d = weight.shape[-1]
    if weight.shape != (d,) or bias.shape != (d,):
        raise ValueError(f"add_layernorm: weight/bias must be [d], got {tuple(weight.shape)}, {tuple(bias.shape)}")
    r2 = _rows("residual", residual, d)
    n = r2.shape[0]
    b2 = None
    if branch is not None:
        if branch.shape != residual.shape:
            raise ValueError(f"add_layernorm: branch shape {tuple(branch.shape)} != residual {tuple(residual.shape)}")
        b2 = _rows("branch", branch, d)
    m = None
    if row_mask is not None:
        if row_mask.dtype != torch.bool or row_mask.numel() != n:
            raise ValueError(f"add_layernorm: row_mask must be bool with {n} elements, got {row_mask.dtype} "
                             f"{tuple(row_mask.shape)}")
        m = row_mask.contiguous().view(-1).view(torch.int8)
    if write_residual:
        if residual_out is None:
            residual_out = torch.empty(residual.shape, dtype=torch.float32, device=residual.device)
        elif residual_out.dtype != torch.float32 or residual_out.shape != residual.shape:
            raise ValueError("add_layernorm: residual_out must be fp32 with the residual's shape")
        ro2 = _rows("residual_out", residual_out, d)
    else:
        residual_out, ro2 = None, r2
    if out is None:
        out = torch.empty(residual.shape, dtype=out_dtype, device=residual.device)
    o2 = _rows("out", out, d)
    block_d = triton.next_power_of_2(d)
    block_rows = max(1, min(16, 4096 // block_d))
    num_warps = 4 if block_d * block_rows <= 4096 else 8
    grid = (triton.cdiv(n, block_rows),)
    _add_layernorm_fwd[grid](
        r2, b2 if b2 is not None else r2, weight, bias, m if m is not None else r2, ro2, o2,
        r2.stride(0), b2.stride(0) if b2 is not None else 0, ro2.stride(0), o2.stride(0),
        n, d, eps,
        BLOCK_ROWS=block_rows, BLOCK_D=block_d, HAS_BRANCH=b2 is not None, HAS_ROW_MASK=m is not None,
        WRITE_RESIDUAL=bool(write_residual), num_warps=num_warps,
        **launch_options(pdl, "add_layernorm"),
    )
    return residual_out, out


def layer_norm(x, weight, bias, eps, out_dtype=None):
    """Plain LayerNorm over the last dimension with fp32 statistics and epsilon `eps`."""
    _, y = add_layernorm(x, None, weight, bias, eps=eps, out_dtype=out_dtype or x.dtype, write_residual=False)
    return y
