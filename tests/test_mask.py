"""kernels/mask.py: the per-batch prefix summary of a valid-token mask, against its torch reference."""

import pytest
import torch
import triton
import triton.language as tl

from shapewise.kernels.mask import first_mask_block, prefix_length_of_row, prefix_lengths, prefix_lengths_reference

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def masks(S):
    """Named [B, S] masks covering every case of the summary."""
    g = torch.Generator().manual_seed(S)
    pos = torch.arange(S)
    lengths = torch.randint(0, S + 1, (5,), generator=g)
    out = {
        "all-true": torch.ones(3, S, dtype=torch.bool),
        "all-false": torch.zeros(2, S, dtype=torch.bool),
        "prefix": pos[None, :] < lengths[:, None],
        "left": pos[None, :] >= (S - lengths)[:, None],
        "holes": torch.rand(4, S, generator=g) < 0.5,
    }
    if S > 2:
        one_hole = torch.ones(2, S, dtype=torch.bool)
        one_hole[0, S // 2] = False  # valid after an invalid token: no prefix
        one_hole[1, -1] = False  # a prefix of length S - 1
        out["one-hole"] = one_hole
    return out


@pytest.mark.parametrize("S", [1, 7, 33, 2500])  # 2500: several blocks of the kernel's loop
def test_prefix_lengths_match_reference(S):
    for name, mask in masks(S).items():
        got = prefix_lengths(mask.to(DEVICE)).cpu()
        want = prefix_lengths_reference(mask)
        assert got.dtype == torch.int32
        assert torch.equal(got, want), f"S={S} {name}: {got.tolist()} != {want.tolist()}"


@triton.jit
def _summary_kernel(Mask, Out, stride_mb, seq_len, BLOCK: tl.constexpr, ONE_REDUCTION: tl.constexpr):
    row = Mask + tl.program_id(0).to(tl.int64) * stride_mb
    first = first_mask_block(row, seq_len, BLOCK, True)
    tl.store(Out + tl.program_id(0), prefix_length_of_row(row, seq_len, first, BLOCK, ONE_REDUCTION))


@pytest.mark.parametrize("one_reduction", [False, True], ids=["count-and-min", "one-reduction"])
@pytest.mark.parametrize("S", [1, 7, 33, 100])
def test_both_ways_of_summarizing_a_row_agree(S, one_reduction):
    """prefix_length_of_row either way (a count and a minimum; one reduction of the last valid and the first invalid
    position, fused_layer.SUMMARY_ONE_REDUCTION), over 16-position blocks so that its loop runs on S > 16."""
    for name, mask in masks(S).items():
        m = mask.to(DEVICE).contiguous().view(torch.int8)
        got = torch.full((mask.shape[0],), -7, dtype=torch.int32, device=DEVICE)
        _summary_kernel[(mask.shape[0],)](m, got, m.stride(0), S, BLOCK=16, ONE_REDUCTION=one_reduction,
                                          num_warps=1)
        want = prefix_lengths_reference(mask)
        assert torch.equal(got.cpu(), want), f"S={S} {name}: {got.cpu().tolist()} != {want.tolist()}"


def test_prefix_lengths_known_values():
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [0, 1, 1, 1], [1, 0, 1, 0], [0, 0, 0, 0]], dtype=torch.bool)
    assert prefix_lengths(mask.to(DEVICE)).cpu().tolist() == [3, 4, -1, -1, 0]


def test_non_contiguous_mask():
    base = torch.rand(6, 40) < 0.5
    base[::2, :20] = True
    base[::2, 20:] = False
    mask = base.t().contiguous().t()  # same values, column-major storage
    assert not mask.is_contiguous()
    assert torch.equal(prefix_lengths(mask.to(DEVICE)).cpu(), prefix_lengths_reference(base))


@pytest.mark.parametrize("bad", [torch.ones(2, 3), torch.ones(2, 3, 4, dtype=torch.bool), "mask"])
def test_bad_mask_is_named(bad):
    with pytest.raises(ValueError, match="prefix_lengths: mask must be a bool"):
        prefix_lengths(bad)
