"""LayerNorm 1 and the packed QKV projection (kernels/fused_layer.py's `ln_qkv`) for Hopper (sm_90a) in Gluon.

Per block of BLOCK_M tokens: qkv = LayerNorm 1 (x) @ Wqkv^T + b_qkv, [BLOCK_M, 3d] in the weights' dtype. Triton's
`ln_qkv` moves official row 13's bytes at 1.89 TB/s (44.3 µs a layer on an H100), reading the packed weight (96 KB at
d_model 128) in every program. Here, as in kernels/layer_tail_hopper.py, one program per SM keeps the weight in shared
memory for all its blocks, a TMA loader warp brings each block's residual into its consumer's slot, and two consumer
warpgroups take the blocks in turns: the slot goes back once read, the LayerNorm and the three [BLOCK_M, d]
products (q, k, v, each from the bias as its initial accumulator, out by TMA) run while the other consumer's do. Operands fp16
or bf16, statistics and accumulation fp32. No mask: the rows of invalid tokens are projected like any other (the
attention hides their keys, the tail zeroes them); the forward's first projection, which also writes the mask's
summary, stays Triton's. `qkv_reference` is the computation in fp64.
"""
from __future__ import annotations

import torch

from .attention_hopper import SMEM_BYTES  # sm_90's, one owner
from .layer_tail_hopper import BLOCK_M, OPERAND_DTYPES, RESIDUAL_DTYPES, WIDTHS, check_vectors, persistent_grid
from .linear_hopper import CONSUMER_REGISTERS, CONSUMERS, PRODUCER_REGISTERS, _descriptor, kernel_options

try:  # Gluon ships with Triton >= 3.5; without it (or without a Hopper GPU) `why_unsupported` says so
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                  warpgroup_mma_wait)
except ImportError:  # pragma: no cover - depends on the installed Triton
    gluon = None

# The vector table's rows ([len, d] fp32, `qkv_vectors`): LayerNorm 1's weight and bias, then q's, k's, v's biases
VECTOR_ORDER = ("n1_w", "n1_b", "q_b", "k_b", "v_b")


def shared_bytes(d_model: int) -> int:
    """Shared memory of a launch at most: the packed weight, each consumer's slot (a block's fp32 residual) and
    output buffer (a [BLOCK_M, d] part of its q, k, v)."""
    return 2 * 3 * d_model * d_model + CONSUMERS * BLOCK_M * d_model * (4 + 2)


def why_unsupported(d_model: int, device=None) -> str | None:
    """Why `ln_qkv_hopper` cannot serve this width (device: where it would run; None: any), or None."""
    if gluon is None:
        return "the Hopper LayerNorm + QKV needs Triton's Gluon (triton >= 3.5)"
    if d_model not in WIDTHS:
        return f"the Hopper LayerNorm + QKV serves d_model in {WIDTHS}, got {d_model}"
    if shared_bytes(d_model) + 1024 > SMEM_BYTES:  # pragma: no cover - every width fits
        return f"the Hopper LayerNorm + QKV's weight and slots exceed an sm_90 CTA's {SMEM_BYTES} bytes"
    if device is not None and (device.type != "cuda" or torch.cuda.get_device_capability(device) != (9, 0)):
        return f"the Hopper LayerNorm + QKV needs an sm_90 GPU (wgmma, TMA), got {device}"
    return None


def qkv_vectors(w: dict) -> torch.Tensor:
    """The kernel's fp32 vector table [len(VECTOR_ORDER), d] from a layer's weights (kernels' names)."""
    d = w["n1_w"].shape[0]
    return torch.cat([w["n1_w"].float().view(1, d), w["n1_b"].float().view(1, d),
                      w["qkv_b"].float().view(3, d)]).contiguous()


def qkv_reference(x, w, *, eps):
    """LayerNorm 1 (x) @ Wqkv^T + b_qkv in fp64: [B, S, 3d]."""
    d = x.shape[-1]
    h = torch.nn.functional.layer_norm(x.double(), (d,), w["n1_w"].double(), w["n1_b"].double(), eps)
    return h @ w["qkv_w"].double().t() + w["qkv_b"].double()


# ----------------------------------------------------------------------------------------------
# Gluon kernel
# ----------------------------------------------------------------------------------------------
if gluon is not None:
    from .hopper_forward import _layer_norm
    from .layer_tail_hopper import _row, _slot_barriers

    _BM = gl.constexpr(BLOCK_M)
    _CONSUMERS = gl.constexpr(CONSUMERS)

    @gluon.jit
    def _loader(x_desc, w_desc, bufs, n_blocks, D: gl.constexpr):
        """The weight once (q, k, v rows), then every block of the program, consumer by consumer, into its slot."""
        x_s, w_s, c_s, ready, empty, w_ready = bufs
        mbarrier.expect(w_ready, 3 * w_desc.block_type.nbytes)
        for part in gl.static_range(3):
            tma.async_copy_global_to_shared(w_desc, [part * D, 0], w_ready, w_s.index(part))
        i = 0
        for t in range(gl.program_id(0), n_blocks, gl.num_programs(0)):
            c = i % _CONSUMERS
            use = i // _CONSUMERS  # the slot's fills so far
            mbarrier.wait(empty.index(c), (use - 1) & 1, pred=use > 0)
            mbarrier.expect(ready.index(c), x_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(x_desc, [t * _BM, 0], ready.index(c), x_s.index(c))
            i += 1

    @gluon.jit
    def _consumer(out_desc, VEC, bufs, n_blocks, eps, C: gl.constexpr, D: gl.constexpr):
        """Consumer warpgroup C: blocks C, C + 2, ... of the program's list, each from its slot to the output, a
        [BLOCK_M, D] part at a time through the consumer's output buffer by TMA (a store from the wgmma's layout
        writes 4 bytes a thread, half a sector a row: that ran at 1.17 TB/s)."""
        x_s, w_s, c_s, ready, empty, w_ready = bufs
        L_D: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D, 16])
        A_D: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=L_D, k_width=2)
        COL_D: gl.constexpr = gl.SliceLayout(0, L_D)
        zeros = gl.zeros([_BM, D], gl.float32, L_D)
        x_buf = x_s.index(C)
        c_buf = c_s.index(C)
        mbarrier.wait(w_ready, 0)
        nprog = gl.num_programs(0)
        use = 0
        for t in range(gl.program_id(0) + C * nprog, n_blocks, _CONSUMERS * nprog):
            mbarrier.wait(ready.index(C), use & 1)
            x = x_buf.load(L_D).to(gl.float32)
            h = _layer_norm(x, _row(VEC, 0, D, D, COL_D), _row(VEC, 1, D, D, COL_D), D, eps)
            # the slot read (h needs every element of x): the loader brings this consumer's next block
            mbarrier.arrive(empty.index(C))
            h = gl.convert_layout(h.to(w_s.dtype), A_D)
            for part in gl.static_range(3):  # q, k, v: bias + LN1(x) @ W_part^T
                acc = warpgroup_mma(h, w_s.index(part).permute((1, 0)),
                                    zeros + gl.expand_dims(_row(VEC, 2 + part, D, D, COL_D), 0), is_async=True)
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
                tma.store_wait(pendings=0)  # the previous part's store has read the buffer
                c_buf.store(acc.to(c_buf.dtype))
                fence_async_shared()  # the stores above before the TMA store reads the buffer (async proxy)
                tma.async_copy_shared_to_global(out_desc, [t * _BM, part * D], c_buf)
            use += 1
        tma.store_wait(pendings=0)

    @gluon.jit
    def _ln_qkv_hopper_fwd(
        x_desc, w_desc, out_desc,  # TMA: x [N, D] (fp32, or the input's dtype), Wqkv [3D, D] and qkv [N, 3D] in
        # [D, D] and [BLOCK_M, D] blocks
        VEC,  # fp32 [len(VECTOR_ORDER), D]
        n_tokens, eps,
        D: gl.constexpr, CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
    ):
        n_blocks = gl.cdiv(n_tokens, _BM)
        x_s = gl.allocate_shared_memory(x_desc.dtype, [_CONSUMERS, _BM, D], x_desc.layout)
        w_s = gl.allocate_shared_memory(w_desc.dtype, [3, D, D], w_desc.layout)
        c_s = gl.allocate_shared_memory(out_desc.dtype, [_CONSUMERS, _BM, D], out_desc.layout)
        ready, empty, w_ready = _slot_barriers()
        bufs = (x_s, w_s, c_s, ready, empty, w_ready)
        gl.warp_specialize([(_consumer, (out_desc, VEC, bufs, n_blocks, eps, 0, D)),
                            (_consumer, (out_desc, VEC, bufs, n_blocks, eps, 1, D)),
                            (_loader, (x_desc, w_desc, bufs, n_blocks, D))],
                           [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


# ----------------------------------------------------------------------------------------------
# Launcher and public function
# ----------------------------------------------------------------------------------------------
def ln_qkv_hopper(x, w, *, eps, vecs=None, num_programs=None):
    """`fused_layer.ln_qkv` without a mask on Hopper: x [B, S, d] contiguous (fp32, or the input's dtype), `w` with
    qkv_w [3d, d] (fp16/bf16), qkv_b, n1_w, n1_b. Returns [B, S, 3d] (q, k, v) in qkv_w's dtype. `eps`: LayerNorm
    1's epsilon. vecs: `qkv_vectors(w)`, made once by a caller that calls often. num_programs: the persistent grid
    (default: one program per SM)."""
    B, S, d = x.shape
    why = why_unsupported(d, x.device)
    if why:
        raise ValueError(f"ln_qkv_hopper: {why}")
    op = w["qkv_w"].dtype
    if (op not in OPERAND_DTYPES or w["qkv_w"].shape != (3 * d, d) or not w["qkv_w"].is_contiguous()
            or w["qkv_w"].device != x.device):
        raise ValueError(f"ln_qkv_hopper: qkv_w must be a contiguous float16/bfloat16 [3d, d] = [{3 * d}, {d}] on "
                         f"{x.device}, got {op} {tuple(w['qkv_w'].shape)} strides {w['qkv_w'].stride()} on "
                         f"{w['qkv_w'].device}")
    if x.dtype not in RESIDUAL_DTYPES or not x.is_contiguous():
        raise ValueError(f"ln_qkv_hopper: x must be a contiguous float32, float16 or bfloat16 [B, S, d], got "
                         f"{x.dtype} {tuple(x.shape)}")
    if vecs is None:
        vecs = qkv_vectors(w)
    check_vectors("ln_qkv_hopper", vecs, (len(VECTOR_ORDER), d), x.device)
    out = torch.empty((B, S, 3 * d), device=x.device, dtype=op)
    n_tokens = B * S
    if n_tokens == 0:
        return out
    _ln_qkv_hopper_fwd[persistent_grid(n_tokens, x.device, num_programs)](
        _descriptor(x.view(n_tokens, d), BLOCK_M, d), _descriptor(w["qkv_w"], d, d),
        _descriptor(out.view(n_tokens, 3 * d), BLOCK_M, d), vecs, n_tokens, eps,
        D=d, CONSUMER_REGS=CONSUMER_REGISTERS, PRODUCER_REGS=PRODUCER_REGISTERS, **kernel_options(),
    )
    return out


__all__ = ["VECTOR_ORDER", "ln_qkv_hopper", "qkv_reference", "qkv_vectors", "shared_bytes", "why_unsupported"]
