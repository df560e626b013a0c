"""kernels.megakernel.megakernel (the whole forward in one kernel) against its fp64 reference, kernel by itself.

On a CPU the kernel runs in the Triton interpreter with two persistent programs, so a batch of three sequences
runs the persistent loop and reuses a program's scratch. Checked: every mask kind (prefix, left padding, holes, a
sequence with no valid token, all-True), causal and not, odd S and d_model, head_dim 8 and 80 (padded head
tiles), S = 1, one layer and three, fp32 / fp16 / bf16 inputs with fp16 and bf16 operands, block_m 16 and 64.
"""

import pytest
import torch

from shapewise.kernels.megakernel import (MAX_SEQ_X_D_MODEL, megakernel, megakernel_reference, stack_layers,
                                          why_unsupported)

from test_fused_layer import DEVICE, make_mask, weights

# operand dtype -> (atol, rtol) against fp64 math on the same (rounded) weights: activations rounded to fp16
# (2^-11) or bf16 (2^-8) before each of ~6 chained matmuls per layer, outputs of order 1 (final LayerNorm)
TOL = {torch.float16: (6e-3, 2e-2), torch.bfloat16: (4e-2, 6e-2)}
# (B, S, d_model, num_heads, ffn_dim, num_layers)
SHAPES = {
    "S1": (3, 1, 32, 2, 32, 2),
    "S7-d48-H3": (3, 7, 48, 3, 80, 2),
    "S33-hd16": (3, 33, 64, 4, 96, 1),
    "hd8-L3": (3, 20, 32, 4, 48, 3),
    "hd80": (2, 16, 80, 1, 80, 2),
    "S80": (2, 80, 32, 2, 64, 2),
}


def stacked(d, ffn, layers, op, seed=0):
    per_layer = [weights(d, ffn, op, seed=seed + i) for i in range(layers)]
    g = torch.Generator().manual_seed(seed + 100)
    final = ((1 + torch.randn(d, generator=g) * 0.1).to(DEVICE), (torch.randn(d, generator=g) * 0.1).to(DEVICE))
    return stack_layers(per_layer, final)


def check(y, want, op):
    atol, rtol = TOL[op]
    assert torch.isfinite(y).all(), "non-finite output"
    err = (y.double().cpu() - want.cpu()).abs()
    bad = err > atol + rtol * want.abs().cpu()
    assert not bad.any(), f"{int(bad.sum())} of {bad.numel()} elements off, max abs error {err.max().item():.3e}"


def run(shape, mask_kind, *, causal=True, op=torch.float16, in_dtype=torch.float32, block_m=None, seed=0):
    B, S, d, H, ffn, L = shape
    w = stacked(d, ffn, L, op, seed)
    x = torch.randn(B, S, d, generator=torch.Generator().manual_seed(seed + 7)).to(DEVICE, in_dtype)
    mask = make_mask(mask_kind, B, S)
    y = megakernel(x, w, num_heads=H, causal=causal, mask=mask, block_m=block_m)
    assert y.dtype == in_dtype and y.shape == x.shape
    want = megakernel_reference(x, w, num_heads=H, causal=causal, mask=mask)
    check(y, want, op)
    if mask is not None:  # invalid rows are exactly 0
        assert (y[~mask] == 0).all()
    return y


@pytest.mark.parametrize("mask_kind", ["none", "all_true", "prefix", "left_pad", "holes", "one_empty", "mixed"])
@pytest.mark.parametrize("shape", list(SHAPES), ids=list(SHAPES))
def test_megakernel_matches_fp64(shape, mask_kind):
    run(SHAPES[shape], mask_kind)


@pytest.mark.parametrize("mask_kind", ["none", "left_pad", "one_empty"])
def test_megakernel_not_causal(mask_kind):
    run(SHAPES["S33-hd16"], mask_kind, causal=False)
    run(SHAPES["hd8-L3"], mask_kind, causal=False)


@pytest.mark.parametrize("block_m", [16, 64])
def test_megakernel_block_m(block_m):
    """Several query tiles per sequence (16 rows of 33) and one tile holding them all."""
    run(SHAPES["S33-hd16"], "holes", block_m=block_m)


@pytest.mark.parametrize("in_dtype,op", [(torch.float16, torch.float16), (torch.bfloat16, torch.float16),
                                         (torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16)])
def test_megakernel_dtypes(in_dtype, op):
    run(SHAPES["S7-d48-H3"], "prefix", in_dtype=in_dtype, op=op)


def test_megakernel_all_true_mask_equals_unmasked():
    """The official call's all-True mask takes the prefix path: the very same output as no mask."""
    B, S, d, H, ffn, L = SHAPES["S7-d48-H3"]
    w = stacked(d, ffn, L, torch.float16)
    x = torch.randn(B, S, d).to(DEVICE)
    a = megakernel(x, w, num_heads=H, causal=True)
    b = megakernel(x, w, num_heads=H, causal=True, mask=torch.ones(B, S, dtype=torch.bool, device=DEVICE))
    assert torch.equal(a, b)


def test_megakernel_limits_and_bad_input():
    assert why_unsupported(128, 128, 4) is None
    assert "seq_len * d_model" in why_unsupported(256, 128, 4)
    assert "d_model" in why_unsupported(8, 8, 1)
    assert "d_model % num_heads" in why_unsupported(16, 48, 5)
    assert MAX_SEQ_X_D_MODEL == 128 * 128
    B, S, d, H, ffn, L = SHAPES["S1"]
    w = stacked(d, ffn, L, torch.float16)
    x = torch.randn(B, S, d).to(DEVICE)
    with pytest.raises(ValueError, match="seq_len"):
        megakernel(torch.randn(1, 1024, d).to(DEVICE), w, num_heads=H, causal=True)
    with pytest.raises(ValueError, match="mask must be bool"):
        megakernel(x, w, num_heads=H, causal=True, mask=torch.ones(B, S, dtype=torch.int8, device=DEVICE))
    bad = dict(w, o_w=w["o_w"][:, :, :-1])
    with pytest.raises(ValueError, match="o_w must be contiguous"):
        megakernel(x, bad, num_heads=H, causal=True)
    with pytest.raises(TypeError, match="float16 or bfloat16"):
        megakernel(x, dict(w, qkv_w=w["qkv_w"].float()), num_heads=H, causal=True)
    with pytest.raises(ValueError, match="lack n2_b"):
        megakernel(x, {k: v for k, v in w.items() if k != "n2_b"}, num_heads=H, causal=True)
