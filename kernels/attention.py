"""Fused flash-style attention forward (Triton).

Online softmax with fp32 running max and sum; causal and key masks applied inside the tile; no
`[B, H, S, S]` tensor. q, k and v are `[B, S, H, D]` strided views (e.g. of a packed QKV projection);
the output is written `[B, S, H, D]` contiguous, so the out-projection reads it as `[B*S, d]`.

Masks follow self-attention semantics: the key mask of batch element b also marks its invalid queries,
whose output rows are written as zeros. A query that sees no valid key gets 0, never NaN.

A key mask may come with its per-batch prefix lengths (kernels/mask.py: the length where the row is a prefix,
-1 where it is not). Batch elements whose mask is a prefix then run as fast as an unmasked call: whole key blocks
below the length and the diagonal need no mask, and query blocks past the length do no work. The choice is made
per program on the device, so an all-True or prefix mask costs no host synchronization.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import INTERPRET as _INTERPRET
from . import PRECISIONS
from .mask import check_summary, prefix_lengths
from .pdl import launch_options, pdl_release_end, pdl_release_start, pdl_wait
from .tiles import DOT_BF16_IN_FP32

MAX_HEAD_DIM = 256  # largest head_dim served (register and shared-memory budget of one tile)
_PRECISION_CODE = {"fp32": 0, "tf32": 1, "fp16": 2, "bf16": 3}


# ----------------------------------------------------------------------------------------------
# Plain torch reference (the contract's math, in fp64 or fp32)
# ----------------------------------------------------------------------------------------------
def attention_reference(q, k, v, *, causal, key_lengths=None, key_mask=None, dtype=torch.float64):
    """[B, S, H, D] in, [B, S, H, D] out; invalid query rows and keyless queries are 0."""
    B, S, H, D = q.shape
    qh, kh, vh = (t.to(dtype).transpose(1, 2) for t in (q, k, v))
    scores = qh @ kh.transpose(-1, -2) * D**-0.5
    valid = _as_key_mask(B, S, key_lengths, key_mask, q.device)
    if causal:
        scores = scores.masked_fill(torch.ones(S, S, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    if valid is not None:
        scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    out = (probs @ vh).transpose(1, 2)
    if valid is not None:
        out = out.masked_fill(~valid[:, :, None, None], 0.0)
    return out.contiguous()


def _as_key_mask(B, S, key_lengths, key_mask, device):
    if key_mask is not None:
        return key_mask.to(device=device, dtype=torch.bool)
    if key_lengths is not None:
        return torch.arange(S, device=device)[None, :] < key_lengths.to(device)[:, None]
    return None


# ----------------------------------------------------------------------------------------------
# Triton kernel
# ----------------------------------------------------------------------------------------------
@triton.jit
def _operand(x, PRECISION: tl.constexpr):
    """Cast a tile to the matmul operand type of PRECISION (fp32 stays fp32 for exact and tf32 dots)."""
    if PRECISION == 2:
        return x.to(tl.float16)
    elif PRECISION == 3:
        if DOT_BF16_IN_FP32:
            return x.to(tl.bfloat16).to(tl.float32)
        return x.to(tl.bfloat16)
    else:
        return x.to(tl.float32)


@triton.jit
def _dot(a, b, PRECISION: tl.constexpr):
    """a @ b with fp32 accumulation; PRECISION 0: exact fp32, 1: tf32, 2: fp16 operands, 3: bf16 operands."""
    if PRECISION == 0:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    elif PRECISION == 1:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="tf32")
    elif PRECISION == 2:
        return tl.dot(a.to(tl.float16), b.to(tl.float16))
    else:
        if DOT_BF16_IN_FP32:
            return tl.dot(a.to(tl.bfloat16).to(tl.float32), b.to(tl.bfloat16).to(tl.float32), input_precision="ieee")
        return tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16))


@triton.jit
def _attention_block(
    acc, m_i, l_i, q,
    k_base, v_base, mask_base,  # pointers to this (batch, head)'s keys/values and this batch's key-mask row
    stride_ks, stride_vs,  # sequence strides of k and v (elements)
    offs_m, offs_d, start_n, seq_len, key_len,
    qk_scale,
    load_mask,  # with HAS_KEY_MASK: whether to read the key mask (False for a prefix: key_len says it all)
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,  # False: block is fully valid and below the diagonal -> no masks at all
    EVEN_N: tl.constexpr,  # seq_len % BLOCK_N == 0: no bounds checks on key loads
    IS_CAUSAL: tl.constexpr, HAS_KEY_MASK: tl.constexpr, PRECISION: tl.constexpr,
):
    offs_n = start_n + tl.arange(0, BLOCK_N)
    d_ok = offs_d[None, :] < HEAD_DIM
    if MASKED and not EVEN_N:
        n_ok = offs_n < seq_len
        k = tl.load(k_base + offs_n[:, None] * stride_ks + offs_d[None, :], mask=n_ok[:, None] & d_ok, other=0.0)
        v = tl.load(v_base + offs_n[:, None] * stride_vs + offs_d[None, :], mask=n_ok[:, None] & d_ok, other=0.0)
    else:
        if HEAD_DIM == BLOCK_D:
            k = tl.load(k_base + offs_n[:, None] * stride_ks + offs_d[None, :])
            v = tl.load(v_base + offs_n[:, None] * stride_vs + offs_d[None, :])
        else:
            k = tl.load(k_base + offs_n[:, None] * stride_ks + offs_d[None, :], mask=d_ok, other=0.0)
            v = tl.load(v_base + offs_n[:, None] * stride_vs + offs_d[None, :], mask=d_ok, other=0.0)
    # raw scores; qk_scale (head_dim**-0.5 * log2 e, > 0) is applied to the row max and, in one multiply-add with
    # the max's subtraction, to the exponent: one instruction per score less than scaling the tile first
    s = _dot(q, tl.trans(_operand(k, PRECISION)), PRECISION)
    if MASKED:
        keep = (offs_n < key_len)[None, :]
        if IS_CAUSAL:
            keep = keep & (offs_n[None, :] <= offs_m[:, None])
        if HAS_KEY_MASK:  # keys past seq_len are out through key_len <= seq_len; unread ones count as valid
            key_ok = tl.load(mask_base + offs_n, mask=(offs_n < seq_len) & load_mask, other=1) != 0
            keep = keep & key_ok[None, :]
        s = tl.where(keep, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)  # log2-domain running max
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with no valid key so far stay at 0
    p = tl.math.exp2(s * qk_scale - m_use[:, None])
    alpha = tl.math.exp2(m_i - m_use)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + _dot(_operand(p, PRECISION), _operand(v, PRECISION), PRECISION)
    return acc, m_new, l_i


@triton.jit
def _attention_fwd(
    Q, K, V,  # pointers to the [B, S, H, D] query/key/value views (unit stride along D)
    Out,  # pointer to the [B, S, H, D] output
    KeyLen,  # int32 [B]: number of valid (prefix) keys per batch element; read when HAS_KEY_LEN. With HAS_KEY_MASK
    # too: the prefix length where that batch element's mask is a prefix, -1 where it is not
    KeyMask,  # int8 [B, S]: 1 = valid key/query; read when HAS_KEY_MASK, which always comes with HAS_KEY_LEN (the
    # launcher passes the mask's prefix summary with it)
    stride_qb, stride_qs, stride_qh,  # q strides (elements) for batch, sequence, head
    stride_kb, stride_ks, stride_kh,  # k strides
    stride_vb, stride_vs, stride_vh,  # v strides
    stride_ob, stride_os, stride_oh,  # output strides
    stride_mb,  # key-mask stride between batch elements
    num_heads, seq_len, qk_scale,  # qk_scale = head_dim**-0.5 * log2(e)
    group_bh,  # (batch, head) pairs whose query blocks run together (pairs_per_group)
    S_BUCKET,  # next power of two of seq_len: the autotune key (one tuning per bucket)
    BH_BUCKET,  # next power of two of batch x heads: the autotune key too, so that a tuning persisted on disk for one
    # grid size (official row 2: 4 programs a query block) is not served to a very different one (row 6: 40 000)
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    IS_CAUSAL: tl.constexpr, HAS_KEY_LEN: tl.constexpr, HAS_KEY_MASK: tl.constexpr,
    EVEN_N: tl.constexpr,  # seq_len % BLOCK_N == 0: key loads need no bounds checks
    PRECISION: tl.constexpr,
    MASK_LOOP: tl.constexpr,  # with HAS_KEY_MASK: a mask that is no prefix runs a loop of its own
    # (MASK_OWN_LOOP_MAX_BLOCK_D)
    PDL: tl.constexpr,  # programmatic dependent launch (kernels/pdl.py)
):
    pdl_release_start(PDL)
    pdl_wait(PDL)
    # A 1-D grid of (query block, batch x head) programs, taken group_bh pairs at a time, query blocks outermost in
    # a group: its keys and values stay in L2 while its query blocks pass (the launcher's `pairs_per_group`)
    n_m = tl.cdiv(seq_len, BLOCK_M)
    pid = tl.program_id(0)
    first = pid // (group_bh * n_m) * group_bh
    size = tl.minimum(group_bh, tl.num_programs(0) // n_m - first)  # the last group may be smaller
    r = pid - first * n_m
    pid_m = r // size
    pid_bh = first + r - pid_m * size
    if IS_CAUSAL:  # the longest query blocks (the last ones) first: the short ones fill the last wave
        pid_m = n_m - 1 - pid_m
    b = pid_bh // num_heads
    h = pid_bh % num_heads
    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d[None, :] < HEAD_DIM

    q_base = Q + b.to(tl.int64) * stride_qb + h * stride_qh
    k_base = K + b.to(tl.int64) * stride_kb + h * stride_kh
    v_base = V + b.to(tl.int64) * stride_vb + h * stride_vh
    o_base = Out + b.to(tl.int64) * stride_ob + h * stride_oh
    mask_base = KeyMask + b.to(tl.int64) * stride_mb

    m_ok = offs_m < seq_len
    # The query tile is loaded before the key length is known, so that the two loads are in flight together: a
    # kernel given lengths (or a mask's prefix summary) then waits one memory round trip before its loop, as an
    # unmasked one does, not two. A query block past the length loads its tile for nothing (no work follows).
    q = tl.load(q_base + offs_m[:, None] * stride_qs + offs_d[None, :], mask=m_ok[:, None] & d_ok, other=0.0)
    key_len = seq_len
    if HAS_KEY_LEN:
        key_len = tl.load(KeyLen + b)
        if HAS_KEY_MASK:  # a prefix length, or -1: this batch element's mask is no prefix
            is_prefix = key_len >= 0
            key_len = tl.where(is_prefix, key_len, seq_len)
    o_ptrs = o_base + offs_m[:, None] * stride_os + offs_d[None, :]

    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)

    # keys this query block can see: [0, hi)
    hi = key_len
    if IS_CAUSAL:
        hi = tl.minimum(hi, start_m + BLOCK_M)
    if HAS_KEY_LEN:
        if start_m >= key_len:
            hi = 0  # every query of this block is padding: its rows are written as zeros
    if hi > 0:
        q_op = _operand(q, PRECISION)
        # Stage 1: key blocks that are whole, valid and at or below every query's diagonal need no mask.
        # (With a mask and prefix lengths: where the mask is a prefix, keys below its length are all valid.)
        full_hi = key_len
        if IS_CAUSAL:
            full_hi = tl.minimum(full_hi, start_m + 1)
        full_hi = (full_hi // BLOCK_N) * BLOCK_N
        if HAS_KEY_MASK:
            full_hi = tl.where(is_prefix, full_hi, 0)
        for start_n in range(0, full_hi, BLOCK_N):
            acc, m_i, l_i = _attention_block(
                acc, m_i, l_i, q_op, k_base, v_base, mask_base, stride_ks, stride_vs,
                offs_m, offs_d, start_n, seq_len, key_len, qk_scale, False,
                HEAD_DIM, BLOCK_D, BLOCK_N, False, EVEN_N, IS_CAUSAL, HAS_KEY_MASK, PRECISION)
        # Stage 2: the diagonal, the ragged end and general masks. One loop for prefix and general masks alike (a
        # prefix skips the mask loads at run time): a separate prefix loop of its own would take more shared memory
        # and time (docs/decisions.md#attention-mask-loop).
        if HAS_KEY_MASK and MASK_LOOP:
            # A prefix runs the key-length path's own stage 2 (no mask in its code at all); a mask that is no
            # prefix (full_hi is 0 then) reads it in a loop of its own, unpipelined, so that this loop takes no
            # shared memory of its own.
            for start_n in range(full_hi, tl.where(is_prefix, hi, 0), BLOCK_N):
                acc, m_i, l_i = _attention_block(
                    acc, m_i, l_i, q_op, k_base, v_base, mask_base, stride_ks, stride_vs,
                    offs_m, offs_d, start_n, seq_len, key_len, qk_scale, False,
                    HEAD_DIM, BLOCK_D, BLOCK_N, True, EVEN_N, IS_CAUSAL, False, PRECISION)
            for start_n in tl.range(0, tl.where(is_prefix, 0, hi), BLOCK_N, num_stages=1):
                acc, m_i, l_i = _attention_block(
                    acc, m_i, l_i, q_op, k_base, v_base, mask_base, stride_ks, stride_vs,
                    offs_m, offs_d, start_n, seq_len, key_len, qk_scale, True,
                    HEAD_DIM, BLOCK_D, BLOCK_N, True, EVEN_N, IS_CAUSAL, True, PRECISION)
        else:
            load_mask = False
            if HAS_KEY_MASK:
                load_mask = not is_prefix
            for start_n in range(full_hi, hi, BLOCK_N):
                acc, m_i, l_i = _attention_block(
                    acc, m_i, l_i, q_op, k_base, v_base, mask_base, stride_ks, stride_vs,
                    offs_m, offs_d, start_n, seq_len, key_len, qk_scale, load_mask,
                    HEAD_DIM, BLOCK_D, BLOCK_N, True, EVEN_N, IS_CAUSAL, HAS_KEY_MASK, PRECISION)

    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # keyless rows: acc is 0, so the row is 0
    if HAS_KEY_LEN:
        out = tl.where((offs_m < key_len)[:, None], out, 0.0)
    if HAS_KEY_MASK:
        if not is_prefix:  # a prefix's invalid queries are the ones past its length, zeroed above
            q_ok = tl.load(mask_base + offs_m, mask=m_ok, other=0) != 0
            out = tl.where(q_ok[:, None], out, 0.0)
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=m_ok[:, None] & d_ok)
    pdl_release_end(PDL)


def _configs():
    if _INTERPRET:
        return [triton.Config({"BLOCK_M": 16, "BLOCK_N": 16}, num_warps=4, num_stages=1)]
    out = []
    for bm, bn, warps, stages in [
        (64, 64, 4, 3), (128, 64, 8, 3), (128, 64, 8, 4), (128, 128, 8, 3), (64, 32, 4, 2), (32, 32, 4, 2),
        (16, 32, 4, 2),
    ]:
        out.append(triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=warps, num_stages=stages))
    return out


# Registers per thread the kernel with a key mask (HAS_KEY_MASK) may take, per launch (BLOCK_M, BLOCK_N, BLOCK_D,
# num_warps, num_stages), where ptxas would otherwise give it enough more than the same launch with key lengths to
# fit fewer programs on an SM; each cap fits without spilling (ptxas for sm_90a;
# docs/decisions.md#attention-register-cap).
MASKED_MAX_REGISTERS = {(64, 64, 32, 4, 3): 96, (32, 32, 64, 4, 2): 96}


def masked_register_cap(block_m, block_n, block_d, num_warps, num_stages):
    """The maxnreg of a masked launch (None: ptxas decides), from MASKED_MAX_REGISTERS."""
    return MASKED_MAX_REGISTERS.get((block_m, block_n, block_d, num_warps, num_stages))


def _capped(config, block_d):
    """`config` with the masked kernel's register cap for its tile, where MASKED_MAX_REGISTERS has one."""
    cap = masked_register_cap(config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"], block_d, config.num_warps,
                              config.num_stages)
    if cap is None:
        return config
    return triton.Config(dict(config.kwargs), num_warps=config.num_warps, num_stages=config.num_stages, maxnreg=cap)


def _prune(configs, named_args, **kwargs):
    """Keep tiles that fit the sequence and the head size; big head dims get small tiles. With a key mask, each
    kept tile carries its register cap (MASKED_MAX_REGISTERS)."""
    keep = _prune_tiles(configs, named_args, **kwargs)
    if kwargs.get("HAS_KEY_MASK", named_args.get("HAS_KEY_MASK")):
        block_d = kwargs.get("BLOCK_D", named_args.get("BLOCK_D"))
        keep = [_capped(c, block_d) for c in keep]
    return keep


# Batch x heads bucket from which a short sequence's tiles are timed against each other; below it 64x64 only, as fast
# there as any other, and timing kernels of a few microseconds would pick by noise
# (docs/decisions.md#attention-wide-grid).
# None: every kept tile timed.
SHORT_SEQUENCE_WIDE_GRID = 4096


def _prune_tiles(configs, named_args, **kwargs):
    seq, d = named_args["seq_len"], kwargs.get("BLOCK_D", named_args.get("BLOCK_D"))
    bh = named_args.get("BH_BUCKET")  # None: the grid is not known (the fixed launch of a long sequence)
    precision = kwargs.get("PRECISION", named_args.get("PRECISION"))
    keep = []
    for c in configs:
        bm, bn = c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"]
        if bm > max(16, triton.next_power_of_2(seq)) or bn > max(16, triton.next_power_of_2(seq)):
            continue
        if d >= 256 and (bm > 64 or bn > 64):
            continue
        if d >= 128 and bm * bn > 128 * 64:
            continue
        if seq >= 8192 and bm < 64:  # long sequences: large tiles only (tuning each config costs seconds)
            continue
        if 64 < seq <= 256 and bm != 64:
            # short sequences: 64-row tiles, since the autotuner's pick among larger ones ran twice as long
            # (docs/decisions.md#attention-short-tiles)
            continue
        if (64 < seq <= 256 and bn != 64 and d <= 128 and bh is not None and SHORT_SEQUENCE_WIDE_GRID is not None
                and bh < SHORT_SEQUENCE_WIDE_GRID):
            # and 64x64 alone below a wide grid (SHORT_SEQUENCE_WIDE_GRID), up to head_dim 128: unmeasured beyond,
            # so both are still timed there
            continue
        if precision == 0 and (bm, bn) not in ((64, 32), (32, 32)):
            # exact fp32 (the reduced_precision ablation's baseline): FMA dots want small tiles, and compiling
            # every candidate per head size would take about a minute per job
            continue
        keep.append(c)
    return keep or configs[-1:]


# Up to this head block (BLOCK_D), a key mask that is no prefix runs a stage-2 loop of its own (the kernel's
# MASK_LOOP), so that a prefix's stage 2 is the key-length path's code and as fast; beyond it the second loop spills
# registers (ptxas for sm_90a; docs/decisions.md#attention-mask-loop). None: one loop for both.
MASK_OWN_LOOP_MAX_BLOCK_D = 64


# From this sequence length (power-of-two bucket) the kernel is not autotuned: timing each candidate on a full-size
# call, seconds each, would make a first call take minutes. The tile is the first of LONG_SEQUENCE_TILES that the
# prune keeps for the shape.
UNTUNED_FROM_SEQ = 32768
LONG_SEQUENCE_TILES = ((128, 64, 8, 3), (64, 64, 4, 3))


def long_sequence_config(seq_len, block_d, precision_code):
    """The fixed launch of a long sequence: {BLOCK_M, BLOCK_N, num_warps, num_stages}."""
    configs = [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s)
               for bm, bn, w, s in LONG_SEQUENCE_TILES]
    kept = _prune_tiles(configs, {"seq_len": seq_len}, BLOCK_D=block_d, PRECISION=precision_code)
    c = kept[0]
    return {**c.kwargs, "num_warps": c.num_warps, "num_stages": c.num_stages}


_even_n = triton.heuristics({"EVEN_N": lambda args: args["seq_len"] % args["BLOCK_N"] == 0})
_attention_fwd_tuned = triton.autotune(
    configs=_configs(),
    key=["S_BUCKET", "BH_BUCKET", "HEAD_DIM", "IS_CAUSAL", "HAS_KEY_LEN", "HAS_KEY_MASK", "PRECISION"],
    prune_configs_by={"early_config_prune": _prune},
    cache_results=True,
)(_even_n(_attention_fwd))


# ----------------------------------------------------------------------------------------------
# Launcher and public function
# ----------------------------------------------------------------------------------------------
# A causal launch takes its (batch, head) pairs in groups whose keys and values together take at most this many
# bytes, each group's query blocks longest first across its pairs, so that the last wave holds short blocks only
# while the keys and values it reads stay in L2 (50 MB on H100 and H200); 0: one pair a group, each pair's query
# blocks longest first (docs/decisions.md#attention-order).
L2_GROUP_BYTES = 16 * 2**20


def pairs_per_group(pairs: int, seq_len: int, head_dim: int, element_bytes: int, causal: bool) -> int:
    """The (batch, head) pairs a launch takes together (L2_GROUP_BYTES), at least one, at most `pairs`."""
    if not causal:  # every query block does the same work: no order to gain
        return 1
    per_pair = 2 * seq_len * head_dim * element_bytes  # one pair's keys and values
    return max(1, min(pairs, L2_GROUP_BYTES // max(1, per_pair)))


def _check(q, k, v, key_lengths, key_mask, precision, mask_prefix_lengths=None):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"flash_attention: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"flash_attention: {name} must be [B, S, H, D], got shape {tuple(t.shape)}")
        if t.stride(-1) != 1:
            raise ValueError(f"flash_attention: {name} must have unit stride along D, got strides {t.stride()}")
        if not t.is_floating_point():
            raise TypeError(f"flash_attention: {name} must be floating point, got {t.dtype}")
    if k.shape != q.shape or v.shape != q.shape:
        raise ValueError(f"flash_attention: q, k, v shapes differ: {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    if k.device != q.device or v.device != q.device:
        raise ValueError(f"flash_attention: q, k, v on different devices: {q.device}, {k.device}, {v.device}")
    B, S, H, D = q.shape
    if not 1 <= D <= MAX_HEAD_DIM:
        raise ValueError(f"flash_attention: head_dim must be in [1, {MAX_HEAD_DIM}], got {D}")
    if precision not in _PRECISION_CODE:
        raise ValueError(f"flash_attention: precision must be one of {PRECISIONS}, got {precision!r}")
    if key_lengths is not None and key_mask is not None:
        raise ValueError("flash_attention: give key_lengths (prefix masks) or key_mask (any mask), not both")
    if mask_prefix_lengths is not None:
        if key_mask is None:
            raise ValueError("flash_attention: mask_prefix_lengths describes a key_mask; give key_mask too")
        check_summary("flash_attention", "mask_prefix_lengths", mask_prefix_lengths, B, q.device)
    if key_lengths is not None:
        if key_lengths.shape != (B,) or key_lengths.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"flash_attention: key_lengths must be an int32/int64 [B]={B} tensor, got "
                             f"{key_lengths.dtype} {tuple(key_lengths.shape)}")
        if key_lengths.device != q.device:
            raise ValueError(f"flash_attention: key_lengths on {key_lengths.device}, q on {q.device}")
    if key_mask is not None:
        if key_mask.dtype != torch.bool:
            raise TypeError(f"flash_attention: key_mask must be torch.bool, got {key_mask.dtype}")
        if tuple(key_mask.shape) != (B, S):
            raise ValueError(f"flash_attention: key_mask must be [B, S]={B, S}, got {tuple(key_mask.shape)}")
        if key_mask.device != q.device:
            raise ValueError(f"flash_attention: key_mask on {key_mask.device}, q on {q.device}")


def flash_attention(q, k, v, *, causal: bool, key_lengths=None, key_mask=None, precision: str = "fp16",
                    out=None, config=None, mask_prefix_lengths=None, pdl=False):
    """Attention over `[B, S, H, D]` views; returns `[B, S, H, D]` (contiguous, dtype of q, or `out`).

    causal: mask keys j > i.
    key_lengths: int32/int64 `[B]`, valid prefix length per batch element (fast path: no mask loads,
        query blocks wholly past the length are written as zeros without work).
    key_mask: bool `[B, S]`, any pattern (left padding, holes); also marks invalid queries.
    mask_prefix_lengths: int32 `[B]` for key_mask, from `kernels.mask.prefix_lengths(key_mask)` (computed here when
        not given): batch elements whose mask is a prefix take the unmasked fast path. Pass it to reuse one
        summary across layers; it must describe key_mask (the kernel trusts it).
    precision: operand precision of both matmuls: "fp32" (exact), "tf32", "fp16", "bf16";
        accumulation and softmax statistics are fp32 always.
    config: optional dict with BLOCK_M, BLOCK_N, num_warps, num_stages to bypass autotuning.
    pdl: launch with programmatic dependent launch (kernels/pdl.py), for a kernel that follows another of the same
        forward (the mask's summary is then given: computing it here would be a launch of its own before this one).
    """
    _check(q, k, v, key_lengths, key_mask, precision, mask_prefix_lengths)
    B, S, H, D = q.shape
    if key_mask is not None and mask_prefix_lengths is None:
        mask_prefix_lengths = prefix_lengths(key_mask)
    if out is None:
        out = torch.empty((B, S, H, D), dtype=q.dtype, device=q.device)
    elif out.shape != q.shape or not out.is_contiguous():
        raise ValueError(f"flash_attention: out must be a contiguous {tuple(q.shape)} tensor")
    dummy = torch.empty(1, dtype=torch.int32, device=q.device)
    if mask_prefix_lengths is not None:
        lengths = mask_prefix_lengths
    else:
        lengths = key_lengths.to(torch.int32).contiguous() if key_lengths is not None else dummy
    mask = key_mask.contiguous().view(torch.int8) if key_mask is not None else dummy.view(torch.int8)
    block_d = max(16, triton.next_power_of_2(D))
    s_bucket = triton.next_power_of_2(S)
    args = (q, k, v, out, lengths, mask,
            q.stride(0), q.stride(1), q.stride(2),
            k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2),
            out.stride(0), out.stride(1), out.stride(2),
            mask.stride(0) if key_mask is not None else 0,
            H, S, D**-0.5 * 1.4426950408889634, pairs_per_group(B * H, S, D, q.element_size(), causal), s_bucket,
            triton.next_power_of_2(B * H))
    consts = dict(HEAD_DIM=D, BLOCK_D=block_d, IS_CAUSAL=bool(causal),
                  HAS_KEY_LEN=key_lengths is not None or mask_prefix_lengths is not None,
                  HAS_KEY_MASK=key_mask is not None, PRECISION=_PRECISION_CODE[precision],
                  MASK_LOOP=(key_mask is not None and MASK_OWN_LOOP_MAX_BLOCK_D is not None
                             and block_d <= MASK_OWN_LOOP_MAX_BLOCK_D),
                  **launch_options(pdl, "flash_attention"))
    if config is None and s_bucket >= UNTUNED_FROM_SEQ:
        config = long_sequence_config(S, block_d, consts["PRECISION"])
    if config is not None:
        bm, bn = config["BLOCK_M"], config["BLOCK_N"]
        warps, stages = config.get("num_warps", 4), config.get("num_stages", 2)
        cap = masked_register_cap(bm, bn, block_d, warps, stages) if key_mask is not None else None
        grid = (triton.cdiv(S, bm) * B * H,)
        _attention_fwd[grid](*args, **consts, BLOCK_M=bm, BLOCK_N=bn, EVEN_N=S % bn == 0, num_warps=warps,
                             num_stages=stages, maxnreg=cap)
        return out

    def grid(meta):
        return (triton.cdiv(S, meta["BLOCK_M"]) * B * H,)

    _attention_fwd_tuned[grid](*args, **consts)
    return out
