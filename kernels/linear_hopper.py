"""A linear layer for Hopper (sm_90a) in Gluon: out = epilogue(a @ w^T + bias), persistent and warp-specialized.

The GEMM the wide rows' fusions need first (official rows 8 and 14 spend 606 µs and 119 ms in cuBLAS's GEMMs, and
218 µs and 41 ms in the residual adds and LayerNorms between them that only an epilogue can absorb). One program
per SM loops over 128 x 128 output tiles (row-major in tile order, so the programs running at once share A's rows
and all of W in L2). `gl.warp_specialize` splits a program into:
  - a producer warp (24 registers) that brings A's [128, 64] and W's [128, 64] blocks of every tile the program
    owns by TMA into a ring of STAGES slots, each slot's "ready" mbarrier counting the bytes, its "empty" one
    waiting for the consumer that read it;
  - two consumer warpgroups (240 registers each) that take the program's tiles in turns (ping-pong), so one's
    epilogue runs while the other's wgmmas keep the tensor cores busy; a consumer starts a tile's waits on the ring
    only once the other has passed its waits of the tile before (mbarrier `turn`). Per K block one async wgmma (A and W^T from
    shared memory, fp32 accumulator in registers), the previous block's slot handed back once its wgmma is done;
    then the epilogue in registers and the tile out through the consumer's own shared buffer by TMA.
Epilogues (EPILOGUES): `bias` (out = acc + bias), `gelu` (exact GELU of it, erf to 1.5e-7 as the Hopper forward's),
`residual` (out = residual + acc + bias in fp32; the residual tile comes by TMA into the output buffer while the
tile's wgmmas run). Operands fp16 (or bf16), accumulation fp32, out fp16/bf16 (`bias`, `gelu`) or fp32 (`residual`).
`linear_reference` is the same computation in fp64 torch.
"""
from __future__ import annotations

import torch

from .attention_hopper import PRODUCER_REGISTERS, REGISTERS_PER_SM, SMEM_BYTES  # sm_90's, one owner

try:  # Gluon ships with Triton >= 3.5; without it (or without a Hopper GPU) `why_unsupported` says so
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                  warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
except ImportError:  # pragma: no cover - depends on the installed Triton
    gluon = None

EPILOGUES = ("bias", "gelu", "residual")
OPERAND_DTYPES = (torch.float16, torch.bfloat16)
BLOCK_M, BLOCK_N, BLOCK_K = 128, 128, 64  # a consumer's tile (its 4 warps' wgmma rows 16 apart) and K step
CONSUMERS = 2  # warpgroups taking a program's tiles in turns
CONSUMER_REGISTERS = 240  # each consumer's, what the SM's 64K leave beside the producer's warpgroup (8-multiple)


def ring_fits(out_dtype: torch.dtype, stages: int) -> bool:
    """Whether a ring of `stages` slots (at least 2) and the output tiles fit an sm_90 CTA, 1 KB left for the
    mbarriers and alignment."""
    return stages >= 2 and shared_bytes(out_dtype, stages) + 1024 <= SMEM_BYTES


def stages_for(out_dtype: torch.dtype) -> int:
    """Ring slots that fit beside the consumers' output buffers: four with 16-bit outputs (4 x 32 KB + 2 x 32 KB),
    three with fp32 ones (3 x 32 KB + 2 x 64 KB)."""
    return 4 if out_dtype.itemsize == 2 else 3


def shared_bytes(out_dtype: torch.dtype, stages: int | None = None) -> int:
    """The shared memory a launch allocates: the ring's A and W blocks (`stages` slots, default `stages_for`) and
    the consumers' output tiles (the mbarriers' few bytes aside)."""
    ring = (stages or stages_for(out_dtype)) * (BLOCK_M + BLOCK_N) * BLOCK_K * 2
    return ring + CONSUMERS * BLOCK_M * BLOCK_N * out_dtype.itemsize


# ----------------------------------------------------------------------------------------------
# Plain torch reference (fp64)
# ----------------------------------------------------------------------------------------------
def linear_reference(a, w, bias, *, epilogue="bias", residual=None, row_mask=None):
    """epilogue(a @ w^T + bias) in fp64: `bias` as it is, `gelu` exact GELU (erf), `residual` plus `residual`;
    rows where `row_mask` is False, 0."""
    y = a.double() @ w.double().t() + bias.double()
    if epilogue == "gelu":
        y = torch.nn.functional.gelu(y, approximate="none")
    if epilogue == "residual":
        y = residual.double() + y
    if row_mask is not None:
        y = y.masked_fill(~row_mask.reshape(-1, 1), 0.0)
    return y


# ----------------------------------------------------------------------------------------------
# Gluon kernel
# ----------------------------------------------------------------------------------------------
if gluon is not None:
    from .hopper_forward import _gelu

    _BM, _BN, _BK, _CONSUMERS = (gl.constexpr(v) for v in (BLOCK_M, BLOCK_N, BLOCK_K, CONSUMERS))

    @gluon.jit
    def _producer(a_desc, w_desc, bufs, counts, STAGES: gl.constexpr):
        """Every A and W block of the program's tiles, in the consumers' order, into the ring."""
        a_bufs, w_bufs, ready, empty, c_bufs, res_ready, turn = bufs
        num_tiles, num_pid_n, k_blocks = counts
        it = 0
        for t in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
            off_m = (t // num_pid_n) * _BM
            off_n = (t % num_pid_n) * _BN
            for kb in range(k_blocks):
                s = it % STAGES
                # the slot's previous block (it - STAGES) handed back: its (it // STAGES)-th release
                mbarrier.wait(empty.index(s), ((it // STAGES) - 1) & 1, pred=it >= STAGES)
                mbarrier.expect(ready.index(s), a_desc.block_type.nbytes + w_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(a_desc, [off_m, kb * _BK], ready.index(s), a_bufs.index(s))
                tma.async_copy_global_to_shared(w_desc, [off_n, kb * _BK], ready.index(s), w_bufs.index(s))
                it += 1

    @gluon.jit
    def _consumer(c_desc, r_desc, bias_ptr, mask_ptr, bufs, counts, M, N, C: gl.constexpr, STAGES: gl.constexpr,
                  EPILOGUE: gl.constexpr, ROW_MASK: gl.constexpr):
        """Consumer warpgroup C: the program's tiles C, C + 2, ...: their wgmmas, then the epilogue and the store."""
        a_bufs, w_bufs, ready, empty, c_bufs, res_ready, turn = bufs
        num_tiles, num_pid_n, k_blocks = counts
        L_ACC: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, _BN, 16])
        c_buf = c_bufs.index(C)
        res_bar = res_ready.index(C)
        nprog = gl.num_programs(0)
        j = C  # the tile's place in the program's list, whose blocks sit at ring positions j * k_blocks on
        for t in range(gl.program_id(0) + C * nprog, num_tiles, _CONSUMERS * nprog):
            off_m = (t // num_pid_n) * _BM
            off_n = (t % num_pid_n) * _BN
            tma.store_wait(pendings=0)  # the last tile's store has read the buffer
            if EPILOGUE == 2:  # the residual tile comes into the output buffer while the wgmmas run
                mbarrier.expect(res_bar, r_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(r_desc, [off_m, off_n], res_bar, c_buf)
            acc = gl.zeros([_BM, _BN], gl.float32, L_ACC)
            base = j * k_blocks
            # the other consumer has waited on every block of the tile before this one: a slot's "ready" phase
            # parity names one fill only while no consumer waits more than one fill ahead of the producer
            mbarrier.wait(turn.index(1 - C), ((j - 1) // _CONSUMERS) & 1, pred=j > 0)
            for kb in range(k_blocks):
                it = base + kb
                s = it % STAGES
                mbarrier.wait(ready.index(s), (it // STAGES) & 1)
                acc = warpgroup_mma(a_bufs.index(s), w_bufs.index(s).permute((1, 0)), acc, is_async=True)
                acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
                # the wgmma of block kb - 1 is done: its slot goes back to the producer
                mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES), pred=kb > 0)
            mbarrier.arrive(turn.index(C))  # the other consumer's next tile may start its waits
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            mbarrier.arrive(empty.index((base + k_blocks - 1) % STAGES))
            cols = off_n + gl.arange(0, _BN, layout=gl.SliceLayout(0, L_ACC))
            bias = gl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(gl.float32)
            y = acc + gl.expand_dims(bias, 0)
            if EPILOGUE == 1:
                y = _gelu(y)
            if EPILOGUE == 2:
                mbarrier.wait(res_bar, (j // _CONSUMERS) & 1)
                y = y + c_buf.load(L_ACC)
            if ROW_MASK:  # the rows of invalid tokens become 0
                rows = off_m + gl.arange(0, _BM, layout=gl.SliceLayout(1, L_ACC))
                keep = gl.load(mask_ptr + rows, mask=rows < M, other=0)
                y = gl.where(gl.expand_dims(keep != 0, 1), y, 0.0)
            c_buf.store(y.to(c_desc.dtype))
            fence_async_shared()  # the stores above before the TMA store reads the buffer (async proxy)
            tma.async_copy_shared_to_global(c_desc, [off_m, off_n], c_buf)
            j += _CONSUMERS
        tma.store_wait(pendings=0)

    @gluon.jit
    def _linear_hopper_fwd(
        a_desc, w_desc, c_desc, r_desc,  # TMA descriptors: A [M, K], W [N, K], out [M, N], residual [M, N] (or out)
        bias_ptr, mask_ptr, M, N, K,  # mask_ptr: int8 [M], read where ROW_MASK
        STAGES: gl.constexpr, EPILOGUE: gl.constexpr, ROW_MASK: gl.constexpr, CONSUMER_REGS: gl.constexpr,
        PRODUCER_REGS: gl.constexpr,
    ):
        num_pid_n = gl.cdiv(N, _BN)
        counts = (gl.cdiv(M, _BM) * num_pid_n, num_pid_n, gl.cdiv(K, _BK))
        a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES, _BM, _BK], a_desc.layout)
        w_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES, _BN, _BK], w_desc.layout)
        c_bufs = gl.allocate_shared_memory(c_desc.dtype, [_CONSUMERS, _BM, _BN], c_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        res_ready = gl.allocate_shared_memory(gl.int64, [_CONSUMERS, 1], mbarrier.MBarrierLayout())
        turn = gl.allocate_shared_memory(gl.int64, [_CONSUMERS, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=1)
        for i in gl.static_range(_CONSUMERS):
            mbarrier.init(res_ready.index(i), count=1)
            mbarrier.init(turn.index(i), count=1)
        bufs = (a_bufs, w_bufs, ready, empty, c_bufs, res_ready, turn)
        # the first consumer is the default partition (num_warps = 4); the second and the producer are workers
        gl.warp_specialize([(_consumer, (c_desc, r_desc, bias_ptr, mask_ptr, bufs, counts, M, N, 0, STAGES, EPILOGUE,
                                         ROW_MASK)),
                            (_consumer, (c_desc, r_desc, bias_ptr, mask_ptr, bufs, counts, M, N, 1, STAGES, EPILOGUE,
                                         ROW_MASK)),
                            (_producer, (a_desc, w_desc, bufs, counts, STAGES))],
                           [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


# ----------------------------------------------------------------------------------------------
# Launcher and public function
# ----------------------------------------------------------------------------------------------
def why_unsupported(a, w, epilogue, device) -> str | None:
    """Why `linear_hopper` cannot serve these operands, or None when it can."""
    if gluon is None:
        return "this Triton has no Gluon (triton.experimental.gluon, Triton >= 3.5)"
    if epilogue not in EPILOGUES:
        return f"epilogue must be one of {EPILOGUES}, got {epilogue!r}"
    if a.dtype not in OPERAND_DTYPES or w.dtype != a.dtype:
        return f"a and w must share a float16/bfloat16 dtype, got a {a.dtype} and w {w.dtype}"
    if a.dim() != 2 or w.dim() != 2 or a.shape[1] != w.shape[1]:
        return f"a must be [M, K] and w [N, K], got a {tuple(a.shape)} and w {tuple(w.shape)}"
    K, N = a.shape[1], w.shape[0]
    if K % 8 or N % 8:  # TMA: every row 16-byte aligned
        return f"K and N must be multiples of 8 (16-byte rows for TMA), got K={K}, N={N}"
    if device.type != "cuda" or torch.cuda.get_device_capability(device) != (9, 0):
        return f"needs an sm_90 GPU (Hopper: wgmma, TMA), got {device}"
    return None


def _descriptor(t: torch.Tensor, rows: int, cols: int):
    """The TMA descriptor of a row-major [R, C] tensor in blocks [rows, cols], its shared layout swizzled."""
    dtype = {torch.float16: gl.float16, torch.bfloat16: gl.bfloat16, torch.float32: gl.float32}[t.dtype]
    layout = gl.NVMMASharedLayout.get_default_for([rows, cols], dtype)
    return TensorDescriptor(t, list(t.shape), [t.stride(0), 1], [rows, cols], layout)


def kernel_options() -> dict:
    """The default partition (the first consumer) has 4 warps; maxnreg is the register share per thread of the
    whole CTA (three warpgroups, the producer's warp padded to one), from which `setmaxnreg` gives each partition
    its own."""
    return {"num_warps": 4, "maxnreg": REGISTERS_PER_SM // ((CONSUMERS + 1) * 128) // 8 * 8}


def linear_hopper(a, w, bias, *, epilogue="bias", residual=None, row_mask=None, out=None, num_programs=None,
                  stages=None):
    """epilogue(a @ w^T + bias) on Hopper: a [M, K] and w [N, K] (nn.Linear's layout), both fp16 or both bf16
    and contiguous; bias [N] (any float dtype, added in fp32). `epilogue`: `bias` or `gelu` return a's dtype,
    `residual` returns fp32 residual + a @ w^T + bias (residual: fp32 [M, N], contiguous). `row_mask`: bool with
    M elements, or None; the output's rows where it is False are 0 (a block's invalid tokens). `out`: the output,
    contiguous [M, N] of that dtype (for `residual` it may be `residual` itself). num_programs: the persistent grid
    (default: one program per SM). stages: the ring's slots (default `stages_for` the output's dtype: the most that
    fit), at least 2."""
    why = why_unsupported(a, w, epilogue, a.device)
    if why:
        raise ValueError(f"linear_hopper: {why}")
    M, K = a.shape
    N = w.shape[0]
    if not (a.is_contiguous() and w.is_contiguous()):
        raise ValueError("linear_hopper: a and w must be contiguous")
    if bias.shape != (N,) or bias.device != a.device:
        raise ValueError(f"linear_hopper: bias must be [{N}] on {a.device}, got {tuple(bias.shape)} on {bias.device}")
    out_dtype = torch.float32 if epilogue == "residual" else a.dtype
    if epilogue == "residual" and (residual is None or residual.dtype != torch.float32 or residual.shape != (M, N)
                                   or not residual.is_contiguous()):
        raise ValueError(f"linear_hopper: epilogue 'residual' needs a contiguous fp32 [{M}, {N}] residual")
    if row_mask is not None and (row_mask.dtype != torch.bool or row_mask.numel() != M
                                 or row_mask.device != a.device):
        raise ValueError(f"linear_hopper: row_mask must be bool with {M} elements on {a.device}, got "
                         f"{row_mask.dtype} {tuple(row_mask.shape)} on {row_mask.device}")
    stages = stages_for(out_dtype) if stages is None else stages
    if not ring_fits(out_dtype, stages):
        raise ValueError(f"linear_hopper: {stages} ring slots: at least 2, and with the {out_dtype} output tiles "
                         f"within an sm_90 CTA's {SMEM_BYTES} bytes of shared memory")
    if out is None:
        out = torch.empty((M, N), dtype=out_dtype, device=a.device)
    elif out.shape != (M, N) or out.dtype != out_dtype or not out.is_contiguous():
        raise ValueError(f"linear_hopper: out must be a contiguous {out_dtype} [{M}, {N}] tensor")
    if M == 0 or N == 0:
        return out
    tiles = -(-M // BLOCK_M) * -(-N // BLOCK_N)
    if num_programs is None:
        num_programs = torch.cuda.get_device_properties(a.device).multi_processor_count
    c_desc = _descriptor(out, BLOCK_M, BLOCK_N)
    r_desc = _descriptor(residual, BLOCK_M, BLOCK_N) if epilogue == "residual" else c_desc
    mask8 = bias if row_mask is None else row_mask.contiguous().view(-1).view(torch.int8)
    _linear_hopper_fwd[(max(1, min(num_programs, tiles)),)](
        _descriptor(a, BLOCK_M, BLOCK_K), _descriptor(w, BLOCK_N, BLOCK_K), c_desc, r_desc, bias, mask8, M, N, K,
        STAGES=stages, EPILOGUE=EPILOGUES.index(epilogue), ROW_MASK=row_mask is not None,
        CONSUMER_REGS=CONSUMER_REGISTERS, PRODUCER_REGS=PRODUCER_REGISTERS, **kernel_options(),
    )
    return out


__all__ = ["EPILOGUES", "SMEM_BYTES", "linear_hopper", "linear_reference", "why_unsupported"]
