"""benchmarks/rounding_budget.py: its emulated forward is the model's computation with no rounding (fp32 against an
fp64 forward, every mask kind), and each class of rounding it names changes the output."""

import pytest
import torch
from model_helpers import build_pair, cfg_of, fp64_forward, make_inputs

from benchmarks import rounding_budget as rb


@pytest.mark.parametrize("mask_kind", ["none", "prefix", "holes"])
def test_without_rounding_it_is_the_model(mask_kind):
    cfg = cfg_of((2, 20, 32, 4, 48, 2))
    ref, _ = build_pair(cfg)
    x, mask = make_inputs(cfg, mask_kind)
    want = fp64_forward(ref.state_dict(), cfg, x, mask).nan_to_num(0.0)
    got = rb.emulated_forward(ref.state_dict(), cfg, x, mask, rounded=set())
    assert (got.double() - want).abs().max().item() < 1e-4


@pytest.mark.parametrize("cls", rb.CLASSES)
def test_each_class_rounds_something(cls):
    cfg = cfg_of((2, 20, 32, 4, 48, 2))
    ref, _ = build_pair(cfg)
    x, mask = make_inputs(cfg, "none")
    exact = rb.emulated_forward(ref.state_dict(), cfg, x, mask, rounded=set())
    assert not torch.equal(rb.emulated_forward(ref.state_dict(), cfg, x, mask, rounded={cls}), exact), cls
