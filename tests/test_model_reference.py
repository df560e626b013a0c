"""BaselineTransformer against an fp64 model written here (independent of shapewise.model)."""


import pytest
import torch
from model_helpers import (
    CFG_MAIN,
    MASK_KINDS,
    build_pair,
    cfg_of,
    fp64_forward,
    make_inputs,
)


@pytest.mark.parametrize("mask_kind", MASK_KINDS)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_baseline_matches_fp64(mask_kind, causal, assert_close):
    cfg = cfg_of(CFG_MAIN, causal)
    ref, _ = build_pair(cfg)
    x, mask = make_inputs(cfg, mask_kind)
    with torch.no_grad():
        y = ref(x, mask)
        e = fp64_forward(ref.state_dict(), cfg, x, mask)
    assert_close(y, e, atol=1e-4, rtol=1e-4, what=f"baseline vs fp64 ({mask_kind}, causal={causal})")
