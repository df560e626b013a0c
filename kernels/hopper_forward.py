"""The whole pre-LayerNorm Transformer forward in one Gluon kernel for Hopper (sm_90): wgmma and a TMA weight ring.

One program (a CTA of S_PAD // 16 warps, one per SM) takes one sequence at a time (persistent: program p runs
sequences p, p + P, ...) and keeps its fp32 residual stream [S_PAD, d] in registers, as the wgmma accumulator, from
the first layer to the final LayerNorm: HBM sees each sequence's input once and its output once. Per layer:
  LayerNorm 1 (registers) -> per head: q, k, v projections (wgmma, A from registers); k, v to shared memory;
  scores, causal/key mask, fp32 softmax, probs @ v (wgmma); the head's slice of the out-projection accumulated
  straight into the residual -> bias -> LayerNorm 2 -> per FFN chunk: in-projection, bias, GELU (erf to 1.5e-7,
  `gelu`), out-projection accumulated into the residual -> bias -> invalid rows zeroed.
Of the q, k, v biases only q's is added: k's adds q . b_k to every score of a query row, which its softmax cancels,
and v's reaches the output as Wo b_v (the probabilities of a row with a visible key sum to 1; a row with none is
an invalid query, zeroed), folded into the out-projection's bias by `pack_weights`.
Every weight operand is one [HD, d] fp16 tile of one stream (`pack_weights`), consumed in order and brought from
L2 by TMA into a ring of NUM_SLOTS shared-memory slots that runs NUM_SLOTS tiles ahead of the math, across
layers and sequences. Head dims are padded to HD (>= 16, a wgmma k step) and the FFN to a multiple of HD with zero
weights, which changes no output bit of the unpadded math but the summation order.

Program pair (`pair=True`, off by default; causal sequences of PAIR_MIN_SEQ_LEN to MAX_SEQ_LEN tokens): two 4-warp
programs serve each sequence, program 2p + 0 its rows 0-63 and program 2p + 1 its rows 64-127, each with its own
64-row residual stream and its own LayerNorms, projections, FFN and masks as above; both score 128 keys. Under the
causal mask the first half's queries see only its own keys (its key rows 64-127 are zeros that the mask hides),
so the first program never waits. It stores each head's k and v (the fp16 [64, HD] tiles it puts in shared
memory, from the same registers) to a global scratch `pair_scratch` ([B, layers, heads, 2, 64, HD] fp16, one
slot per sequence: a first program running ahead overwrites nothing its second still reads), and after the next
CTA barrier (the next head's, or the layer's last) one GPU-scope release exchange sets the sequence's flag to the
count of heads published in its forward (layer * heads + heads done). The second program reads the flag (acquire
load, spun on) only when the count it last saw is short of the head it needs, then copies the tiles into its key
rows 0-63 by cp.async under its own projections, beside its own k and v (rows 64-127); once the sequence is done
it sets the flag back to 0, so every launch starts from zeros: no epoch to carry, CUDA-graph replays included.
Deadlock-free: the first program never waits, and a launch has at most as many programs as SMs, each SM holding at
least one, so the program a second one waits on is resident. Gluon 3.6 launches clusters (`num_ctas`) only to
spread tensors over CTAs by layout; it exposes no CTA rank in a cluster, no distributed shared memory and no
cluster barrier, so the pair shares through L2.

Loader warp (`producer=True`, off by default): `gl.warp_specialize` runs the math above in the program's warps (the
default partition) and one more warp (LOADER_REGISTERS registers) that issues every TMA load of the ring, each once
the math has handed back the tile its slot held: the math warps no longer expect, address or issue loads. The math
hands tiles back in groups, one mbarrier arrive per group (a head's projections free its q, k, v tiles and the
previous head's out-projection; an FFN chunk's in-projection frees its tile and the previous chunk's out-projection),
on a ring of EVENT_SLOTS event barriers that the loader reads in the same order (`_event_of`). Triton 3.6 puts a
barrier of the partition's warps before every arrive, and between two waits on one allocation: the ring's "tile
landed" barriers are spread over RING_GROUPS allocations (`_bar`) so that a head's three waits take none. The same
math in the same order: the output is bit for bit the default's.

Warpgroup duo (`duo=True`, where the routing policy's `hopper.duo_max_head_dim` says; causal sequences of
PAIR_MIN_SEQ_LEN to MAX_SEQ_LEN tokens): the pair's two halves in one program, as two partitions of 4 warps beside
the loader warp, each with its own residual stream and no barrier with the other, so that one half's wgmma runs while
the other's softmax does. The first half scores only its own 64 keys (the causal mask hides the rest); it writes its
k and v rows of each head into one of two shared buffers (alternating by head) and signals them by an mbarrier, the
second half waits for them, scores all 128 keys and hands the buffer back by another; both hand weight tiles back
(each event counts two arrivals).

Operands fp16, accumulation and statistics fp32; masks exact (any valid-token mask, a sequence with no valid
token included); the output in the caller's dtype.
"""
from __future__ import annotations

import math

import torch

try:  # Gluon ships with Triton >= 3.5; without it (or without a Hopper GPU) `why_unsupported` says so
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (async_copy, fence_async_shared, mbarrier, tma,
                                                                  warpgroup_mma, warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from triton import knobs
    from triton.backends.nvidia.driver import make_tensordesc_arg
    from triton.runtime import driver
except ImportError:  # pragma: no cover - depends on the installed Triton
    gluon = None

D_MODELS = (32, 64, 128)  # residual widths one register tile holds (a power of two: the tile's columns)
MAX_SEQ_LEN = 128  # rows of one program's tile: 64 (4 warps) or 128 (8 warps), one warpgroup per 64 rows
MIN_HEAD_DIM = 16  # a wgmma k step for fp16: narrower heads are padded to it with zero weights
SMEM_BYTES = 216 * 1024  # shared memory one program may take (the H200 offers 227 KB per block)
MAX_SLOTS = 16  # the weight ring's depth at most
MIN_SLOTS = 4  # and at least: a head's q, k, v tiles are waited for while the previous head's out-projection's is held
PAIR_ROWS = 64  # rows of each program of a pair: one warpgroup, the 64-row tile's code path
PAIR_MIN_SEQ_LEN = PAIR_ROWS + 1  # a pair's second program holds a token (shorter: one 64-row program serves)
# `producer`'s loader partition: one warp, registers enough for its loop (the math warps take the rest of the file)
LOADER_REGISTERS = 24
# `duo`'s second-half partition: registers as many as its 128-key scores need; the first half takes what the loader
# and it leave (65536 a block: 240 for 4 warps beside these)
DUO_REGISTERS = 248
DUO_MAX_HEAD_DIM = 64  # `duo`'s heads: a wider one's q, k, v accumulators beside the scores would spill
# `producer`'s hand-back events in flight at most: a multiple of 4 above MAX_SLOTS (the loader waits for the event of
# tile t - NUM_SLOTS while the math has handed back at most the tiles before t, each at most one event)
EVENT_SLOTS = 2 * MAX_SLOTS
# A layer's fp32 vectors, one row of `pack_weights`'s `vecs` in this order (the kernel's offsets follow it): read
# from shared memory, where the next layer's are staged during each layer (an L2 load at each use stalled the math)
VECTOR_ORDER = ("n1_w", "n1_b", "n2_w", "n2_b", "o_b", "out_b", "q_b", "in_b")
# erf(z) = 1 - t (a1 + t (a2 + ... + t a5)) exp(-z^2), t = 1 / (1 + p z) for z >= 0, to 1.5e-7 (Abramowitz and
# Stegun 7.1.26): a fifth of the instructions of libdevice's erff, far below the fp16 rounding of GELU's output
ERF_P = 0.3275911
ERF_A = (0.254829592, -0.284496736, 1.421413741, -1.453152027, 1.061405429)


def head_dim_padded(head_dim: int) -> int:
    """The head width the kernel computes with: head_dim rounded up to a multiple of MIN_HEAD_DIM."""
    return -(-head_dim // MIN_HEAD_DIM) * MIN_HEAD_DIM


def why_unsupported(seq_len: int, d_model: int, num_heads: int, ffn_dim: int, *, causal: bool = True,
                    pair: bool = False, duo: bool = False) -> str | None:
    """Why the Hopper forward (with `pair`: two programs a sequence; with `duo`: two warpgroups a sequence in one
    program) cannot serve this shape (any device), or None: the one statement of its limits."""
    for on, what in ((pair, "program pair"), (duo, "warpgroup duo")):
        if on and not causal:
            return f"the Hopper forward's {what} serves causal attention only (its first half reads no later key)"
        if on and not PAIR_MIN_SEQ_LEN <= seq_len <= MAX_SEQ_LEN:
            return (f"the Hopper forward's {what} serves seq_len in [{PAIR_MIN_SEQ_LEN}, {MAX_SEQ_LEN}] (two "
                    f"halves of {PAIR_ROWS} rows), got {seq_len}")
    if pair and duo:
        return "the Hopper forward runs a sequence's halves as a program pair or as a warpgroup duo, not both"
    if duo and num_heads and d_model % num_heads == 0 and head_dim_padded(d_model // num_heads) > DUO_MAX_HEAD_DIM:
        return (f"the Hopper forward's warpgroup duo serves heads up to {DUO_MAX_HEAD_DIM} wide, got "
                f"{d_model // num_heads}")
    if gluon is None:
        return "the Hopper forward needs Triton's Gluon (triton >= 3.5)"
    if d_model not in D_MODELS:
        return f"the Hopper forward serves d_model in {D_MODELS}, got {d_model}"
    if seq_len > MAX_SEQ_LEN:
        return f"the Hopper forward serves seq_len <= {MAX_SEQ_LEN} (one tile of rows), got {seq_len}"
    if d_model % num_heads:
        return f"the Hopper forward needs d_model % num_heads == 0, got {d_model} % {num_heads}"
    hd = head_dim_padded(d_model // num_heads)
    if hd > d_model:
        return f"the Hopper forward pads head_dim to {hd}, wider than d_model={d_model}"
    if _ring_slots(_seq_pad(seq_len), hd, d_model, stream_tiles(num_heads, ffn_dim, hd),
                   _vector_pad(d_model, num_heads, ffn_dim, hd), duo=duo) < MIN_SLOTS:
        return (f"the Hopper forward's weight ring holds fewer than {MIN_SLOTS} tiles of [{hd}, {d_model}] in "
                f"shared memory")
    return None


def gelu(t: torch.Tensor) -> torch.Tensor:
    """GELU as the kernel computes it, x Phi(x) with `ERF_A`'s erf, in torch (the kernel's `_gelu` in Gluon)."""
    r = 1.0 / (1.0 + ERF_P * t.abs() * 0.5**0.5)
    poly = r * (ERF_A[0] + r * (ERF_A[1] + r * (ERF_A[2] + r * (ERF_A[3] + r * ERF_A[4]))))
    q = 0.5 * poly * torch.exp(-0.5 * t * t)  # 1 - Phi(|x|) = erfc(|x| / sqrt(2)) / 2
    return torch.where(t >= 0, t - t * q, t * q)


def stream_tiles(num_heads: int, ffn_dim: int, hd: int) -> int:
    """Weight tiles per layer: q, k, v and out-projection per head, then in and out per FFN chunk of hd."""
    return 4 * num_heads + 2 * (-(-ffn_dim // hd))


def _seq_pad(seq_len: int) -> int:
    """Rows of one program's tile: a warpgroup (4 warps) per 64 rows."""
    return 64 if seq_len <= 64 else 128


def _vector_pad(d_model: int, num_heads: int, ffn_dim: int, hd: int) -> int:
    """Length of a layer's row of `vecs` (VECTOR_ORDER: six of d_model, q_b and in_b padded to hd lanes a head and
    an FFN chunk), rounded up to a power of two (a block of one load) of at least 256 (8 warps' lanes)."""
    width = 6 * d_model + hd * (num_heads + -(-ffn_dim // hd))
    return max(256, 1 << (width - 1).bit_length())


def ring_groups(tiles_per_layer: int) -> int:
    """Allocations the ring's mbarriers are spread over, tile g's in allocation g mod this: 4 where a layer's tiles
    are a multiple of 4 (a tile's position mod 4 is then fixed by the code that consumes it), else 2 (a layer's tiles
    are even). Triton orders every two waits or arrives on one allocation by a barrier of the warps; on different
    allocations, not."""
    return 4 if tiles_per_layer % 4 == 0 else 2


def _ring_slots(s_pad: int, hd: int, d_model: int, tiles_per_layer: int, v_pad: int, duo: bool = False) -> int:
    """Slots of the weight ring: as many [hd, d] fp16 tiles as fit in SMEM_BYTES beside k and v ([s_pad, hd] fp16
    each, s_pad the keys) and two layers' vectors (fp32), both twice with `duo` (two heads' k and v, each half's
    vectors), at most MAX_SLOTS and at most a layer's tiles, a multiple of `ring_groups`."""
    copies = 2 if duo else 1
    fit = min(MAX_SLOTS, tiles_per_layer,
              (SMEM_BYTES - copies * (4 * s_pad * hd + 8 * v_pad)) // (2 * hd * d_model))
    return fit - fit % ring_groups(tiles_per_layer)


# ----------------------------------------------------------------------------------------------
# Plain torch: the weight stream, and the forward computed from it (fp64) as the kernel consumes it
# ----------------------------------------------------------------------------------------------
def pack_weights(layers: list[dict], final: tuple, num_heads: int, operand_dtype=torch.float16) -> dict:
    """The kernel's weights from per-layer dicts (kernels' names: qkv_w [3d, d], qkv_b, o_w [d, d], o_b, in_w
    [f, d], in_b, out_w [d, f], out_b, n1_w, n1_b, n2_w, n2_b) and the final norm's (weight, bias):
    - `stream` [L * tiles * HD, d] in `operand_dtype`: per layer, per head h the tiles Wq_h, Wk_h, Wv_h
      ([HD, d], out features by in features) and Wo[:, h]ᵀ ([HD, d], in features by out features), then per FFN
      chunk c Win_c ([HD, d]) and Wout[:, c]ᵀ ([HD, d]); head lanes and FFN columns past the real ones are 0;
    - `q_b` [L, H * HD], `in_b` [L, F_PAD] padded alike, `o_b` + Wo b_v (the v bias folded), `out_b`, the norms
      [L, d], fp32 (no k bias: the softmax cancels it);
    - `final_w`, `final_b` [d] fp32;
    - `vecs` [L, V_PAD] fp32: each layer's vectors above in VECTOR_ORDER, zero past them (what the kernel reads)."""
    L, d = len(layers), layers[0]["o_w"].shape[0]
    hd = d // num_heads
    hdp, ffn = head_dim_padded(hd), layers[0]["in_w"].shape[0]
    chunks = -(-ffn // hdp)
    dt, dev = operand_dtype, layers[0]["qkv_w"].device
    stream = torch.zeros(L, stream_tiles(num_heads, ffn, hdp), hdp, d, dtype=dt, device=dev)
    q_b = torch.zeros(L, num_heads, hdp, dtype=torch.float32, device=dev)
    o_b = torch.zeros(L, d, dtype=torch.float64, device=dev)
    in_b = torch.zeros(L, chunks * hdp, dtype=torch.float32, device=dev)
    for i, w in enumerate(layers):
        qkv = w["qkv_w"].view(3, num_heads, hd, d)
        wo_t = w["o_w"].t().reshape(num_heads, hd, d)  # [in, out] rows of head h
        for h in range(num_heads):
            for j in range(3):
                stream[i, 4 * h + j, :hd] = qkv[j, h]
            stream[i, 4 * h + 3, :hd] = wo_t[h]
        win, wout_t = w["in_w"], w["out_w"].t()  # [f, d] each
        for c in range(chunks):
            lo, hi = c * hdp, min(ffn, (c + 1) * hdp)
            stream[i, 4 * num_heads + 2 * c, :hi - lo] = win[lo:hi]
            stream[i, 4 * num_heads + 2 * c + 1, :hi - lo] = wout_t[lo:hi]
        q_b[i, :, :hd] = w["qkv_b"][:d].float().view(num_heads, hd)
        o_b[i] = w["o_b"].double() + w["o_w"].double() @ w["qkv_b"][2 * d:].double()
        in_b[i, :ffn] = w["in_b"].float()
    out = {"stream": stream.view(-1, d).contiguous(), "q_b": q_b.view(L, -1).contiguous(),
           "o_b": o_b.to(torch.float64 if dt == torch.float64 else torch.float32).contiguous(),  # a sum: rounded
           "in_b": in_b.contiguous(), "final_w": final[0].float().contiguous(),
           "final_b": final[1].float().contiguous()}
    for n in ("out_b", "n1_w", "n1_b", "n2_w", "n2_b"):
        out[n] = torch.stack([w[n].float() for w in layers]).contiguous()
    row = torch.cat([out[n].float() for n in VECTOR_ORDER], dim=1)
    out["vecs"] = torch.zeros(L, _vector_pad(d, num_heads, ffn, hdp), dtype=torch.float32, device=dev)
    out["vecs"][:, :row.shape[1]] = row
    return out


def packed_bytes(num_layers: int, d_model: int, num_heads: int, ffn_dim: int, operand_dtype=torch.float16) -> int:
    """Bytes of `pack_weights`'s output for this model, its layout's one statement beside it: the stream in
    `operand_dtype`, and in fp32 (o_b in fp64 with an fp64 stream) q_b and in_b padded, o_b, out_b and the norms
    per layer, their copy in `vecs`, and the final norm."""
    hdp = head_dim_padded(d_model // num_heads)
    chunks = -(-ffn_dim // hdp)
    stream = stream_tiles(num_heads, ffn_dim, hdp) * hdp * d_model * operand_dtype.itemsize
    o_b = d_model * (8 if operand_dtype == torch.float64 else 4)
    vectors = 4 * (num_heads * hdp + chunks * hdp + 5 * d_model + _vector_pad(d_model, num_heads, ffn_dim, hdp))
    return num_layers * (stream + o_b + vectors) + 4 * 2 * d_model


def _pair_attention(q, k, v, valid, scale):
    """One head's attention over a causal sequence as a pair computes it: the first program's rows (0 to
    PAIR_ROWS - 1) against its own keys and PAIR_ROWS zero keys (masked), the second's against the first's k and
    v (published) beside its own: [B, S, HD]."""
    B, S = valid.shape
    r = PAIR_ROWS
    pos = torch.arange(2 * r, device=q.device)
    key_ok = torch.nn.functional.pad(valid, (0, 2 * r - S))  # keys past the sequence: invalid
    zeros = k.new_zeros(B, r, k.shape[-1])  # the first program's key rows r to 2r - 1
    out = []
    for rows, keys, vals in ((slice(0, r), torch.cat([k[:, :r], zeros], 1), torch.cat([v[:, :r], zeros], 1)),
                             (slice(r, S), k, v)):  # the second's keys: the scratch's rows, then its own
        n = keys.shape[1]
        vis = key_ok[:, None, :n] & (pos[None, None, :n] <= pos[rows][None, :, None])
        s = (q[:, rows] @ keys.transpose(1, 2) * scale).masked_fill(~vis, float("-inf"))
        out.append(torch.softmax(s, -1).nan_to_num(0.0) @ vals)
    return torch.cat(out, 1)


def forward_from_stream(x, w, *, num_heads, causal, eps, mask=None, pair=False):
    """The forward computed in fp64 from `pack_weights`'s layout, tile by tile in the kernel's order (padded heads
    and FFN chunks included): what the kernel computes, up to its fp16 operands and summation order; `eps`: the
    LayerNorms' epsilon. `pair`: each
    head's attention as a pair computes it (`_pair_attention`; causal, PAIR_MIN_SEQ_LEN <= S <= 128)."""
    B, S, d = x.shape
    hd = d // num_heads
    L, hdp = w["o_b"].shape[0], head_dim_padded(hd)
    if pair and (not causal or not PAIR_MIN_SEQ_LEN <= S <= MAX_SEQ_LEN):
        raise ValueError(f"forward_from_stream: {why_unsupported(S, d, num_heads, 0, causal=causal, pair=True)}")
    tiles = w["stream"].double().view(L, -1, hdp, d)
    chunks = (tiles.shape[1] - 4 * num_heads) // 2
    valid = torch.ones(B, S, dtype=torch.bool, device=x.device) if mask is None else mask
    visible = valid[:, None, :]
    if causal:
        visible = visible & torch.ones(S, S, dtype=torch.bool, device=x.device).tril()
    ln = torch.nn.functional.layer_norm
    h = x.double()
    for i in range(L):
        t, q_b = tiles[i], w["q_b"][i].double().view(num_heads, hdp)
        n1 = ln(h, (d,), w["n1_w"][i].double(), w["n1_b"][i].double(), eps)
        for head in range(num_heads):
            q, k, v = (n1 @ t[4 * head + j].t() for j in range(3))
            q = q + q_b[head]
            if pair:
                o = _pair_attention(q, k, v, valid, hd**-0.5)
            else:
                s = (q @ k.transpose(1, 2) * hd**-0.5).masked_fill(~visible, float("-inf"))
                o = torch.softmax(s, -1).nan_to_num(0.0) @ v
            h = h + o @ t[4 * head + 3]
        h = h + w["o_b"][i].double()
        n2 = ln(h, (d,), w["n2_w"][i].double(), w["n2_b"][i].double(), eps)
        for c in range(chunks):
            f = n2 @ t[4 * num_heads + 2 * c].t() + w["in_b"][i, c * hdp:(c + 1) * hdp].double()
            h = h + torch.nn.functional.gelu(f) @ t[4 * num_heads + 2 * c + 1]  # exact: `gelu`'s error is tested
        h = (h + w["out_b"][i].double()).masked_fill(~valid[:, :, None], 0.0)
    y = ln(h, (d,), w["final_w"].double(), w["final_b"].double(), eps)
    return y.masked_fill(~valid[:, :, None], 0.0)


# ----------------------------------------------------------------------------------------------
# Gluon kernel
# ----------------------------------------------------------------------------------------------
if gluon is not None:

    @gluon.jit
    def _layer_norm(x, w, b, D: gl.constexpr, eps):
        """LayerNorm of each row of the fp32 tile x (every column real) with the column vectors w, b."""
        mean = gl.sum(x, axis=1) / D
        xc = x - gl.expand_dims(mean, 1)
        rstd = gl.rsqrt(gl.sum(xc * xc, axis=1) / D + eps)
        return xc * gl.expand_dims(rstd, 1) * gl.expand_dims(w, 0) + gl.expand_dims(b, 0)

    @gluon.jit
    def _vec(vecs, OFFSET: gl.constexpr, N: gl.constexpr, layout: gl.constexpr):
        """N floats of a layer's staged vectors from OFFSET (VECTOR_ORDER), as a column vector in `layout`."""
        return vecs.slice(OFFSET, N).load(layout)

    # GELU's constants folded: 1 + p |x| / sqrt(2); the coefficients halved (1 - Phi = erfc / 2); exp(-x^2 / 2)
    _ERF_PS = gl.constexpr(ERF_P * 0.5**0.5)
    _H1, _H2, _H3, _H4, _H5 = (gl.constexpr(0.5 * a) for a in ERF_A)
    _NEG_HALF_LOG2E = gl.constexpr(-0.5 / math.log(2))
    _LOADER_REGISTERS = gl.constexpr(LOADER_REGISTERS)
    _EVENT_SLOTS = gl.constexpr(EVENT_SLOTS)
    _DUO_REGISTERS = gl.constexpr(DUO_REGISTERS)

    @gluon.jit
    def _gelu(t):
        """`gelu`: x Phi(x) from ERF_A's erf, about 15 instructions an element; fp32."""
        r = gl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=r,r", [1.0 + _ERF_PS * gl.abs(t)],
                                      dtype=gl.float32, is_pure=True, pack=1)  # of [1, inf): one MUFU.RCP
        q = r * (_H1 + r * (_H2 + r * (_H3 + r * (_H4 + r * _H5)))) * gl.exp2(t * t * _NEG_HALF_LOG2E)  # 1 - Phi(|x|)
        return gl.where(t >= 0, t - t * q, t * q)

    @gluon.jit
    def _bar(bars, g, P: gl.constexpr, NUM_SLOTS: gl.constexpr):
        """The mbarrier of ring slot g % NUM_SLOTS (stream tile g's) in `bars`, a tuple of `ring_groups` allocations:
        allocation g mod their count, which the caller states as P, g's position mod 4 in its layer (a layer's
        first tile, and a sequence's, sits at a multiple of the count)."""
        NB: gl.constexpr = len(bars)
        return bars[P % NB].index((g // NB) % (NUM_SLOTS // NB))

    @gluon.jit
    def _wait_tile(bars, g, P: gl.constexpr, NUM_SLOTS: gl.constexpr):
        """The ring slot of stream tile g (the g-th this program consumes; P: `_bar`'s), once its TMA load has
        landed."""
        mbarrier.wait(_bar(bars, g, P, NUM_SLOTS), (g // NUM_SLOTS) & 1)
        return g % NUM_SLOTS

    @gluon.jit
    def _tile_mma(a, ring, bars, g, P: gl.constexpr, acc, TRANSPOSE: gl.constexpr, USE_ACC: gl.constexpr,
                  NUM_SLOTS: gl.constexpr, OVERLAP: gl.constexpr):
        """acc (+)= a @ B with B stream tile g (P: its position mod 4 in its layer, `_bar`), its transpose where
        TRANSPOSE (tiles of in-projections are stored out features by in features), once the tile has landed. In
        flight on return where OVERLAP (the caller waits before reading the result), else complete."""
        b = ring.index(_wait_tile(bars, g, P, NUM_SLOTS))
        if TRANSPOSE:
            b = b.permute((1, 0))
        acc = warpgroup_mma(a, b, acc, use_acc=USE_ACC, is_async=True)
        if not OVERLAP:
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        return acc

    @gluon.jit
    def _refill_last(w_desc, ring, bars, g, G_POS: gl.constexpr, N: gl.constexpr, lo, first, total,
                     tiles_per_forward, HD: gl.constexpr, NUM_SLOTS: gl.constexpr):
        """The N tiles before stream tile g, those from tile `lo` on, are consumed (their wgmmas waited for by every
        warp: the barrier) and their slots not yet handed back: load tile i + NUM_SLOTS into the slot of each tile i
        among them, where there is one. N is fixed by the caller's code: no hand-back count is carried across the
        sequence loop, which Triton 3.6 carried wrongly (docs/decisions.md#hopper-sequences-per-program). G_POS:
        g's position mod 4 in its layer (`_bar`)."""
        gl.thread_barrier()
        for j in gl.static_range(N):
            i = g - N + j
            nxt = i + NUM_SLOTS
            if (nxt < total) & (i >= lo):
                bar = _bar(bars, i, (G_POS + 4 - N + j) % 4, NUM_SLOTS)
                mbarrier.expect(bar, w_desc.block_type.nbytes)
                pos = nxt - first
                pos = gl.where(pos >= tiles_per_forward, pos - tiles_per_forward, pos)
                tma.async_copy_global_to_shared(w_desc, [pos * HD, 0], bar, ring.index(i % NUM_SLOTS))

    @gluon.jit
    def _kv_offsets(ROWS: gl.constexpr, HD: gl.constexpr, layout: gl.constexpr):
        """Offsets of a [ROWS, HD] scratch tile's elements (row-major) in `layout`."""
        return (gl.expand_dims(gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout)), 1) * HD
                + gl.expand_dims(gl.arange(0, HD, layout=gl.SliceLayout(0, layout)), 0))

    @gluon.jit
    def _publish(t, dst, ROWS: gl.constexpr, HD: gl.constexpr, layout: gl.constexpr):
        """A pair's first program: its fp16 k or v [ROWS, HD] in `layout` (a head's, in registers as it is
        stored to shared memory: no registers beyond it) to the scratch tile at dst."""
        gl.store(dst + _kv_offsets(ROWS, HD, layout), t)

    @gluon.jit
    def _copy_published(k_s, v_s, src, ROWS: gl.constexpr, HD: gl.constexpr, layout: gl.constexpr):
        """A pair's second program: the scratch tile pair at src (k, v; published: the caller's acquire) into
        rows 0 to ROWS - 1 of k_s and v_s, copied asynchronously (cp.async, 16 bytes, bypassing L1: no registers
        hold the tiles) as one group; the caller waits for the group before its barrier."""
        offs = _kv_offsets(ROWS, HD, layout)
        async_copy.async_copy_global_to_shared(k_s.slice(0, ROWS), src + offs, cache_modifier=".cg")
        async_copy.async_copy_global_to_shared(v_s.slice(0, ROWS), src + ROWS * HD + offs, cache_modifier=".cg")
        async_copy.commit_group()

    @gluon.jit
    def _release(flag, heads):
        """Set a pair's flag to the count of heads published: GPU-scope release, after a CTA barrier that
        follows every warp's scratch stores (cumulative: those stores are visible to whoever acquires it)."""
        gl.atomic_xchg(flag, heads, sem="release", scope="gpu")

    @gluon.jit
    def _acquire(flag, need):
        """A pair's second program: the flag's count of heads published, spun on (GPU-scope acquire) until it
        reaches `need`; the scratch tiles of every head below the count are then visible."""
        seen = gl.atomic_add(flag, 0, sem="acquire", scope="gpu")
        while seen < need:
            seen = gl.atomic_add(flag, 0, sem="acquire", scope="gpu")
        return seen

    @gluon.jit
    def _event_of(i, NUM_HEADS: gl.constexpr, F_CHUNKS: gl.constexpr):
        """The hand-back event that frees stream tile i, in the order the math hands back (`_hand_back`), a layer's
        NUM_HEADS + F_CHUNKS + 2 events: head h's projections free its q, k, v and the previous head's
        out-projection (event h); the head loop's end the last head's out-projection (NUM_HEADS); FFN chunk c's
        in-projection frees its own and the previous chunk's out-projection (NUM_HEADS + 1 + c); the layer's end
        the last chunk's out-projection (NUM_HEADS + F_CHUNKS + 1)."""
        TILES: gl.constexpr = 4 * NUM_HEADS + 2 * F_CHUNKS
        layer = i // TILES
        pos = i - layer * TILES
        if pos < 4 * NUM_HEADS:
            local = pos // 4 + (pos % 4 == 3).to(gl.int32)
        else:
            pos -= 4 * NUM_HEADS
            local = NUM_HEADS + 1 + pos // 2 + (pos % 2).to(gl.int32)
        return layer * (NUM_HEADS + F_CHUNKS + 2) + local

    @gluon.jit
    def _load_weights(w_desc, ring, bars, events, total, tiles_per_forward, HD: gl.constexpr,
                      NUM_SLOTS: gl.constexpr, NUM_HEADS: gl.constexpr, F_CHUNKS: gl.constexpr):
        """PRODUCER's loader partition (one warp): every stream tile this program consumes, in order, into the
        ring by TMA, each once the math has handed back the tile its slot held (the event `_event_of` that tile,
        in the ring of `events`; the first NUM_SLOTS tiles go straight in). Every sequence reads the whole stream:
        tile t is the stream's t mod tiles_per_forward."""
        NB: gl.constexpr = len(bars)
        pos = 0  # t's position in the stream
        for t in range(total):
            slot = t % NUM_SLOTS
            if t >= NUM_SLOTS:
                e = _event_of(t - NUM_SLOTS, NUM_HEADS, F_CHUNKS)
                mbarrier.wait(events.index(e % _EVENT_SLOTS), (e // _EVENT_SLOTS) & 1)
            for p in gl.static_range(NB):  # the allocation of t's barrier (`_bar`)
                if t % NB == p:
                    mbarrier.expect(bars[p].index(slot // NB), w_desc.block_type.nbytes)
                    tma.async_copy_global_to_shared(w_desc, [pos * HD, 0], bars[p].index(slot // NB),
                                                    ring.index(slot))
            pos += 1
            if pos == tiles_per_forward:
                pos = 0

    @gluon.jit
    def _hand_back(w_desc, ring, bars, events, event, g, G_POS: gl.constexpr, N: gl.constexpr, lo, first, total,
                   tiles_per_forward, HD: gl.constexpr, NUM_SLOTS: gl.constexpr, PRODUCER: gl.constexpr):
        """The N tiles before stream tile g, those from tile `lo` on, are consumed (their wgmmas waited for by
        every warp: the barrier) and their slots not yet handed back: with PRODUCER hand-back `event` (`_event_of`
        each of them) is signalled, one arrive on its mbarrier in the ring of `events` (the loader partition
        refills the slots), else their next tiles are loaded here (`_refill_last`). Either way the barrier orders
        every warp's shared-memory work before what follows. G_POS: g's position mod 4 in its layer (`_bar`)."""
        if PRODUCER:
            gl.thread_barrier()
            mbarrier.arrive(events.index(event % _EVENT_SLOTS))
        else:
            _refill_last(w_desc, ring, bars, g, G_POS, N, lo, first, total, tiles_per_forward, HD, NUM_SLOTS)

    @gluon.jit
    def _ring_barriers(NUM_SLOTS: gl.constexpr, RING_GROUPS: gl.constexpr):
        """One mbarrier per ring slot, in a tuple of RING_GROUPS allocations (`_bar`), each initialized to one
        arrival."""
        if RING_GROUPS == 4:
            bars = (gl.allocate_shared_memory(gl.int64, [NUM_SLOTS // 4, 1], mbarrier.MBarrierLayout()),
                    gl.allocate_shared_memory(gl.int64, [NUM_SLOTS // 4, 1], mbarrier.MBarrierLayout()),
                    gl.allocate_shared_memory(gl.int64, [NUM_SLOTS // 4, 1], mbarrier.MBarrierLayout()),
                    gl.allocate_shared_memory(gl.int64, [NUM_SLOTS // 4, 1], mbarrier.MBarrierLayout()))
        else:
            bars = (gl.allocate_shared_memory(gl.int64, [NUM_SLOTS // 2, 1], mbarrier.MBarrierLayout()),
                    gl.allocate_shared_memory(gl.int64, [NUM_SLOTS // 2, 1], mbarrier.MBarrierLayout()))
        for i in gl.static_range(NUM_SLOTS):
            mbarrier.init(_bar(bars, i, i % 4, NUM_SLOTS), count=1)
        return bars

    @gluon.jit
    def _hopper_forward_fwd(
        X, Y, Mask,  # [B, S, d] input (any float dtype), [B, S, d] output, int8 [B, S] valid tokens (HAS_MASK)
        w_desc,  # TMA descriptor of the weight stream [L * tiles * HD, d] fp16, block [HD, d]
        VEC, NFw, NFb,  # fp32: [L, V_PAD] layer vectors (pack_weights' vecs), the final norm's weight and bias
        batch, seq_len, num_layers, qk_scale, eps,  # qk_scale = head_dim**-0.5 * log2(e)
        stride_xb, stride_xs, stride_yb, stride_ys, stride_mb,
        KV, Flags,  # PAIR: fp16 [B, L, NUM_HEADS, 2, S_PAD, HD] k, v of first halves; int32 [B] heads published
        S_PAD: gl.constexpr, D: gl.constexpr, HD: gl.constexpr, NUM_HEADS: gl.constexpr, F_CHUNKS: gl.constexpr,
        NUM_SLOTS: gl.constexpr, RING_GROUPS: gl.constexpr, V_PAD: gl.constexpr, IS_CAUSAL: gl.constexpr,
        HAS_MASK: gl.constexpr, OVERLAP: gl.constexpr, PAIR: gl.constexpr, PRODUCER: gl.constexpr,
        DUO: gl.constexpr, num_warps: gl.constexpr,
    ):
        # keys a program scores: its own rows', or with PAIR (DUO) the whole (two-halves) sequence's
        if PAIR or DUO:
            KEYS: gl.constexpr = 2 * S_PAD
        else:
            KEYS: gl.constexpr = S_PAD
        KV_LAYOUT: gl.constexpr = gl.NVMMASharedLayout.get_default_for([KEYS, HD], gl.float16)
        TILES: gl.constexpr = 4 * NUM_HEADS + 2 * F_CHUNKS
        ring = gl.allocate_shared_memory(gl.float16, [NUM_SLOTS, HD, D], w_desc.layout)
        bars = _ring_barriers(NUM_SLOTS, RING_GROUPS)  # a slot's tile landed
        if DUO:  # k and v of two heads in turn (the first half writes the next while the second reads this
            # one); each half's vectors in its own two rows; per buffer: the first half's rows written, the second's
            # reads done
            k_s = gl.allocate_shared_memory(gl.float16, [2, KEYS, HD], KV_LAYOUT)
            v_s = gl.allocate_shared_memory(gl.float16, [2, KEYS, HD], KV_LAYOUT)
            vec_s = gl.allocate_shared_memory(gl.float32, [4, V_PAD], gl.SwizzledSharedLayout(1, 1, 1, [0]))
            kv_full = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
            kv_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
            for i in gl.static_range(2):
                mbarrier.init(kv_full.index(i), count=1)
                mbarrier.init(kv_free.index(i), count=1)
            kv_bars = (kv_full, kv_free)
        else:
            k_s = gl.allocate_shared_memory(gl.float16, [KEYS, HD], KV_LAYOUT)
            v_s = gl.allocate_shared_memory(gl.float16, [KEYS, HD], KV_LAYOUT)
            vec_s = gl.allocate_shared_memory(gl.float32, [2, V_PAD], gl.SwizzledSharedLayout(1, 1, 1, [0]))
            kv_bars = (bars[0], bars[0])  # not read
        if PRODUCER:  # tiles handed back: the loader partition may refill their slots (`_event_of`)
            events = gl.allocate_shared_memory(gl.int64, [_EVENT_SLOTS, 1], mbarrier.MBarrierLayout())
            for i in gl.static_range(_EVENT_SLOTS):
                mbarrier.init(events.index(i), count=2 if DUO else 1)  # with DUO both halves hand back
        else:
            events = ring  # not read

        pid = gl.program_id(0)
        programs = gl.num_programs(0)
        half = pid * 0
        if PAIR:  # programs 2p, 2p + 1: pair p, each its half of the pair's sequences; below pid is the pair's
            half = pid % 2
            pid = pid // 2
            programs = programs // 2
        tiles_per_forward = num_layers * TILES
        total = gl.cdiv(batch - pid, programs) * tiles_per_forward  # tiles this program consumes
        if DUO:  # the sequence's two halves in two partitions of num_warps warps, and the loader
            gl.warp_specialize([
                (_forward_program, (X, Y, Mask, w_desc, VEC, NFw, NFb, batch, seq_len, num_layers, qk_scale, eps,
                                    stride_xb, stride_xs, stride_yb, stride_ys, stride_mb, KV, Flags, ring, bars,
                                    events, k_s, v_s, vec_s, kv_bars, pid, programs, half, total,
                                    tiles_per_forward, S_PAD, D, HD, NUM_HEADS, F_CHUNKS, NUM_SLOTS, V_PAD, S_PAD,
                                    IS_CAUSAL, HAS_MASK, OVERLAP, PAIR, PRODUCER, DUO, 0, num_warps)),
                (_forward_program, (X, Y, Mask, w_desc, VEC, NFw, NFb, batch, seq_len, num_layers, qk_scale, eps,
                                    stride_xb, stride_xs, stride_yb, stride_ys, stride_mb, KV, Flags, ring, bars,
                                    events, k_s, v_s, vec_s, kv_bars, pid, programs, half, total,
                                    tiles_per_forward, S_PAD, D, HD, NUM_HEADS, F_CHUNKS, NUM_SLOTS, V_PAD, KEYS,
                                    IS_CAUSAL, HAS_MASK, OVERLAP, PAIR, PRODUCER, DUO, 1, num_warps)),
                (_load_weights, (w_desc, ring, bars, events, total, tiles_per_forward, HD, NUM_SLOTS, NUM_HEADS,
                                 F_CHUNKS)),
            ], [num_warps, 1], [_DUO_REGISTERS, _LOADER_REGISTERS])
        elif PRODUCER:
            gl.warp_specialize([
                (_forward_program, (X, Y, Mask, w_desc, VEC, NFw, NFb, batch, seq_len, num_layers, qk_scale, eps,
                                    stride_xb, stride_xs, stride_yb, stride_ys, stride_mb, KV, Flags, ring, bars,
                                    events, k_s, v_s, vec_s, kv_bars, pid, programs, half, total, tiles_per_forward,
                                    S_PAD, D, HD, NUM_HEADS, F_CHUNKS, NUM_SLOTS, V_PAD, KEYS, IS_CAUSAL, HAS_MASK,
                                    OVERLAP, PAIR, PRODUCER, DUO, 0, num_warps)),
                (_load_weights, (w_desc, ring, bars, events, total, tiles_per_forward, HD, NUM_SLOTS, NUM_HEADS,
                                 F_CHUNKS)),
            ], [1], [_LOADER_REGISTERS])
        else:
            for i in gl.static_range(NUM_SLOTS):  # the ring's first fill
                if i < total:
                    mbarrier.expect(_bar(bars, i, i % 4, NUM_SLOTS), w_desc.block_type.nbytes)
                    tma.async_copy_global_to_shared(w_desc, [(i % tiles_per_forward) * HD, 0],
                                                    _bar(bars, i, i % 4, NUM_SLOTS), ring.index(i))
            _forward_program(X, Y, Mask, w_desc, VEC, NFw, NFb, batch, seq_len, num_layers, qk_scale, eps,
                             stride_xb, stride_xs, stride_yb, stride_ys, stride_mb, KV, Flags, ring, bars, events,
                             k_s, v_s, vec_s, kv_bars, pid, programs, half, total, tiles_per_forward, S_PAD, D, HD,
                             NUM_HEADS, F_CHUNKS, NUM_SLOTS, V_PAD, KEYS, IS_CAUSAL, HAS_MASK, OVERLAP, PAIR,
                             PRODUCER, DUO, 0, num_warps)
        for i in gl.static_range(NUM_SLOTS):
            mbarrier.invalidate(_bar(bars, i, i % 4, NUM_SLOTS))
        if PRODUCER:
            for i in gl.static_range(_EVENT_SLOTS):
                mbarrier.invalidate(events.index(i))

    @gluon.jit
    def _forward_program(X, Y, Mask, w_desc, VEC, NFw, NFb, batch, seq_len, num_layers, qk_scale, eps,
                         stride_xb, stride_xs, stride_yb, stride_ys, stride_mb, KV, Flags, ring, bars, events, k_s,
                         v_s, vec_s, kv_bars, pid, programs, half, total, tiles_per_forward, S_PAD: gl.constexpr,
                         D: gl.constexpr, HD: gl.constexpr, NUM_HEADS: gl.constexpr, F_CHUNKS: gl.constexpr,
                         NUM_SLOTS: gl.constexpr, V_PAD: gl.constexpr, KEYS: gl.constexpr, IS_CAUSAL: gl.constexpr,
                         HAS_MASK: gl.constexpr, OVERLAP: gl.constexpr, PAIR: gl.constexpr,
                         PRODUCER: gl.constexpr, DUO: gl.constexpr, HALF: gl.constexpr, NUM_WARPS: gl.constexpr):
        """A program's sequences (pid, pid + programs, ...) through every layer and the final LayerNorm, in
        NUM_WARPS warps (with PRODUCER the default partition: the loader partition fills the ring). With DUO one
        half of each sequence, rows HALF * S_PAD on, scoring KEYS keys (the first half its own 64: the causal mask
        hides the rest; the second all 128), k and v in the double buffers of k_s and v_s (`kv_bars`)."""
        # accumulators: residual/out-projection [S_PAD, D], per-head [S_PAD, HD], scores [S_PAD, KEYS]
        L_D: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS, 1],
                                                      instr_shape=[16, D, 16])
        L_H: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS, 1],
                                                      instr_shape=[16, HD, 16])
        L_S: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS, 1],
                                                      instr_shape=[16, KEYS, 16])
        A_H: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=L_H, k_width=2)  # -> [S, HD] products
        A_D: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=L_D, k_width=2)  # -> [S, D] products
        A_S: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=L_S, k_width=2)  # -> scores
        # PAIR's scratch tiles [S_PAD, HD] fp16 in 16-byte vectors, a warp's lanes along a row first
        L_KV: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // HD, HD // 8], [NUM_WARPS, 1], [1, 0])
        TILES: gl.constexpr = 4 * NUM_HEADS + 2 * F_CHUNKS
        # VECTOR_ORDER's offsets in a layer's row of VEC
        N1W: gl.constexpr = 0
        N1B: gl.constexpr = D
        N2W: gl.constexpr = 2 * D
        N2B: gl.constexpr = 3 * D
        OB: gl.constexpr = 4 * D
        OUTB: gl.constexpr = 5 * D
        QB: gl.constexpr = 6 * D
        INB: gl.constexpr = 6 * D + NUM_HEADS * HD
        L_V: gl.constexpr = gl.BlockedLayout([V_PAD // (32 * NUM_WARPS)], [32], [NUM_WARPS], [0])
        L_M: gl.constexpr = gl.BlockedLayout([1], [32], [NUM_WARPS], [0])  # a sequence's mask, a byte a thread
        # the keys' mask as positions where measured faster: heads below 64 wide, and the duo's 64-wide ones
        # (despite their spill); elsewhere from 64 on the layout change spills
        MASK_POSITIONS: gl.constexpr = HD < 64 or (HD == 64 and DUO)
        L_COL: gl.constexpr = gl.SliceLayout(0, L_D)
        H_COL: gl.constexpr = gl.SliceLayout(0, L_H)

        v_offs = gl.arange(0, V_PAD, layout=L_V)
        VB: gl.constexpr = 2 * HALF  # this half's two rows of vec_s (with DUO; else HALF is 0)
        vec_s.index(VB).store(gl.load(VEC + v_offs))  # layer 0's vectors; each layer stages the next one's
        if PAIR:
            if half == 0:  # its key rows S_PAD.. stay zero: masked, and finite for p @ v
                k_s.slice(S_PAD, S_PAD).store(gl.zeros([S_PAD, HD], gl.float16, L_KV))
                v_s.slice(S_PAD, S_PAD).store(gl.zeros([S_PAD, HD], gl.float16, L_KV))
        gl.thread_barrier()

        rows = gl.arange(0, S_PAD, layout=gl.SliceLayout(1, L_D))
        cols = gl.arange(0, D, layout=L_COL)
        hcols = gl.arange(0, HD, layout=H_COL)
        q_rows = gl.arange(0, S_PAD, layout=gl.SliceLayout(1, L_S))
        keys = gl.arange(0, KEYS, layout=gl.SliceLayout(0, L_S))
        if PAIR:  # this program's rows: positions half * S_PAD.. of the sequence
            rows = rows + half * S_PAD
            q_rows = q_rows + half * S_PAD
        if DUO:  # this partition's rows
            rows = rows + HALF * S_PAD
            q_rows = q_rows + HALF * S_PAD
        row_in = rows < seq_len
        key_in = keys < seq_len
        tile_in = gl.expand_dims(row_in, 1) & gl.expand_dims(cols < D, 0)

        zeros_h = gl.zeros([S_PAD, HD], gl.float32, L_H)
        zeros_s = gl.zeros([S_PAD, KEYS], gl.float32, L_S)
        g = 0  # stream tiles whose wgmma has been issued
        for b in range(pid, batch, programs):
            first = g  # this sequence's first tile
            b64 = b.to(gl.int64)
            x = gl.load(X + b64 * stride_xb + gl.expand_dims(rows, 1) * stride_xs + gl.expand_dims(cols, 0),
                        mask=tile_in, other=0.0).to(gl.float32)
            row_ok = row_in
            if HAS_MASK:
                row_ok = row_ok & (gl.load(Mask + b64 * stride_mb + rows, mask=row_in, other=0) != 0)
            if not MASK_POSITIONS:  # the keys' mask loaded into the scores' layout, a boolean a score
                key_ok = key_in
                if HAS_MASK:
                    key_ok = key_ok & (gl.load(Mask + b64 * stride_mb + keys, mask=key_in, other=0) != 0)
                visible = gl.expand_dims(key_ok, 0) & gl.expand_dims(q_rows >= 0, 1)
                if IS_CAUSAL:
                    visible = visible & (gl.expand_dims(keys, 0) <= gl.expand_dims(q_rows, 1))
            else:  # a key's position, or 2 * KEYS where hidden: one compare an element against the last key
                # a row sees; the mask read a byte a thread and moved into the scores' layout
                if HAS_MASK:
                    m_keys = gl.arange(0, KEYS, layout=L_M)
                    m_ok = gl.load(Mask + b64 * stride_mb + m_keys, mask=m_keys < seq_len, other=0) != 0
                    kpos = gl.convert_layout(gl.where(m_ok, m_keys, 2 * KEYS), gl.SliceLayout(0, L_S))
                else:
                    kpos = gl.where(key_in, keys, 2 * KEYS)
                last = q_rows if IS_CAUSAL else q_rows * 0 + KEYS
                visible = gl.expand_dims(kpos, 0) <= gl.expand_dims(last, 1)
            if PAIR:
                flag = Flags + b
                seen = pid * 0  # heads of this sequence the second program knows published
            for layer in range(num_layers):
                layers_run = g // TILES  # by this program before this layer, every sequence counted
                ev0 = layers_run * (NUM_HEADS + F_CHUNKS + 2)  # this layer's first hand-back event (`_event_of`)
                hc0 = layers_run * NUM_HEADS  # heads run before this layer (DUO's k, v buffers)
                # the vectors of the layer after this one (the next sequence's first after the last), loaded now
                # and staged in the other buffer at the layer's end; the buffer: the parity of layers run so far
                upcoming = gl.load(VEC + gl.where(layer + 1 < num_layers, layer + 1, 0) * V_PAD + v_offs)
                parity = layers_run % 2
                vecs = vec_s.index(VB + parity)
                h = _layer_norm(x, _vec(vecs, N1W, D, L_COL), _vec(vecs, N1B, D, L_COL), D, eps).to(gl.float16)
                h = gl.convert_layout(h, A_H)
                # a runtime loop: one copy of a head's code (four unrolled copies stalled on instruction fetch)
                for head in range(NUM_HEADS):
                    if DUO:  # this head's k, v buffer; the first half scores its own rows' keys only
                        hc = hc0 + head
                        kv = hc % 2
                        kb = k_s.index(kv)
                        vb = v_s.index(kv)
                        kr = kb.slice(0, KEYS)
                        vr = vb.slice(0, KEYS)
                    else:
                        kr = k_s
                        vr = v_s
                    b_q = gl.load(VEC + layer * V_PAD + QB + head * HD + hcols)  # arrives under the projections
                    lo = gl.where(head > 0, g - 1, g)  # the previous head's out-projection's tile, where there is one
                    if PAIR:  # this head's scratch tiles
                        kv_tile = KV + ((b64 * num_layers + layer) * NUM_HEADS + head) * (2 * S_PAD * HD)
                        if half == 1:  # published (waited for where not yet seen), copied under the projections
                            need = layer * NUM_HEADS + head + 1
                            if seen < need:
                                seen = _acquire(flag, need)
                            gl.thread_barrier()  # every warp is past the previous head's reads of k_s and v_s
                            _copy_published(k_s, v_s, kv_tile, S_PAD, HD, L_KV)
                    if HD >= 128:  # q, k, v accumulators at once (192 registers) beside the residual spill:
                        # k, v, then q, each waited for alone
                        k = _tile_mma(h, ring, bars, g + 1, 1, zeros_h, True, False, NUM_SLOTS, False)
                        if PAIR:  # k stored before v is projected: one [64, HD] fp32 tile at a time beside x
                            gl.thread_barrier()  # every warp is past the previous head's reads of k_s and v_s
                            if (half == 0) & (head > 0):  # every warp's stores of the previous head's tiles done
                                _release(flag, layer * NUM_HEADS + head)
                            if half == 0:
                                k_s.slice(0, S_PAD).store(k.to(gl.float16))
                                _publish(k.to(gl.float16), kv_tile, S_PAD, HD, L_H)
                            else:
                                k_s.slice(S_PAD, S_PAD).store(k.to(gl.float16))
                            v = _tile_mma(h, ring, bars, g + 2, 2, zeros_h, True, False, NUM_SLOTS, False)
                            if half == 0:
                                v_s.slice(0, S_PAD).store(v.to(gl.float16))
                                _publish(v.to(gl.float16), kv_tile + S_PAD * HD, S_PAD, HD, L_H)
                            else:
                                v_s.slice(S_PAD, S_PAD).store(v.to(gl.float16))
                            async_copy.wait_group(0)  # the first half's rows landed (the second program)
                        else:
                            v = _tile_mma(h, ring, bars, g + 2, 2, zeros_h, True, False, NUM_SLOTS, False)
                            gl.thread_barrier()  # every warp is past the previous head's reads of k_s and v_s
                            k_s.store(k.to(gl.float16))
                            v_s.store(v.to(gl.float16))
                        fence_async_shared()  # the stores above before the wgmma reads below (async proxy)
                        q = _tile_mma(h, ring, bars, g, 0, zeros_h, True, False, NUM_SLOTS, False)
                        g += 3
                        # q's tile read too: the slots of q, k, v and the previous head's out-projection are
                        # free; the hand-back's barrier also orders every warp's k and v stores before the scores
                        _hand_back(w_desc, ring, bars, events, ev0 + head, g, 3, 4, lo, first, total,
                                   tiles_per_forward, HD, NUM_SLOTS, PRODUCER)
                    else:
                        q = _tile_mma(h, ring, bars, g, 0, zeros_h, True, False, NUM_SLOTS, OVERLAP)
                        k = _tile_mma(h, ring, bars, g + 1, 1, zeros_h, True, False, NUM_SLOTS, OVERLAP)
                        v = _tile_mma(h, ring, bars, g + 2, 2, zeros_h, True, False, NUM_SLOTS, OVERLAP)
                        q, k, v = warpgroup_mma_wait(num_outstanding=0, deps=(q, k, v))
                        g += 3
                        # every warp is past the previous head's probs @ v and out-projection: k_s, v_s and the
                        # consumed tiles' slots (q, k, v; the previous head's out-projection) are free
                        _hand_back(w_desc, ring, bars, events, ev0 + head, g, 3, 4, lo, first, total,
                                   tiles_per_forward, HD, NUM_SLOTS, PRODUCER)
                        if PAIR:
                            if (half == 0) & (head > 0):  # every warp's stores of the previous head's tiles done
                                _release(flag, layer * NUM_HEADS + head)
                            if half == 0:
                                k_s.slice(0, S_PAD).store(k.to(gl.float16))
                                v_s.slice(0, S_PAD).store(v.to(gl.float16))
                                _publish(k.to(gl.float16), kv_tile, S_PAD, HD, L_H)
                                _publish(v.to(gl.float16), kv_tile + S_PAD * HD, S_PAD, HD, L_H)
                            else:
                                k_s.slice(S_PAD, S_PAD).store(k.to(gl.float16))
                                v_s.slice(S_PAD, S_PAD).store(v.to(gl.float16))
                            async_copy.wait_group(0)  # the first half's rows landed (the second program)
                        elif DUO:
                            if HALF == 0:  # the second half has read this buffer's head before last
                                mbarrier.wait(kv_bars[1].index(kv), (hc // 2 + 1) & 1, pred=hc >= 2)
                            kb.slice(HALF * S_PAD, S_PAD).store(k.to(gl.float16))
                            vb.slice(HALF * S_PAD, S_PAD).store(v.to(gl.float16))
                        else:
                            k_s.store(k.to(gl.float16))
                            v_s.store(v.to(gl.float16))
                        fence_async_shared()  # the stores above before the wgmma reads below (async proxy)
                        gl.thread_barrier()  # every warp's rows of k and v written
                        if DUO:
                            if HALF == 0:  # its rows of this head's k and v are the second half's to read
                                mbarrier.arrive(kv_bars[0].index(kv))
                            else:
                                mbarrier.wait(kv_bars[0].index(kv), (hc // 2) & 1)
                    q = (q + gl.expand_dims(b_q, 0)).to(gl.float16)
                    s = warpgroup_mma(gl.convert_layout(q, A_S), kr.permute((1, 0)), zeros_s, use_acc=False)
                    s = gl.where(visible, s, float("-inf"))
                    m = gl.max(s, axis=1)
                    m = gl.where(m == float("-inf"), 0.0, m)  # a row with no visible key: p = 0, output 0
                    p = gl.exp2(s * qk_scale - gl.expand_dims(m * qk_scale, 1))  # one FFMA an element
                    l_sum = gl.sum(p, axis=1)
                    o = warpgroup_mma(gl.convert_layout(p.to(gl.float16), A_H), vr, zeros_h, use_acc=False)
                    if DUO:
                        if HALF == 1:  # its reads of this buffer done: the first half may write it again
                            mbarrier.arrive(kv_bars[1].index(kv))
                    l_sum = gl.convert_layout(gl.where(l_sum == 0.0, 1.0, l_sum), gl.SliceLayout(1, L_H))
                    o = (o / gl.expand_dims(l_sum, 1)).to(gl.float16)
                    # complete: the loop carries x as a tensor, not as a wgmma in flight
                    x = _tile_mma(gl.convert_layout(o, A_D), ring, bars, g, 3, x, False, True, NUM_SLOTS, False)
                    g += 1
                # the out-projection's tile
                _hand_back(w_desc, ring, bars, events, ev0 + NUM_HEADS, g, 0, 1, 0, first, total, tiles_per_forward,
                           HD, NUM_SLOTS, PRODUCER)
                if PAIR:
                    if half == 0:  # the hand-back's barrier follows every warp's stores of the last head's tiles
                        _release(flag, (layer + 1) * NUM_HEADS)
                x = x + gl.expand_dims(_vec(vecs, OB, D, L_COL), 0)
                h = _layer_norm(x, _vec(vecs, N2W, D, L_COL), _vec(vecs, N2B, D, L_COL), D, eps).to(gl.float16)
                h = gl.convert_layout(h, A_H)
                t = _tile_mma(h, ring, bars, g, 0, zeros_h, True, False, NUM_SLOTS, OVERLAP)
                g += 1
                for c in gl.static_range(F_CHUNKS):
                    t, x = warpgroup_mma_wait(num_outstanding=0, deps=(t, x))
                    if c == 0:  # the in-projection; then the previous chunk's out-projection too
                        _hand_back(w_desc, ring, bars, events, ev0 + NUM_HEADS + 1, g, 1, 1, 0, first, total,
                                   tiles_per_forward, HD, NUM_SLOTS, PRODUCER)
                    else:
                        _hand_back(w_desc, ring, bars, events, ev0 + NUM_HEADS + 1 + c, g, (2 * c + 1) % 4, 2, 0,
                                   first, total, tiles_per_forward, HD, NUM_SLOTS, PRODUCER)
                    t = t + gl.expand_dims(_vec(vecs, INB + c * HD, HD, H_COL), 0)
                    a = _gelu(t).to(gl.float16)
                    x = _tile_mma(gl.convert_layout(a, A_D), ring, bars, g, (2 * c + 1) % 4, x, False, True, NUM_SLOTS,
                                  OVERLAP)
                    g += 1
                    if c + 1 < F_CHUNKS:  # the next chunk's in-projection behind it, no wait between
                        t = _tile_mma(h, ring, bars, g, (2 * c + 2) % 4, zeros_h, True, False, NUM_SLOTS, OVERLAP)
                        g += 1
                x = warpgroup_mma_wait(num_outstanding=0, deps=(x,))
                # the out-projection's tile
                _hand_back(w_desc, ring, bars, events, ev0 + NUM_HEADS + F_CHUNKS + 1, g, (2 * F_CHUNKS) % 4, 1, 0,
                           first, total, tiles_per_forward, HD, NUM_SLOTS, PRODUCER)
                x = x + gl.expand_dims(_vec(vecs, OUTB, D, L_COL), 0)
                x = gl.where(gl.expand_dims(row_ok, 1), x, 0.0)
                # every warp is past this layer's last read of the other buffer (the hand-back's barrier above)
                vec_s.index(VB + 1 - parity).store(upcoming)
                gl.thread_barrier()
            if PAIR:
                if half == 1:  # every head seen (the count is final): the flag back to 0 for the next launch
                    gl.atomic_xchg(flag, 0, sem="relaxed", scope="gpu")
            y = _layer_norm(x, gl.load(NFw + cols), gl.load(NFb + cols), D, eps)
            y = gl.where(gl.expand_dims(row_ok, 1), y, 0.0)
            gl.store(Y + b64 * stride_yb + gl.expand_dims(rows, 1) * stride_ys + gl.expand_dims(cols, 0),
                     y.to(Y.dtype.element_ty), mask=tile_in)


# ----------------------------------------------------------------------------------------------
# Launcher and public function
# ----------------------------------------------------------------------------------------------
def launch_config(seq_len: int, d_model: int, num_heads: int, ffn_dim: int, pair: bool = False,
                  duo: bool = False) -> dict:
    """The kernel's compile-time shape for this model shape: S_PAD (a program's, or with `duo` a warpgroup's, rows),
    HD, F_CHUNKS, NUM_SLOTS, RING_GROUPS, V_PAD, PAIR, DUO, num_warps (a half's with `duo`: the program has twice as
    many and a loader warp). With `pair` or `duo` a half holds PAIR_ROWS rows and the second scores all 128 keys (k
    and v take shared memory for 128 rows, as without them; twice with `duo`)."""
    hd = head_dim_padded(d_model // num_heads)
    keys = _seq_pad(seq_len)
    s_pad = PAIR_ROWS if pair or duo else keys
    v_pad = _vector_pad(d_model, num_heads, ffn_dim, hd)
    tiles = stream_tiles(num_heads, ffn_dim, hd)
    return {"S_PAD": s_pad, "HD": hd, "F_CHUNKS": -(-ffn_dim // hd),
            "NUM_SLOTS": _ring_slots(keys, hd, d_model, tiles, v_pad, duo=duo), "RING_GROUPS": ring_groups(tiles),
            "V_PAD": v_pad, "PAIR": bool(pair), "DUO": bool(duo), "num_warps": s_pad // 16}


def weight_descriptor(stream: torch.Tensor, hd: int):
    """The TMA descriptor of the weight stream: [HD, d] fp16 blocks in the swizzled layout wgmma reads."""
    d = stream.shape[1]
    layout = gl.NVMMASharedLayout.get_default_for([hd, d], gl.float16)
    return TensorDescriptor(stream, list(stream.shape), list(stream.stride()), [hd, d], layout)


def programs_for(batch: int, device, pair: bool = False) -> int:
    """Persistent programs of one launch: one per SM (a program takes most of an SM's shared memory); with `pair`
    two per sequence, in pairs, at most as many as SMs (a pair's second program waits on its first: both
    resident)."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    if pair:
        return 2 * max(1, min(batch, sms // 2))
    return max(1, min(batch, sms))


def pair_scratch(batch: int, num_layers: int, num_heads: int, hd: int, device) -> dict:
    """The global scratch of `pair` (two programs a sequence): `kv` fp16 [B, L, heads, 2, PAIR_ROWS, hd] (each
    first half's k and v per layer and head: one slot per sequence, so a first program running ahead overwrites
    nothing its second still reads) and `flags` int32 [B] (heads published), zero. A launch leaves every flag at
    zero again: the same scratch serves launch after launch (CUDA-graph replays included), one launch at a time."""
    return {"kv": torch.empty(batch, num_layers, num_heads, 2, PAIR_ROWS, hd, dtype=torch.float16, device=device),
            "flags": torch.zeros(batch, dtype=torch.int32, device=device)}


def pair_scratch_bytes(batch: int, num_layers: int, num_heads: int, hd: int) -> int:
    """Bytes of `pair_scratch(batch, num_layers, num_heads, hd, ...)`: its kv fp16 and its int32 flags."""
    return batch * (num_layers * num_heads * 2 * PAIR_ROWS * hd * 2 + 4)


def _arguments(x, w, *, num_heads, causal, eps, mask, out, desc, programs, overlap, pair, producer, scratch,
               duo=False):
    """(programs, the kernel's arguments by parameter name) for `hopper_forward`'s call, checked: every name of
    `_hopper_forward_fwd`'s signature, constexprs and num_warps included."""
    if not isinstance(x, torch.Tensor) or x.dim() != 3 or x.stride(-1) != 1:
        raise ValueError(f"hopper_forward: x must be a [B, S, d] tensor with unit stride along d, got "
                         f"{tuple(getattr(x, 'shape', ()))}")
    B, S, d = x.shape
    L = w["o_b"].shape[0]
    ffn = w["in_b"].shape[1]  # padded: the same chunks as the real width
    why = why_unsupported(S, d, num_heads, ffn, causal=bool(causal), pair=bool(pair), duo=bool(duo))
    if why:
        raise ValueError(f"hopper_forward: {why}")
    if not _on_hopper(x.device):
        raise ValueError(f"hopper_forward: needs a Hopper GPU (sm_90), got {x.device}")
    cfg = launch_config(S, d, num_heads, ffn, pair=bool(pair), duo=bool(duo))
    stream = w["stream"]
    if stream.dtype != torch.float16 or stream.shape != (L * stream_tiles(num_heads, ffn, cfg["HD"]) * cfg["HD"], d):
        raise ValueError(f"hopper_forward: the weight stream must be fp16 [{L} layers * tiles * {cfg['HD']}, {d}] "
                         f"(pack_weights), got {stream.dtype} {list(stream.shape)}")
    if w["vecs"].dtype != torch.float32 or tuple(w["vecs"].shape) != (L, cfg["V_PAD"]):
        raise ValueError(f"hopper_forward: the vectors must be fp32 [{L}, {cfg['V_PAD']}] (pack_weights), got "
                         f"{w['vecs'].dtype} {list(w['vecs'].shape)}")
    if mask is not None and (mask.dtype != torch.bool or tuple(mask.shape) != (B, S) or mask.device != x.device):
        raise ValueError(f"hopper_forward: mask must be bool [B, S]={B, S} on {x.device}, got {mask.dtype} "
                         f"{tuple(mask.shape)} on {mask.device}")
    if out is None:
        out = torch.empty((B, S, d), device=x.device, dtype=x.dtype)
    elif tuple(out.shape) != (B, S, d) or out.stride(-1) != 1:
        raise ValueError(f"hopper_forward: out must be [B, S, d]={B, S, d} with unit stride along d")
    m = mask.view(torch.int8) if mask is not None else out
    if mask is not None and m.stride(-1) != 1:
        m = m.contiguous()
    desc = desc if desc is not None else weight_descriptor(stream, cfg["HD"])
    programs = programs or programs_for(B, x.device, bool(pair))
    kv = flags = out  # not read without pair
    if pair:
        sms = torch.cuda.get_device_properties(x.device).multi_processor_count
        if programs % 2 or programs > sms:
            raise ValueError(f"hopper_forward: `pair` runs programs in pairs, all resident: an even count of at most "
                             f"{sms} (the SMs), got {programs}")
        scratch = scratch if scratch is not None else pair_scratch(B, L, num_heads, cfg["HD"], x.device)
        kv, flags = scratch["kv"], scratch["flags"]
        want = (L, num_heads, 2, PAIR_ROWS, cfg["HD"])
        if (kv.dtype != torch.float16 or tuple(kv.shape[1:]) != want or kv.shape[0] < B or not kv.is_contiguous()
                or flags.dtype != torch.int32 or flags.numel() < B or not flags.is_contiguous()
                or kv.device != x.device or flags.device != x.device):
            raise ValueError(f"hopper_forward: scratch must be pair_scratch's: kv fp16 [>= {B}, "
                             f"{', '.join(map(str, want))}], flags int32 [>= {B}] on {x.device}")
    return programs, dict(
        X=x, Y=out, Mask=m, w_desc=desc, VEC=w["vecs"], NFw=w["final_w"], NFb=w["final_b"], batch=B, seq_len=S,
        num_layers=L, qk_scale=(d // num_heads) ** -0.5 * math.log2(math.e), eps=eps,
        stride_xb=x.stride(0), stride_xs=x.stride(1), stride_yb=out.stride(0), stride_ys=out.stride(1),
        stride_mb=m.stride(0) if mask is not None else 0, KV=kv, Flags=flags,
        S_PAD=cfg["S_PAD"], D=d, HD=cfg["HD"], NUM_HEADS=num_heads, F_CHUNKS=cfg["F_CHUNKS"],
        NUM_SLOTS=cfg["NUM_SLOTS"], RING_GROUPS=cfg["RING_GROUPS"], V_PAD=cfg["V_PAD"], IS_CAUSAL=bool(causal),
        HAS_MASK=mask is not None,
        OVERLAP=bool(overlap), PAIR=bool(pair), PRODUCER=bool(producer or duo), DUO=bool(duo),
        num_warps=cfg["num_warps"],
    )


def hopper_forward(x, w, *, num_heads, causal, eps, mask=None, out=None, desc=None, programs=None, overlap=True,
                   pair=False, producer=False, scratch=None, duo=False):
    """The whole forward over `x [B, S, d]` with `pack_weights`'s weights `w`: [B, S, d] in x's dtype (or into
    `out`), invalid rows 0. `eps`: the LayerNorms' epsilon (the model's, model/reference.py). `desc`: the stream's
    `weight_descriptor` (built here when None); `programs`: persistent programs (default one per SM); `overlap`: a
    head's q, k, v projections (and an FFN chunk's out-projection with the next chunk's in-projection) issued back
    to back before one wait, else each waited for alone; `pair`: two 4-warp programs per sequence, rows 0-63 and
    64-127 (causal, PAIR_MIN_SEQ_LEN <= S <= 128; the module's docstring), `programs` then even and at most the SMs,
    `scratch` its `pair_scratch` (allocated here when None; reused, one launch at a time); `producer`: a loader
    warp fills the weight ring (the module's docstring; docs/decisions.md#hopper-producer); `duo`: a sequence's two
    halves in two warpgroups of one program, with a loader warp (causal, PAIR_MIN_SEQ_LEN <= S <= 128, heads up to
    DUO_MAX_HEAD_DIM wide; the module's docstring; docs/decisions.md#hopper-duo)."""
    programs, args = _arguments(x, w, num_heads=num_heads, causal=causal, eps=eps, mask=mask, out=out, desc=desc,
                                programs=programs, overlap=overlap, pair=pair, producer=producer, scratch=scratch,
                                duo=duo)
    _hopper_forward_fwd[(programs,)](**args)
    return args["Y"]


class PreparedLaunch:
    """`hopper_forward` for one input signature with its per-call work cut to an output allocation and one launch
    of the compiled kernel: the arguments are checked, the kernel compiled and its argument list assembled once,
    here (Triton's JIT launch binds and specializes every argument again on each call). It serves inputs of the
    signature it was prepared with (shape, dtype, device, a mask or none) whose layout is the one the kernel was
    specialized on, contiguous and 16-byte aligned: `serves(x, mask)` says whether; the same keywords as
    `hopper_forward` otherwise (`out` excepted: each call returns a new tensor).

    A call hands Triton's C launcher the argument list as its wrapper would expand it, built once: the weight
    stream's TMA descriptor encoded here (the stream is refreshed in place, so its address holds), every other
    tensor as its address; per call only x's, the mask's and the output's addresses are written in. `direct` is
    None where this Triton's launcher is not reachable that way (`_c_launcher`); a call then goes through the
    compiled kernel's `run`, which encodes the descriptor and resolves every pointer again, as it does while a
    profiler's launch hooks are set, or with `direct=False`."""

    __slots__ = ("programs", "values", "at_x", "at_out", "at_mask", "index", "stream",
                 "run", "function", "metadata", "kernel", "c_launch", "direct", "direct_at")

    def __init__(self, x, w, *, num_heads, causal, eps, mask=None, desc=None, programs=None, overlap=True,
                 pair=False, producer=False, scratch=None, direct=True, duo=False):
        if not _aligned(x, mask):
            raise ValueError("PreparedLaunch: x and the mask must be contiguous and 16-byte aligned (the layout the "
                             "kernel is specialized on); hopper_forward serves any layout")
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
        self.programs, args = _arguments(x, w, num_heads=num_heads, causal=causal, eps=eps, mask=mask, out=out,
                                         desc=desc,
                                         programs=programs, overlap=overlap, pair=pair, producer=producer,
                                         scratch=scratch, duo=duo)
        with torch.cuda.device(x.device):  # the module loads into this device's context
            kernel = _hopper_forward_fwd.warmup(grid=(self.programs,), **args)
            if kernel is None:  # a jit_cache_hook of Triton's knobs declined the compile
                raise RuntimeError("PreparedLaunch: Triton did not compile _hopper_forward_fwd (jit_cache_hook)")
            self.kernel = kernel.result() if hasattr(kernel, "result") else kernel  # an async compile's future
            self.run, self.function = self.kernel.run, self.kernel.function  # `run` loads the module first
        self.metadata = self.kernel.packed_metadata
        names = _hopper_forward_fwd.arg_names  # the launcher takes every parameter in order, constexprs included
        if set(names) != set(args):
            raise RuntimeError(f"PreparedLaunch: the kernel's parameters {names} are not the arguments built "
                               f"{sorted(args)}")
        values = [args[n] for n in names]
        # the per-call tensors' places: x; the output (Y, and KV, Flags and Mask where they stand in for it)
        self.at_x = [i for i, v in enumerate(values) if v is x]
        self.at_out = [i for i, v in enumerate(values) if v is out]
        self.at_mask = names.index("Mask") if mask is not None else None
        for i in self.at_x + self.at_out + ([] if self.at_mask is None else [self.at_mask]):
            values[i] = None  # filled each call: the first call's tensors are not held
        self.values = values  # holds every tensor the direct launch passes by address
        self.index = x.device.index
        self.stream = driver.active.get_current_stream  # the device's current stream, as a Triton launch reads it
        self.c_launch, self.direct, self.direct_at = self._direct() if direct else (None, None, None)

    def _direct(self):
        """(the C launch function, its argument list with None where a call writes, {"x"|"out"|"mask": their
        indices}), or (None, None, None) where the C launcher is not reachable."""
        found = _c_launcher(self.run)
        if found is None:
            return None, None, None
        launch, cooperative, pdl = found
        tensordesc_meta = iter(getattr(self.kernel.metadata, "tensordesc_meta", None) or ())
        per_call = {i: "x" for i in self.at_x} | {i: "out" for i in self.at_out}
        if self.at_mask is not None:
            per_call[self.at_mask] = "mask"
        # the C launcher's leading arguments: grid, stream (written per call), function, cooperative and PDL
        # flags, no global or profile scratch, the packed metadata, no launch metadata and no hooks
        head = [self.programs, 1, 1, None, self.function, cooperative, pdl, None, None, self.metadata, None, None,
                None]
        args, at = head, {"x": [], "out": [], "mask": []}
        for i, v in enumerate(self.values):
            if i in per_call:
                at[per_call[i]].append(len(args))
                args.append(None)
            elif isinstance(v, TensorDescriptor):
                args.extend(make_tensordesc_arg(v, next(tensordesc_meta, None)))
            elif isinstance(v, torch.Tensor):
                args.append(v.data_ptr())
            else:
                args.append(v)
        return launch, args, at

    @staticmethod
    def serves(x, mask) -> bool:
        """Whether an input of the prepared signature has the layout the kernel was specialized on."""
        return _aligned(x, mask)

    def __call__(self, x, mask=None):
        out = torch.empty_like(x)  # x as `serves` accepts it (contiguous): the output's shape, dtype and layout
        enter, leave = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
        hooked = not (_no_calls(enter) and _no_calls(leave))  # the launcher skips hooks given as None
        if self.direct is not None and not hooked:
            args, at = self.direct.copy(), self.direct_at
            args[3] = self.stream(self.index)
            for name, tensor in (("x", x), ("out", out), ("mask", mask)):
                if at[name]:
                    address = tensor.data_ptr()
                    for i in at[name]:
                        args[i] = address
            self.c_launch(*args)
            return out
        values = self.values.copy()
        for i in self.at_x:
            values[i] = x
        for i in self.at_out:
            values[i] = out
        if self.at_mask is not None:
            values[self.at_mask] = mask  # bool and int8 share their bytes: the launcher reads the address alone
        stream = self.stream(self.index)
        if hooked:  # a profiler's hooks see this launch as they see a JIT launch
            meta = self.kernel.launch_metadata((self.programs,), stream, *values)
        else:
            meta = enter = leave = None
        self.run(self.programs, 1, 1, stream, self.function, self.metadata, meta, enter, leave, *values)
        return out


def _c_launcher(run):
    """(Triton's C launch function under `run`, the compiled kernel's launcher, its cooperative-grid and PDL
    flags), or None. In Triton 3.6 `run` is a CudaLauncher whose `launch` is the C function, or a Python wrapper
    that expands tensor descriptors around it (a closure over `launcher`); a launcher that allocates global or
    profile scratch per launch is not served. Private to Triton: tests/test_hopper_forward.py fails when a GPU
    run finds none."""
    if getattr(run, "global_scratch_size", None) != 0 or getattr(run, "profile_scratch_size", None) != 0:
        return None
    launch = getattr(run, "launch", None)
    code = getattr(launch, "__code__", None)
    if code is not None:  # the descriptor wrapper: the C function is its closure's `launcher`
        if "launcher" not in code.co_freevars:
            return None
        launch = launch.__closure__[code.co_freevars.index("launcher")].cell_contents
    if launch is None or not callable(launch) or hasattr(launch, "__code__"):
        return None
    return launch, run.launch_cooperative_grid, run.launch_pdl


def _no_calls(hook) -> bool:
    """A launch hook that would call nothing: None, or an empty chain (Triton's `knobs.HookChain`)."""
    return hook is None or getattr(hook, "calls", None) == []


def _on_hopper(device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9


def _aligned(x, mask) -> bool:
    """x and the mask (if any) contiguous and at 16-byte aligned addresses."""
    return (x.is_contiguous() and x.data_ptr() % 16 == 0
            and (mask is None or (mask.is_contiguous() and mask.data_ptr() % 16 == 0)))


__all__ = ["PreparedLaunch", "forward_from_stream", "hopper_forward", "pack_weights", "packed_bytes", "pair_scratch",
           "pair_scratch_bytes", "why_unsupported"]
