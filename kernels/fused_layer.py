"""One whole pre-LayerNorm Transformer layer in one Triton kernel, for short sequences of narrow models.

Where a sequence's activations fit on chip (`why_unsupported` states where), one program takes BLOCK_M
query rows of one sequence and runs: LayerNorm 1 of the whole sequence (its keys and values),
the QKV projection head by head, exact softmax attention over the (short) key range with causal and key
masks in the tile, the out-projection accumulated head by head, the residual add, LayerNorm 2, the FFN
(bias, exact GELU, bias) chunk by chunk, the second residual add and the invalid-row zeroing; the last
layer also applies the final LayerNorm. Each layer reads the residual stream once and writes it once:
no intermediate tensor touches global memory. Matmul operands are fp16 or bf16, accumulation and all
statistics fp32.

With `kv_precompute`, a second small kernel (`_ln_kv_fwd`) first writes every token's keys and values
([B, S, 2d], operand dtype) and the layer kernel reads them, instead of every program recomputing LayerNorm 1
and the K/V projection of its whole sequence. With it, `key_block` runs each head's softmax over blocks of keys
(online, fp32 running max and sum; a causal tile stops at its last query) instead of the whole sequence at once,
and `ffn_block` narrows the FFN's column chunks: fewer live registers. Both are off unless the routing policy's
launch entry sets them.

With a mask, each program summarizes its sequence's mask (kernels/mask.py: the prefix length, or -1) and treats a
prefix, the official harness's all-True mask among them, by its length alone, as index arithmetic; only a mask
that is no prefix is read into the visibility tile. The model's layer 0 writes that summary (`prefix_out`) and the
later layers read it (`mask_prefix_lengths`) instead of the mask.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .layer_tail import layer_tail_reference
from .mask import check_summary, first_mask_block, prefix_length_of_row, summary_block
from .pdl import launch_options, pdl_release_end, pdl_release_start, pdl_wait
from .tiles import (MAX_D_MODEL, MIN_D_MODEL, PROJECT_BLOCK_N, _ffn_residual, _layer_norm_rows, _mm, _project_rows,
                    _store_rows)

MAX_SEQ = 128
# Largest block_m served: 64 and 128 fault on the H200 under Triton 3.6 (docs/decisions.md#fused-block-m).
MAX_BLOCK_M = 32


# ----------------------------------------------------------------------------------------------
# Plain torch reference (one layer of the contract, optionally with the final norm)
# ----------------------------------------------------------------------------------------------
def fused_layer_reference(x, w, *, num_heads, causal, eps, mask=None, final=None):
    """x: [B, S, d] (float); w: dict of fp32/fp64 tensors named as in `pack_layer_weights`; eps: the LayerNorms'
    epsilon."""
    B, S, d = x.shape
    hd = d // num_heads
    x = x.double()
    n1 = torch.nn.functional.layer_norm(x, (d,), w["n1_w"].double(), w["n1_b"].double(), eps)
    qkv = n1 @ w["qkv_w"].double().t() + w["qkv_b"].double()
    q, k, v = qkv.view(B, S, 3, num_heads, hd).permute(2, 0, 3, 1, 4)
    s = q @ k.transpose(-1, -2) * hd**-0.5
    if causal:
        s = s.masked_fill(torch.ones(S, S, dtype=torch.bool, device=x.device).triu(1), float("-inf"))
    if mask is not None:
        s = s.masked_fill(~mask[:, None, None, :], float("-inf"))
    o = (torch.softmax(s, -1).nan_to_num(0.0) @ v).transpose(1, 2).reshape(B, S, d)
    return layer_tail_reference(o, x, w, mask=mask, final=final, eps=eps)  # the rest of the layer


# ----------------------------------------------------------------------------------------------
# Triton kernel
# ----------------------------------------------------------------------------------------------
@triton.jit
def _attend_key_blocks(q, kv_base, mask_base, rows, hcol, hd_ok, stride_kvs, d_model, seq_len, key_hi, qk_scale,
                       key_len, not_prefix,
                       BLOCK_M: tl.constexpr, BLOCK_HD: tl.constexpr, BLOCK_N: tl.constexpr,
                       IS_CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr):
    """One head's attention output [BLOCK_M, BLOCK_HD] for the query tile `q`, over keys 0..key_hi in blocks of
    BLOCK_N with an online softmax (fp32 running max and sum), reading this head's precomputed keys at
    `kv_base` (+ key * stride_kvs + column) and values d_model columns further. Live tiles are [BLOCK_M, BLOCK_N]
    instead of [BLOCK_M, BLOCK_S], and a causal tile skips the key blocks past its last query."""
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_HD], dtype=tl.float32)
    for n0 in range(0, key_hi, BLOCK_N):
        kn = n0 + tl.arange(0, BLOCK_N)
        kn_ok = kn < seq_len
        kv_ptrs = kv_base + kn[:, None] * stride_kvs + hcol[None, :]
        k = tl.load(kv_ptrs, mask=kn_ok[:, None] & hd_ok[None, :], other=0.0)
        v = tl.load(kv_ptrs + d_model, mask=kn_ok[:, None] & hd_ok[None, :], other=0.0)
        s = _mm(q, tl.trans(k)) * qk_scale
        visible = (kn < key_len)[None, :]  # key_len <= seq_len
        if HAS_MASK:  # a prefix reads no mask: key_len says it all
            visible = visible & (tl.load(mask_base + kn, mask=kn_ok & not_prefix, other=1) != 0)[None, :]
        if IS_CAUSAL:
            visible = visible & (kn[None, :] <= rows[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with no visible key so far stay at 0
        p = tl.math.exp2(s - m_use[:, None])
        alpha = tl.math.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + _mm(p.to(q.dtype), v)
        m_i = m_new
    return acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]


@triton.jit
def _fused_layer_fwd(
    X,  # pointer to the residual stream in, [B, S, d] (fp32, or the input dtype for layer 0)
    Y,  # pointer to the output, [B, S, d]: fp32 residual, or the final normalized output when FINAL_NORM
    Mask,  # pointer to int8 [B, S], 1 = valid token; read when HAS_MASK
    Prefix,  # pointer to int32 [B]: the mask's summary (kernels/mask.py: prefix length, or -1); PREFIX_IN/PREFIX_OUT
    Wqkv, Bqkv,  # pointers to the packed QKV weight [3d, d] (rows: q, k, v outputs) and bias [3d]
    Wo, Bo,  # pointers to the out-projection weight [d, d] and bias [d]
    Win, Bin,  # pointers to the FFN input weight [ffn, d] and bias [ffn]
    Wout, Bout,  # pointers to the FFN output weight [d, ffn] and bias [d]
    N1w, N1b, N2w, N2b,  # pointers to LayerNorm 1 and 2 weight/bias [d] (fp32)
    NFw, NFb,  # pointers to the final LayerNorm weight/bias [d] (fp32); read when FINAL_NORM
    KV,  # pointer to precomputed [B, S, 2d] keys (columns 0..d) and values (d..2d), operand dtype; read when KV_GLOBAL
    stride_kvb, stride_kvs,  # KV strides (elements) for batch and sequence; unit stride along the 2d columns
    stride_xb, stride_xs,  # X strides (elements) for batch and sequence; unit stride along d
    stride_yb, stride_ys,  # Y strides
    stride_mb,  # Mask stride between batch elements
    seq_len, d_model, ffn_dim, qk_scale, eps,  # qk_scale = head_dim**-0.5 * log2(e)
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_HD: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_F: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_S: tl.constexpr,
    IS_CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, FINAL_NORM: tl.constexpr,
    KV_GLOBAL: tl.constexpr,  # read K and V from KV (written by _ln_kv_fwd) instead of recomputing them here
    BLOCK_N: tl.constexpr,  # keys per step: BLOCK_S = the whole sequence at once; less (KV_GLOBAL only): key blocks
    PREFIX_IN: tl.constexpr,  # with HAS_MASK: read the mask's summary from Prefix instead of computing it
    PREFIX_OUT: tl.constexpr,  # with HAS_MASK, not PREFIX_IN: write the summary to Prefix (for the next layers)
    ROW_MASK_BRANCH: tl.constexpr,  # ROW_MASK_BRANCH: the output rows' mask read in a branch (_store_rows)
    PDL: tl.constexpr,  # programmatic dependent launch (kernels/pdl.py)
):
    pdl_release_start(PDL)
    pdl_wait(PDL)
    pid_m = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    op_ty = Wqkv.dtype.element_ty
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # this program's queries
    keys = tl.arange(0, BLOCK_S)  # the whole (short) sequence
    cols = tl.arange(0, BLOCK_D)
    hcol = tl.arange(0, BLOCK_HD)
    col_ok = cols < d_model
    row_ok = rows < seq_len
    key_ok = keys < seq_len
    hd_ok = hcol < HEAD_DIM
    x_base = X + b * stride_xb
    mask_row = Mask + b * stride_mb
    if HAS_MASK and PREFIX_IN:  # the summary layer 0 wrote: one value, no barrier; its latency hides behind X's
        summary = tl.load(Prefix + b)

    # LayerNorm 1 of every key row (unless K and V come precomputed) and of this program's query rows
    if not KV_GLOBAL:
        xk = tl.load(x_base + keys[:, None] * stride_xs + cols[None, :],
                     mask=(keys < seq_len)[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
        hk = _layer_norm_rows(xk, N1w, N1b, cols, col_ok, d_model, eps).to(op_ty)
    xq = tl.load(x_base + rows[:, None] * stride_xs + cols[None, :], mask=row_ok[:, None] & col_ok[None, :],
                 other=0.0).to(tl.float32)
    # The mask is summarized after the residual rows are requested: read before them, its load and the barrier of
    # its layout change would delay those loads by a memory round trip (docs/decisions.md#fused-mask-summary).
    key_len = seq_len  # where this sequence's mask is a prefix: its length
    not_prefix = False
    if HAS_MASK:
        if not PREFIX_IN:
            summary = prefix_length_of_row(mask_row, seq_len, first_mask_block(mask_row, seq_len, BLOCK_S, True),
                                           BLOCK_S)
            if PREFIX_OUT:
                if pid_m == 0:
                    tl.store(Prefix + b, summary)
        not_prefix = summary < 0
        key_len = tl.where(not_prefix, seq_len, summary)
    hq = _layer_norm_rows(xq, N1w, N1b, cols, col_ok, d_model, eps).to(op_ty)

    # a prefix's visibility is index arithmetic, as without a mask; only a mask that is no prefix is read into the
    # [BLOCK_M, BLOCK_S] tile
    visible = (keys < key_len)[None, :]
    if HAS_MASK:
        if not_prefix:
            visible = (key_ok & (tl.load(mask_row + keys, mask=key_ok, other=0) != 0))[None, :]
    if IS_CAUSAL:
        visible = visible & (keys[None, :] <= rows[:, None])
    KEY_BLOCKS: tl.constexpr = KV_GLOBAL and BLOCK_N < BLOCK_S
    if KEY_BLOCKS:  # keys past this tile's last query are never visible under a causal mask
        if IS_CAUSAL:
            key_hi = tl.minimum(seq_len, (pid_m + 1) * BLOCK_M)
        else:
            key_hi = seq_len

    # attention, head by head, with the out-projection accumulated per head
    attn = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    w_mask = col_ok[:, None] & hd_ok[None, :]  # [BLOCK_D, BLOCK_HD] slices of a [*, d] weight
    for h in range(NUM_HEADS):
        f0 = h * HEAD_DIM
        # W^T slices [d, head_dim]: element (c, j) of the q/k/v weight is row (part*d + f0 + j), column c
        wq = tl.load(Wqkv + (f0 + hcol[None, :]) * d_model + cols[:, None], mask=w_mask, other=0.0)
        if not KV_GLOBAL:
            wk = tl.load(Wqkv + (d_model + f0 + hcol[None, :]) * d_model + cols[:, None], mask=w_mask, other=0.0)
            wv = tl.load(Wqkv + (2 * d_model + f0 + hcol[None, :]) * d_model + cols[:, None], mask=w_mask,
                         other=0.0)
        bq = tl.load(Bqkv + f0 + hcol, mask=hd_ok, other=0.0).to(tl.float32)
        if not KV_GLOBAL:
            bk = tl.load(Bqkv + d_model + f0 + hcol, mask=hd_ok, other=0.0).to(tl.float32)
            bv = tl.load(Bqkv + 2 * d_model + f0 + hcol, mask=hd_ok, other=0.0).to(tl.float32)
        q = (_mm(hq, wq) + bq[None, :]).to(op_ty)
        if KEY_BLOCKS:
            o = _attend_key_blocks(q, KV + b * stride_kvb + f0, mask_row, rows, hcol, hd_ok, stride_kvs,
                                   d_model, seq_len, key_hi, qk_scale, key_len, not_prefix,
                                   BLOCK_M, BLOCK_HD, BLOCK_N, IS_CAUSAL, HAS_MASK)
        elif KV_GLOBAL:  # this head's precomputed keys and values: [BLOCK_S, BLOCK_HD] tiles of KV
            kv_ptrs = KV + b * stride_kvb + keys[:, None] * stride_kvs + f0 + hcol[None, :]
            kv_ok = (keys < seq_len)[:, None] & hd_ok[None, :]
            k = tl.load(kv_ptrs, mask=kv_ok, other=0.0)
            v = tl.load(kv_ptrs + d_model, mask=kv_ok, other=0.0)
            s = _mm(q, tl.trans(k)) * qk_scale
        else:
            k = (_mm(hk, wk) + bk[None, :]).to(op_ty)
            v = (_mm(hk, wv) + bv[None, :]).to(op_ty)
            s = _mm(q, tl.trans(k)) * qk_scale
        if not KEY_BLOCKS:
            s = tl.where(visible, s, float("-inf"))
            m = tl.max(s, 1)
            m = tl.where(m == float("-inf"), 0.0, m)
            p = tl.math.exp2(s - m[:, None])
            total = tl.sum(p, 1)
            o = _mm(p.to(op_ty), v) / tl.where(total == 0.0, 1.0, total)[:, None]
        # out-projection rows f0..f0+head_dim of W_o^T: element (j, n) is Wo[n, f0 + j]
        wo = tl.load(Wo + cols[None, :] * d_model + f0 + hcol[:, None], mask=hd_ok[:, None] & col_ok[None, :],
                     other=0.0)
        attn += _mm(o.to(op_ty), wo)
    bo = tl.load(Bo + cols, mask=col_ok, other=0.0).to(tl.float32)
    x1 = xq + attn + bo[None, :]
    x2 = _ffn_residual(x1, N2w, N2b, Win, Bin, Wout, Bout, cols, col_ok, d_model, ffn_dim, eps, BLOCK_M, BLOCK_D,
                       BLOCK_F)
    _store_rows(x2, Y, Mask, b, stride_yb, stride_ys, stride_mb, NFw, NFb, rows, row_ok, cols, col_ok, d_model, eps,
                key_len, not_prefix, HAS_MASK, FINAL_NORM, ROW_MASK_BRANCH)
    pdl_release_end(PDL)


@triton.jit
def _ln_kv_fwd(
    X,  # pointer to the residual stream in, [B, S, d]
    KV,  # pointer to the output [B, S, n_cols]: LN1(x) @ Wqkv[first_col:first_col + n_cols]ᵀ + bias, operand dtype
    Wqkv, Bqkv,  # pointers to the packed QKV weight [3d, d] and bias [3d]: rows 0..d W_q, d..2d W_k, 2d..3d W_v
    N1w, N1b,  # pointers to LayerNorm 1 weight/bias [d] (fp32)
    stride_xb, stride_xs,  # X strides (elements) for batch and sequence; unit stride along d
    stride_kvb, stride_kvs,  # KV strides for batch and sequence; unit stride along the n_cols columns
    seq_len, d_model, eps,
    first_col, n_cols,  # the projection's output columns: d, 2d (keys and values), or 0, 3d (q, k and v)
    cols_per_program,  # this program's share of the n_cols columns (a multiple of BLOCK_N): grid axis 2 splits them
    Mask, PrefixOut, stride_mb,  # with WRITE_PREFIX: int8 mask [B, S] in, its per-sequence prefix summary out
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    WRITE_PREFIX: tl.constexpr, MASK_BLOCK: tl.constexpr,
    PDL: tl.constexpr,  # programmatic dependent launch (kernels/pdl.py)
):
    """LayerNorm 1 and a column range of the QKV projection of every token, once: keys and values for
    _fused_layer_fwd with KV_GLOBAL (the same math as its in-program recomputation: LayerNorm 1 in fp32,
    operand-dtype dot, fp32 accumulation, bias, rounding), or q, k and v for the split layer (ln_qkv). A program
    takes BLOCK_T tokens and columns [program_id(2) * cols_per_program, + cols_per_program) of n_cols; with
    several column blocks each recomputes its tokens' LayerNorm (cheap) so that few tokens still fill the GPU."""
    pdl_release_start(PDL)
    pdl_wait(PDL)
    pid_t = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    c_lo = tl.program_id(2) * cols_per_program
    c_hi = tl.minimum(n_cols, c_lo + cols_per_program)
    if WRITE_PREFIX:  # the mask's summary (kernels/mask.py) on the side, by one program per sequence: no launch.
        # Its first mask block is loaded here, beside x; the summary is finished and stored after the projection.
        summarizes = (pid_t == 0) & (tl.program_id(2) == 0)
        mask_head = first_mask_block(Mask + b * stride_mb, seq_len, MASK_BLOCK, summarizes)
    op_ty = Wqkv.dtype.element_ty
    rows = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_D)
    col_ok = cols < d_model
    row_ok = rows < seq_len
    x = tl.load(X + b * stride_xb + rows[:, None] * stride_xs + cols[None, :], mask=row_ok[:, None] & col_ok[None, :],
                other=0.0).to(tl.float32)
    h = _layer_norm_rows(x, N1w, N1b, cols, col_ok, d_model, eps).to(op_ty)
    _project_rows(h, Wqkv, Bqkv, KV + b * stride_kvb, rows, row_ok, stride_kvs, cols, col_ok, d_model, first_col, c_lo,
                  c_hi, BLOCK_N)
    if WRITE_PREFIX:
        if summarizes:
            tl.store(PrefixOut + b, prefix_length_of_row(Mask + b * stride_mb, seq_len, mask_head, MASK_BLOCK))
    pdl_release_end(PDL)


# ----------------------------------------------------------------------------------------------
# Launchers and public functions
# ----------------------------------------------------------------------------------------------
# _ln_project's launch: 64 columns per step; programs of 64 tokens, or 32 or 16 where even one program per column
# step leaves fewer than LN_PROJECT_MIN_PROGRAMS // 2 programs (about one per SM of the H200's 132); then as many
# column blocks as it takes for LN_PROJECT_MIN_PROGRAMS programs, so that a few tokens still fill the GPU
# (docs/decisions.md#split-layer).
LN_PROJECT_BLOCK_N = PROJECT_BLOCK_N
LN_PROJECT_MIN_PROGRAMS = 264


def _ln_project_grid(B, S, n_cols, block_t=None, col_blocks=None):
    """(block_t, cols_per_program, grid) of an _ln_kv_fwd launch over B sequences of S tokens and n_cols columns
    (defaults: the rule above; block_t at most S's power of two, at least 16)."""
    steps = triton.cdiv(n_cols, LN_PROJECT_BLOCK_N)
    if block_t is None:
        for block_t in (64, 32, 16):
            if block_t <= max(16, triton.next_power_of_2(S)) and (
                    triton.cdiv(S, block_t) * B * steps >= LN_PROJECT_MIN_PROGRAMS // 2):
                break
    token_blocks = triton.cdiv(S, block_t)
    if col_blocks is None:
        col_blocks = triton.cdiv(LN_PROJECT_MIN_PROGRAMS, token_blocks * B)
    steps_per_program = triton.cdiv(steps, max(1, min(col_blocks, steps)))
    return (block_t, steps_per_program * LN_PROJECT_BLOCK_N,
            (token_blocks, B, triton.cdiv(steps, steps_per_program)))


def _ln_project(x, w, first_col, n_cols, eps, block_t=None, col_blocks=None, num_warps=4, mask=None, pdl=False):
    """LayerNorm 1 of every token of x [B, S, d] and its projection onto rows first_col..first_col + n_cols of
    the packed QKV weight: [B, S, n_cols] in the weights' dtype (one _ln_kv_fwd launch; `_ln_project_grid`).
    With `mask` (bool [B, S]) the same launch also returns its prefix summary (kernels.mask.prefix_lengths).
    pdl: launch with programmatic dependent launch (kernels/pdl.py)."""
    B, S, d = x.shape
    out = torch.empty((B, S, n_cols), device=x.device, dtype=w["qkv_w"].dtype)
    block_t, cols_per_program, grid = _ln_project_grid(B, S, n_cols, block_t, col_blocks)
    if mask is not None:
        m = mask.contiguous().view(torch.int8)
        prefix = torch.empty(B, dtype=torch.int32, device=x.device)
    else:
        m = prefix = out  # placeholders, never read or written
    _ln_kv_fwd[grid](
        x, out, w["qkv_w"], w["qkv_b"], w["n1_w"], w["n1_b"], x.stride(0), x.stride(1), out.stride(0), out.stride(1),
        S, d, eps, first_col, n_cols, cols_per_program, m, prefix, m.stride(0) if mask is not None else 0,
        BLOCK_T=block_t, BLOCK_D=max(16, triton.next_power_of_2(d)), BLOCK_N=LN_PROJECT_BLOCK_N,
        WRITE_PREFIX=mask is not None, MASK_BLOCK=summary_block(S), num_warps=num_warps,
        num_stages=1, **launch_options(pdl, "ln_qkv"),
    )
    return out if mask is None else (out, prefix)


def ln_qkv(x, w, *, eps, block_t=None, col_blocks=None, num_warps=4, mask=None, pdl=False):
    """LayerNorm 1 and the packed QKV projection of x [B, S, d] (d <= MAX_D_MODEL, unit stride along d) in one
    kernel: [B, S, 3d] (q, k, v) in the weights' dtype (fp16/bf16), with fp32 statistics and sums. `w` as for
    fused_layer (qkv_w, qkv_b, n1_w, n1_b); eps: LayerNorm 1's epsilon. block_t, col_blocks, num_warps: the launch
    (None: `_ln_project_grid`'s defaults), for benchmarks. With `mask` (bool [B, S]): returns (qkv, the mask's
    prefix summary as kernels.mask.prefix_lengths gives it), computed in the same launch. pdl: launch with
    programmatic dependent launch (kernels/pdl.py), for a kernel that follows another of the same forward."""
    B, S, d = x.shape
    if not MIN_D_MODEL <= d <= MAX_D_MODEL or x.stride(-1) != 1:
        raise ValueError(f"ln_qkv: x must be [B, S, d] with {MIN_D_MODEL} <= d <= {MAX_D_MODEL} and unit stride "
                         f"along d, got shape {tuple(x.shape)} strides {x.stride()}")
    if w["qkv_w"].shape != (3 * d, d) or w["qkv_w"].dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"ln_qkv: qkv_w must be float16/bfloat16 [3d, d] = [{3 * d}, {d}], got "
                         f"{w['qkv_w'].dtype} {tuple(w['qkv_w'].shape)}")
    if mask is not None and (mask.dtype != torch.bool or tuple(mask.shape) != (B, S)):
        raise ValueError(f"ln_qkv: mask must be bool [B, S]={B, S}, got {mask.dtype} {tuple(mask.shape)}")
    return _ln_project(x, w, 0, 3 * d, eps, block_t, col_blocks, num_warps, mask, pdl)


def why_unsupported(seq_len: int, d_model: int, num_heads: int) -> str | None:
    """Why `fused_layer` cannot serve this shape, or None when it can: the one statement of its limits."""
    if not (seq_len <= MAX_SEQ and MIN_D_MODEL <= d_model <= MAX_D_MODEL):
        return (f"the fused layer serves seq_len <= {MAX_SEQ} and {MIN_D_MODEL} <= d_model <= {MAX_D_MODEL}, "
                f"got seq_len={seq_len}, d_model={d_model}")
    if d_model % num_heads != 0:
        return f"the fused layer needs d_model % num_heads == 0, got {d_model} % {num_heads}"
    return None


def _block_size(name: str, value, default: int, most: int) -> int:
    """A launcher's tile size: `default` for None, else a power of two of at least 16 (the smallest dot tile),
    capped at `most` (the padded size of the dimension it tiles)."""
    if value is None:
        return default
    if not isinstance(value, int) or value < 16 or value & (value - 1):
        raise ValueError(f"fused_layer: {name} must be a power of two of at least 16 (or None), got {value!r}")
    return min(value, most)


# The output rows' mask loaded in a branch on "no prefix" instead of predicated off for a prefix (_store_rows): a
# prefix then reads no mask at all, as fast as no mask (docs/decisions.md#fused-mask-summary). False: predicated off.
ROW_MASK_BRANCH = True


def fused_layer(x, w, *, num_heads, causal, eps, mask=None, final=None, out_dtype=None, out=None, block_m=None,
                num_warps=4, num_stages=1, kv_precompute=False, key_block=None, ffn_block=None,
                mask_prefix_lengths=None, prefix_out=None, pdl=False):
    """One layer (and the final norm when `final=(weight, bias)`) over `x [B, S, d]`.

    w: dict with qkv_w [3d, d], qkv_b [3d], o_w, o_b, in_w [ffn, d], in_b, out_w [d, ffn], out_b in the
    operand dtype (fp16/bf16) and n1_w, n1_b, n2_w, n2_b in fp32; eps: the LayerNorms' epsilon (the model's,
    model/reference.py). Returns the new fp32 residual
    `[B, S, d]`, or the normalized output (in `out_dtype`, default x's dtype) when `final` is given.
    block_m, num_warps, num_stages: launch configuration (defaults: the one checked on the H200).
    kv_precompute: compute the keys and values of every token once, in a second small kernel (_ln_kv_fwd),
    and have the layer kernel read them instead of each program recomputing them for the whole sequence
    (S / block_m times per sequence). Same math up to accumulation order; two launches per layer.
    key_block (with kv_precompute only): keys per step of an online softmax instead of the whole sequence at
    once, and a causal tile stops at its last query. Fewer live registers; the softmax's rounding differs.
    ffn_block: FFN columns per step (default 64, or ffn_dim's power of two when smaller).
    None for either keeps the kernel as the committed policy runs it.
    With a mask the kernel summarizes it per sequence (kernels.mask: its prefix length, or -1) and treats a prefix
    as index arithmetic; prefix_out (int32 [B]) also receives that summary, and a later layer given it as
    mask_prefix_lengths reads it instead of the mask (it must describe `mask`: the kernel trusts it).
    pdl: launch the layer's kernels with programmatic dependent launch (kernels/pdl.py), for a layer that follows
    another kernel of the same forward.
    """
    B, S, d = x.shape
    why = why_unsupported(S, d, num_heads)
    if why:
        raise ValueError(f"fused_layer: {why}")
    if x.stride(-1) != 1:
        raise ValueError(f"fused_layer: x must have unit stride along d_model, got strides {x.stride()}")
    op = w["qkv_w"].dtype
    if op not in (torch.float16, torch.bfloat16):
        raise TypeError(f"fused_layer: weights must be float16 or bfloat16, got {op}")
    ffn = w["in_w"].shape[0]
    if w["qkv_w"].shape != (3 * d, d) or w["in_w"].shape != (ffn, d) or w["out_w"].shape != (d, ffn):
        raise ValueError("fused_layer: weight shapes do not match d_model/ffn_dim")
    if mask is not None and (mask.dtype != torch.bool or tuple(mask.shape) != (B, S)):
        raise ValueError(f"fused_layer: mask must be bool [B, S]={B, S}, got {mask.dtype} {tuple(mask.shape)}")
    for name, t in (("mask_prefix_lengths", mask_prefix_lengths), ("prefix_out", prefix_out)):
        if t is None:
            continue
        if mask is None:
            raise ValueError(f"fused_layer: {name} describes a mask; give mask too")
        check_summary("fused_layer", name, t, B, x.device)
    if mask_prefix_lengths is not None and prefix_out is not None:
        raise ValueError("fused_layer: give mask_prefix_lengths (read the summary) or prefix_out (write it), not both")
    hd = d // num_heads
    if out is None:
        out = torch.empty((B, S, d), device=x.device, dtype=torch.float32 if final is None else out_dtype or x.dtype)
    m = mask.contiguous().view(torch.int8) if mask is not None else out
    nf_w, nf_b = final if final is not None else (w["n1_w"], w["n1_b"])
    block_s = max(16, triton.next_power_of_2(S))
    # default 32 query rows with 4 warps, 1 stage: the first configuration checked on the H200. The model
    # passes the policy's tuned configuration (model/routing_policy.json, fused.launch; `shapewise tune`).
    block_m = min(block_s, block_m or 32)
    if block_m > MAX_BLOCK_M:
        raise ValueError(f"fused_layer: block_m must be at most {MAX_BLOCK_M}, got {block_m}")
    block_d = max(16, triton.next_power_of_2(d))
    block_n = _block_size("key_block", key_block, block_s, block_s)
    if block_n < block_s and not kv_precompute:
        raise ValueError(f"fused_layer: key_block={key_block} (< the padded sequence {block_s}) needs "
                         f"kv_precompute=True: the key blocks are read from the precomputed keys and values")
    ffn_pad = max(16, triton.next_power_of_2(ffn))
    block_f = _block_size("ffn_block", ffn_block, min(64, ffn_pad), ffn_pad)
    kv = _ln_project(x, w, d, 2 * d, eps, pdl=pdl) if kv_precompute else out  # out: a placeholder pointer, never read
    grid = (triton.cdiv(S, block_m), B)
    prefix = mask_prefix_lengths if mask_prefix_lengths is not None else prefix_out
    _fused_layer_fwd[grid](
        x, out, m, prefix if prefix is not None else m,
        w["qkv_w"], w["qkv_b"], w["o_w"], w["o_b"], w["in_w"], w["in_b"], w["out_w"], w["out_b"],
        w["n1_w"], w["n1_b"], w["n2_w"], w["n2_b"], nf_w, nf_b,
        kv, kv.stride(0) if kv_precompute else 0, kv.stride(1) if kv_precompute else 0,
        x.stride(0), x.stride(1), out.stride(0), out.stride(1), m.stride(0) if mask is not None else 0,
        S, d, ffn, hd**-0.5 * math.log2(math.e), eps,
        NUM_HEADS=num_heads, HEAD_DIM=hd, BLOCK_HD=max(16, triton.next_power_of_2(hd)),
        BLOCK_D=block_d, BLOCK_F=block_f, BLOCK_M=block_m, BLOCK_S=block_s,
        IS_CAUSAL=bool(causal), HAS_MASK=mask is not None, FINAL_NORM=final is not None,
        KV_GLOBAL=bool(kv_precompute), BLOCK_N=block_n, PREFIX_IN=mask_prefix_lengths is not None,
        PREFIX_OUT=prefix_out is not None, ROW_MASK_BRANCH=ROW_MASK_BRANCH,
        num_warps=num_warps, num_stages=num_stages, **launch_options(pdl, "fused_layer"),
    )
    return out
