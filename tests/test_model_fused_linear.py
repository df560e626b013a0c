"""The triton route's unfused layer with fused GEMMs (kernels/fused_linear.py, `Route.fused_linear`) against the
reference under the interpreter: every mask kind, fp32 and fp16 inputs, its switches, and the policy that leaves it
off unless it names a width."""

from dataclasses import replace

import pytest
import torch
from model_helpers import CFG_MAIN, CFG_SEQ7, CPU_ROUTES, MASK_KINDS, build_pair, cfg_of, check_official, make_inputs
from shapewise.model import TransformerConfig, routing
from shapewise.model.optimized import OPTIMIZATIONS, switches_used
from shapewise.model.route_triton import working_set

pytestmark = pytest.mark.skipif("triton" not in CPU_ROUTES,
                                reason="the triton route does not serve a CPU tensor here (TRITON_INTERPRET unset)")


@pytest.fixture
def fused_policy(monkeypatch):
    """The policy with fused GEMMs from d_model 16 and no split layer (which would take these widths)."""
    monkeypatch.setitem(routing.POLICY, "split_layer", {"max_d_model": None, "min_tokens": None})
    monkeypatch.setitem(routing.POLICY, "fused_linear", {"min_d_model": 16})


@pytest.mark.parametrize("mask_kind", MASK_KINDS)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_fused_linear_route_matches_baseline(mask_kind, causal, fused_policy):
    cfg = cfg_of(CFG_MAIN, causal)
    ref, opt = build_pair(cfg, "triton")
    x, mask = make_inputs(cfg, mask_kind)
    x_before = x.clone()
    with torch.no_grad():
        r, y = ref(x, mask), opt(x, mask)
    route = opt.last_route
    assert route.fused_linear and not route.split_layer and "fused-linear" in str(route), route
    assert torch.equal(x, x_before), "the forward wrote into its input"
    check_official(r, y, f"fused linear, mask={mask_kind} causal={causal}")
    if mask is not None and (~mask).any():
        assert y[~mask].abs().max().item() == 0.0, "invalid rows are not exactly zero"


def test_fused_linear_route_fp16_input(fused_policy, assert_close):
    """fp16 model and input: the residual stream becomes fp32 before the first fused epilogue adds to it; within
    fp16's tolerance of the fp32 reference on the same rounded weights (as tests/test_model_routes.py measures it)."""
    cfg = cfg_of(CFG_SEQ7)
    ref, opt = build_pair(cfg, "triton")
    opt = opt.to(torch.float16)
    ref.load_state_dict({k: v.half().float() for k, v in ref.state_dict().items()}, strict=True)
    x, mask = make_inputs(cfg, "left", torch.float16)
    with torch.no_grad():
        truth, y = ref(x.float(), mask), opt(x, mask)
    assert opt.last_route.fused_linear and y.dtype == torch.float16
    assert_close(y, truth, atol=1e-2, rtol=2e-2, what="fused linear, fp16 model and input")


@pytest.mark.parametrize("switch", ["fused_linear", "packed_qkv", "reduced_precision"])
def test_fused_linear_needs_its_switches(switch, fused_policy):
    """Each switch the fused GEMMs need, turned off, runs cuBLAS GEMMs instead (and says why); still exact."""
    cfg = cfg_of(CFG_SEQ7)
    ref, opt = build_pair(cfg, "triton", disable=(switch,))
    x, mask = make_inputs(cfg, "holes")
    with torch.no_grad():
        r, y = ref(x, mask), opt(x, mask)
    assert not opt.last_route.fused_linear and "no fused linear" in opt.last_route.reason, opt.last_route
    check_official(r, y, f"fused linear off by {switch}")


def test_policy_decides_where(monkeypatch):
    """Off in the committed policy; on from `fused_linear.min_d_model` for fp16 operands and widths the kernel takes
    (multiples of 16), never beside the split layer; its switch counts where it runs."""
    wide = TransformerConfig(batch_size=4, seq_len=256, d_model=1024, num_heads=4, ffn_dim=1024, num_layers=2)
    assert routing.POLICY["fused_linear"]["min_d_model"] is None
    assert not routing.select_route(wide, torch.float32, "cuda").fused_linear
    monkeypatch.setitem(routing.POLICY, "fused_linear", {"min_d_model": 1024})
    route = routing.select_route(wide, torch.float32, "cuda")
    assert route.name in ("graph", "triton") and route.fused_linear and "d_model >= 1024" in route.reason
    assert "fused_linear" in switches_used(route, torch.float32, "cuda") and "fused_linear" in OPTIMIZATIONS
    assert working_set(wide, torch.float32, route) > working_set(wide, torch.float32, replace(route, fused_linear=False))
    narrow = TransformerConfig(batch_size=4, seq_len=256, d_model=512, num_heads=4, ffn_dim=1024, num_layers=2)
    assert not routing.select_route(narrow, torch.float32, "cuda").fused_linear
    odd = TransformerConfig(batch_size=4, seq_len=256, d_model=1024, num_heads=4, ffn_dim=1000, num_layers=2)
    assert not routing.select_route(odd, torch.float32, "cuda").fused_linear
    monkeypatch.setitem(routing.POLICY, "fused_linear", {"min_d_model": 16})
    small = TransformerConfig(batch_size=2, seq_len=8, d_model=64, num_heads=4, ffn_dim=96, num_layers=1)
    split = routing.select_route(small, torch.float32, "cpu", forced="triton", interpret=True)
    assert split.split_layer and not split.fused_linear  # the committed policy splits d_model 64
