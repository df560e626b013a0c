"""The layer tail (kernels/layer_tail.py's computation) for Hopper (sm_90a) in Gluon: persistent, weights once per SM.

Per block of BLOCK_M tokens: x1 = x + o @ Wo^T + b_o; h = LayerNorm 2 (x1); y = x1 + GELU(h @ Win^T + b_in) @
Wout^T + b_out; invalid rows 0; for the forward's last layer the final LayerNorm of y. The Triton tail loads all
three weights (96 KB at d_model and ffn_dim 128) in every 64-token program and spills, so on long rows (official row
13: 65 536 tokens) it moves the residual stream at 1.28 TB/s. Here one program per SM keeps the three weights in
shared memory for all its blocks, and `gl.warp_specialize` splits it into:
  - a loader warp that brings each block's attention output (fp16/bf16) and residual (fp32) by TMA into its
    consumer's slot, once that consumer has handed the slot back ("ready" counts the bytes, "empty" the hand-back);
  - two consumer warpgroups taking the program's blocks in turns, each with its own slot, so one's loads and
    LayerNorm / GELU run under the other's wgmmas. A consumer hands its slot back as soon as the out-projection has
    read it, so the next block's loads run under the rest of this one.
The residual adds ride in the wgmma accumulators (x + b_o is the out-projection's initial accumulator, x1 + b_out
the FFN-out's), so a consumer holds x1 and one product at a time. GELU is the Hopper forward's (erf to 1.5e-7).
Operands fp16 or bf16, accumulation and statistics fp32; the output fp32 (the residual) or, with the final
LayerNorm, the caller's dtype. `layer_tail_reference` (kernels/layer_tail.py) is the computation in fp64.
"""
from __future__ import annotations

import torch

from .attention_hopper import SMEM_BYTES  # sm_90's, one owner
from .linear_hopper import CONSUMER_REGISTERS, CONSUMERS, PRODUCER_REGISTERS, _descriptor, kernel_options

try:  # Gluon ships with Triton >= 3.5; without it (or without a Hopper GPU) `why_unsupported` says so
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
except ImportError:  # pragma: no cover - depends on the installed Triton
    gluon = None

WIDTHS = (32, 64, 128)  # d_model and ffn_dim served: a power of two (a tile's columns), a wgmma k step's multiple
BLOCK_M = 64  # tokens of a block: one warpgroup's wgmma rows
OPERAND_DTYPES = (torch.float16, torch.bfloat16)
RESIDUAL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # x: fp32, or the input's dtype into layer 0
# A layer's vectors, one fp32 row each of `tail_vectors`' [len, max(d, ffn)] table (the kernel's rows follow it);
# the final LayerNorm's rows are read only with it
VECTOR_ORDER = ("o_b", "n2_w", "n2_b", "in_b", "out_b", "final_w", "final_b")


def shared_bytes(d_model: int, ffn_dim: int) -> int:
    """Shared memory of a launch at most: the three weights, each consumer's slot (a block's attention output and
    fp32 residual), the mbarriers' few bytes aside."""
    weights = 2 * (d_model * d_model + 2 * ffn_dim * d_model)
    return weights + CONSUMERS * BLOCK_M * d_model * (2 + 4)


def why_unsupported(d_model: int, ffn_dim: int, device=None) -> str | None:
    """Why `layer_tail_hopper` cannot serve this layer (device: where it would run; None: any), or None."""
    if gluon is None:
        return "the Hopper layer tail needs Triton's Gluon (triton >= 3.5)"
    if d_model not in WIDTHS or ffn_dim not in WIDTHS:
        return f"the Hopper layer tail serves d_model and ffn_dim in {WIDTHS}, got {d_model} and {ffn_dim}"
    if shared_bytes(d_model, ffn_dim) + 1024 > SMEM_BYTES:  # pragma: no cover - every WIDTHS pair fits
        return f"the Hopper layer tail's weights and slots exceed an sm_90 CTA's {SMEM_BYTES} bytes"
    if device is not None and (device.type != "cuda" or torch.cuda.get_device_capability(device) != (9, 0)):
        return f"the Hopper layer tail needs an sm_90 GPU (wgmma, TMA), got {device}"
    return None


def tail_vectors(w: dict, final: tuple | None = None) -> torch.Tensor:
    """The kernel's fp32 vector table [len(VECTOR_ORDER), max(d, ffn)] from a layer's weights (kernels' names) and
    the final LayerNorm's (weight, bias) (zeros without it); rows padded with zeros. Made once per layer by a
    caller that calls often (the routes), else by each call."""
    d, ffn = w["o_w"].shape[0], w["in_w"].shape[0]
    width = max(d, ffn)
    got = {**w, "final_w": final[0] if final else None, "final_b": final[1] if final else None}
    table = torch.zeros(len(VECTOR_ORDER), width, dtype=torch.float32, device=w["o_w"].device)
    for i, name in enumerate(VECTOR_ORDER):
        if got[name] is not None:
            table[i, :got[name].numel()] = got[name].float()
    return table


# ----------------------------------------------------------------------------------------------
# Gluon kernel
# ----------------------------------------------------------------------------------------------
if gluon is not None:
    from .hopper_forward import _gelu, _layer_norm

    _BM = gl.constexpr(BLOCK_M)
    _CONSUMERS = gl.constexpr(CONSUMERS)

    @gluon.jit
    def _loader(o_desc, x_desc, wo_desc, win_desc, wout_desc, bufs, n_blocks):
        """The weights once, then every block of the program, consumer by consumer in turn, into its slot."""
        o_s, x_s, wo_s, win_s, wout_s, ready, empty, w_ready = bufs
        mbarrier.expect(w_ready, wo_desc.block_type.nbytes + win_desc.block_type.nbytes
                        + wout_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(wo_desc, [0, 0], w_ready, wo_s)
        tma.async_copy_global_to_shared(win_desc, [0, 0], w_ready, win_s)
        tma.async_copy_global_to_shared(wout_desc, [0, 0], w_ready, wout_s)
        i = 0
        for t in range(gl.program_id(0), n_blocks, gl.num_programs(0)):
            c = i % _CONSUMERS
            use = i // _CONSUMERS  # the slot's fills so far
            mbarrier.wait(empty.index(c), (use - 1) & 1, pred=use > 0)
            mbarrier.expect(ready.index(c), o_desc.block_type.nbytes + x_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(o_desc, [t * _BM, 0], ready.index(c), o_s.index(c))
            tma.async_copy_global_to_shared(x_desc, [t * _BM, 0], ready.index(c), x_s.index(c))
            i += 1

    @gluon.jit
    def _slot_barriers():
        """The mbarriers of a program's slots, initialized: each consumer's "ready" (the loader's bytes landed) and
        "empty" (the consumer handed it back), and "w_ready" (the weights landed)."""
        ready = gl.allocate_shared_memory(gl.int64, [_CONSUMERS, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [_CONSUMERS, 1], mbarrier.MBarrierLayout())
        w_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        for i in gl.static_range(_CONSUMERS):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=1)
        mbarrier.init(w_ready, count=1)
        return ready, empty, w_ready

    @gluon.jit
    def _row(VEC, R: gl.constexpr, WIDTH: gl.constexpr, N: gl.constexpr, layout: gl.constexpr):
        """N floats of row R of the vector table (VECTOR_ORDER), as a column vector in `layout`."""
        return gl.load(VEC + R * WIDTH + gl.arange(0, N, layout=layout))

    @gluon.jit
    def _consumer(Y, Mask, VEC, bufs, n_tokens, n_blocks, eps, C: gl.constexpr, D: gl.constexpr, F: gl.constexpr,
                  WIDTH: gl.constexpr, HAS_MASK: gl.constexpr, FINAL_NORM: gl.constexpr):
        """Consumer warpgroup C: blocks C, C + 2, ... of the program's list, each from its slot to Y."""
        o_s, x_s, wo_s, win_s, wout_s, ready, empty, w_ready = bufs
        L_D: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D, 16])
        L_F: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, F, 16])
        A_D: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=L_D, k_width=2)  # -> [BM, D] products
        A_F: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=L_F, k_width=2)  # -> [BM, F] products
        COL_D: gl.constexpr = gl.SliceLayout(0, L_D)
        COL_F: gl.constexpr = gl.SliceLayout(0, L_F)
        rows0 = gl.arange(0, _BM, layout=gl.SliceLayout(1, L_D))
        cols = gl.arange(0, D, layout=COL_D)
        zeros_f = gl.zeros([_BM, F], gl.float32, L_F)
        o_buf = o_s.index(C)
        x_buf = x_s.index(C)
        mbarrier.wait(w_ready, 0)
        nprog = gl.num_programs(0)
        use = 0  # this consumer's blocks so far: its slot's fills
        for t in range(gl.program_id(0) + C * nprog, n_blocks, _CONSUMERS * nprog):
            mbarrier.wait(ready.index(C), use & 1)
            acc = x_buf.load(L_D).to(gl.float32) + gl.expand_dims(_row(VEC, 0, WIDTH, D, COL_D), 0)
            acc = warpgroup_mma(o_buf, wo_s.permute((1, 0)), acc, is_async=True)
            x1 = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            mbarrier.arrive(empty.index(C))  # the slot read: the loader brings this consumer's next block
            h = _layer_norm(x1, _row(VEC, 1, WIDTH, D, COL_D), _row(VEC, 2, WIDTH, D, COL_D), D, eps)
            f = warpgroup_mma(gl.convert_layout(h.to(o_buf.dtype), A_F), win_s.permute((1, 0)), zeros_f,
                              use_acc=False, is_async=True)
            f = warpgroup_mma_wait(num_outstanding=0, deps=(f,))
            a = _gelu(f + gl.expand_dims(_row(VEC, 3, WIDTH, F, COL_F), 0)).to(o_buf.dtype)
            y = warpgroup_mma(gl.convert_layout(a, A_D), wout_s.permute((1, 0)),
                              x1 + gl.expand_dims(_row(VEC, 4, WIDTH, D, COL_D), 0), is_async=True)
            y = warpgroup_mma_wait(num_outstanding=0, deps=(y,))
            rows = t * _BM + rows0
            row_in = rows < n_tokens
            if HAS_MASK:  # the rows of invalid tokens become 0
                keep = gl.load(Mask + rows, mask=row_in, other=0) != 0
                y = gl.where(gl.expand_dims(keep, 1), y, 0.0)
            if FINAL_NORM:
                y = _layer_norm(y, _row(VEC, 5, WIDTH, D, COL_D), _row(VEC, 6, WIDTH, D, COL_D), D, eps)
                if HAS_MASK:
                    y = gl.where(gl.expand_dims(keep, 1), y, 0.0)
            offs = gl.expand_dims(rows.to(gl.int64) * D, 1) + gl.expand_dims(cols, 0)
            gl.store(Y + offs, y.to(Y.dtype.element_ty), mask=gl.expand_dims(row_in, 1))
            use += 1

    @gluon.jit
    def _layer_tail_hopper_fwd(
        o_desc, x_desc, wo_desc, win_desc, wout_desc,  # TMA: o [N, D], x [N, D], Wo [D, D], Win [F, D], Wout [D, F]
        Y, Mask, VEC,  # out [N, D]; int8 [N] (read where HAS_MASK); fp32 [len(VECTOR_ORDER), WIDTH]
        n_tokens, eps,
        D: gl.constexpr, F: gl.constexpr, WIDTH: gl.constexpr, HAS_MASK: gl.constexpr, FINAL_NORM: gl.constexpr,
        CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
    ):
        n_blocks = gl.cdiv(n_tokens, _BM)
        o_s = gl.allocate_shared_memory(o_desc.dtype, [_CONSUMERS, _BM, D], o_desc.layout)
        x_s = gl.allocate_shared_memory(x_desc.dtype, [_CONSUMERS, _BM, D], x_desc.layout)
        wo_s = gl.allocate_shared_memory(wo_desc.dtype, [D, D], wo_desc.layout)
        win_s = gl.allocate_shared_memory(win_desc.dtype, [F, D], win_desc.layout)
        wout_s = gl.allocate_shared_memory(wout_desc.dtype, [D, F], wout_desc.layout)
        ready, empty, w_ready = _slot_barriers()
        bufs = (o_s, x_s, wo_s, win_s, wout_s, ready, empty, w_ready)
        # the first consumer is the default partition (num_warps = 4); the second and the loader are workers
        gl.warp_specialize([(_consumer, (Y, Mask, VEC, bufs, n_tokens, n_blocks, eps, 0, D, F, WIDTH, HAS_MASK,
                                         FINAL_NORM)),
                            (_consumer, (Y, Mask, VEC, bufs, n_tokens, n_blocks, eps, 1, D, F, WIDTH, HAS_MASK,
                                         FINAL_NORM)),
                            (_loader, (o_desc, x_desc, wo_desc, win_desc, wout_desc, bufs, n_blocks))],
                           [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


# ----------------------------------------------------------------------------------------------
# Launcher and public function
# ----------------------------------------------------------------------------------------------
def check_vectors(where: str, vecs: torch.Tensor, shape: tuple, device) -> None:
    """A caller's vector table (this module's `tail_vectors`, ln_qkv_hopper's `qkv_vectors`) as the kernel reads it:
    contiguous fp32 of `shape` on `device`, else a ValueError naming `where`."""
    if vecs.shape != shape or vecs.dtype != torch.float32 or not vecs.is_contiguous() or vecs.device != device:
        raise ValueError(f"{where}: vecs must be a contiguous fp32 {list(shape)} on {device}, got {vecs.dtype} "
                         f"{tuple(vecs.shape)} on {vecs.device}")


def persistent_grid(n_tokens: int, device, num_programs=None) -> tuple:
    """The launch grid of a persistent split-layer kernel over n_tokens: one program per SM (or `num_programs`), no
    more than its BLOCK_M-token blocks keep busy with CONSUMERS consumers each, at least one."""
    if num_programs is None:
        num_programs = torch.cuda.get_device_properties(device).multi_processor_count
    blocks = -(-n_tokens // BLOCK_M)
    return (max(1, min(num_programs, -(-blocks // CONSUMERS))),)


def layer_tail_hopper(o, x, w, *, eps, mask=None, final=None, out_dtype=None, vecs=None, num_programs=None):
    """`layer_tail.layer_tail` on Hopper: `o` [B, S, d] (the attention output, the weights' fp16/bf16 dtype) and `x`
    [B, S, d] (the residual into the layer: fp32, or the input's dtype into layer 0), both contiguous; `w` with o_w,
    o_b, in_w, in_b, out_w, out_b and n2_w, n2_b. Returns the fp32 residual [B, S, d], or with
    `final=(weight, bias)` the final LayerNorm of it in `out_dtype` (default fp32). Rows where `mask` (bool [B, S])
    is False are 0. `eps`: the LayerNorms' epsilon.
    vecs: `tail_vectors(w, final)`, made once by a caller that calls often. num_programs: the persistent grid
    (default: one program per SM)."""
    B, S, d = x.shape
    ffn = w["in_w"].shape[0]
    why = why_unsupported(d, ffn, x.device)
    if why:
        raise ValueError(f"layer_tail_hopper: {why}")
    op = w["o_w"].dtype
    if op not in OPERAND_DTYPES or o.dtype != op or any(w[n].dtype != op for n in ("in_w", "out_w")):
        raise TypeError(f"layer_tail_hopper: o and the weights must share a float16/bfloat16 dtype, got o {o.dtype} "
                        f"and weights {op}")
    if x.dtype not in RESIDUAL_DTYPES:
        raise TypeError(f"layer_tail_hopper: the residual x must be float32, float16 or bfloat16, got {x.dtype}")
    if o.shape != x.shape or not (o.is_contiguous() and x.is_contiguous()):
        raise ValueError(f"layer_tail_hopper: o and x must be contiguous [B, S, d] of one shape, got o "
                         f"{tuple(o.shape)} and x {tuple(x.shape)}")
    if w["o_w"].shape != (d, d) or w["in_w"].shape != (ffn, d) or w["out_w"].shape != (d, ffn):
        raise ValueError("layer_tail_hopper: weight shapes do not match d_model/ffn_dim")
    for name in ("o_w", "in_w", "out_w"):  # TMA reads them as row-major blocks
        if not w[name].is_contiguous() or w[name].device != x.device:
            raise ValueError(f"layer_tail_hopper: weight {name} must be contiguous on {x.device}, got strides "
                             f"{w[name].stride()} on {w[name].device}")
    if o.device != x.device or (mask is not None and mask.device != x.device):
        raise ValueError(f"layer_tail_hopper: o, x and mask must be on one device, got {o.device}, {x.device}"
                         f"{'' if mask is None else f' and {mask.device}'}")
    if mask is not None and (mask.dtype != torch.bool or tuple(mask.shape) != (B, S)):
        raise ValueError(f"layer_tail_hopper: mask must be bool [B, S]={B, S}, got {mask.dtype} "
                         f"{tuple(mask.shape)}")
    if vecs is None:
        vecs = tail_vectors(w, final)
    check_vectors("layer_tail_hopper", vecs, (len(VECTOR_ORDER), max(d, ffn)), x.device)
    out = torch.empty((B, S, d), device=x.device,
                      dtype=torch.float32 if final is None else out_dtype or torch.float32)
    n_tokens = B * S
    if n_tokens == 0:
        return out
    o2, x2 = o.view(n_tokens, d), x.view(n_tokens, d)
    m = mask.contiguous().view(-1).view(torch.int8) if mask is not None else out
    _layer_tail_hopper_fwd[persistent_grid(n_tokens, x.device, num_programs)](
        _descriptor(o2, BLOCK_M, d), _descriptor(x2, BLOCK_M, d), _descriptor(w["o_w"], d, d),
        _descriptor(w["in_w"], ffn, d), _descriptor(w["out_w"], d, ffn), out, m, vecs, n_tokens, eps,
        D=d, F=ffn, WIDTH=max(d, ffn), HAS_MASK=mask is not None, FINAL_NORM=final is not None,
        CONSUMER_REGS=CONSUMER_REGISTERS, PRODUCER_REGS=PRODUCER_REGISTERS, **kernel_options(),
    )
    return out


__all__ = ["BLOCK_M", "VECTOR_ORDER", "WIDTHS", "layer_tail_hopper", "shared_bytes", "tail_vectors",
           "why_unsupported"]
