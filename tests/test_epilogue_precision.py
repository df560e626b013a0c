"""benchmarks/epilogue_precision.py: its two emulated forwards are the model's computation (the official tolerance
against an fp64 forward, every mask kind), and folding the LayerNorms into the GEMMs is algebra, not approximation
(in fp64 operands the two agree to rounding)."""

import pytest
import torch
from model_helpers import build_pair, cfg_of, check_official, fp64_forward, make_inputs

from benchmarks import epilogue_precision as ep
from benchmarks import rounding_budget as rb


@pytest.mark.parametrize("mask_kind", ["none", "prefix", "holes"])
@pytest.mark.parametrize("fold", [False, True])
def test_the_emulated_forwards_are_the_models(mask_kind, fold):
    cfg = cfg_of((2, 20, 32, 4, 48, 2))
    ref, _ = build_pair(cfg)
    x, mask = make_inputs(cfg, mask_kind)
    want = fp64_forward(ref.state_dict(), cfg, x, mask).nan_to_num(0.0).float()
    got = ep.emulated_forward(ref.state_dict(), cfg, x, mask, fold=fold)
    check_official(want, got, f"emulated forward, fold={fold}, {mask_kind}")


def test_the_fold_is_exact_without_rounding():
    cfg = cfg_of((2, 20, 32, 4, 48, 2))
    ref, _ = build_pair(cfg)
    x, mask = make_inputs(cfg, "prefix")
    state = {k: v.double() for k, v in ref.state_dict().items()}
    # no rounding beyond fp64's: only the algebra differs
    plain = rb.emulated_forward(state, cfg, x.double(), mask, set(), fold=False, acc=torch.float64)
    folded = rb.emulated_forward(state, cfg, x.double(), mask, set(), fold=True, acc=torch.float64)
    assert (plain - folded).abs().max().item() < 1e-9
