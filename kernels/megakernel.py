"""The whole pre-LayerNorm Transformer forward in one Triton kernel, for sequences whose working set fits on chip.

One program takes one sequence at a time (persistent: program p runs sequences p, p + P, ...) and runs every
layer, the final LayerNorm and the masks on it. Per layer, three phases separated by CTA barriers:
  A. LayerNorm 1 of every row and the packed QKV projection, into the program's q/k/v scratch;
  B. per block of query rows, every head at once in batched dots: online softmax over key blocks (a causal tile
     stops at its last query), into the program's attention scratch;
  C. per block of rows: the out-projection, the residual add, LayerNorm 2, the FFN (bias, exact GELU, bias) chunk
     by chunk, the second residual add, invalid rows zeroed, into the residual scratch (the last layer writes the
     final LayerNorm of it to the output instead). The residual is the accumulator's start: no second fp32 tile is
     live across the FFN.
The scratch is per program ([P, S, d] fp32 residual, [P, S, 3d] q/k/v and [P, S, d] attention in the operand
dtype), written and read back by the same program within microseconds, so it stays in L2: HBM sees each
sequence's input once and its output once, and every layer's weights are read from L2. Matmul operands fp16 or
bf16, accumulation and statistics fp32.

A mask is summarized per sequence on entry (kernels/mask.py: its prefix length, or -1): a prefix, the official
harness's all-True mask among them, is index arithmetic; only a mask that is no prefix is read into the tiles.

One program per sequence serializes a layer into a chain of dependent steps (load, layout change, dot) that no
other work hides: on the official rows it runs slower than the per-layer routes, and the routing policy leaves it
off (docs/decisions.md#megakernel).
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ..model.reference import LAYER_NORM_EPS
from .fused_layer import fused_layer_reference
from .mask import first_mask_block, prefix_length_of_row, summary_block
from .tiles import DOT_BF16_IN_FP32, MAX_D_MODEL, MIN_D_MODEL, _layer_norm_rows, _mm, _store_rows

# A row of the residual stream is one tile (tiles.MAX_D_MODEL); one sequence's scratch (12 * seq_len * d_model
# bytes at fp16 operands) times one program per SM stays well inside the H200's 50 MB L2.
MAX_SEQ_X_D_MODEL = 128 * 128
MAX_HEAD_DIM = 128
FINAL_WEIGHTS = ("final_w", "final_b")  # the final LayerNorm's; every other entry of the weights is stacked per layer


# ----------------------------------------------------------------------------------------------
# Plain torch reference (fp64)
# ----------------------------------------------------------------------------------------------
def megakernel_reference(x, w, *, num_heads, causal, mask=None, eps=LAYER_NORM_EPS):
    """The whole forward in fp64 over stacked weights (`stack_layers`'s layout); invalid rows 0."""
    num_layers = w["qkv_w"].shape[0]
    h = x.double()
    for i in range(num_layers):
        last = i == num_layers - 1
        layer = {n: t[i] for n, t in w.items() if n not in FINAL_WEIGHTS}
        h = fused_layer_reference(h, layer, num_heads=num_heads, causal=causal,
                                  mask=mask, final=(w["final_w"], w["final_b"]) if last else None, eps=eps)
    return h


# ----------------------------------------------------------------------------------------------
# Triton kernel
# ----------------------------------------------------------------------------------------------
@triton.jit
def _mm_acc(a, b, acc):
    """acc + a @ b, accumulated in place (operands already in the fp16/bf16 operand type)."""
    if DOT_BF16_IN_FP32:
        return acc + _mm(a, b)
    return tl.dot(a, b, acc)


@triton.jit
def _ffn_into(x1, N2w, N2b, Win, Bin, Wout, Bout, cols, col_ok, d_model, ffn_dim, eps, BLOCK_F: tl.constexpr):
    """x1 + FFN(LayerNorm 2(x1)) for an fp32 tile of residual rows (padding columns 0), accumulated into x1 itself
    so that no second [rows, d] fp32 tile is live across the FFN: chunk by chunk over ffn_dim (bias, exact GELU)."""
    op_ty = Win.dtype.element_ty
    h2 = _layer_norm_rows(x1, N2w, N2b, cols, col_ok, d_model, eps).to(op_ty)
    acc = x1 + tl.load(Bout + cols, mask=col_ok, other=0.0)[None, :]
    fcol = tl.arange(0, BLOCK_F)
    for f_start in range(0, ffn_dim, BLOCK_F):
        f_ok = (f_start + fcol) < ffn_dim
        w_in = tl.load(Win + (f_start + fcol[None, :]) * d_model + cols[:, None],
                       mask=col_ok[:, None] & f_ok[None, :], other=0.0)  # [BLOCK_D, BLOCK_F] = W_inᵀ slice
        t = _mm(h2, w_in) + tl.load(Bin + f_start + fcol, mask=f_ok, other=0.0)[None, :]
        t = 0.5 * t * (1.0 + tl.erf(t * 0.7071067811865476))  # exact GELU
        w_out = tl.load(Wout + cols[None, :] * ffn_dim + f_start + fcol[:, None],
                        mask=f_ok[:, None] & col_ok[None, :], other=0.0)  # [BLOCK_F, BLOCK_D] = W_outᵀ slice
        acc = _mm_acc(t.to(op_ty), w_out, acc)
    return acc


@triton.jit
def _attend_all_heads(qkv_base, mask_row, rows, row_ok, hh, jj, head_ok, qkv_cols, d_model, seq_len, key_hi,
                      qk_scale, key_len, not_prefix, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr):
    """Every head's attention output [BLOCK_H, BLOCK_M, BLOCK_HD] (fp32) for the query rows `rows`, over keys
    0..key_hi in blocks of BLOCK_N with an online softmax (fp32 running max and sum), all heads in each batched
    dot: the q, k, v of token t, head h, lane j are at qkv_base + t * qkv_cols + {0, d, 2d} + h * head_dim + j."""
    lane = hh[:, None, None] * HEAD_DIM + jj[None, None, :]  # [BLOCK_H, 1, BLOCK_HD]
    lane_ok = head_ok[:, None, :]
    q = tl.load(qkv_base + rows[None, :, None] * qkv_cols + lane, mask=lane_ok & row_ok[None, :, None], other=0.0)
    m_i = tl.full([hh.shape[0], BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([hh.shape[0], BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([hh.shape[0], BLOCK_M, jj.shape[0]], dtype=tl.float32)
    lane_t = hh[:, None, None] * HEAD_DIM + jj[None, :, None]  # [BLOCK_H, BLOCK_HD, 1]: kᵀ's rows
    lane_t_ok = head_ok[:, :, None]
    for n0 in range(0, key_hi, BLOCK_N):
        kn = n0 + tl.arange(0, BLOCK_N)
        kn_ok = kn < seq_len
        k_t = tl.load(qkv_base + d_model + kn[None, None, :] * qkv_cols + lane_t,
                      mask=lane_t_ok & kn_ok[None, None, :], other=0.0)  # [BLOCK_H, BLOCK_HD, BLOCK_N]
        v = tl.load(qkv_base + 2 * d_model + kn[None, :, None] * qkv_cols + lane,
                    mask=lane_ok & kn_ok[None, :, None], other=0.0)  # [BLOCK_H, BLOCK_N, BLOCK_HD]
        s = _mm(q, k_t) * qk_scale
        visible = kn < key_len  # key_len <= seq_len
        if HAS_MASK:  # a prefix reads no mask: key_len says it all
            visible = visible & (tl.load(mask_row + kn, mask=kn_ok & not_prefix, other=1) != 0)
        visible = visible[None, None, :]
        if IS_CAUSAL:
            visible = visible & (kn[None, None, :] <= rows[None, :, None])
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 2))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with no visible key so far stay at 0
        p = tl.math.exp2(s - m_use[:, :, None])
        alpha = tl.math.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 2)
        acc = _mm_acc(p.to(q.dtype), v, acc * alpha[:, :, None])
        m_i = m_new
    return acc / tl.where(l_i == 0.0, 1.0, l_i)[:, :, None]


@triton.jit
def _megakernel_fwd(
    X,  # pointer to the input [B, S, d] (any float dtype; unit stride along d)
    Y,  # pointer to the output [B, S, d] (the output dtype; unit stride along d)
    Mask,  # pointer to int8 [B, S], 1 = valid token; read when HAS_MASK
    Res,  # pointer to the residual scratch [P, S, d] fp32 (P = programs)
    QKV,  # pointer to the q/k/v scratch [P, S, 3d], operand dtype: columns q 0..d, k d..2d, v 2d..3d
    Att,  # pointer to the attention scratch [P, S, d], operand dtype: head h, lane j at column h * head_dim + j
    Wqkv, Bqkv,  # [L, 3d, d] operand dtype, [L, 3d] fp32
    Wo, Bo,  # [L, d, d], [L, d]
    Win, Bin,  # [L, ffn, d], [L, ffn]
    Wout, Bout,  # [L, d, ffn], [L, d]
    N1w, N1b, N2w, N2b,  # [L, d] fp32
    NFw, NFb,  # [d] fp32
    batch, seq_len, d_model, ffn_dim, num_layers, qk_scale, eps,  # qk_scale = head_dim**-0.5 * log2(e)
    stride_xb, stride_xs, stride_yb, stride_ys, stride_mb,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HD: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_F: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_A: tl.constexpr, BLOCK_C: tl.constexpr,
    MASK_BLOCK: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_D)
    col_ok = cols < d_model
    ccol = tl.arange(0, BLOCK_C)
    hh = tl.arange(0, BLOCK_H)  # heads, padded to a power of two
    jj = tl.arange(0, BLOCK_HD)  # lanes of a head, padded likewise
    head_ok = (hh[:, None] < NUM_HEADS) & (jj[None, :] < HEAD_DIM)  # [BLOCK_H, BLOCK_HD]
    qkv_cols = 3 * d_model
    res_base = Res + pid.to(tl.int64) * seq_len * d_model
    qkv_base = QKV + pid.to(tl.int64) * seq_len * qkv_cols
    att_base = Att + pid.to(tl.int64) * seq_len * d_model
    for b in range(pid.to(tl.int64), batch, tl.num_programs(0)):  # int64: b * stride_xb may pass 2**31
        x_base = X + b * stride_xb
        y_base = Y + b * stride_yb
        mask_row = Mask + b * stride_mb
        key_len = seq_len  # where this sequence's mask is a prefix: its length
        not_prefix = False
        if HAS_MASK:
            summary = prefix_length_of_row(mask_row, seq_len, first_mask_block(mask_row, seq_len, MASK_BLOCK, True),
                                           MASK_BLOCK)
            not_prefix = summary < 0
            key_len = tl.where(not_prefix, seq_len, summary)
        for layer in range(num_layers):
            wqkv = Wqkv + layer * qkv_cols * d_model
            bqkv = Bqkv + layer * qkv_cols
            n1w = N1w + layer * d_model
            n1b = N1b + layer * d_model
            # A. LayerNorm 1 and q, k, v of every row, BLOCK_A rows at a time
            for m0 in range(0, seq_len, BLOCK_A):
                rows = m0 + tl.arange(0, BLOCK_A)
                row_ok = rows < seq_len
                tile_ok = row_ok[:, None] & col_ok[None, :]
                if layer == 0:
                    x = tl.load(x_base + rows[:, None] * stride_xs + cols[None, :], mask=tile_ok,
                                other=0.0).to(tl.float32)
                else:
                    x = tl.load(res_base + rows[:, None] * d_model + cols[None, :], mask=tile_ok, other=0.0)
                h = _layer_norm_rows(x, n1w, n1b, cols, col_ok, d_model, eps).to(Wqkv.dtype.element_ty)
                for c0 in range(0, qkv_cols, BLOCK_C):
                    c = c0 + ccol
                    c_ok = c < qkv_cols
                    # [BLOCK_D, BLOCK_C] slice of Wqkvᵀ: element (k, j) is row c0 + j, column k of Wqkv
                    w = tl.load(wqkv + c[None, :] * d_model + cols[:, None], mask=col_ok[:, None] & c_ok[None, :],
                                other=0.0)
                    bias = tl.load(bqkv + c, mask=c_ok, other=0.0)
                    t = _mm(h, w) + bias[None, :]
                    tl.store(qkv_base + rows[:, None] * qkv_cols + c[None, :], t.to(QKV.dtype.element_ty),
                             mask=row_ok[:, None] & c_ok[None, :])
            tl.debug_barrier()  # every row's q, k, v written before any query block reads them
            # B. attention per block of query rows, every head at once, into the attention scratch
            for m0 in range(0, seq_len, BLOCK_M):
                rows = m0 + tl.arange(0, BLOCK_M)
                row_ok = rows < seq_len
                if IS_CAUSAL:  # keys past this tile's last query are never visible
                    key_hi = tl.minimum(seq_len, m0 + BLOCK_M)
                else:
                    key_hi = seq_len
                o = _attend_all_heads(qkv_base, mask_row, rows, row_ok, hh, jj, head_ok, qkv_cols, d_model,
                                      seq_len, key_hi, qk_scale, key_len, not_prefix, HEAD_DIM, BLOCK_M, BLOCK_N,
                                      IS_CAUSAL, HAS_MASK)
                # head h, lane j at column h * head_dim + j: the heads side by side, as the out-projection reads them
                o_ptrs = att_base + rows[None, :, None] * d_model + (hh[:, None, None] * HEAD_DIM + jj[None, None, :])
                tl.store(o_ptrs, o.to(Att.dtype.element_ty), mask=head_ok[:, None, :] & row_ok[None, :, None])
            tl.debug_barrier()  # every query row's attention written before the out-projection reads it
            # C. out-projection, residual, LayerNorm 2, FFN, residual per block of rows
            wo = Wo + layer * d_model * d_model
            for m0 in range(0, seq_len, BLOCK_M):
                rows = m0 + tl.arange(0, BLOCK_M)
                row_ok = rows < seq_len
                tile_ok = row_ok[:, None] & col_ok[None, :]
                # the residual is the accumulator's start: the stream, then + out-projection, + FFN, all fp32
                if layer == 0:
                    x = tl.load(x_base + rows[:, None] * stride_xs + cols[None, :], mask=tile_ok,
                                other=0.0).to(tl.float32)
                else:
                    x = tl.load(res_base + rows[:, None] * d_model + cols[None, :], mask=tile_ok, other=0.0)
                acc = x + tl.load(Bo + layer * d_model + cols, mask=col_ok, other=0.0)[None, :]
                o = tl.load(att_base + rows[:, None] * d_model + cols[None, :], mask=tile_ok, other=0.0)
                # W_oᵀ: element (j, n) is Wo[n, j]
                wo_t = tl.load(wo + cols[None, :] * d_model + cols[:, None], mask=col_ok[:, None] & col_ok[None, :],
                               other=0.0)
                acc = _mm_acc(o, wo_t, acc)
                x2 = _ffn_into(acc, N2w + layer * d_model, N2b + layer * d_model, Win + layer * ffn_dim * d_model,
                               Bin + layer * ffn_dim, Wout + layer * d_model * ffn_dim, Bout + layer * d_model,
                               cols, col_ok, d_model, ffn_dim, eps, BLOCK_F)
                if layer == num_layers - 1:
                    _store_rows(x2, y_base, mask_row, 0, 0, stride_ys, 0, NFw, NFb, rows, row_ok, cols, col_ok,
                                d_model, eps, key_len, not_prefix, HAS_MASK, True, True)
                else:
                    _store_rows(x2, res_base, mask_row, 0, 0, d_model, 0, NFw, NFb, rows, row_ok, cols, col_ok,
                                d_model, eps, key_len, not_prefix, HAS_MASK, False, True)
            tl.debug_barrier()  # the residual rows written before the next layer's (or sequence's) phase A


# ----------------------------------------------------------------------------------------------
# Launcher and public function
# ----------------------------------------------------------------------------------------------
def why_unsupported(seq_len: int, d_model: int, num_heads: int) -> str | None:
    """Why `megakernel` cannot serve this shape, or None when it can: the one statement of its limits."""
    if not MIN_D_MODEL <= d_model <= MAX_D_MODEL:
        return f"the megakernel serves {MIN_D_MODEL} <= d_model <= {MAX_D_MODEL}, got d_model={d_model}"
    if seq_len * d_model > MAX_SEQ_X_D_MODEL:
        return (f"the megakernel serves seq_len * d_model <= {MAX_SEQ_X_D_MODEL} (one sequence's working set on "
                f"chip), got {seq_len} * {d_model}")
    if d_model % num_heads != 0:
        return f"the megakernel needs d_model % num_heads == 0, got {d_model} % {num_heads}"
    if d_model // num_heads > MAX_HEAD_DIM:
        return f"the megakernel serves head_dim <= {MAX_HEAD_DIM}, got {d_model // num_heads}"
    return None


def stack_layers(layers: list[dict], final: tuple) -> dict:
    """The megakernel's weights from per-layer dicts (named as the per-layer kernels take them: qkv_w, qkv_b, o_w,
    ..., n2_b) and the final norm's (weight, bias): each name stacked over layers, biases and norms in fp32."""
    out = {n: torch.stack([w[n] for w in layers]).contiguous() for n in layers[0]}
    for n in ("qkv_b", "o_b", "in_b", "out_b"):
        out[n] = out[n].float()
    out["final_w"], out["final_b"] = final[0].float().contiguous(), final[1].float().contiguous()
    return out


def _check_weights(w, d):
    """(ffn_dim, num_layers) of the stacked weights `w` for width d, after checking every tensor's shape and dtype."""
    missing = sorted({"qkv_w", "in_w"} - set(w))
    if missing:
        raise ValueError(f"megakernel: the weights lack {', '.join(missing)} (stack_layers names them)")
    op = w["qkv_w"].dtype
    if op not in (torch.float16, torch.bfloat16):
        raise TypeError(f"megakernel: weights must be float16 or bfloat16, got qkv_w {op}")
    L, ffn = w["qkv_w"].shape[0], w["in_w"].shape[1]
    shapes = {"qkv_w": (L, 3 * d, d), "qkv_b": (L, 3 * d), "o_w": (L, d, d), "o_b": (L, d), "in_w": (L, ffn, d),
              "in_b": (L, ffn), "out_w": (L, d, ffn), "out_b": (L, d), "n1_w": (L, d), "n1_b": (L, d),
              "n2_w": (L, d), "n2_b": (L, d), "final_w": (d,), "final_b": (d,)}
    missing = sorted(set(shapes) - set(w))
    if missing:
        raise ValueError(f"megakernel: the weights lack {', '.join(missing)} (stack_layers names them)")
    for name, shape in shapes.items():
        t = w[name]
        want = op if name in ("qkv_w", "o_w", "in_w", "out_w") else torch.float32
        if tuple(t.shape) != shape or t.dtype != want or not t.is_contiguous():
            raise ValueError(f"megakernel: {name} must be contiguous {want} {list(shape)}, got {t.dtype} "
                             f"{list(t.shape)}{'' if t.is_contiguous() else ' (not contiguous)'}")
    return ffn, L


def _block(name, value, default, most):
    """A launch's tile size: `default` for None, else a power of two of at least 16 (the smallest dot tile); at
    most `most` (the padded size of the dimension it tiles)."""
    if value is None:
        value = default
    elif not isinstance(value, int) or value < 16 or value & (value - 1):
        raise ValueError(f"megakernel: {name} must be a power of two of at least 16 (or None), got {value!r}")
    return min(value, most)


def programs_for(batch: int, device, programs_per_sm: int = 1) -> int:
    """How many persistent programs a launch over `batch` sequences runs: at most `programs_per_sm` per SM."""
    if device.type != "cuda":
        return min(batch, 2)  # the interpreter: two programs exercise the persistent loop and the scratch
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(batch, sms * programs_per_sm))


def megakernel(x, w, *, num_heads, causal, mask=None, out_dtype=None, out=None, block_m=None, block_n=None,
               block_a=None, block_f=None, block_c=None, num_warps=8, num_stages=1, programs_per_sm=1):
    """The whole forward over `x [B, S, d]` with stacked weights `w` (`stack_layers`): [B, S, d] in `out_dtype`
    (default x's dtype), invalid rows 0. The launch (the routing policy's; None: the defaults): block_m query rows
    per tile (64), block_n keys per softmax step (64), block_a rows per step of the QKV projection (block_m), block_f FFN columns per step (64),
    block_c QKV columns per step (64), each at most its dimension's power of two; num_warps, num_stages;
    programs_per_sm persistent programs per SM."""
    if not isinstance(x, torch.Tensor) or x.dim() != 3 or x.stride(-1) != 1:
        raise ValueError(f"megakernel: x must be a [B, S, d] tensor with unit stride along d, got "
                         f"{tuple(getattr(x, 'shape', ()))}")
    B, S, d = x.shape
    why = why_unsupported(S, d, num_heads)
    if why:
        raise ValueError(f"megakernel: {why}")
    ffn, num_layers = _check_weights(w, d)
    if mask is not None and (mask.dtype != torch.bool or tuple(mask.shape) != (B, S) or mask.device != x.device):
        raise ValueError(f"megakernel: mask must be bool [B, S]={B, S} on {x.device}, got {mask.dtype} "
                         f"{tuple(mask.shape)} on {mask.device}")
    if out is None:
        out = torch.empty((B, S, d), device=x.device, dtype=out_dtype or x.dtype)
    elif tuple(out.shape) != (B, S, d) or out.stride(-1) != 1:
        raise ValueError(f"megakernel: out must be [B, S, d]={B, S, d} with unit stride along d")
    programs = programs_for(B, x.device, programs_per_sm)
    res = torch.empty((programs, S, d), device=x.device, dtype=torch.float32)
    qkv = torch.empty((programs, S, 3 * d), device=x.device, dtype=w["qkv_w"].dtype)
    att = torch.empty((programs, S, d), device=x.device, dtype=w["qkv_w"].dtype)
    m = mask.contiguous().view(torch.int8) if mask is not None else out
    hd = d // num_heads
    block_s = max(16, triton.next_power_of_2(S))
    block_m = _block("block_m", block_m, 64, block_s)
    block_n = _block("block_n", block_n, 64, block_s)
    block_a = _block("block_a", block_a, block_m, block_s)
    block_f = _block("block_f", block_f, 64, max(16, triton.next_power_of_2(ffn)))
    block_c = _block("block_c", block_c, 64, max(16, triton.next_power_of_2(3 * d)))
    _megakernel_fwd[(programs,)](
        x, out, m, res, qkv, att,
        w["qkv_w"], w["qkv_b"], w["o_w"], w["o_b"], w["in_w"], w["in_b"], w["out_w"], w["out_b"],
        w["n1_w"], w["n1_b"], w["n2_w"], w["n2_b"], w["final_w"], w["final_b"],
        B, S, d, ffn, num_layers, hd**-0.5 * math.log2(math.e), LAYER_NORM_EPS,
        x.stride(0), x.stride(1), out.stride(0), out.stride(1), m.stride(0) if mask is not None else 0,
        NUM_HEADS=num_heads, HEAD_DIM=hd, BLOCK_H=triton.next_power_of_2(num_heads),
        BLOCK_HD=max(16, triton.next_power_of_2(hd)),
        BLOCK_D=max(16, triton.next_power_of_2(d)), BLOCK_F=block_f, BLOCK_M=block_m,
        BLOCK_N=block_n, BLOCK_A=block_a, BLOCK_C=block_c, MASK_BLOCK=summary_block(S),
        IS_CAUSAL=bool(causal), HAS_MASK=mask is not None, num_warps=num_warps, num_stages=num_stages,
    )
    return out


__all__ = ["megakernel", "megakernel_reference", "stack_layers", "why_unsupported"]
