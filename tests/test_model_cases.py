"""The contract's inputs (generate_random_case) and comparator (compare_outputs, TOLERANCES)."""

import math

import pytest
import torch
from model_helpers import cfg_of
from shapewise.model import TOLERANCES, compare_outputs, describe_comparison, generate_random_case


def test_generate_random_case_reproducible_and_padded():
    cfg = cfg_of((4, 33, 32, 2, 64, 1))
    a, ma = generate_random_case(cfg, "cpu", torch.float32, seed=5, padding_ratio=0.5)
    b, mb = generate_random_case(cfg, "cpu", torch.float32, seed=5, padding_ratio=0.5)
    c, _ = generate_random_case(cfg, "cpu", torch.float32, seed=6, padding_ratio=0.5)
    assert torch.equal(a, b) and torch.equal(ma, mb)
    assert not torch.equal(a, c)
    assert a.shape == (4, 33, 32) and ma.shape == (4, 33) and ma.dtype == torch.bool
    lengths = ma.sum(1)
    low = max(1, round(33 * 0.5))
    assert ((lengths >= low) & (lengths <= 33)).all()
    # prefix masks: valid positions are exactly [0, length)
    assert torch.equal(ma, torch.arange(33)[None, :] < lengths[:, None])
    assert a[~ma].abs().max().item() == 0.0, "padded rows are not zeroed"
    assert a[ma].abs().min().item() >= 0 and a[ma].std().item() > 0.5


def test_generate_random_case_no_padding_and_scale():
    cfg = cfg_of((2, 16, 32, 2, 64, 1))
    x, m = generate_random_case(cfg, "cpu", torch.float32, seed=3)
    assert m is None
    y, _ = generate_random_case(cfg, "cpu", torch.float32, seed=3, input_scale=4.0)
    torch.testing.assert_close(y, 4.0 * x)
    h, _ = generate_random_case(cfg, "cpu", torch.float16, seed=3)
    assert h.dtype == torch.float16
    torch.testing.assert_close(h.float(), x, atol=1e-3, rtol=1e-3)
    # independent of the global RNG
    torch.manual_seed(99)
    x2, _ = generate_random_case(cfg, "cpu", torch.float32, seed=3)
    assert torch.equal(x, x2)


def test_generate_random_case_generator_device():
    """generator_device="device" draws with a generator on the target device: on the CPU that is the CPU draw
    itself (padding included); an unknown value is refused by name."""
    cfg = cfg_of((3, 17, 16, 2, 32, 1))
    a, ma = generate_random_case(cfg, "cpu", torch.float32, seed=11, padding_ratio=0.4)
    b, mb = generate_random_case(cfg, "cpu", torch.float32, seed=11, padding_ratio=0.4, generator_device="device")
    assert torch.equal(a, b) and torch.equal(ma, mb)
    with pytest.raises(ValueError, match="generator_device"):
        generate_random_case(cfg, "cpu", torch.float32, seed=11, generator_device="gpu")


def test_generate_random_case_seed_determines_x_directly():
    """x = randn(B, S, d) * input_scale from a generator seeded with `seed` (contract)."""
    cfg = cfg_of((2, 5, 8, 2, 16, 1))
    x, _ = generate_random_case(cfg, "cpu", torch.float32, seed=1234)
    g = torch.Generator().manual_seed(1234)
    torch.testing.assert_close(x, torch.randn(2, 5, 8, generator=g), atol=0, rtol=0)


def test_compare_outputs_counts_and_worst_index():
    ref = torch.tensor([[1.0, 100.0, 0.0, 1.0], [1.0, 2.0, float("nan"), 5.0]])
    opt = ref.clone()
    opt[0, 0] = 1.0 + 0.0015  # |d| = 1.5e-3 <= atol 2e-3: passes on atol (rtol*|ref| = 0.02 also covers it)
    opt[0, 1] = 100.0 + 1.5  # |d| = 1.5 > atol, <= rtol*100 = 2: passes on rtol only
    opt[0, 2] = 0.0 + 0.0019  # ref 0: passes on atol only
    opt[0, 3] = 1.0 + 0.03  # |d| = 0.03 > 2e-3 and > 0.02: fails
    opt[1, 1] = float("inf")  # not finite: fails
    # [1, 2]: NaN in reference and in optimized: both must be finite -> fails
    opt[1, 2] = float("nan")
    opt[1, 3] = 5.0 + 0.2  # fails, the largest finite error
    c = compare_outputs(ref, opt, rtol=2e-2, atol=2e-3)
    assert c.total_elements == 8
    assert c.failed_elements == 4
    assert not c.passed
    # the worst failing element: a non-finite one (inf or NaN) ranks above any finite error
    assert tuple(c.worst_index) in {(1, 1), (1, 2)}
    assert math.isclose(c.max_abs_error, 1.5, rel_tol=1e-9)  # over the finite pairs
    d = c.as_dict()
    assert d["failed_elements"] == 4 and isinstance(d["worst_index"], list)


def test_compare_outputs_rule_boundaries():
    ref = torch.tensor([10.0, 10.0, 0.001, -3.0])
    opt = torch.tensor([10.19, 10.21, 0.0029, -3.0 + 0.061])
    c = compare_outputs(ref, opt, rtol=2e-2, atol=2e-3)
    # 10.19: 0.19 <= 0.2 passes; 10.21: 0.21 > 0.2 fails; 0.0029: 0.0019 <= atol passes; -2.939: 0.061 > 0.06 fails
    assert c.failed_elements == 2
    assert tuple(c.worst_index) == (1,), "worst failing element is the one with the largest error (0.21)"
    ok = compare_outputs(ref, ref.clone(), rtol=0.0, atol=0.0)
    assert ok.passed and ok.failed_elements == 0 and ok.max_abs_error == 0.0
    only_nan_opt = compare_outputs(ref, torch.tensor([10.0, float("nan"), 0.001, -3.0]), rtol=2e-2, atol=2e-3)
    assert only_nan_opt.failed_elements == 1 and tuple(only_nan_opt.worst_index) == (1,)
    with pytest.raises(ValueError):
        compare_outputs(ref, ref[:3], rtol=2e-2, atol=2e-3)


def test_tolerances_constants():
    assert TOLERANCES == {"official": {"atol": 2e-3, "rtol": 2e-2}, "strict": {"atol": 1e-3, "rtol": 1e-2}}


def test_compare_outputs_refuses_an_output_that_is_not_a_plain_tensor():
    """A torch.Tensor subclass could answer the comparison's own arithmetic (its __torch_function__): it is refused
    by name, on either side."""

    class Agreeable(torch.Tensor):
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            return torch.zeros(())

    ref = torch.randn(2, 3, 4)
    forged = (ref + 1.0).as_subclass(Agreeable)
    for args in ((ref, forged), (forged, ref)):
        with pytest.raises(TypeError, match="Agreeable, not a plain torch.Tensor"):
            compare_outputs(*args, rtol=0.02, atol=0.002)
    assert compare_outputs(ref, ref.clone(), rtol=0.02, atol=0.002).passed


def test_non_finite_elements_are_counted_and_named():
    """An optimized output of NaN (or inf) fails with its non-finite elements counted and named in the sentence,
    never "max abs error 0" alone (the errors cover the finite pairs only)."""
    ref = torch.zeros(2, 3)
    all_nan = compare_outputs(ref, torch.full((2, 3), float("nan")), rtol=2e-2, atol=2e-3)
    assert not all_nan.passed and all_nan.failed_elements == 6 and all_nan.nonfinite_elements == 6
    assert all_nan.max_abs_error == 0.0  # nothing finite to measure
    assert all_nan.describe() == ("6 of 6 elements outside the tolerance, 6 of them non-finite (NaN or inf in the "
                                  "reference or the optimized output); no finite pair to measure an error on")
    opt = ref.clone()
    opt[0, 0], opt[0, 1], opt[1, 2] = float("inf"), float("nan"), 0.5
    some = compare_outputs(ref, opt, rtol=2e-2, atol=2e-3)
    assert some.failed_elements == 3 and some.nonfinite_elements == 2 and some.as_dict()["nonfinite_elements"] == 2
    assert some.describe().startswith("3 of 6 elements outside the tolerance, 2 of them non-finite")
    assert some.describe().endswith("max abs error over the finite pairs 0.5")
    close = compare_outputs(ref, ref + 1e-3, rtol=2e-2, atol=2e-3)
    assert close.passed and close.nonfinite_elements == 0
    assert close.describe() == "0 of 6 elements outside the tolerance (max abs error 0.001)"
    # a sum of several comparisons (as a job adds its trials up) reads the same way
    summed = {k: all_nan.as_dict()[k] + close.as_dict()[k]
              for k in ("failed_elements", "nonfinite_elements", "total_elements")}
    assert describe_comparison({**summed, "max_abs_error": 0.001}).startswith(
        "6 of 12 elements outside the tolerance, 6 of them non-finite")
