"""Route `megakernel` inside the model: forced and picked by the policy, refused loudly where it cannot serve, its
switch in the ablation, its stacked weights refreshed after an edit (its memory plan: test_memory's streamed forwards). The route's outputs against
the reference on every mask kind and dtype are checked with every other CPU route (test_model_routes,
test_model_inputs); the kernel alone in tests/test_megakernel.py."""

import pytest
import torch
from shapewise.model import routing
from shapewise.model.optimized import OPTIMIZATIONS, RouteUnavailable, switches_used

from model_helpers import CFG_MAIN, CPU_ROUTES, build_pair, cfg_of, check_official, fp64_forward, make_inputs

pytestmark = pytest.mark.skipif("megakernel" not in CPU_ROUTES,
                                reason="the megakernel route does not serve a CPU tensor here (TRITON_INTERPRET unset)")
SHAPE = routing.Shape(batch_size=64, seq_len=128, d_model=128, num_heads=4, ffn_dim=128, num_layers=4, causal=True)


def test_policy_leaves_it_off_and_picks_it_where_it_says(monkeypatch):
    cuda = torch.device("cuda")
    assert routing.select_route(SHAPE, torch.float32, cuda, "general").name != "megakernel"
    monkeypatch.setitem(routing.POLICY, "megakernel", {**routing.POLICY["megakernel"],
                                                       "max_seq_len_x_d_model": 128 * 128})
    route = routing.select_route(SHAPE, torch.float32, cuda, "general")
    assert route.name == "megakernel" and not route.forced
    assert route.launch == tuple(routing.POLICY["megakernel"]["launch"].values())
    assert "whole forward in one kernel" in str(route)
    off = routing.select_route(SHAPE, torch.float32, cuda, "general", allow_megakernel=False)
    assert off.name != "megakernel"
    wide = routing.Shape(**{**SHAPE.__dict__, "seq_len": 256})
    assert routing.select_route(wide, torch.float32, cuda, "general").name != "megakernel"


def test_forced_route_names_the_limit():
    wide = routing.Shape(**{**SHAPE.__dict__, "seq_len": 1024})
    with pytest.raises(RouteUnavailable, match="seq_len \\* d_model"):
        routing.select_route(wide, torch.float32, torch.device("cpu"), "general", forced="megakernel")


def test_switch_is_in_the_ablation_and_a_forced_route_without_it_fails_loudly():
    assert "megakernel" in OPTIMIZATIONS
    route = routing.select_route(SHAPE, torch.float32, torch.device("cpu"), "general", forced="megakernel")
    assert "megakernel" in switches_used(route, torch.float32, "cpu")
    cfg = cfg_of(CFG_MAIN)
    x, mask = make_inputs(cfg, "holes")
    _, opt = build_pair(cfg, "megakernel", disable=("megakernel",))
    with pytest.raises(RouteUnavailable, match="megakernel optimization is disabled"):
        opt(x, mask)
    _, exact = build_pair(cfg, "megakernel", disable=("reduced_precision",))
    with pytest.raises(RouteUnavailable, match="fp16 or bf16 operands"):
        exact(x, mask)


@pytest.mark.parametrize("edit", ["copy_", "data_copy_", "load_state_dict"])
def test_weight_edits_after_a_call_are_seen(edit):
    cfg = cfg_of(CFG_MAIN)
    ref, opt = build_pair(cfg, "megakernel")
    x, mask = make_inputs(cfg, "prefix")
    with torch.no_grad():
        opt(x, mask)
        w = torch.randn_like(opt.layers[1].attention.v_proj.weight) * 0.2
        if edit == "copy_":
            opt.layers[1].attention.v_proj.weight.copy_(w)
        elif edit == "data_copy_":
            opt.layers[1].attention.v_proj.weight.data.copy_(w)
        else:
            state = ref.state_dict()
            state["layers.1.attention.v_proj.weight"] = w
            opt.load_state_dict(state)
        y = opt(x, mask)
    assert opt.last_route.name == "megakernel"
    check_official(fp64_forward(opt.state_dict(), cfg, x, mask), y, f"megakernel after {edit}")
