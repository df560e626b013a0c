"""The rest of a pre-LayerNorm layer after its attention, in one Triton kernel ("layer tail").

Per block of BLOCK_M tokens: the out-projection of the attention output, the residual add, LayerNorm 2, the
FFN chunk by chunk (bias, exact GELU, bias), the second residual add, invalid rows zeroed and, for the last
layer, the final LayerNorm. With `fused_layer.ln_qkv` (LayerNorm 1 and the QKV projection) before it and flash
attention between, a layer is three kernels whose only global traffic is the residual stream, q/k/v and the
attention output: the split layer of the triton and graph routes (model/routing.py, `split_layer`; the policy's
`split_layer.max_d_model` turns it on). A token's row must fit one tile (`why_unsupported`). Matmul operands fp16 or
bf16, accumulation and statistics fp32.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import launch_options, pdl_release_end, pdl_release_start, pdl_wait
from .tiles import MAX_D_MODEL, MIN_D_MODEL, _ffn_residual, _mm, _store_rows


# ----------------------------------------------------------------------------------------------
# Plain torch reference (fp64)
# ----------------------------------------------------------------------------------------------
def layer_tail_reference(o, x, w, *, eps, mask=None, final=None):
    """o: attention output [B, S, d] (heads concatenated); x: the residual stream into the layer [B, S, d];
    w: o_w, o_b, n2_w, n2_b, in_w, in_b, out_w, out_b. Returns the layer's output residual (or, with
    `final=(weight, bias)`, the final LayerNorm of it) in fp64, invalid rows 0; `eps`: the LayerNorms' epsilon."""
    d = x.shape[-1]
    f = {k: v.double() for k, v in w.items()}
    x1 = x.double() + o.double() @ f["o_w"].t() + f["o_b"]
    h = torch.nn.functional.layer_norm(x1, (d,), f["n2_w"], f["n2_b"], eps)
    y = x1 + torch.nn.functional.gelu(h @ f["in_w"].t() + f["in_b"]) @ f["out_w"].t() + f["out_b"]
    if mask is not None:
        y = y.masked_fill(~mask[..., None], 0.0)
    if final is not None:
        y = torch.nn.functional.layer_norm(y, (d,), final[0].double(), final[1].double(), eps)
        if mask is not None:
            y = y.masked_fill(~mask[..., None], 0.0)
    return y


# ----------------------------------------------------------------------------------------------
# Triton kernel
# ----------------------------------------------------------------------------------------------
@triton.jit
def _layer_tail_fwd(
    Att,  # pointer to the attention output [N, d] (N = B*S tokens, contiguous), operand dtype
    X,  # pointer to the residual stream in [N, d] (contiguous; fp32, or the input dtype for layer 0)
    Y,  # pointer to the output [N, d]: fp32 residual, or the final normalized output when FINAL_NORM
    Mask,  # pointer to int8 [N], 1 = valid token; read when HAS_MASK
    Wo, Bo, Win, Bin, Wout, Bout,  # out-projection [d, d], FFN in [ffn, d] and out [d, ffn] weights, biases
    N2w, N2b, NFw, NFb,  # LayerNorm 2 and final LayerNorm weight/bias [d] (fp32); NF read when FINAL_NORM
    n_tokens, d_model, ffn_dim, eps,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_F: tl.constexpr,
    HAS_MASK: tl.constexpr, FINAL_NORM: tl.constexpr,
    PDL: tl.constexpr,  # programmatic dependent launch (kernels/pdl.py): weights first, then the wait
):
    pdl_release_start(PDL)
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_D)
    row_ok = rows < n_tokens
    col_ok = cols < d_model
    tile_ok = row_ok[:, None] & col_ok[None, :]
    # W_o^T [d, d]: element (j, n) is Wo[n, j]
    wo = tl.load(Wo + cols[None, :] * d_model + cols[:, None], mask=col_ok[:, None] & col_ok[None, :], other=0.0)
    bo = tl.load(Bo + cols, mask=col_ok, other=0.0).to(tl.float32)
    pdl_wait(PDL)
    o = tl.load(Att + rows[:, None] * d_model + cols[None, :], mask=tile_ok, other=0.0)
    x = tl.load(X + rows[:, None] * d_model + cols[None, :], mask=tile_ok, other=0.0).to(tl.float32)
    x1 = x + _mm(o.to(Wo.dtype.element_ty), wo) + bo[None, :]
    x2 = _ffn_residual(x1, N2w, N2b, Win, Bin, Wout, Bout, cols, col_ok, d_model, ffn_dim, eps, BLOCK_M, BLOCK_D,
                       BLOCK_F)
    # rows index the flat [N, d] output and [N] mask: one "sequence" (b = 0), row stride d_model, mask stride 1, of
    # n_tokens rows whose mask is read as it is (no prefix summary)
    _store_rows(x2, Y, Mask, 0, 0, d_model, 1, NFw, NFb, rows, row_ok, cols, col_ok, d_model, eps, n_tokens,
                True, HAS_MASK, FINAL_NORM, False)
    pdl_release_end(PDL)


# ----------------------------------------------------------------------------------------------
# Launcher and public function
# ----------------------------------------------------------------------------------------------
def why_unsupported(d_model: int) -> str | None:
    """Why `layer_tail` (and with it the split layer) cannot serve this width, or None when it can."""
    if not MIN_D_MODEL <= d_model <= MAX_D_MODEL:
        return f"the layer tail serves {MIN_D_MODEL} <= d_model <= {MAX_D_MODEL}, got d_model={d_model}"
    return None


# The default launch: 64 tokens per program where that still gives TAIL_MIN_PROGRAMS programs (about one per SM of
# the H200), else 32, else 16: a few tokens (row 2 has 128) spread over more programs instead of two.
TAIL_BLOCK_M = (64, 32, 16)
TAIL_MIN_PROGRAMS = 128


def tail_block_m(n_tokens: int) -> int:
    """The default tokens per program of a layer_tail launch over n_tokens tokens (TAIL_BLOCK_M, TAIL_MIN_PROGRAMS)."""
    for block_m in TAIL_BLOCK_M:
        if triton.cdiv(n_tokens, block_m) >= TAIL_MIN_PROGRAMS:
            return block_m
    return TAIL_BLOCK_M[-1]


def layer_tail(o, x, w, *, eps, mask=None, final=None, out_dtype=None, block_m=None, ffn_block=32, num_warps=None,
               num_stages=3, pdl=False):
    """The layer after attention: `o` [B, S, d] (the attention output, weights' dtype) and `x` [B, S, d] (the
    residual into the layer), both contiguous; `w` with o_w, o_b, in_w, in_b, out_w, out_b (fp16/bf16) and n2_w,
    n2_b (fp32), as for fused_layer. Returns the fp32 residual [B, S, d], or with `final=(weight, bias)` the final
    LayerNorm of it in `out_dtype` (default x's dtype). Rows where `mask` (bool [B, S]) is False are 0. `eps`: the
    LayerNorms' epsilon (the model's, model/reference.py).
    Default launch: `tail_block_m` tokens (64 from 8192 tokens), 4 warps, 32 FFN columns per step, 3 stages: the
    fastest measured on the H200 at d_model 128 (docs/decisions.md#split-layer). pdl: launch with programmatic
    dependent launch (kernels/pdl.py), for a kernel that follows another of the same forward."""
    B, S, d = x.shape
    why = why_unsupported(d)
    if why:
        raise ValueError(f"layer_tail: {why}")
    if o.shape != x.shape or not (o.is_contiguous() and x.is_contiguous()):
        raise ValueError(f"layer_tail: o and x must be contiguous [B, S, d] of one shape, got o {tuple(o.shape)} "
                         f"and x {tuple(x.shape)}")
    op = w["o_w"].dtype
    if op not in (torch.float16, torch.bfloat16) or o.dtype != op:
        raise TypeError(f"layer_tail: o and the weights must share a float16/bfloat16 dtype, got o {o.dtype} and "
                        f"weights {op}")
    ffn = w["in_w"].shape[0]
    if w["o_w"].shape != (d, d) or w["in_w"].shape != (ffn, d) or w["out_w"].shape != (d, ffn):
        raise ValueError("layer_tail: weight shapes do not match d_model/ffn_dim")
    if mask is not None and (mask.dtype != torch.bool or tuple(mask.shape) != (B, S)):
        raise ValueError(f"layer_tail: mask must be bool [B, S]={B, S}, got {mask.dtype} {tuple(mask.shape)}")
    out = torch.empty((B, S, d), device=x.device, dtype=torch.float32 if final is None else out_dtype or x.dtype)
    m = mask.contiguous().view(torch.int8) if mask is not None else out
    nf_w, nf_b = final if final is not None else (w["n2_w"], w["n2_b"])
    n_tokens = B * S
    ffn_pad = max(16, triton.next_power_of_2(ffn))
    block_m = block_m or tail_block_m(n_tokens)
    _layer_tail_fwd[(triton.cdiv(n_tokens, block_m),)](
        o, x, out, m, w["o_w"], w["o_b"], w["in_w"], w["in_b"], w["out_w"], w["out_b"], w["n2_w"], w["n2_b"],
        nf_w, nf_b, n_tokens, d, ffn, eps,
        BLOCK_M=block_m, BLOCK_D=max(16, triton.next_power_of_2(d)), BLOCK_F=min(ffn_block, ffn_pad),
        HAS_MASK=mask is not None, FINAL_NORM=final is not None, num_warps=num_warps or 4, num_stages=num_stages,
        **launch_options(pdl, "layer_tail"),
    )
    return out
