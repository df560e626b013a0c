"""kernels.fused_layer.fused_layer against its fp64 reference (fused_layer_reference), kernel by itself.

On a CPU the kernel runs in the Triton interpreter. The model-level tests (tests/test_model.py, route `fused`)
cover it inside the model; here each launch option is checked directly: block_m 16 and 32, the
keys/values precomputed by _ln_kv_fwd (kv_precompute), with it the online softmax over key blocks (key_block) and
narrower FFN chunks (ffn_block), masks (holes, a fully masked sequence), causal and not, the final norm, odd S,
d_model that is not a power of two, head_dim 8 and 80, fp16 and bf16 operands.
"""

import pytest
import torch

from shapewise.kernels.fused_layer import MAX_BLOCK_M, fused_layer, fused_layer_reference
from shapewise.kernels.mask import prefix_lengths_reference
from shapewise.model.reference import LAYER_NORM_EPS as EPS

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# operand dtype -> (atol, rtol) against fp64 math on the same (rounded) weights: activations rounded to
# fp16 (2^-11) or bf16 (2^-8) before each of ~6 chained matmuls, outputs of order 1
TOL = {torch.float16: (4e-3, 2e-2), torch.bfloat16: (3e-2, 5e-2)}
# (B, S, d_model, num_heads, ffn_dim)
SHAPES = {
    "S1": (2, 1, 32, 2, 32),
    "S7-d48-H3": (2, 7, 48, 3, 80),
    "S33-hd16": (2, 33, 64, 4, 96),
    "hd8": (2, 20, 32, 4, 48),
    "hd80": (1, 16, 80, 1, 80),
    "S128": (1, 128, 32, 2, 64),
}


def weights(d, ffn, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)

    def r(*shape, scale=1.0):
        return torch.randn(*shape, generator=g) * scale

    w = {"qkv_w": r(3 * d, d, scale=d**-0.5), "qkv_b": r(3 * d, scale=0.1), "o_w": r(d, d, scale=d**-0.5),
         "o_b": r(d, scale=0.1), "in_w": r(ffn, d, scale=d**-0.5), "in_b": r(ffn, scale=0.1),
         "out_w": r(d, ffn, scale=ffn**-0.5), "out_b": r(d, scale=0.1)}
    op = {k: v.to(DEVICE, dtype) for k, v in w.items()}
    for name in ("n1", "n2"):
        op[name + "_w"] = (1 + r(d, scale=0.1)).to(DEVICE)
        op[name + "_b"] = r(d, scale=0.1).to(DEVICE)
    return op


def make_mask(kind, B, S):
    """none, holes (random), one_empty (holes, batch element 0 without a valid token), all_true, prefix (element 0
    full, the others cut short), left_pad (the first tokens invalid), mixed (element 0 a short prefix, element 1
    holes, the rest full)."""
    if kind == "none":
        return None
    g = torch.Generator().manual_seed(S)
    mask = torch.rand(B, S, generator=g) > 0.3
    if kind == "one_empty":
        mask[0] = False
    elif kind in ("all_true", "prefix", "left_pad", "mixed"):
        positions = torch.arange(S)[None, :]
        cut = torch.tensor([S] + [max(1, (S * (b + 1)) // (B + 2)) for b in range(1, B)])[:, None]
        mask = {"all_true": torch.ones(B, S, dtype=torch.bool), "prefix": positions < cut,
                "left_pad": positions >= S - cut}[kind] if kind != "mixed" else torch.ones(B, S, dtype=torch.bool)
        if kind == "mixed":
            mask[0, max(1, S // 2):] = False
            if B > 1:
                mask[1] = torch.rand(S, generator=g) > 0.3
    return mask.to(DEVICE)


def check(y, want, dtype):
    atol, rtol = TOL[dtype]
    err = (y.double().cpu() - want.cpu()).abs()
    bad = err > atol + rtol * want.abs().cpu()
    assert torch.isfinite(y).all(), "non-finite output"
    assert not bad.any(), f"{int(bad.sum())} elements off, max abs error {err.max().item():.3e}"


@pytest.mark.parametrize("block_m", [16, 32])
@pytest.mark.parametrize("mask_kind", ["none", "holes", "one_empty"])
@pytest.mark.parametrize("shape", list(SHAPES), ids=list(SHAPES))
def test_fused_layer_matches_fp64(shape, mask_kind, block_m):
    B, S, d, H, ffn = SHAPES[shape]
    causal = S % 2 == 1 or shape == "S128"  # both kinds across the shapes
    w = weights(d, ffn, torch.float16)
    x = torch.randn(B, S, d, device=DEVICE)
    mask = make_mask(mask_kind, B, S)
    y = fused_layer(x, w, num_heads=H, causal=causal, mask=mask, block_m=block_m, eps=EPS)
    want = fused_layer_reference(x, {k: v.double() for k, v in w.items()}, num_heads=H, causal=causal, eps=EPS,
                                 mask=mask)
    check(y, want, torch.float16)


MASK_KINDS = ["all_true", "prefix", "left_pad", "mixed", "holes", "one_empty"]
# (shape, kv_precompute, key_block): the whole-sequence kernel, precomputed keys and values, their key blocks
SUMMARY_LAUNCHES = {"S7-whole": ("S7-d48-H3", False, None), "S33-whole": ("S33-hd16", False, None),
                    "S33-kv": ("S33-hd16", True, None), "S33-key-blocks": ("S33-hd16", True, 16),
                    "S128-whole": ("S128", False, None)}


@pytest.mark.parametrize("launch", list(SUMMARY_LAUNCHES), ids=list(SUMMARY_LAUNCHES))
@pytest.mark.parametrize("mask_kind", MASK_KINDS)
@pytest.mark.parametrize("summary", ["computed", "written", "given"])
def test_mask_summary_paths_match_fp64(summary, mask_kind, launch):
    """However the kernel learns the mask's summary (computed in the kernel; computed and written to prefix_out, as
    the model's layer 0 does; given, as the later layers read it), it gives the contract's layer on prefix masks,
    where it uses the length alone, and on masks that are none (left padding, holes, a sequence without a valid
    token, prefix and holes in one batch); the summary it writes is kernels.mask's."""
    name, kv, key_block = SUMMARY_LAUNCHES[launch]
    B, S, d, H, ffn = SHAPES[name]
    B = max(B, 3)
    causal = S % 2 == 1
    g = torch.Generator().manual_seed(7)
    x = torch.randn(B, S, d, generator=g).to(DEVICE)
    w = weights(d, ffn, torch.float16)
    mask = make_mask(mask_kind, B, S)
    want_summary = prefix_lengths_reference(mask)
    kwargs = dict(num_heads=H, causal=causal, block_m=16, kv_precompute=kv, key_block=key_block)
    written = torch.full((B,), -7, dtype=torch.int32, device=DEVICE)
    if summary == "written":
        kwargs["prefix_out"] = written
    elif summary == "given":
        kwargs["mask_prefix_lengths"] = want_summary
    y = fused_layer(x, w, mask=mask, **kwargs, eps=EPS)
    want = fused_layer_reference(x, {k: v.double() for k, v in w.items()}, num_heads=H, causal=causal, eps=EPS,
                                 mask=mask)
    check(y, want, torch.float16)
    if summary == "written":
        assert torch.equal(written.cpu(), want_summary.cpu())


@pytest.mark.parametrize("launch", ["S7-whole", "S33-key-blocks", "S128-whole"])
@pytest.mark.parametrize("mask_kind", MASK_KINDS)
@pytest.mark.parametrize("summary", ["computed", "written", "given"])
def test_row_mask_branch_off_matches_fp64(summary, mask_kind, launch, monkeypatch):
    """With the row-mask switch off (fused_layer.ROW_MASK_BRANCH False: the output rows' mask predicated off for a
    prefix instead of read in a branch; on by default, which the test above runs), every way of learning the
    summary still gives the contract's layer on every mask kind, and the summary written is kernels.mask's."""
    from shapewise.kernels import fused_layer as fused_module

    monkeypatch.setattr(fused_module, "ROW_MASK_BRANCH", False)
    test_mask_summary_paths_match_fp64(summary, mask_kind, launch)


def test_row_mask_branch_reaches_the_launch(monkeypatch):
    from shapewise.kernels import fused_layer as fused_module

    launched = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: launched.append(kwargs["ROW_MASK_BRANCH"])

    B, S, d, H, ffn = SHAPES["S7-d48-H3"]
    x = torch.randn(B, S, d).to(DEVICE)
    w = weights(d, ffn, torch.float16)
    mask = torch.ones(B, S, dtype=torch.bool, device=DEVICE)
    monkeypatch.setattr(fused_module, "_fused_layer_fwd", Recorder())
    for switch in (False, True):
        monkeypatch.setattr(fused_module, "ROW_MASK_BRANCH", switch)
        fused_layer(x, w, num_heads=H, causal=True, mask=mask, eps=EPS)
    assert launched == [False, True]


def test_summary_arguments_are_checked():
    B, S, d, H, ffn = SHAPES["S7-d48-H3"]
    x = torch.randn(B, S, d).to(DEVICE)
    w = weights(d, ffn, torch.float16)
    mask = torch.ones(B, S, dtype=torch.bool, device=DEVICE)
    good = torch.zeros(B, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="mask_prefix_lengths describes a mask"):
        fused_layer(x, w, num_heads=H, causal=True, mask_prefix_lengths=good, eps=EPS)
    with pytest.raises(ValueError, match="prefix_out must be int32"):
        fused_layer(x, w, num_heads=H, causal=True, mask=mask, prefix_out=good.long(), eps=EPS)
    with pytest.raises(ValueError, match="not both"):
        fused_layer(x, w, num_heads=H, causal=True, eps=EPS, mask=mask, prefix_out=good,
                    mask_prefix_lengths=good.clone())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_final_norm_and_operand_dtypes(dtype):
    B, S, d, H, ffn = SHAPES["S33-hd16"]
    w = weights(d, ffn, dtype)
    final = ((1 + 0.1 * torch.randn(d)).to(DEVICE), (0.1 * torch.randn(d)).to(DEVICE))
    x = torch.randn(B, S, d, device=DEVICE)
    mask = make_mask("holes", B, S)
    y = fused_layer(x, w, num_heads=H, causal=True, mask=mask, final=final, out_dtype=torch.float32, eps=EPS)
    want = fused_layer_reference(x, {k: v.double() for k, v in w.items()}, num_heads=H, causal=True, mask=mask,
                                 final=final, eps=EPS)
    check(y, want, dtype)


@pytest.mark.parametrize("mask_kind", ["none", "holes", "one_empty"])
@pytest.mark.parametrize("shape", list(SHAPES), ids=list(SHAPES))
def test_precomputed_keys_and_values_match_fp64(shape, mask_kind):
    """kv_precompute: _ln_kv_fwd writes every token's keys and values once, the layer kernel reads them."""
    B, S, d, H, ffn = SHAPES[shape]
    causal = S % 2 == 0
    w = weights(d, ffn, torch.float16, seed=5)
    x = torch.randn(B, S, d, device=DEVICE)
    mask = make_mask(mask_kind, B, S)
    y = fused_layer(x, w, num_heads=H, causal=causal, mask=mask, block_m=16, kv_precompute=True, eps=EPS)
    want = fused_layer_reference(x, {k: v.double() for k, v in w.items()}, num_heads=H, causal=causal, eps=EPS,
                                 mask=mask)
    check(y, want, torch.float16)


@pytest.mark.parametrize("blocks", [{}, {"key_block": 16, "ffn_block": 32}], ids=["whole-sequence", "key-blocks"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_precomputed_keys_and_values_with_final_norm(dtype, blocks):
    """32-row query tiles; with 16-key blocks the causal bound cuts inside a tile. Causal and not."""
    B, S, d, H, ffn = SHAPES["S128"]
    w = weights(d, ffn, dtype, seed=6)
    final = ((1 + 0.1 * torch.randn(d)).to(DEVICE), (0.1 * torch.randn(d)).to(DEVICE))
    x = torch.randn(B, S, d, device=DEVICE)
    mask = make_mask("holes", B, S)
    for causal in (True, False):
        y = fused_layer(x, w, num_heads=H, causal=causal, mask=mask, final=final, out_dtype=torch.float32,
                        block_m=32, kv_precompute=True, **blocks, eps=EPS)
        want = fused_layer_reference(x, {k: v.double() for k, v in w.items()}, num_heads=H, causal=causal,
                                     mask=mask, final=final, eps=EPS)
        check(y, want, dtype)


@pytest.mark.parametrize("mask_kind", ["none", "holes", "one_empty"])
@pytest.mark.parametrize("shape", list(SHAPES), ids=list(SHAPES))
def test_key_blocks_match_fp64(shape, mask_kind):
    """key_block: the precomputed keys 16 at a time with an online softmax (a causal tile stops at its last
    query), FFN columns 16 at a time; S=1 and 7 fit in one key block, S=33 and 128 take several."""
    B, S, d, H, ffn = SHAPES[shape]
    causal = S % 2 == 1 or shape == "S128"
    w = weights(d, ffn, torch.float16, seed=7)
    x = torch.randn(B, S, d, device=DEVICE)
    mask = make_mask(mask_kind, B, S)
    y = fused_layer(x, w, num_heads=H, causal=causal, mask=mask, block_m=16, kv_precompute=True, key_block=16,
                    ffn_block=16, eps=EPS)
    want = fused_layer_reference(x, {k: v.double() for k, v in w.items()}, num_heads=H, causal=causal, eps=EPS,
                                 mask=mask)
    check(y, want, torch.float16)


@pytest.mark.parametrize("variant, bound", [({"kv_precompute": True}, 1e-3),
                                            ({"kv_precompute": True, "key_block": 16, "ffn_block": 16}, 2e-3),
                                            ({"ffn_block": 16}, 1e-3)],
                         ids=["kv-precompute", "key-blocks", "ffn-block"])
def test_variants_give_the_same_layer(variant, bound):
    """The kv_precompute variant computes the same layer as the default kernel, to accumulation order."""
    B, S, d, H, ffn = SHAPES["S33-hd16"]
    w = weights(d, ffn, torch.float16, seed=3)
    x = torch.randn(B, S, d, device=DEVICE)
    a = fused_layer(x, w, num_heads=H, causal=True, eps=EPS)
    b = fused_layer(x, w, num_heads=H, causal=True, **variant, eps=EPS)
    assert (a - b).abs().max().item() < bound


@pytest.mark.parametrize("block_m", [MAX_BLOCK_M * 2, MAX_BLOCK_M * 4])
def test_block_m_beyond_the_checked_range_is_refused(block_m):
    B, S, d, H, ffn = SHAPES["S128"]
    w = weights(d, ffn, torch.float16)
    with pytest.raises(ValueError, match=f"block_m must be at most {MAX_BLOCK_M}"):
        fused_layer(torch.randn(B, S, d, device=DEVICE), w, num_heads=H, causal=True, block_m=block_m, eps=EPS)


def test_block_sizes_are_checked():
    B, S, d, H, ffn = SHAPES["S33-hd16"]
    w = weights(d, ffn, torch.float16)
    x = torch.randn(B, S, d, device=DEVICE)
    with pytest.raises(ValueError, match="key_block=16 .* needs kv_precompute=True"):
        fused_layer(x, w, num_heads=H, causal=True, key_block=16, eps=EPS)
    for name, value in (("key_block", 24), ("ffn_block", 8), ("key_block", 0)):
        with pytest.raises(ValueError, match=f"{name} must be a power of two of at least 16"):
            fused_layer(x, w, num_heads=H, causal=True, kv_precompute=True, **{name: value}, eps=EPS)


def test_bad_inputs_are_named():
    B, S, d, H, ffn = SHAPES["S7-d48-H3"]
    w = weights(d, ffn, torch.float16)
    with pytest.raises(ValueError, match="seq_len <= 128"):
        fused_layer(torch.randn(1, 129, d, device=DEVICE), w, num_heads=H, causal=True, eps=EPS)
    with pytest.raises(TypeError, match="float16 or bfloat16"):
        fused_layer(torch.randn(B, S, d, device=DEVICE), {**w, "qkv_w": w["qkv_w"].float()}, num_heads=H,
                    causal=True, eps=EPS)
    with pytest.raises(ValueError, match="mask must be bool"):
        fused_layer(torch.randn(B, S, d, device=DEVICE), w, num_heads=H, causal=True,
                    mask=torch.ones(B, S, dtype=torch.int32, device=DEVICE), eps=EPS)
