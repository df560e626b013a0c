"""kernels.attention.flash_attention against an fp64 attention written here in plain torch.

q, k, v are strided views of one packed qkv tensor [B, S, 3, H, D] (``qkv.unbind(2)``), the way the model
feeds them. On a machine without CUDA the Triton kernel runs under TRITON_INTERPRET=1 (see conftest), so the
shape grid is pruned: the full cross product only on the small points, every listed value appears at least once.
"""

import itertools
import re

import pytest
import torch

from shapewise.kernels.attention import flash_attention

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

# (precision, input dtype) -> (atol, rtol). fp32 must be (nearly) exact; tf32/fp16 round inputs to 10-11
# mantissa bits (~5e-4 relative each), bf16 to 8 bits (~4e-3).
TOL = {
    ("fp32", torch.float32): (1e-5, 1e-5),
    ("tf32", torch.float32): (4e-3, 4e-3),
    ("fp16", torch.float32): (4e-3, 4e-3),
    ("fp16", torch.float16): (4e-3, 4e-3),
    ("bf16", torch.float32): (3e-2, 3e-2),
    ("bf16", torch.bfloat16): (3e-2, 3e-2),
}

MASK_KINDS = ("none", "lengths", "prefix_mask", "left", "holes", "empty_element")


# ----------------------------------------------------------------------------------------------------------
# fp64 reference
# ----------------------------------------------------------------------------------------------------------
def reference_attention(q, k, v, causal, key_valid=None):
    """fp64 attention on [B, S, H, D]; key_valid: [B, S] bool or None.

    Self-attention semantics (kernels/attention.py docstring): the key mask also marks invalid queries, whose
    rows are 0; a query with no allowed key gives 0."""
    q64, k64, v64 = (t.detach().to("cpu", torch.float64).permute(0, 2, 1, 3) for t in (q, k, v))
    B, H, S, D = q64.shape
    scores = (q64 @ k64.transpose(-1, -2)) * D ** -0.5
    allowed = torch.ones(B, 1, S, S, dtype=torch.bool)
    if causal:
        allowed &= torch.ones(S, S, dtype=torch.bool).tril()
    if key_valid is not None:
        allowed &= key_valid.to("cpu")[:, None, None, :]
    scores = scores.masked_fill(~allowed, float("-inf"))
    any_allowed = allowed.any(-1, keepdim=True)
    scores = torch.where(any_allowed, scores, torch.zeros_like(scores))
    probs = torch.softmax(scores, dim=-1) * any_allowed
    out = (probs @ v64).permute(0, 2, 1, 3)  # [B, S, H, D]
    if key_valid is not None:
        out = out * key_valid.to("cpu")[:, :, None, None]
    return out


def make_qkv(B, S, H, D, dtype, scale=1.0, device=DEVICE):
    qkv = (torch.randn(B, S, 3, H, D, dtype=torch.float32) * scale).to(device=device, dtype=dtype)
    q, k, v = qkv.unbind(2)
    return qkv, q, k, v


def make_mask(kind, B, S):
    """Returns (key_lengths or None, key_mask or None, key_valid [B,S] bool or None) for a mask kind."""
    g = torch.Generator().manual_seed(1000 * B + S)
    pos = torch.arange(S)
    if kind == "none":
        return None, None, None
    if kind in ("lengths", "prefix_mask"):
        lengths = torch.randint(1, S + 1, (B,), generator=g)
        lengths[0] = max(1, S // 2)  # at least one element really padded when S > 1
        valid = pos[None, :] < lengths[:, None]
        if kind == "lengths":
            return lengths.to(DEVICE, torch.int32), None, valid
        return None, valid.to(DEVICE), valid
    if kind == "left":
        lengths = torch.randint(1, S + 1, (B,), generator=g)
        lengths[0] = max(1, S // 2)
        valid = pos[None, :] >= (S - lengths)[:, None]
        return None, valid.to(DEVICE), valid
    if kind == "holes":
        valid = torch.rand(B, S, generator=g) < 0.6
        valid[:, -1] = True  # every element keeps a key
        if S > 2:
            valid[0, 0] = False  # causal: query 0 of element 0 sees no key at all
            valid[0, 1] = True
        return None, valid.to(DEVICE), valid
    if kind == "empty_element":
        valid = torch.ones(B, S, dtype=torch.bool)
        valid[0] = False  # batch element 0 fully masked
        if B > 1 and S > 1:
            valid[1, S // 2:] = False
        return None, valid.to(DEVICE), valid
    raise AssertionError(kind)


def run_case(B, S, H, D, causal, mask_kind, precision, dtype, assert_close, scale=1.0, tol=None):
    qkv, q, k, v = make_qkv(B, S, H, D, dtype, scale)
    assert q.stride() == (S * 3 * H * D, 3 * H * D, D, 1)  # a view, not a copy
    before = qkv.clone()
    key_lengths, key_mask, key_valid = make_mask(mask_kind, B, S)
    out = flash_attention(q, k, v, causal=causal, key_lengths=key_lengths, key_mask=key_mask,
                          precision=precision)
    assert torch.equal(qkv, before), "flash_attention wrote into its inputs"
    assert out.shape == (B, S, H, D)
    assert out.is_contiguous()
    assert out.device.type == q.device.type
    assert not torch.isnan(out).any(), "NaN in attention output"
    ref = reference_attention(q, k, v, causal, key_valid)
    atol, rtol = tol or TOL[(precision, dtype)]
    assert_close(out, ref, atol=atol, rtol=rtol,
                 what=f"attention B={B} S={S} H={H} D={D} causal={causal} mask={mask_kind} {precision}/{dtype}")
    # queries that see no key at all (fully masked element, causal query before the first valid key) and
    # invalid queries are exactly 0
    if key_valid is not None:
        if (~key_valid).any():
            assert out.detach().cpu()[~key_valid].abs().max().item() == 0.0, "invalid query row is not 0"
        allowed = key_valid[:, None, :].expand(B, S, S)
        if causal:
            allowed = allowed & torch.ones(S, S, dtype=torch.bool).tril()
        no_key = ~allowed.any(-1)  # [B, S]
        if no_key.any():
            assert out.detach().cpu()[no_key].abs().max().item() == 0.0, "query with no visible key is not 0"
    return out, key_valid


# ----------------------------------------------------------------------------------------------------------
# grid: full cross product on the small points, a few points on the large ones (interpreter budget)
# ----------------------------------------------------------------------------------------------------------
SMALL = [pytest.param(S, D, causal, m, id=f"S{S}-D{D}-{'causal' if causal else 'full'}-{m}")
         for S, D, causal, m in itertools.product((1, 7, 33), (8, 80), (True, False), MASK_KINDS)]

LARGE = [
    pytest.param(128, 32, True, "lengths", id="S128-D32-causal-lengths"),
    pytest.param(128, 64, False, "holes", id="S128-D64-full-holes"),
    pytest.param(128, 128, True, "none", id="S128-D128-causal-none"),
    pytest.param(200, 64, True, "left", id="S200-D64-causal-left"),
    pytest.param(200, 128, False, "empty_element", id="S200-D128-full-empty_element"),
    pytest.param(200, 32, True, "prefix_mask", id="S200-D32-causal-prefix_mask"),
    pytest.param(33, 128, True, "holes", id="S33-D128-causal-holes"),
    pytest.param(7, 64, False, "lengths", id="S7-D64-full-lengths"),
]


MID = [pytest.param(33, D, causal, m, id=f"S33-D{D}-{'causal' if causal else 'full'}-{m}")
       for D, causal, m in itertools.product((32, 64, 128), (True, False), MASK_KINDS)]


@pytest.mark.parametrize("S,D,causal,mask_kind", SMALL + MID)
def test_fp32_small_grid(S, D, causal, mask_kind, assert_close):
    run_case(2, S, 2, D, causal, mask_kind, "fp32", torch.float32, assert_close)


@pytest.mark.parametrize("S,D,causal,mask_kind", LARGE)
def test_fp32_large_points(S, D, causal, mask_kind, assert_close):
    run_case(2, S, 1, D, causal, mask_kind, "fp32", torch.float32, assert_close)


PRECISION_POINTS = [
    pytest.param(p, dt, S, D, causal, m, id=f"{p}-{str(dt).split('.')[-1]}-S{S}-D{D}-{'c' if causal else 'f'}-{m}")
    for (p, dt), (S, D, causal, m) in itertools.product(
        TOL.keys(), [(33, 80, True, "holes"), (7, 8, False, "lengths"), (128, 64, True, "left"),
                     (1, 32, True, "empty_element"), (33, 128, False, "prefix_mask")])
    if p != "fp32"
]


@pytest.mark.parametrize("S,D,causal,mask_kind", [
    pytest.param(S, D, causal, m, id=f"S{S}-D{D}-{'causal' if causal else 'full'}-{m}")
    for S, D, causal, m in itertools.product((1, 33, 70), (8, 64), (True, False),
                                             ("prefix_mask", "left", "holes", "empty_element"))])
def test_mask_own_loop_matches_fp64(S, D, causal, mask_kind, assert_close, monkeypatch):
    """The switch that gives a mask that is no prefix its own stage-2 loop (attention.MASK_OWN_LOOP_MAX_BLOCK_D):
    on for every head size (256) and off (None: one loop for prefix and general masks), every mask kind still
    matches fp64, in fp32 (exact dots) and fp16 operands, and the kernel is specialized by it (the switch reaches
    the launch)."""
    from shapewise.kernels import attention

    for bound in (256, None):
        monkeypatch.setattr(attention, "MASK_OWN_LOOP_MAX_BLOCK_D", bound)
        run_case(2, S, 2, D, causal, mask_kind, "fp32", torch.float32, assert_close)
        run_case(2, S, 2, D, causal, mask_kind, "fp16", torch.float32, assert_close)
    launched = {}

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: launched.update(kwargs)

    monkeypatch.setattr(attention, "_attention_fwd_tuned", Recorder())
    _, key_mask, _ = make_mask(mask_kind, 2, S)
    _, q, k, v = make_qkv(2, S, 2, D, torch.float32)
    monkeypatch.setattr(attention, "MASK_OWN_LOOP_MAX_BLOCK_D", 256)
    flash_attention(q, k, v, causal=causal, key_mask=key_mask)
    assert launched["MASK_LOOP"] is True
    monkeypatch.setattr(attention, "MASK_OWN_LOOP_MAX_BLOCK_D", 32)
    flash_attention(q, k, v, causal=causal, key_mask=key_mask)
    assert launched["MASK_LOOP"] is (D <= 32)
    monkeypatch.setattr(attention, "MASK_OWN_LOOP_MAX_BLOCK_D", None)
    flash_attention(q, k, v, causal=causal, key_mask=key_mask)
    assert launched["MASK_LOOP"] is False


@pytest.mark.parametrize("precision,dtype,S,D,causal,mask_kind", PRECISION_POINTS)
def test_reduced_precisions(precision, dtype, S, D, causal, mask_kind, assert_close):
    run_case(2, S, 2, D, causal, mask_kind, precision, dtype, assert_close)


@pytest.mark.parametrize("causal", [True, False])
def test_large_scores_are_stable(causal, assert_close):
    """Scores with std ~36 (max ~150): a kernel that does not subtract the running max overflows exp2().
    fp32 rounding of such scores is ~1e-5 absolute, times |v|~6: the tolerance is scaled accordingly."""
    run_case(1, 65, 2, 32, causal, "holes", "fp32", torch.float32, assert_close, scale=6.0, tol=(5e-4, 1e-4))


def test_fully_masked_element_is_all_zero():
    _, q, k, v = make_qkv(3, 33, 2, 32, torch.float32)
    for kw in ({"key_mask": torch.tensor([[True] * 33, [False] * 33, [True] * 20 + [False] * 13], device=DEVICE)},
               {"key_lengths": torch.tensor([33, 0, 20], dtype=torch.int32, device=DEVICE)}):
        for causal in (True, False):
            out = flash_attention(q, k, v, causal=causal, precision="fp32", **kw)
            assert not torch.isnan(out).any()
            assert out[1].abs().max().item() == 0.0, f"masked element not zero ({list(kw)}, causal={causal})"
            assert out[0].abs().max().item() > 0.0


def test_lengths_and_equivalent_mask_agree():
    _, q, k, v = make_qkv(2, 40, 2, 32, torch.float32)
    lengths = torch.tensor([17, 40], dtype=torch.int32, device=DEVICE)
    mask = torch.arange(40, device=DEVICE)[None, :] < lengths[:, None].long()
    for causal in (True, False):
        a = flash_attention(q, k, v, causal=causal, key_lengths=lengths, precision="fp32")
        b = flash_attention(q, k, v, causal=causal, key_mask=mask, precision="fp32")
        valid = mask.cpu()
        torch.testing.assert_close(a.cpu()[valid], b.cpu()[valid], atol=1e-6, rtol=1e-6)


def test_contiguous_and_strided_inputs_agree():
    qkv, q, k, v = make_qkv(2, 33, 2, 80, torch.float32)
    a = flash_attention(q, k, v, causal=True, precision="fp32")
    b = flash_attention(q.contiguous(), k.contiguous(), v.contiguous(), causal=True, precision="fp32")
    torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


def test_masked_keys_do_not_leak():
    """Changing k, v at masked key positions must not change any output."""
    qkv, q, k, v = make_qkv(2, 33, 2, 32, torch.float32)
    _, key_mask, valid = make_mask("holes", 2, 33)
    a = flash_attention(q, k, v, causal=False, key_mask=key_mask, precision="fp32")
    qkv2 = qkv.clone()
    inv = ~valid.to(DEVICE)
    qkv2[:, :, 1][inv] = 1e4  # k at masked positions
    qkv2[:, :, 2][inv] = -1e4  # v at masked positions
    q2, k2, v2 = qkv2.unbind(2)
    b = flash_attention(q2, k2, v2, causal=False, key_mask=key_mask, precision="fp32")
    torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


def test_key_lengths_int64_and_zero_length():
    _, q, k, v = make_qkv(2, 20, 2, 16, torch.float32)
    lengths = torch.tensor([0, 13], dtype=torch.int64, device=DEVICE)
    out = flash_attention(q, k, v, causal=True, key_lengths=lengths, precision="fp32")
    valid = torch.arange(20)[None, :] < lengths.cpu()[:, None]
    ref = reference_attention(q, k, v, True, valid)
    torch.testing.assert_close(out.cpu().double(), ref, atol=1e-5, rtol=1e-5)
    assert out[0].abs().max().item() == 0.0


def test_non_contiguous_key_mask(assert_close):
    """A [B, S] bool view with a non-unit stride along S (e.g. the transpose of an [S, B] mask) must be read
    by its strides, not as if it were contiguous."""
    B, S = 3, 24
    _, q, k, v = make_qkv(B, S, 2, 16, torch.float32)
    g = torch.Generator().manual_seed(5)
    valid = torch.rand(B, S, generator=g) < 0.6
    valid[:, -1] = True
    key_mask = valid.t().contiguous().to(DEVICE).t()  # [B, S] with strides (1, B)
    assert not key_mask.is_contiguous()
    out = flash_attention(q, k, v, causal=False, key_mask=key_mask, precision="fp32")
    assert_close(out, reference_attention(q, k, v, False, valid), atol=1e-5, rtol=1e-5,
                 what="attention with a transposed (non-contiguous) key_mask")


def test_non_contiguous_key_lengths(assert_close):
    """key_lengths given as a strided view (every other element of a longer tensor) must be read by stride."""
    B, S = 3, 24
    _, q, k, v = make_qkv(B, S, 2, 16, torch.float32)
    backing = torch.tensor([5, 99, 24, 99, 11, 99], dtype=torch.int32, device=DEVICE)
    key_lengths = backing[::2]
    assert not key_lengths.is_contiguous()
    valid = torch.arange(S)[None, :] < key_lengths.cpu()[:, None]
    out = flash_attention(q, k, v, causal=True, key_lengths=key_lengths, precision="fp32")
    assert_close(out, reference_attention(q, k, v, True, valid), atol=1e-5, rtol=1e-5,
                 what="attention with strided key_lengths")


def test_out_argument_is_written_and_returned():
    _, q, k, v = make_qkv(2, 17, 2, 32, torch.float32)
    buf = torch.full((2, 17, 2, 32), float("nan"), device=DEVICE)
    res = flash_attention(q, k, v, causal=True, precision="fp32", out=buf)
    assert res.data_ptr() == buf.data_ptr()
    torch.testing.assert_close(buf.cpu().double(), reference_attention(q, k, v, True), atol=1e-5, rtol=1e-5)


def test_output_dtype_follows_q():
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        _, q, k, v = make_qkv(1, 9, 1, 16, dtype)
        assert flash_attention(q, k, v, causal=True, precision="fp32").dtype == dtype


def test_repeated_calls_do_not_alias():
    _, q, k, v = make_qkv(1, 9, 2, 16, torch.float32)
    a = flash_attention(q, k, v, causal=True, precision="fp32")
    a_copy = a.clone()
    _, q2, k2, v2 = make_qkv(1, 9, 2, 16, torch.float32)
    b = flash_attention(q2, k2, v2, causal=True, precision="fp32")
    assert a.data_ptr() != b.data_ptr()
    assert torch.equal(a, a_copy)


# ----------------------------------------------------------------------------------------------------------
# bad inputs: ValueError / TypeError naming the culprit
# ----------------------------------------------------------------------------------------------------------
def _bad_cases():
    _, q, k, v = make_qkv(2, 8, 2, 16, torch.float32)
    bmask = torch.ones(2, 8, dtype=torch.bool, device=DEVICE)
    lens = torch.full((2,), 8, dtype=torch.int32, device=DEVICE)
    return {
        "q-rank3": ("q", dict(q=q[0], k=k, v=v)),
        "k-rank5": ("k", dict(q=q, k=k[None], v=v)),
        "k-other-S": ("k", dict(q=q, k=k[:, :5], v=v)),
        "v-other-D": ("v", dict(q=q, k=k, v=v[..., :8])),
        "k-other-H": ("k", dict(q=q, k=k[:, :, :1], v=v)),
        "q-not-tensor": ("q", dict(q=q.tolist(), k=k, v=v)),
        "v-int": ("v", dict(q=q, k=k, v=v.to(torch.int32))),
        "q-D-strided": ("q", dict(q=q.transpose(-1, -2), k=k.transpose(-1, -2), v=v.transpose(-1, -2))),
        "key_mask-float": ("key_mask", dict(q=q, k=k, v=v, key_mask=bmask.float())),
        "key_mask-short": ("key_mask", dict(q=q, k=k, v=v, key_mask=bmask[:, :7])),
        "key_mask-batch": ("key_mask", dict(q=q, k=k, v=v, key_mask=torch.ones(3, 8, dtype=torch.bool,
                                                                                 device=DEVICE))),
        "key_mask-rank3": ("key_mask", dict(q=q, k=k, v=v, key_mask=bmask[..., None])),
        "key_lengths-batch": ("key_lengths", dict(q=q, k=k, v=v, key_lengths=torch.ones(3, dtype=torch.int32,
                                                                                         device=DEVICE))),
        "key_lengths-float": ("key_lengths", dict(q=q, k=k, v=v, key_lengths=lens.float())),
        "both-masks": ("key_mask", dict(q=q, k=k, v=v, key_lengths=lens, key_mask=bmask)),
        "precision": ("precision", dict(q=q, k=k, v=v, precision="fp8")),
        "out-shape": ("out", dict(q=q, k=k, v=v, out=torch.empty(2, 8, 2, 8, device=DEVICE))),
    }


@pytest.mark.parametrize("case", sorted(_bad_cases()))
def test_bad_inputs_raise_naming_the_tensor(case):
    name, kw = _bad_cases()[case]
    kw.setdefault("precision", "fp32")
    with pytest.raises((ValueError, TypeError)) as ei:
        flash_attention(kw.pop("q"), kw.pop("k"), kw.pop("v"), causal=True, **kw)
    assert re.search(rf"\b{name}\b", str(ei.value)), f"error does not name {name!r}: {ei.value}"


def test_autotune_candidates_are_pruned_by_shape_and_precision(monkeypatch):
    """The autotuner's early prune: tiles no larger than the sequence, small tiles for big head sizes and for
    exact fp32 (whose compile time per candidate dominated pipeline jobs), large tiles for long sequences, one tile
    for short sequences below a wide grid."""
    import triton

    from shapewise.kernels import attention
    from shapewise.kernels.attention import _prune

    configs = [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=4, num_stages=2)
               for bm, bn in [(128, 128), (128, 64), (64, 64), (64, 32), (32, 32), (16, 32)]]

    def kept(seq, block_d, precision, bh=None):
        return [(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"])
                for c in _prune(configs, {"seq_len": seq, "BH_BUCKET": bh}, BLOCK_D=block_d, PRECISION=precision)]

    assert kept(1024, 32, 2) == [(128, 128), (128, 64), (64, 64), (64, 32), (32, 32), (16, 32)]
    assert kept(40, 32, 2) == [(64, 64), (64, 32), (32, 32), (16, 32)]
    assert kept(128, 32, 2) == [(64, 64), (64, 32)]  # official rows' length: 64-row tiles only
    assert kept(128, 32, 2, bh=256) == [(64, 64)]  # below a wide grid, 64x64 alone (official rows 1-5, 9-11)
    assert kept(128, 32, 2, bh=4096) == [(64, 64), (64, 32)]  # official row 6: timed
    assert kept(128, 256, 2, bh=256) == [(64, 64), (64, 32)]  # head_dim 256 (official row 8): timed
    monkeypatch.setattr(attention, "SHORT_SEQUENCE_WIDE_GRID", None)
    assert kept(128, 32, 2, bh=256) == [(64, 64), (64, 32)]  # the grid switch off: both timed
    assert kept(1024, 32, 2, bh=256) == kept(1024, 32, 2)  # longer sequences: the grid does not prune
    assert kept(1024, 256, 2) == [(64, 64), (64, 32), (32, 32), (16, 32)]
    assert kept(100_000, 64, 3) == [(128, 128), (128, 64), (64, 64), (64, 32)]
    assert kept(1024, 32, 0) == [(64, 32), (32, 32)]
    assert kept(8, 32, 0) == [(16, 32)], "nothing fits: the last candidate is kept"


def test_masked_tiles_carry_their_register_cap(monkeypatch):
    """With a key mask the prune hands the autotuner each tile with its cap from MASKED_MAX_REGISTERS (ptxas would
    give the masked kernel more registers than the unmasked one and fewer programs per SM); without a mask, and for
    tiles without an entry, ptxas decides. The fixed launch of a long sequence passes the same cap."""
    import triton

    from shapewise.kernels import attention
    from shapewise.kernels.attention import MASKED_MAX_REGISTERS, _prune, masked_register_cap

    (bm, bn, block_d, warps, stages), cap = next(iter(MASKED_MAX_REGISTERS.items()))
    configs = [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=warps, num_stages=stages),
               triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=warps, num_stages=stages + 1)]
    masked = _prune(configs, {"seq_len": 512}, BLOCK_D=block_d, PRECISION=2, HAS_KEY_MASK=True)
    assert [c.maxnreg for c in masked] == [cap, None]
    assert [(c.kwargs, c.num_warps, c.num_stages) for c in masked] == [(c.kwargs, c.num_warps, c.num_stages)
                                                                       for c in configs]
    plain = _prune(configs, {"seq_len": 512}, BLOCK_D=block_d, PRECISION=2, HAS_KEY_MASK=False)
    assert [c.maxnreg for c in plain] == [None, None]
    assert masked_register_cap(bm, bn, block_d, warps, stages) == cap
    assert masked_register_cap(bm, bn, 2 * block_d, warps, stages) is None

    launched = []  # the fixed-config launch: the cap goes with a masked call only

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: launched.append(kwargs.get("maxnreg"))

    monkeypatch.setattr(attention, "_attention_fwd", Recorder())
    D = block_d
    _, q, k, v = make_qkv(1, 8, 1, D, torch.float16)
    cfg = {"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": warps, "num_stages": stages}
    flash_attention(q, k, v, causal=True, config=cfg)
    flash_attention(q, k, v, causal=True, config=cfg, key_mask=torch.ones(1, 8, dtype=torch.bool, device=q.device))
    assert launched == [None, cap]


@pytest.mark.parametrize("mask_kind", ["none", "lengths", "holes"])
@pytest.mark.parametrize("budget", [0, 1, 3, None], ids=["one-pair", "tiny", "three-pairs", "all-pairs"])
def test_pairs_taken_in_groups_match_fp64(budget, mask_kind, monkeypatch, assert_close):
    """Every (query block, batch x head) program runs once whatever the groups of the launch's order: one pair a
    group, groups of three pairs of eight (the last one of two), all pairs in one; a ragged last query block."""
    from shapewise.kernels import attention

    B, S, H, D = 2, 45, 4, 16
    per_pair = 2 * S * D * 4  # fp32 keys and values
    monkeypatch.setattr(attention, "L2_GROUP_BYTES", {None: 10**9}.get(budget, (budget or 0) * per_pair))
    want = {0: 1, 1: 1, 3: 3, None: B * H}[budget]
    assert attention.pairs_per_group(B * H, S, D, 4, True) == want
    assert attention.pairs_per_group(B * H, S, D, 4, False) == 1
    run_case(B, S, H, D, True, mask_kind, "fp32", torch.float32, assert_close)


def test_pairs_per_group_follows_the_l2_budget():
    """The official row 13's 256 pairs of 1 024 tokens at head_dim 32 in fp16 (128 KB of keys and values each)
    go 128 at a time; row 14's pairs (25.6 MB each) one at a time; short rows all together."""
    from shapewise.kernels import attention

    assert attention.pairs_per_group(256, 1024, 32, 2, True) == 128
    assert attention.pairs_per_group(512, 100_000, 64, 2, True) == 1
    assert attention.pairs_per_group(256, 128, 32, 2, True) == 256


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_all_true_mask_is_the_unmasked_call(causal):
    """The official harness passes an all-True mask: the kernel takes the unmasked path for it (the per-batch
    prefix summary says so), so the output is the unmasked call's, bit for bit."""
    _, q, k, v = make_qkv(2, 37, 2, 16, torch.float16)
    plain = flash_attention(q, k, v, causal=causal, precision="fp16")
    masked = flash_attention(q, k, v, causal=causal, precision="fp16",
                             key_mask=torch.ones(2, 37, dtype=torch.bool, device=DEVICE))
    assert torch.equal(plain, masked)


def test_prefix_summary_given_or_computed_agree():
    from shapewise.kernels.mask import prefix_lengths

    _, q, k, v = make_qkv(3, 40, 2, 32, torch.float32)
    mask = torch.ones(3, 40, dtype=torch.bool, device=DEVICE)
    mask[0, 25:] = False  # prefix
    mask[1, 5] = False  # hole
    for causal in (True, False):
        a = flash_attention(q, k, v, causal=causal, key_mask=mask, precision="fp32")
        b = flash_attention(q, k, v, causal=causal, key_mask=mask, precision="fp32",
                            mask_prefix_lengths=prefix_lengths(mask))
        assert torch.equal(a, b)
        ref = reference_attention(q, k, v, causal, mask.cpu())
        torch.testing.assert_close(a.cpu().double(), ref.cpu().double(), atol=1e-5, rtol=1e-5)


def test_prefix_summary_needs_its_mask():
    _, q, k, v = make_qkv(2, 8, 1, 16, torch.float32)
    with pytest.raises(ValueError, match="mask_prefix_lengths describes a key_mask"):
        flash_attention(q, k, v, causal=True, mask_prefix_lengths=torch.zeros(2, dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match="mask_prefix_lengths must be int32"):
        flash_attention(q, k, v, causal=True, key_mask=torch.ones(2, 8, dtype=torch.bool, device=DEVICE),
                        mask_prefix_lengths=torch.zeros(3, dtype=torch.int32, device=DEVICE))


def test_long_sequences_take_a_fixed_tile_without_autotuning(monkeypatch):
    """From UNTUNED_FROM_SEQ on, the launcher runs the first long-sequence tile the prune keeps instead of timing
    every candidate at full size; results stay exact."""
    from shapewise.kernels import attention

    assert attention.long_sequence_config(100_000, 64, 2) == {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8,
                                                               "num_stages": 3}
    assert attention.long_sequence_config(100_000, 256, 2)["BLOCK_M"] == 64  # big heads: small tiles
    monkeypatch.setattr(attention, "UNTUNED_FROM_SEQ", 64)
    monkeypatch.setattr(attention, "LONG_SEQUENCE_TILES", ((16, 16, 4, 1),))
    monkeypatch.setattr(attention, "_attention_fwd_tuned", None)  # calling the autotuner now fails
    _, q, k, v = make_qkv(1, 70, 2, 16, torch.float32)
    mask = torch.ones(1, 70, dtype=torch.bool, device=DEVICE)
    mask[0, 5] = False
    out = attention.flash_attention(q, k, v, causal=True, key_mask=mask, precision="fp32")
    ref = reference_attention(q, k, v, True, mask.cpu())
    torch.testing.assert_close(out.cpu().double(), ref.cpu().double(), atol=1e-5, rtol=1e-5)
