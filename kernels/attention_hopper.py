"""Causal (or full) attention forward for Hopper (sm_90a) in Gluon: TMA, an mbarrier ring, wgmma, warp specialization.

One program (CTA) takes one (batch, head) and CONSUMERS * BLOCK_M consecutive query rows; programs of the longest
query blocks start first (the grid's slow axis runs over query blocks from the last to the first, its fast axis
over batch x heads), so that under a causal mask the short blocks fill the last wave. `gl.warp_specialize` splits
the CTA into two kinds of warps:
  - a producer warp (few registers) that brings each consumer's Q tile once, then K and V tiles of BLOCK_N keys by
    TMA into a ring of STAGES slots, each slot handed back by every consumer that reads it (one "empty" mbarrier per
    consumer and slot, so that a consumer whose causal range ends early has nothing left to hand back);
  - CONSUMERS consumer warpgroups (4 warps each, the default partition being the first), each owning BLOCK_M query
    rows: S = Q K^T by wgmma from shared memory, online softmax in fp32 (exp2 with head_dim^-0.5 log2 e folded into
    one multiply-add per score), P cast to fp16 in registers as wgmma's A operand of O += P V with V from shared
    memory. Within a warpgroup the QK^T of block j is issued before the PV of block j - 1, so the softmax of block
    j runs while that PV is on the tensor cores. Across warpgroups (PINGPONG) the issue of those two wgmmas is
    passed round the consumers by mbarriers, so that one warpgroup's softmax overlaps the others' matmuls.
Causal masking is applied only on the blocks that cross the diagonal (or pass the sequence's end); whole blocks
below it run unmasked and blocks above it are never loaded. The output goes back through the consumer's Q buffer
by TMA (rows past the sequence's end clipped by the descriptor's bounds).

q, k, v are [B, S, H, D] fp16 views with unit stride along D and heads D apart (a packed [B, S, 3, H, D] QKV's
`unbind(2)` and a contiguous [B, S, H, D] both are): each is read through a rank-3 descriptor over [B, S, H * D]
with the row stride of the view, blocks [1, rows, D] at column h * D, so that a query block's rows stop at its own
batch element's end. Operands fp16, statistics and accumulation fp32, probabilities rounded to fp16 before P V
(as FlashAttention does), the output fp16 [B, S, H, D] contiguous. `attention_by_blocks` is the same computation
in torch, block by block in the kernel's order (its counts, masks and rescaling checked on the CPU).
"""
from __future__ import annotations

import math

import torch

from .attention import attention_reference

try:  # Gluon ships with Triton >= 3.5; without it (or without a Hopper GPU) `why_unsupported` says so
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                  warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
except ImportError:  # pragma: no cover - depends on the installed Triton
    gluon = None

HEAD_DIMS = (64, 128)  # head widths served: a multiple of wgmma's k step (16) whose row is a 128-byte swizzle
SMEM_BYTES = 227 * 1024  # shared memory one CTA may take on the H200 (sm_90)
REGISTERS_PER_SM = 65536
PRODUCER_REGISTERS = 24  # the TMA warp's registers per thread after `setmaxnreg` (the least a warp may keep)
# Registers per thread of a consumer warpgroup after `setmaxnreg`, by consumer count: what the SM's 64K registers
# leave after the producer's warpgroup (a multiple of 8, as setmaxnreg takes)
CONSUMER_REGISTERS = {2: 240, 3: 160}
# The launch per head dim: BLOCK_M query rows per consumer warpgroup, BLOCK_N keys per ring slot, STAGES slots,
# CONSUMERS warpgroups, PINGPONG on. 64 rows a warpgroup keep the scores of block j (BLOCK_N / 2 registers per
# thread), the fp16 probabilities of block j - 1 in flight and O beside each other within a consumer's registers,
# which issuing QK^T before the previous PV needs (128 rows spill and serialize the wgmmas at 240 registers). Two
# consumers get 240 registers each; three get 160, where 128 keys a slot spill (ptxas for sm_90a), so three
# consumers run 64 keys a slot, with twice the barriers per score.
DEFAULT_CONFIGS = {
    64: dict(BLOCK_M=64, BLOCK_N=128, STAGES=3, CONSUMERS=2, PINGPONG=True, EXP2_POLY=0),
    128: dict(BLOCK_M=64, BLOCK_N=128, STAGES=2, CONSUMERS=2, PINGPONG=True, EXP2_POLY=0),
}
CONFIG_KEYS = ("BLOCK_M", "BLOCK_N", "STAGES", "CONSUMERS", "PINGPONG", "EXP2_POLY")
# EXP2_POLY: how many of a score block's BLOCK_N columns (its last ones) take their exp2 from `exp2_poly` on the
# FMA and integer pipes instead of MUFU's ex2, a multiple of BLOCK_N / 8 (the tile is halved three times at most,
# each half a slice of every thread's registers); 0, the default, leaves every exp2 on MUFU. At head_dim 64 a
# 64 x 128 score block takes about as many cycles of ex2 (16 a clock per SM) as of wgmma, so moving a share of
# them off MUFU relieves that unit at the cost of issue slots (about 8 instructions per element instead of 1).
EXP2_POLY_PARTS = 8
# 2^f on f in [0, 1] as 1 + f (C1 + f (C2 + f C3)): the minimax polynomial of relative error with 2^0 = 1 held
# exact (a linear program on 20 001 points of [0, 1], coefficients rounded to fp32). Its max relative error, the
# fp32 Horner evaluation measured on 2 000 001 points, is 8.57e-5, a sixth of fp16's half ulp (4.9e-4) in which
# the probabilities meet P V; 2^0 = 1 exactly keeps each row's max at probability 1, and exp2(-inf) at 0 (below).
EXP2_POLY_COEFFS = (0.6951172947883606, 0.22764353454113007, 0.077068030834198)
EXP2_POLY_FLOOR = -127.0  # x is clamped here: 2^-127 scaled by 2^0 = 1 has the bit pattern 0, so exp2(-inf) = 0
_ROUND_DOWN_MAGIC = 12582912.0  # 1.5 * 2^23: x + it, rounded down, holds floor(x) in its low mantissa bits


def attention_reference_fp64(q, k, v, *, causal):
    """The contract's attention in fp64 on [B, S, H, D] (`kernels.attention.attention_reference`): scores
    q k^T head_dim^-0.5, keys j > i masked where causal, softmax, times v; [B, S, H, D] fp64."""
    return attention_reference(q, k, v, causal=causal, dtype=torch.float64)


def kv_blocks(q0: int, seq_len: int, block_m: int, block_n: int, causal: bool) -> tuple[int, int]:
    """(blocks, unmasked) of query rows [q0, q0 + block_m), as the kernel's `_kv_blocks` counts them: the key blocks
    they see, and how many of the first ones need no mask."""
    if causal:
        return -(-min(q0 + block_m, seq_len) // block_n), min(q0 + 1, seq_len) // block_n
    return -(-seq_len // block_n), seq_len // block_n


def attention_by_blocks(q, k, v, *, causal, config=None, dtype=torch.float64):
    """The kernel's computation in torch (`dtype`), block by block in its order: per CTA and consumer the key
    blocks `kv_blocks` counts, masks only past the unmasked ones, exp2 of scaled scores less the running max, P
    rounded to fp16, P_{j-1} V_{j-1} added before O is rescaled by block j's alpha; the last EXP2_POLY columns of
    every block by `exp2_poly` in fp32. [B, S, H, D] in `dtype`."""
    B, S, H, D = q.shape
    cfg = check_config(D, config)
    bm, bn, consumers, poly = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["CONSUMERS"], cfg["EXP2_POLY"]
    scale = D**-0.5 * math.log2(math.e)
    pad = -(-S // (consumers * bm)) * consumers * bm + bn  # zero rows past S, as TMA reads them
    qh, kh, vh = (torch.nn.functional.pad(t.to(dtype).transpose(1, 2), (0, 0, 0, pad - S)) for t in (q, k, v))
    out = torch.zeros(B, H, pad, D, dtype=dtype, device=q.device)
    cols = torch.arange(bn, device=q.device)
    for m0 in range(0, S, consumers * bm):
        for c in range(consumers):
            q0 = m0 + c * bm
            n, full = kv_blocks(q0, S, bm, bn, causal)
            last = q0 + torch.arange(bm, device=q.device)  # each row's last visible key where causal
            m_i = torch.full((B, H, bm), float("-inf"), dtype=dtype, device=q.device)
            l_i = torch.zeros_like(m_i)
            acc = torch.zeros(B, H, bm, D, dtype=dtype, device=q.device)
            p16 = None
            for j in range(n):
                s = qh[:, :, q0:q0 + bm] @ kh[:, :, j * bn:(j + 1) * bn].transpose(-1, -2)
                if j >= full:
                    keep = (j * bn + cols < S)[None, :]
                    if causal:
                        keep = keep & (j * bn + cols[None, :] <= last[:, None])
                    s = s.masked_fill(~keep, float("-inf"))
                m_new = torch.maximum(m_i, s.amax(-1) * scale)
                p = torch.exp2(s * scale - m_new[..., None])
                if poly:
                    p[..., bn - poly:] = exp2_poly(s[..., bn - poly:] * scale - m_new[..., None]).to(dtype)
                alpha = torch.exp2(m_i - m_new)
                l_i = l_i * alpha + p.sum(-1)
                if j > 0:
                    acc = (acc + p16 @ vh[:, :, (j - 1) * bn:j * bn]) * alpha[..., None]
                p16, m_i = p.half().to(dtype), m_new
            acc = acc + p16 @ vh[:, :, (n - 1) * bn:n * bn]
            out[:, :, q0:q0 + bm] = acc / l_i[..., None]
    return out[:, :, :S].transpose(1, 2).contiguous()


def exp2_poly(x: torch.Tensor) -> torch.Tensor:
    """2^x in fp32 as the kernel's polynomial path computes it, for x <= 0 (scores less the row max, log2 domain):
    x clamped at EXP2_POLY_FLOOR, n = floor(x), f = x - n in [0, 1] (fp32's rounding of x - n may give 1), 2^f by
    the EXP2_POLY_COEFFS polynomial in Horner's fmas, 2^n added to its exponent bits (n << 23 added to the bit
    pattern, an integer add: no MUFU). Each fma is emulated by an fp64 product (exact) and sum rounded to fp32, bit
    for bit the kernel's fma except in the rare case where that double rounding differs. x <= -127 gives 0;
    x in (-127, -126) gives a denormal below 2^-126 (the bits of 2^f's mantissa), as harmless as ex2's flush to 0."""
    x = torch.clamp_min(x.float(), EXP2_POLY_FLOOR)
    n = torch.floor(x)
    f = (x - n).double()

    def fma(a, b, c):
        return (a.double() * b + c).float()

    c1, c2, c3 = EXP2_POLY_COEFFS
    p = fma(fma(fma(torch.full_like(f, c3, dtype=torch.float32), f, c2), f, c1), f, 1.0)
    return (p.view(torch.int32) + (n.to(torch.int32) << 23)).view(torch.float32)


def why_unsupported(head_dim: int, dtype=torch.float16, device=None) -> str | None:
    """Why the Hopper attention cannot serve this head dim, dtype and device (None: any), or None: the one
    statement of its limits."""
    if gluon is None:
        return "the Hopper attention needs Triton's Gluon (triton >= 3.5)"
    if dtype != torch.float16:
        return f"the Hopper attention takes fp16 q, k, v, got {dtype}"
    if head_dim not in HEAD_DIMS:
        return f"the Hopper attention serves head_dim in {HEAD_DIMS}, got {head_dim}"
    if device is not None:
        device = torch.device(device)
        if device.type != "cuda":
            return f"the Hopper attention needs a CUDA device, got {device}"
        if torch.cuda.get_device_capability(device)[0] != 9:
            return f"the Hopper attention needs a Hopper GPU (sm_90), got {torch.cuda.get_device_name(device)}"
    return None


def shared_bytes(head_dim: int, cfg: dict) -> int:
    """Shared memory of one CTA at this launch: the consumers' Q tiles (the output's staging too), the K and V
    ring, the mbarriers (Q ready, K and V ready and empty per slot and consumer, the consumers' turns)."""
    c, s = cfg["CONSUMERS"], cfg["STAGES"]
    tiles = 2 * head_dim * (c * cfg["BLOCK_M"] + 2 * s * cfg["BLOCK_N"])
    return tiles + 8 * (c + 2 * s + 2 * s * c + c)


def check_config(head_dim: int, cfg: dict) -> dict:
    """`cfg` completed from DEFAULT_CONFIGS[head_dim] and checked: the ValueError names what does not fit."""
    cfg = {**DEFAULT_CONFIGS[head_dim], **(cfg or {})}
    unknown = set(cfg) - set(CONFIG_KEYS)
    if unknown:
        raise ValueError(f"hopper_attention: unknown config keys {sorted(unknown)}; known: {CONFIG_KEYS}")
    if cfg["BLOCK_M"] not in (64, 128):  # a warpgroup's wgmma takes rows in steps of 64
        raise ValueError(f"hopper_attention: BLOCK_M must be 64 or 128, got {cfg['BLOCK_M']}")
    if cfg["BLOCK_N"] not in (64, 128):
        raise ValueError(f"hopper_attention: BLOCK_N must be 64 or 128, got {cfg['BLOCK_N']}")
    if cfg["CONSUMERS"] not in CONSUMER_REGISTERS:
        raise ValueError(f"hopper_attention: CONSUMERS must be in {tuple(CONSUMER_REGISTERS)}, got "
                         f"{cfg['CONSUMERS']}")
    if not 2 <= cfg["STAGES"] <= 4:
        raise ValueError(f"hopper_attention: STAGES must be 2, 3 or 4, got {cfg['STAGES']}")
    if shared_bytes(head_dim, cfg) > SMEM_BYTES:
        raise ValueError(f"hopper_attention: {cfg} takes {shared_bytes(head_dim, cfg)} bytes of shared memory, more "
                         f"than {SMEM_BYTES}")
    part = cfg["BLOCK_N"] // EXP2_POLY_PARTS
    poly = cfg["EXP2_POLY"]
    if isinstance(poly, bool) or not isinstance(poly, int) or not 0 <= poly <= cfg["BLOCK_N"] or poly % part:
        raise ValueError(f"hopper_attention: EXP2_POLY (score columns of a block whose exp2 take the polynomial) "
                         f"must be a multiple of BLOCK_N / {EXP2_POLY_PARTS} = {part} from 0 to {cfg['BLOCK_N']}, "
                         f"got {poly!r}")
    cfg["PINGPONG"] = bool(cfg["PINGPONG"])
    return cfg


def kernel_options(cfg: dict) -> dict:
    """Compile options of a launch: the default partition (the first consumer) has 4 warps, and maxnreg is the
    register share per thread of the whole CTA (the producer's warp padded to a warpgroup), from which
    `setmaxnreg` gives each partition its own (the default partition what the workers leave)."""
    warpgroups = cfg["CONSUMERS"] + 1
    share = REGISTERS_PER_SM // (warpgroups * 128) // 8 * 8
    return {"num_warps": 4, "maxnreg": share}


# ----------------------------------------------------------------------------------------------
# Gluon kernel
# ----------------------------------------------------------------------------------------------
if gluon is not None:

    @gluon.jit
    def _kv_blocks(q0, seq_len, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, IS_CAUSAL: gl.constexpr):
        """(blocks, unmasked): key blocks that query rows [q0, q0 + BLOCK_M) see, and how many of the first ones
        need no mask (every key below every row's diagonal and the sequence's end)."""
        if IS_CAUSAL:
            hi = gl.minimum(q0 + BLOCK_M, seq_len)
            full = gl.minimum(q0 + 1, seq_len) // BLOCK_N
        else:
            hi = seq_len
            full = seq_len // BLOCK_N
        return gl.cdiv(hi, BLOCK_N), full

    @gluon.jit
    def _producer(descs, bufs, shape, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                  CONSUMERS: gl.constexpr, IS_CAUSAL: gl.constexpr):
        """The TMA warp: each consumer's Q tile, then K and V of every key block some consumer sees, in order, each
        into ring slot j % STAGES once the consumers that read the slot's previous block have handed it back."""
        q_desc, k_desc, v_desc = descs
        q_bufs, k_bufs, v_bufs, q_ready, k_ready, v_ready, k_empty, v_empty, turns = bufs
        b, col, m0, seq_len, qk_scale = shape
        for c in gl.static_range(CONSUMERS):
            mbarrier.expect(q_ready.index(c), q_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(q_desc, [b, m0 + c * BLOCK_M, col], q_ready.index(c), q_bufs.index(c))
        # the last consumer's rows are the last: under a causal mask it sees the most blocks
        n_last, _ = _kv_blocks(m0 + (CONSUMERS - 1) * BLOCK_M, seq_len, BLOCK_M, BLOCK_N, IS_CAUSAL)
        for j in range(n_last):
            slot = j % STAGES
            empty_phase = ((j // STAGES) & 1) ^ 1  # a fresh barrier passes a wait for parity 1
            kv = j * BLOCK_N
            for c in gl.static_range(CONSUMERS):
                n_c, _ = _kv_blocks(m0 + c * BLOCK_M, seq_len, BLOCK_M, BLOCK_N, IS_CAUSAL)
                mbarrier.wait(k_empty.index(c * STAGES + slot), empty_phase, pred=j - STAGES < n_c)
            mbarrier.expect(k_ready.index(slot), k_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(k_desc, [b, kv, col], k_ready.index(slot), k_bufs.index(slot))
            for c in gl.static_range(CONSUMERS):
                n_c, _ = _kv_blocks(m0 + c * BLOCK_M, seq_len, BLOCK_M, BLOCK_N, IS_CAUSAL)
                mbarrier.wait(v_empty.index(c * STAGES + slot), empty_phase, pred=j - STAGES < n_c)
            mbarrier.expect(v_ready.index(slot), v_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(v_desc, [b, kv, col], v_ready.index(slot), v_bufs.index(slot))

    @gluon.jit
    def _take_turn(turns, turn, on, C: gl.constexpr, PINGPONG: gl.constexpr):
        """With PINGPONG, wait until consumer C may issue its wgmmas of turn `turn` (after the previous consumer's
        of the same turn; the first consumer after the last one's previous turn); at once where not `on`."""
        if PINGPONG:
            parity = turn & 1
            if C == 0:
                parity = parity ^ 1  # its first turn waits on nobody: a fresh barrier passes parity 1
            mbarrier.wait(turns.index(C), parity, pred=on)

    @gluon.jit
    def _pass_turn(turns, on, C: gl.constexpr, CONSUMERS: gl.constexpr, PINGPONG: gl.constexpr):
        """With PINGPONG, hand the tensor cores' issue turn to the next consumer where `on`."""
        if PINGPONG:
            mbarrier.arrive(turns.index((C + 1) % CONSUMERS), pred=on)

    _EXP2_C1 = gl.constexpr(EXP2_POLY_COEFFS[0])
    _EXP2_C2 = gl.constexpr(EXP2_POLY_COEFFS[1])
    _EXP2_C3 = gl.constexpr(EXP2_POLY_COEFFS[2])
    _EXP2_FLOOR = gl.constexpr(EXP2_POLY_FLOOR)
    _MAGIC = gl.constexpr(_ROUND_DOWN_MAGIC)

    @gluon.jit
    def _exp2_poly(x):
        """2^x (x <= 0, fp32) without MUFU, as `exp2_poly`: n = floor(x) from one add rounded down (the add's
        integer part lands in the low mantissa bits, so the bit pattern shifted left 23 is n << 23, two's
        complement), f = x - n, 2^f by three fmas, and n added to 2^f's exponent by an integer add."""
        x = gl.maximum(x, _EXP2_FLOOR)  # masked scores (-inf) too: they end at 0 with the rest below the clamp
        t = gl.inline_asm_elementwise("add.rm.f32 $0, $1, 0f4B400000;", "=f,f", [x], dtype=gl.float32,
                                      is_pure=True, pack=1)
        f = x - (t - _MAGIC)
        p = gl.fma(gl.fma(gl.fma(f, _EXP2_C3, _EXP2_C2), f, _EXP2_C1), f, 1.0)
        bits = p.to(gl.int32, bitcast=True) + (t.to(gl.int32, bitcast=True) << 23)
        return bits.to(gl.float32, bitcast=True)

    @gluon.jit
    def _exp2_columns(x, POLY: gl.constexpr):
        """2^x of a [rows, N] tile: its last POLY columns by `_exp2_poly`, the others by ex2, each element one way.
        The tile is halved along its columns (reshape to [rows, 2, N / 2], the halves' axis moved last and split):
        a column bit above the accumulator's lane bits is a register bit, so the halves are register subsets and
        the split and the join back move no data."""
        ROWS: gl.constexpr = x.shape[0]
        N: gl.constexpr = x.shape[1]
        if POLY == 0:
            y = gl.exp2(x)
        elif POLY == N:
            y = _exp2_poly(x)
        else:
            lo, hi = x.reshape([ROWS, 2, N // 2]).permute((0, 2, 1)).split()
            if POLY >= N // 2:
                lo = _exp2_columns(lo, POLY - N // 2)
                hi = _exp2_poly(hi)
            else:
                lo = gl.exp2(lo)
                hi = _exp2_columns(hi, POLY)
            # the halves' layouts may be named differently (a slice, a linear layout) for the same registers
            hi = gl.convert_layout(hi, lo.type.layout, assert_trivial=True)
            y = gl.join(lo, hi).permute((0, 2, 1)).reshape([ROWS, N])
        return y

    @gluon.jit
    def _softmax_step(s, m_i, l_i, j, q0, seq_len, qk_scale, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                      MASKED: gl.constexpr, IS_CAUSAL: gl.constexpr, EXP2_POLY: gl.constexpr, L_S: gl.constexpr):
        """Online softmax of score block j (raw q k^T, fp32): (probabilities fp32, alpha, new max, new sum), the max
        in the log2 domain of scaled scores. The scale (> 0) is applied to the row max and, in one multiply-add
        with the max's subtraction, to the exponent."""
        if MASKED:  # block-local columns against per-row limits: the column offsets stay immediates
            cols = gl.expand_dims(gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, L_S)), 0)
            k0 = j * BLOCK_N
            keep = cols < seq_len - k0
            if IS_CAUSAL:
                last = q0 - k0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, L_S))  # each row's last key
                keep = keep & (cols <= gl.expand_dims(last, 1))
            s = gl.where(keep, s, float("-inf"))
        # every row sees key 0 in block 0, the first one taken: after it the max is finite, and a row that sees no
        # key of a later block gets probabilities exp2(-inf) = 0 there
        m_new = gl.maximum(m_i, gl.max(s, axis=1) * qk_scale)
        x = s * qk_scale - gl.expand_dims(m_new, 1)
        if EXP2_POLY == 0:
            p = gl.exp2(x)
        else:  # the halves' split and join are register renamings: the layout back to L_S must be one too
            p = gl.convert_layout(_exp2_columns(x, EXP2_POLY), L_S, assert_trivial=True)
        alpha = gl.exp2(m_i - m_new)
        l_i = l_i * alpha + gl.sum(p, axis=1)
        return p, alpha, m_new, l_i

    @gluon.jit
    def _consumer_block(j, q, k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty, turns, p16, m_i, l_i, acc,
                        q0, seq_len, qk_scale, n_turns, C: gl.constexpr, HEAD_DIM: gl.constexpr,
                        BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CONSUMERS: gl.constexpr,
                        PINGPONG: gl.constexpr, MASKED: gl.constexpr, IS_CAUSAL: gl.constexpr,
                        EXP2_POLY: gl.constexpr, L_S: gl.constexpr, L_O: gl.constexpr, A_P: gl.constexpr):
        """Key block j (>= 1): S_j = Q K_j^T issued, then O += P_{j-1} V_{j-1}; the softmax of S_j while that PV
        runs; then O rescaled by the new max. Returns the state with P_j (fp16, A operand) not yet applied."""
        slot = j % STAGES
        mbarrier.wait(k_ready.index(slot), (j // STAGES) & 1)
        prev = (j - 1) % STAGES
        mbarrier.wait(v_ready.index(prev), ((j - 1) // STAGES) & 1)
        turn_on = j < n_turns
        _take_turn(turns, j, turn_on, C, PINGPONG)
        s = warpgroup_mma(q, k_bufs.index(slot).reshape([BLOCK_N, HEAD_DIM]).permute((1, 0)),
                          gl.zeros([BLOCK_M, BLOCK_N], gl.float32, L_S), use_acc=False, is_async=True)
        acc = warpgroup_mma(p16, v_bufs.index(prev).reshape([BLOCK_N, HEAD_DIM]), acc, is_async=True)
        _pass_turn(turns, turn_on, C, CONSUMERS, PINGPONG)
        s = warpgroup_mma_wait(num_outstanding=1, deps=(s,))  # S_j done; P_{j-1} V_{j-1} may still run
        mbarrier.arrive(k_empty.index(C * STAGES + slot))
        p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, j, q0, seq_len, qk_scale, BLOCK_M, BLOCK_N, MASKED,
                                           IS_CAUSAL, EXP2_POLY, L_S)
        p_next = gl.convert_layout(p.to(gl.float16), A_P)  # before the wait: the fp32 probabilities die here
        acc, p16 = warpgroup_mma_wait(num_outstanding=0, deps=(acc, p16))
        mbarrier.arrive(v_empty.index(C * STAGES + prev))
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, L_O)), 1)
        return p_next, m_i, l_i, acc

    @gluon.jit
    def _consumer(o_desc, bufs, shape, C: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr,
                  BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CONSUMERS: gl.constexpr, PINGPONG: gl.constexpr,
                  IS_CAUSAL: gl.constexpr, EXP2_POLY: gl.constexpr):
        """Consumer warpgroup C: query rows [m0 + C BLOCK_M, + BLOCK_M) against every key block they see. `bufs`:
        the shared buffers and mbarriers; `shape`: (batch, column of the head, first row of the CTA, S, qk_scale);
        the rest: the launch's constants."""
        q_bufs, k_bufs, v_bufs, q_ready, k_ready, v_ready, k_empty, v_empty, turns = bufs
        b, col, m0, seq_len, qk_scale = shape
        L_S: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                      instr_shape=[16, BLOCK_N, 16])
        L_O: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                      instr_shape=[16, HEAD_DIM, 16])
        A_P: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=L_O, k_width=2)
        q0 = m0 + C * BLOCK_M
        n, full = _kv_blocks(q0, seq_len, BLOCK_M, BLOCK_N, IS_CAUSAL)
        # turns: the blocks every consumer takes (the first consumer's rows are the first: it sees the fewest)
        n_turns, _ = _kv_blocks(m0, seq_len, BLOCK_M, BLOCK_N, IS_CAUSAL)
        q_tile = q_bufs.index(C)
        q = q_tile.reshape([BLOCK_M, HEAD_DIM])
        mbarrier.wait(q_ready.index(C), 0)

        # block 0: S_0, its softmax; masked where it is not a whole block below the diagonal
        mbarrier.wait(k_ready.index(0), 0)
        _take_turn(turns, 0, True, C, PINGPONG)
        s = warpgroup_mma(q, k_bufs.index(0).reshape([BLOCK_N, HEAD_DIM]).permute((1, 0)),
                          gl.zeros([BLOCK_M, BLOCK_N], gl.float32, L_S), use_acc=False, is_async=True)
        _pass_turn(turns, True, C, CONSUMERS, PINGPONG)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
        mbarrier.arrive(k_empty.index(C * STAGES))
        m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, gl.SliceLayout(1, L_S))
        l_i = gl.zeros([BLOCK_M], gl.float32, gl.SliceLayout(1, L_S))
        if full > 0:
            p, _alpha, m_i, l_i = _softmax_step(s, m_i, l_i, 0, q0, seq_len, qk_scale, BLOCK_M, BLOCK_N, False,
                                                IS_CAUSAL, EXP2_POLY, L_S)
        else:
            p, _alpha, m_i, l_i = _softmax_step(s, m_i, l_i, 0, q0, seq_len, qk_scale, BLOCK_M, BLOCK_N, True,
                                                IS_CAUSAL, EXP2_POLY, L_S)
        p16 = gl.convert_layout(p.to(gl.float16), A_P)
        acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, L_O)

        for j in range(1, full):  # whole blocks below the diagonal: no mask
            p16, m_i, l_i, acc = _consumer_block(
                j, q, k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty, turns, p16, m_i, l_i, acc, q0, seq_len,
                qk_scale, n_turns, C, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, CONSUMERS, PINGPONG, False, IS_CAUSAL,
                EXP2_POLY, L_S, L_O, A_P)
        for j in range(gl.maximum(full, 1), n):  # the diagonal's blocks and the sequence's ragged end
            p16, m_i, l_i, acc = _consumer_block(
                j, q, k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty, turns, p16, m_i, l_i, acc, q0, seq_len,
                qk_scale, n_turns, C, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, CONSUMERS, PINGPONG, True, IS_CAUSAL,
                EXP2_POLY, L_S, L_O, A_P)

        # the last block's P V, then O / l in fp16 out through this consumer's Q buffer (every QK^T is done)
        last = (n - 1) % STAGES
        mbarrier.wait(v_ready.index(last), ((n - 1) // STAGES) & 1)
        acc = warpgroup_mma(p16, v_bufs.index(last).reshape([BLOCK_N, HEAD_DIM]), acc, is_async=True)
        acc, p16 = warpgroup_mma_wait(num_outstanding=0, deps=(acc, p16))
        mbarrier.arrive(v_empty.index(C * STAGES + last))
        o = acc / gl.expand_dims(gl.convert_layout(l_i, gl.SliceLayout(1, L_O)), 1)
        q.store(o.to(gl.float16))
        fence_async_shared()  # the stores above before the TMA store reads the buffer (async proxy)
        tma.async_copy_shared_to_global(o_desc, [b, q0, col], q_tile)
        tma.store_wait(pendings=0)

    @gluon.jit
    def _attention_hopper_fwd(
        q_desc, k_desc, v_desc, o_desc,  # rank-3 TMA descriptors over [B, S, H * D], blocks [1, rows, D]
        seq_len, num_heads, qk_scale,  # qk_scale = head_dim**-0.5 * log2(e)
        HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
        CONSUMERS: gl.constexpr, PINGPONG: gl.constexpr, IS_CAUSAL: gl.constexpr, EXP2_POLY: gl.constexpr,
        CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
    ):
        pid_bh = gl.program_id(0)
        pid_m = gl.program_id(1)
        if IS_CAUSAL:  # the longest query blocks (the last ones) first: the short ones fill the last wave
            pid_m = gl.num_programs(1) - 1 - pid_m
        b = pid_bh // num_heads
        col = (pid_bh % num_heads) * HEAD_DIM
        m0 = pid_m * (CONSUMERS * BLOCK_M)

        q_bufs = gl.allocate_shared_memory(gl.float16, [CONSUMERS, 1, BLOCK_M, HEAD_DIM], q_desc.layout)
        k_bufs = gl.allocate_shared_memory(gl.float16, [STAGES, 1, BLOCK_N, HEAD_DIM], k_desc.layout)
        v_bufs = gl.allocate_shared_memory(gl.float16, [STAGES, 1, BLOCK_N, HEAD_DIM], v_desc.layout)
        q_ready = gl.allocate_shared_memory(gl.int64, [CONSUMERS, 1], mbarrier.MBarrierLayout())
        k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        # per consumer and slot: a consumer hands back only the blocks it reads
        k_empty = gl.allocate_shared_memory(gl.int64, [CONSUMERS * STAGES, 1], mbarrier.MBarrierLayout())
        v_empty = gl.allocate_shared_memory(gl.int64, [CONSUMERS * STAGES, 1], mbarrier.MBarrierLayout())
        turns = gl.allocate_shared_memory(gl.int64, [CONSUMERS, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(CONSUMERS):
            mbarrier.init(q_ready.index(i), count=1)
            mbarrier.init(turns.index(i), count=1)
        for i in gl.static_range(STAGES):
            mbarrier.init(k_ready.index(i), count=1)
            mbarrier.init(v_ready.index(i), count=1)
        for i in gl.static_range(CONSUMERS * STAGES):
            mbarrier.init(k_empty.index(i), count=1)
            mbarrier.init(v_empty.index(i), count=1)

        # the first consumer is the default partition (num_warps = 4); the others and the producer are workers
        bufs = (q_bufs, k_bufs, v_bufs, q_ready, k_ready, v_ready, k_empty, v_empty, turns)
        shape = (b, col, m0, seq_len, qk_scale)
        descs = (q_desc, k_desc, v_desc)
        if CONSUMERS == 2:
            gl.warp_specialize([(_consumer, (o_desc, bufs, shape, 0, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, CONSUMERS,
                                             PINGPONG, IS_CAUSAL, EXP2_POLY)),
                                (_consumer, (o_desc, bufs, shape, 1, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, CONSUMERS,
                                             PINGPONG, IS_CAUSAL, EXP2_POLY)),
                                (_producer, (descs, bufs, shape, BLOCK_M, BLOCK_N, STAGES, CONSUMERS, IS_CAUSAL))],
                               [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
        else:
            gl.warp_specialize([(_consumer, (o_desc, bufs, shape, 0, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, CONSUMERS,
                                             PINGPONG, IS_CAUSAL, EXP2_POLY)),
                                (_consumer, (o_desc, bufs, shape, 1, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, CONSUMERS,
                                             PINGPONG, IS_CAUSAL, EXP2_POLY)),
                                (_consumer, (o_desc, bufs, shape, 2, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, CONSUMERS,
                                             PINGPONG, IS_CAUSAL, EXP2_POLY)),
                                (_producer, (descs, bufs, shape, BLOCK_M, BLOCK_N, STAGES, CONSUMERS, IS_CAUSAL))],
                               [4, 4, 1], [CONSUMER_REGS, CONSUMER_REGS, PRODUCER_REGS])


# ----------------------------------------------------------------------------------------------
# Launcher and public function
# ----------------------------------------------------------------------------------------------
def block_layout(rows: int, head_dim: int):
    """The shared layout of a [1, rows, head_dim] fp16 TMA block: rows of head_dim * 2 bytes, 128-byte swizzle."""
    return gl.NVMMASharedLayout.get_default_for([1, rows, head_dim], gl.float16)


def descriptor(t: torch.Tensor, rows: int):
    """The rank-3 TMA descriptor of a [B, S, H, D] view with heads D apart: [B, S, H * D] with the view's batch
    and row strides, blocks [1, rows, D]."""
    B, S, H, D = t.shape
    return TensorDescriptor(t, [B, S, H * D], [t.stride(0), t.stride(1), 1], [1, rows, D], block_layout(rows, D))


def _tma_ready(t: torch.Tensor) -> bool:
    """Whether a [B, S, H, D] view can be read through `descriptor` as it is: unit stride along D, heads D apart,
    16-byte aligned base and strides (TMA's rules)."""
    H, D = t.shape[2:]
    esz = t.element_size()
    return (t.stride(3) == 1 and (t.stride(2) == D or H == 1) and t.data_ptr() % 16 == 0
            and all((s * esz) % 16 == 0 for s in (t.stride(0), t.stride(1))))


def hopper_attention(q, k, v, *, causal: bool, config: dict | None = None, out=None):
    """Attention over [B, S, H, D] fp16 views (unit stride along D, heads D apart, e.g. a packed QKV's
    `unbind(2)`; any other view is copied to a contiguous tensor first): [B, S, H, D] fp16 contiguous (or into
    `out`). causal: keys j > i masked. config: launch override of DEFAULT_CONFIGS (BLOCK_M, BLOCK_N, STAGES,
    CONSUMERS, PINGPONG, EXP2_POLY)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"hopper_attention: {name} must be a [B, S, H, D] tensor, got "
                             f"{tuple(getattr(t, 'shape', ()))}")
    if k.shape != q.shape or v.shape != q.shape:
        raise ValueError(f"hopper_attention: q, k, v shapes differ: {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"hopper_attention: q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    if k.device != q.device or v.device != q.device:
        raise ValueError(f"hopper_attention: q, k, v on different devices: {q.device}, {k.device}, {v.device}")
    B, S, H, D = q.shape
    why = why_unsupported(D, q.dtype, q.device)
    if why:
        raise ValueError(f"hopper_attention: {why}")
    if S == 0 or B * H == 0:
        return torch.empty((B, S, H, D), dtype=q.dtype, device=q.device) if out is None else out
    cfg = check_config(D, config)
    q, k, v = (t if _tma_ready(t) else t.contiguous() for t in (q, k, v))
    if out is None:
        out = torch.empty((B, S, H, D), dtype=q.dtype, device=q.device)
    elif tuple(out.shape) != (B, S, H, D) or out.dtype != q.dtype or not out.is_contiguous():
        raise ValueError(f"hopper_attention: out must be a contiguous {q.dtype} {(B, S, H, D)} tensor")
    rows_m, rows_n = cfg["BLOCK_M"], cfg["BLOCK_N"]
    grid = (B * H, -(-S // (cfg["CONSUMERS"] * rows_m)))
    if grid[1] > 65535:
        raise ValueError(f"hopper_attention: {grid[1]} query blocks exceed the grid's 65535 (S={S})")
    _attention_hopper_fwd[grid](
        descriptor(q, rows_m), descriptor(k, rows_n), descriptor(v, rows_n), descriptor(out, rows_m),
        S, H, D**-0.5 * math.log2(math.e),
        HEAD_DIM=D, BLOCK_M=rows_m, BLOCK_N=rows_n, STAGES=cfg["STAGES"], CONSUMERS=cfg["CONSUMERS"],
        PINGPONG=cfg["PINGPONG"], IS_CAUSAL=bool(causal), EXP2_POLY=cfg["EXP2_POLY"],
        CONSUMER_REGS=CONSUMER_REGISTERS[cfg["CONSUMERS"]], PRODUCER_REGS=PRODUCER_REGISTERS, **kernel_options(cfg),
    )
    return out


__all__ = ["DEFAULT_CONFIGS", "attention_by_blocks", "attention_reference_fp64", "exp2_poly", "hopper_attention",
           "why_unsupported"]
