"""Device functions the layer kernels share (kernels/fused_layer.py, kernels/layer_tail.py): the tile matmul, row
LayerNorm, the FFN with its residual, the row store with masking and the final LayerNorm; and the row widths one
tile serves."""
from __future__ import annotations

import triton
import triton.language as tl

from . import INTERPRET

MIN_D_MODEL = 16  # the smallest tile Triton's dot takes
MAX_D_MODEL = 128  # the widest token row one tile holds
PROJECT_BLOCK_N = 64  # output columns per step where a launcher runs _project_rows (ln_qkv)
# Triton 3.6's interpreter computes garbage for bf16 dots: there the (already bf16-rounded) operands are multiplied
# in fp32, which gives the tensor cores' products (exact products, fp32 sums). Every kernel's bf16 dot asks this.
DOT_BF16_IN_FP32 = tl.constexpr(INTERPRET)


@triton.jit
def _mm(a, b):
    """a @ b with fp32 accumulation (operands already in the fp16/bf16 operand type)."""
    if DOT_BF16_IN_FP32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _layer_norm_rows(x, w_ptr, b_ptr, cols, col_ok, n_cols, eps):
    """LayerNorm of each row of an fp32 tile whose padding columns are 0."""
    mean = tl.sum(x, 1) / n_cols
    xc = tl.where(col_ok[None, :], x - mean[:, None], 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, 1) / n_cols + eps)
    w = tl.load(w_ptr + cols, mask=col_ok, other=0.0)
    b = tl.load(b_ptr + cols, mask=col_ok, other=0.0)
    return xc * rstd[:, None] * w[None, :] + b[None, :]


@triton.jit
def _project_rows(h, W, Bias, out_base, rows, row_ok, stride_out, cols, col_ok, d_model, first_col, c_lo, c_hi,
                  BLOCK_N: tl.constexpr):
    """Store h @ W[first_col + c]ᵀ + Bias[first_col + c] for columns c in [c_lo, c_hi), BLOCK_N at a time: h is a
    [rows, BLOCK_D] tile in the weights' dtype (padding columns 0), W a row-major [*, d_model] weight; row r, column c
    of the result goes to out_base + r * stride_out + c in out_base's dtype (fp32 sums and bias, one rounding)."""
    ncol = tl.arange(0, BLOCK_N)
    for n0 in range(c_lo, c_hi, BLOCK_N):
        n = n0 + ncol
        n_ok = n < c_hi
        # [BLOCK_D, BLOCK_N] slice of Wᵀ: element (k, j) is row first_col + n0 + j, column k of W
        w = tl.load(W + (first_col + n[None, :]) * d_model + cols[:, None], mask=col_ok[:, None] & n_ok[None, :],
                    other=0.0)
        bias = tl.load(Bias + first_col + n, mask=n_ok, other=0.0).to(tl.float32)
        out = _mm(h, w) + bias[None, :]
        tl.store(out_base + rows[:, None] * stride_out + n[None, :], out.to(out_base.dtype.element_ty),
                 mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def _gelu_exact(t):
    """GELU with the error function (the contract's exact GELU), in fp32."""
    return 0.5 * t * (1.0 + tl.erf(t * 0.7071067811865476))


@triton.jit
def _ffn_residual(x1, N2w, N2b, Win, Bin, Wout, Bout, cols, col_ok, d_model, ffn_dim, eps,
                  BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_F: tl.constexpr):
    """x1 + FFN(LayerNorm 2(x1)) for an fp32 [BLOCK_M, BLOCK_D] tile of residual rows (padding columns 0): the
    FFN chunk by chunk over ffn_dim (bias, exact GELU, bias), operands in the weights' dtype, fp32 sums."""
    op_ty = Win.dtype.element_ty
    h2 = _layer_norm_rows(x1, N2w, N2b, cols, col_ok, d_model, eps).to(op_ty)
    fcol = tl.arange(0, BLOCK_F)
    ffn = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for f_start in range(0, ffn_dim, BLOCK_F):
        f_ok = (f_start + fcol) < ffn_dim
        w_in = tl.load(Win + (f_start + fcol[None, :]) * d_model + cols[:, None],
                       mask=col_ok[:, None] & f_ok[None, :], other=0.0)  # [BLOCK_D, BLOCK_F] = W_in^T slice
        b_in = tl.load(Bin + f_start + fcol, mask=f_ok, other=0.0).to(tl.float32)
        t = _gelu_exact(_mm(h2, w_in) + b_in[None, :])
        w_out = tl.load(Wout + cols[None, :] * ffn_dim + f_start + fcol[:, None],
                        mask=f_ok[:, None] & col_ok[None, :], other=0.0)  # [BLOCK_F, BLOCK_D] = W_out^T slice
        ffn += _mm(t.to(op_ty), w_out)
    b_out = tl.load(Bout + cols, mask=col_ok, other=0.0).to(tl.float32)
    return x1 + ffn + b_out[None, :]


@triton.jit
def _store_rows(x2, Y, Mask, b, stride_yb, stride_ys, stride_mb, NFw, NFb, rows, row_ok, cols, col_ok, d_model, eps,
                key_len, not_prefix, HAS_MASK: tl.constexpr, FINAL_NORM: tl.constexpr, BRANCH: tl.constexpr):
    """Store a tile of rows of sequence b (row r at Y + b * stride_yb + r * stride_ys): invalid rows
    (Mask[b * stride_mb + r] == 0) as 0, after the final LayerNorm when FINAL_NORM. Where the mask is a prefix
    (not_prefix False) the rows below key_len are the valid ones and the mask is not read; elsewhere (not_prefix
    True, key_len the number of rows) the mask says. BRANCH: the mask's load in a branch on not_prefix instead of
    a load predicated off for a prefix."""
    if HAS_MASK:
        if BRANCH:
            row_valid = rows < key_len
            if not_prefix:
                row_valid = row_valid & (tl.load(Mask + b * stride_mb + rows, mask=row_ok, other=1) != 0)
        else:
            row_valid = (rows < key_len) & (tl.load(Mask + b * stride_mb + rows, mask=row_ok & not_prefix,
                                                    other=1) != 0)
        x2 = tl.where(row_valid[:, None], x2, 0.0)
    if FINAL_NORM:
        x2 = _layer_norm_rows(x2, NFw, NFb, cols, col_ok, d_model, eps)
        if HAS_MASK:
            x2 = tl.where(row_valid[:, None], x2, 0.0)
    y_ptrs = Y + b * stride_yb + rows[:, None] * stride_ys + cols[None, :]
    tl.store(y_ptrs, x2.to(Y.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])
