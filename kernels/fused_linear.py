"""A linear layer with its neighbours fused in (Triton): `y = epilogue(prologue(a) @ w.T + bias)`.

Prologue (`ln=(mean, rstd)`, fp32 [M] each): the A tile is normalized as it is loaded, `((a - mean) * rstd)` in fp32,
rounded to the fp16 operand: LayerNorm without its affine part, whose gamma and beta the caller folds into `w` and
`bias` once (`fold_layernorm`). Without it A is the fp16 operand as is.
Epilogue, in this order, in fp32: `+ bias`; exact (erf) GELU with `gelu=True`; `+ residual` (fp32 [M, N]); rows
where `row_mask` is False set to 0; `y` written in `out_dtype` (fp16 for an activation, fp32 for the residual stream).
With `stats_out` the epilogue also writes what the next LayerNorm needs of `y` (fp32, before the cast to out_dtype):
per row and per BLOCK_N-column block the partial `(sum, sum of squared deviations from the block's mean)` into
`stats_out[M, cdiv(N, BLOCK_N), 2]`; `layernorm_stats` merges the blocks in a fixed order (Chan's pairwise formula)
into `(mean, rstd)` for the next call's prologue. No atomics: the result is the same bits on every run.

Operands fp16, accumulation and statistics fp32. N and K must be multiples of 16 (rows of 16-byte-aligned fp16);
M, N and K need not be multiples of the blocks. The A and W tiles come by pointer loads (cp.async, pipelined over
`num_stages` on sm_90), or with `tma=True` by host tensor descriptors (TMA); both run under the interpreter.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .tiles import _gelu_exact

# A Hopper-sized tile: 128 x 128 outputs, 64-deep K steps, 8 warps, 4 stages of the K loop in shared memory.
BLOCK_M, BLOCK_N, BLOCK_K = 128, 128, 64
NUM_WARPS, NUM_STAGES, GROUP_M = 8, 4, 8
ALIGN = 16  # N and K are multiples of it
OUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


# ----------------------------------------------------------------------------------------------
# Plain torch references (fp64)
# ----------------------------------------------------------------------------------------------
def fused_linear_reference(a, w, bias, *, ln=None, gelu=False, residual=None, row_mask=None, round_operand=True):
    """fp64 `y` of `fused_linear`, before the cast to its out_dtype. With `round_operand` the prologue's normalized A
    is rounded to the fp16 operand as the kernel rounds it (its fp32 arithmetic aside); without, it stays fp64."""
    x = a.detach().double()
    if ln is not None:
        x = (x - ln[0].double()[:, None]) * ln[1].double()[:, None]
        if round_operand:
            x = x.to(torch.float16).double()
    y = x @ w.double().t() + bias.double()
    if gelu:
        y = torch.nn.functional.gelu(y)
    if residual is not None:
        y = y + residual.double()
    if row_mask is not None:
        y = y.masked_fill(~row_mask[:, None], 0.0)
    return y


def layernorm_stats_reference(x, *, eps):
    """(mean, rstd) of each row of x, fp64: what `layernorm_stats` returns from the partials of x."""
    x = x.double()
    mean = x.mean(-1)
    return mean, 1.0 / torch.sqrt(((x - mean[:, None]) ** 2).mean(-1) + eps)


# ----------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------
@triton.jit
def _fused_linear_fwd(
    A,  # a [M, K]: fp16 operand, or (HAS_LN) any float dtype, normalized as loaded; a pointer, or with TMA a
    # tensor descriptor of [BLOCK_M, BLOCK_K] blocks
    W,  # w [N, K] fp16 (nn.Linear's layout): a pointer, or with TMA a descriptor of [BLOCK_N, BLOCK_K] blocks
    Bias,  # pointer to bias [N] (fp32 or fp16)
    Mean, Rstd,  # pointers to fp32 [M]; read when HAS_LN
    Res,  # pointer to the residual [M, N] fp32; read when HAS_RES
    RowMask,  # pointer to int8 [M], 0 = row set to 0; read when HAS_ROW_MASK
    Y,  # pointer to y [M, N] in the output dtype
    Stats,  # pointer to fp32 [M, n_blocks_n, 2] (contiguous); written when HAS_STATS
    M, N, K,
    stride_am, stride_wn, stride_rm, stride_ym,  # row strides (elements); every last dimension has unit stride
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    HAS_LN: tl.constexpr, GELU: tl.constexpr, HAS_RES: tl.constexpr, HAS_ROW_MASK: tl.constexpr,
    HAS_STATS: tl.constexpr, EVEN_K: tl.constexpr,
    TMA: tl.constexpr,  # A and W are tensor descriptors: the tiles come by TMA, zero past every edge
):
    # Programs in groups of GROUP_M row blocks sweep the column blocks together: their A rows and W columns
    # stay in L2 while the group runs.
    pid = tl.program_id(0)
    n_m = tl.cdiv(M, BLOCK_M)
    n_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * n_n
    first_m = (pid // per_group) * GROUP_M
    group_m = min(n_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_m
    pid_n = (pid % per_group) // group_m

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # Loads wrap rows and columns past the edge onto valid ones (no masks in the K loop): their results are
    # never stored.
    rows_in = (rows % M).to(tl.int64)
    cols_in = (cols % N).to(tl.int64)
    ks = tl.arange(0, BLOCK_K)
    if not TMA:
        a_ptrs = A + rows_in[:, None] * stride_am + ks[None, :]
        w_ptrs = W + cols_in[None, :] * stride_wn + ks[:, None]  # the [BLOCK_K, BLOCK_N] tile of w.T
    if HAS_LN:
        mean = tl.load(Mean + rows_in)
        rstd = tl.load(Rstd + rows_in)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        if TMA:
            a = A.load([pid_m * BLOCK_M, k * BLOCK_K])
            b = W.load([pid_n * BLOCK_N, k * BLOCK_K]).T
        elif EVEN_K:
            a = tl.load(a_ptrs + k * BLOCK_K)
            b = tl.load(w_ptrs + k * BLOCK_K)
        else:
            k_ok = ks < K - k * BLOCK_K
            a = tl.load(a_ptrs + k * BLOCK_K, mask=k_ok[None, :], other=0.0)
            b = tl.load(w_ptrs + k * BLOCK_K, mask=k_ok[:, None], other=0.0)
        if HAS_LN:
            # K columns past the edge become -mean * rstd here; their w rows are 0, so they add nothing
            a = ((a.to(tl.float32) - mean[:, None]) * rstd[:, None]).to(tl.float16)
        acc = tl.dot(a, b, acc)

    row_ok = rows < M
    col_ok = cols < N
    ok = row_ok[:, None] & col_ok[None, :]
    rows64 = rows.to(tl.int64)
    acc += tl.load(Bias + cols_in).to(tl.float32)[None, :]
    if GELU:
        acc = _gelu_exact(acc)
    if HAS_RES:
        acc += tl.load(Res + rows64[:, None] * stride_rm + cols[None, :], mask=ok, other=0.0)
    if HAS_ROW_MASK:
        keep = tl.load(RowMask + rows, mask=row_ok, other=0) != 0
        acc = tl.where(keep[:, None], acc, 0.0)
    tl.store(Y + rows64[:, None] * stride_ym + cols[None, :], acc.to(Y.dtype.element_ty), mask=ok)
    if HAS_STATS:
        n_valid = tl.minimum(N - pid_n * BLOCK_N, BLOCK_N).to(tl.float32)
        total = tl.sum(tl.where(col_ok[None, :], acc, 0.0), 1)
        dev = tl.where(col_ok[None, :], acc - (total / n_valid)[:, None], 0.0)
        base = Stats + (rows64 * n_n + pid_n) * 2
        tl.store(base, total, mask=row_ok)
        tl.store(base + 1, tl.sum(dev * dev, 1), mask=row_ok)


@triton.jit
def _layernorm_stats_fwd(
    Stats,  # pointer to fp32 [M, n_blocks, 2] (contiguous): per block (sum, squared deviations from its mean)
    Mean, Rstd,  # pointers to fp32 [M], written
    M, N, n_blocks, eps,
    BLOCK_N: tl.constexpr,  # the column block the partials were taken over (the last block may be narrower)
    BLOCK_ROWS: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    row_ok = rows < M
    count = tl.zeros((BLOCK_ROWS,), dtype=tl.float32)
    mean = tl.zeros((BLOCK_ROWS,), dtype=tl.float32)
    m2 = tl.zeros((BLOCK_ROWS,), dtype=tl.float32)
    for b in range(0, n_blocks):
        base = Stats + (rows * n_blocks + b) * 2
        total = tl.load(base, mask=row_ok, other=0.0)
        dev2 = tl.load(base + 1, mask=row_ok, other=0.0)
        n_b = tl.minimum(N - b * BLOCK_N, BLOCK_N).to(tl.float32)
        # Chan et al.'s pairwise update: merging the block's (n_b, its mean, its M2) into the running triple
        delta = total / n_b - mean
        merged = count + n_b
        mean += delta * (n_b / merged)
        m2 += dev2 + delta * delta * (count * n_b / merged)
        count = merged
    tl.store(Mean + rows, mean, mask=row_ok)
    tl.store(Rstd + rows, 1.0 / tl.sqrt(m2 / N + eps), mask=row_ok)


# ----------------------------------------------------------------------------------------------
# Launchers and public functions
# ----------------------------------------------------------------------------------------------
def _check(name, t, shape, dtypes, device):
    """t is a tensor of `shape` (None: any size there), one of `dtypes`, on `device`, with unit stride last."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"fused_linear: {name} must be a tensor, got {type(t).__name__}")
    if t.dim() != len(shape) or any(s is not None and s != n for s, n in zip(shape, t.shape)):
        want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
        raise ValueError(f"fused_linear: {name} must have shape {want}, got {list(t.shape)}")
    if t.dtype not in dtypes:
        raise ValueError(f"fused_linear: {name} must be {' or '.join(str(d) for d in dtypes)}, got {t.dtype}")
    if t.device != device:
        raise ValueError(f"fused_linear: {name} is on {t.device}, a is on {device}")
    if t.numel() > 0 and t.stride(-1) != 1:
        raise ValueError(f"fused_linear: {name} must have unit stride in its last dimension, got {t.stride()}")


def why_unsupported(d_model, ffn_dim):
    """Why a layer of these widths cannot run its GEMMs here (every N and K a multiple of ALIGN), or None."""
    odd = [f"{name} {size}" for name, size in (("d_model", d_model), ("ffn_dim", ffn_dim)) if size % ALIGN]
    return f"{' and '.join(odd)} not a multiple of {ALIGN}" if odd else None


def stats_shape(m, n, block_n=BLOCK_N):
    """The shape of `stats_out` for y [m, n] under column blocks of `block_n`: [m, cdiv(n, block_n), 2]."""
    return (m, triton.cdiv(n, block_n), 2)


def fused_linear(a, w, bias, *, ln=None, gelu=False, residual=None, row_mask=None, stats_out=None,
                 out_dtype=torch.float16, out=None, block_m=BLOCK_M, block_n=BLOCK_N, block_k=BLOCK_K,
                 num_warps=NUM_WARPS, num_stages=NUM_STAGES, group_m=GROUP_M, tma=False):
    """y [M, N] = epilogue(prologue(a) @ w.T + bias), the module docstring's computation.

    a: [M, K], fp16 (with `ln`: fp16, bf16 or fp32); w: fp16 [N, K]; bias: fp32 or fp16 [N]; ln: (mean, rstd), fp32
    [M] each (`layernorm_stats`), with w and bias folded (`fold_layernorm`); residual: fp32 [M, N]; row_mask: bool [M];
    stats_out: fp32 [M, cdiv(N, block_n), 2] contiguous (`stats_shape`), filled with each block's partial statistics
    of y for `layernorm_stats(stats_out, N, block_n=block_n, eps=...)`. out: a [M, N] tensor of out_dtype to write
    (may be `residual` itself: each element is read before it is written, by the same program). N, K multiples of 16.
    The launch (block sizes, warps, stages, L2 grouping) defaults to a Hopper tile; `tma=True` brings a's and w's
    tiles by host tensor descriptors (TMA on sm_90+; rows and base addresses 16-byte aligned) instead of pointer
    loads."""
    if not isinstance(a, torch.Tensor) or a.dim() != 2:
        raise ValueError(f"fused_linear: a must be a 2-D tensor [M, K], got "
                         f"{list(a.shape) if isinstance(a, torch.Tensor) else type(a).__name__}")
    M, K = a.shape
    device = a.device
    a_dtypes = (torch.float16, torch.bfloat16, torch.float32) if ln is not None else (torch.float16,)
    _check("a", a, (M, K), a_dtypes, device)
    _check("w", w, (None, K), (torch.float16,), device)
    N = w.shape[0]
    for name, size in (("N (w's rows)", N), ("K (a's columns)", K)):
        if size % ALIGN or size == 0:
            raise ValueError(f"fused_linear: {name} = {size} must be a positive multiple of {ALIGN}")
    _check("bias", bias, (N,), (torch.float32, torch.float16), device)
    if ln is not None:
        if not isinstance(ln, (tuple, list)) or len(ln) != 2:
            raise ValueError("fused_linear: ln must be a pair (mean, rstd)")
        _check("ln mean", ln[0], (M,), (torch.float32,), device)
        _check("ln rstd", ln[1], (M,), (torch.float32,), device)
    if residual is not None:
        _check("residual", residual, (M, N), (torch.float32,), device)
    mask8 = None
    if row_mask is not None:
        _check("row_mask", row_mask, (M,), (torch.bool,), device)
        mask8 = row_mask.contiguous().view(torch.int8)
    if stats_out is not None:
        _check("stats_out", stats_out, stats_shape(M, N, block_n), (torch.float32,), device)
        if not stats_out.is_contiguous():
            raise ValueError("fused_linear: stats_out must be contiguous")
    if out_dtype not in OUT_DTYPES:
        raise ValueError(f"fused_linear: out_dtype must be one of {OUT_DTYPES}, got {out_dtype}")
    if out is None:
        out = torch.empty((M, N), dtype=out_dtype, device=device)
    else:
        _check("out", out, (M, N), (out_dtype,), device)
    if M == 0:
        return out
    for name, size in (("block_m", block_m), ("block_n", block_n), ("block_k", block_k)):
        if size < 16 or size & (size - 1):
            raise ValueError(f"fused_linear: {name} = {size} must be a power of 2, at least 16")
    mean, rstd = ln if ln is not None else (out, out)
    a_arg, w_arg = a, w
    if tma:
        from triton.tools.tensor_descriptor import TensorDescriptor  # deferred: only a TMA launch needs it

        for name, t in (("a", a), ("w", w)):
            if t.data_ptr() % 16 or (t.stride(0) * t.element_size()) % 16:
                raise ValueError(f"fused_linear: with tma=True, {name} needs a 16-byte aligned start and rows, got "
                                 f"address {t.data_ptr()} and row stride {t.stride(0)} of {t.dtype}")
        a_arg = TensorDescriptor.from_tensor(a, [block_m, block_k])
        w_arg = TensorDescriptor.from_tensor(w, [block_n, block_k])
    grid = (triton.cdiv(M, block_m) * triton.cdiv(N, block_n),)
    _fused_linear_fwd[grid](
        a_arg, w_arg, bias, mean, rstd, residual if residual is not None else out,
        mask8 if mask8 is not None else out, out, stats_out if stats_out is not None else out,
        M, N, K, a.stride(0), w.stride(0), residual.stride(0) if residual is not None else 0, out.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=group_m,
        HAS_LN=ln is not None, GELU=bool(gelu), HAS_RES=residual is not None, HAS_ROW_MASK=mask8 is not None,
        HAS_STATS=stats_out is not None, EVEN_K=K % block_k == 0, TMA=bool(tma),
        num_warps=num_warps, num_stages=num_stages,
    )
    return out


def layernorm_stats(stats, n_cols, *, eps, block_n=BLOCK_N):
    """(mean, rstd), fp32 [M] each, of the rows whose partials `fused_linear(stats_out=stats, block_n=block_n)` wrote
    (n_cols: that call's N); `eps`: the LayerNorm's epsilon (the model's: a kernel owns no constant of the contract).
    The blocks merge in column order, the same bits on every run."""
    if not isinstance(stats, torch.Tensor) or stats.dim() != 3:
        raise ValueError("layernorm_stats: stats must be a 3-D tensor [M, n_blocks, 2]")
    M = stats.shape[0]
    want = stats_shape(M, n_cols, block_n)
    if tuple(stats.shape) != want or stats.dtype != torch.float32 or not stats.is_contiguous():
        raise ValueError(f"layernorm_stats: stats must be contiguous fp32 of shape {list(want)} (n_cols {n_cols}, "
                         f"block_n {block_n}), got {stats.dtype} {list(stats.shape)}")
    mean = torch.empty(M, dtype=torch.float32, device=stats.device)
    rstd = torch.empty_like(mean)
    if M:
        block_rows = 128
        _layernorm_stats_fwd[(triton.cdiv(M, block_rows),)](stats, mean, rstd, M, n_cols, want[1], eps,
                                                             BLOCK_N=block_n, BLOCK_ROWS=block_rows, num_warps=4)
    return mean, rstd


def fold_layernorm(w, bias, gamma, beta):
    """(w', b') with `LayerNorm(x) @ w.T + bias == ((x - mean) * rstd) @ w'.T + b'`: `w' = w * gamma[None, :]`
    (fp16) and `b' = bias + w @ beta` (fp32), computed in fp64 from the given values. w: [N, K]; bias: [N];
    gamma, beta: [K]."""
    if w.dim() != 2:
        raise ValueError(f"fold_layernorm: w must be [N, K], got {list(w.shape)}")
    n, k = w.shape
    for name, t, size in (("bias", bias, n), ("gamma", gamma, k), ("beta", beta, k)):
        if t.shape != (size,):
            raise ValueError(f"fold_layernorm: {name} must have shape [{size}], got {list(t.shape)}")
    w64 = w.double()
    return (w64 * gamma.double()[None, :]).to(torch.float16), (bias.double() + w64 @ beta.double()).float()
