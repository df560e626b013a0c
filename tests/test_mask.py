"""kernels/mask.py: the per-batch prefix summary of a valid-token mask, against its torch reference."""

import pytest
import torch

from shapewise.kernels.mask import prefix_lengths, prefix_lengths_reference

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
