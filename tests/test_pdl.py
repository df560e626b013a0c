"""Programmatic dependent launch (kernels/pdl.py): which routes take it, that a forward's first kernel never does,
that the interpreter refuses it, and on the GPU that it changes no output bit.

CPU: the routing rule (`routing.with_pdl`), the switch, each launcher's refusal under TRITON_INTERPRET=1, and the
route runners' pdl flags per kernel recorded with stand-in kernels. GPU (`pytest -m gpu tests/test_pdl.py`): every
PDL route's output equals, bit for bit, the output of the same model with `pdl` switched off, with and without a
mask, eager and captured, and after a weight edit between calls.
"""
from dataclasses import replace

import pytest
import torch
from test_fused_layer import weights

from shapewise.kernels import INTERPRET
from shapewise.model import TransformerConfig, UserOptimizedTransformer, routing
from shapewise.model.optimized import OPTIMIZATIONS, switches_used
from shapewise.model.reference import LAYER_NORM_EPS as EPS
from shapewise.model.routing import ROUTE_SPECS, Route, with_pdl
from shapewise.report.report_data import route_label

HOPPER, AMPERE = (9, 0), (8, 0)


@pytest.mark.parametrize("name", ["triton", "graph", "fused"])
def test_kernel_routes_take_pdl_from_sm90(name):
    route = Route(name, "fp16", "r")
    on = with_pdl(route, HOPPER)
    assert on.pdl and "programmatic dependent launch" in on.reason
    assert with_pdl(route, (10, 0)).pdl
    assert with_pdl(route, AMPERE) == route
    assert with_pdl(route, None) == route


@pytest.mark.parametrize("name", ["reference", "sdpa", "hopper"])
def test_routes_without_pdl_kernels_stay_as_they_are(name):
    route = Route(name, "fp16", "r")
    assert with_pdl(route, HOPPER) == route
    assert not ROUTE_SPECS[name].pdl


def test_policy_null_turns_pdl_off(monkeypatch):
    monkeypatch.setitem(routing.POLICY, "pdl", {"min_capability": None})
    assert not with_pdl(Route("graph", "fp16", "r"), HOPPER).pdl


def test_pdl_is_an_ablation_switch_of_the_routes_that_use_it():
    assert "pdl" in OPTIMIZATIONS
    f32 = torch.float32
    on = Route("graph", "fp16", "r", split_layer=True, pdl=True)
    assert "pdl" in switches_used(on, f32, "cuda")
    assert "pdl" not in switches_used(replace(on, pdl=False), f32, "cuda")
    assert route_label(str(on)) == "graph/fp16 split-layer pdl"
    assert " pdl " in str(on)


def test_cpu_model_never_asks_for_pdl():
    cfg = TransformerConfig(batch_size=2, seq_len=9, d_model=32, num_heads=2, ffn_dim=48, num_layers=2, causal=True)
    model = UserOptimizedTransformer(cfg, route="triton").eval()
    with torch.no_grad():
        model(torch.randn(2, 9, 32), torch.ones(2, 9, dtype=torch.bool))
    assert not model.last_route.pdl


@pytest.mark.skipif(not INTERPRET, reason="the kernels run compiled here: there is no interpreter to refuse PDL")
def test_every_launcher_refuses_pdl_under_the_interpreter():
    from shapewise.kernels.attention import flash_attention
    from shapewise.kernels.fused_layer import fused_layer, ln_qkv
    from shapewise.kernels.layer_tail import layer_tail
    from shapewise.kernels.layernorm import add_layernorm

    B, S, d, H = 1, 16, 32, 2
    x, w = torch.randn(B, S, d), weights(d, 32, torch.float16)
    q = torch.randn(B, S, H, d // H).half()
    calls = {
        "ln_qkv": lambda: ln_qkv(x, w, pdl=True, eps=EPS),
        "flash_attention": lambda: flash_attention(q, q, q, causal=True, pdl=True),
        "layer_tail": lambda: layer_tail(x.half(), x, w, pdl=True, eps=EPS),
        "fused_layer": lambda: fused_layer(x, w, num_heads=H, causal=True, pdl=True, eps=EPS),
        "add_layernorm": lambda: add_layernorm(x, None, w["n1_w"], w["n1_b"], pdl=True, eps=EPS),
    }
    for name, call in calls.items():
        with pytest.raises(ValueError, match=f"{name}: pdl=True needs a CUDA GPU"):
            call()


class _Recorder:
    """Stands in for one kernel launcher: records the pdl flag of each launch, returns `make(args)`."""

    def __init__(self, log, name, make):
        self.log, self.name, self.make = log, name, make

    def __call__(self, *args, pdl=False, **kwargs):
        self.log.append((self.name, pdl))
        return self.make(args, kwargs)


CFG = TransformerConfig(batch_size=2, seq_len=16, d_model=32, num_heads=2, ffn_dim=32, num_layers=3, causal=True)


def _model():
    torch.manual_seed(0)
    return UserOptimizedTransformer(CFG).eval()


@pytest.mark.parametrize("masked", [False, True])
def test_split_layer_launches_all_but_the_first_kernel_with_pdl(masked):
    from shapewise.model import route_triton

    model = _model()
    runner = route_triton.runner(model, Route("graph", "fp16", "r", split_layer=True, pdl=True))
    log = []
    B, S, d = 2, 16, 32
    qkv = torch.zeros(B, S, 3 * d)
    prefix = torch.zeros(B, dtype=torch.int32)
    runner.ln_qkv = _Recorder(log, "ln_qkv", lambda a, k: (qkv, prefix) if k.get("mask") is not None else qkv)
    runner.flash_attention = _Recorder(log, "attention", lambda a, k: torch.zeros(B, S, 2, d // 2))
    runner.layer_tail = _Recorder(log, "tail", lambda a, k: torch.zeros(B, S, d))
    mask = torch.ones(B, S, dtype=torch.bool) if masked else None
    runner(model, torch.zeros(B, S, d), mask)
    assert log[0] == ("ln_qkv", False)
    assert all(pdl for _, pdl in log[1:]) and len(log) == 3 * CFG.num_layers


def test_fused_route_launches_all_but_the_first_layer_with_pdl():
    from shapewise.model import route_fused

    model = _model()
    runner = route_fused.runner(model, Route("fused", "fp16", "r", launch=(16, 4, 1), pdl=True))
    log = []
    runner.fused_layer = _Recorder(log, "layer", lambda a, k: torch.zeros(2, 16, 32))
    runner(model, torch.zeros(2, 16, 32), None)
    assert [pdl for _, pdl in log] == [False] + [True] * (CFG.num_layers - 1)


@pytest.mark.parametrize("masked", [False, True])
def test_unfused_route_launches_none_of_the_first_kernels_with_pdl(masked):
    from shapewise.model import route_triton

    model = _model()
    runner = route_triton.runner(model, Route("triton", "fp16", "r", pdl=True))
    log = []
    B, S, d = 2, 16, 32
    runner.add_layernorm = _Recorder(log, "add_ln", lambda a, k: (torch.zeros(B, S, d), torch.zeros(B, S, d).half()))
    runner.flash_attention = _Recorder(log, "attention", lambda a, k: torch.zeros(B, S, 2, d // 2).half())
    runner.prefix_lengths = lambda m: torch.full((B,), S, dtype=torch.int32)
    runner(model, torch.zeros(B, S, d), torch.ones(B, S, dtype=torch.bool) if masked else None)
    assert log[0] == ("add_ln", False)
    assert all(pdl for _, pdl in log[1:]) and len(log) == 1 + 3 * CFG.num_layers


# ----------------------------------------------------------------------------------------------
# GPU: PDL changes no bit of any output
# ----------------------------------------------------------------------------------------------
# (config fields, forced route): split layer captured and eager, the fused route (with keys and values precomputed
# by a kernel of their own in one case), and the unfused layer (cuBLAS GEMMs between our kernels)
GPU_CASES = {
    "graph-split": (dict(batch_size=8, seq_len=128, d_model=128, num_heads=4, ffn_dim=128, num_layers=4), "graph"),
    "triton-split": (dict(batch_size=3, seq_len=77, d_model=64, num_heads=2, ffn_dim=96, num_layers=3), "triton"),
    "fused": (dict(batch_size=64, seq_len=32, d_model=128, num_heads=4, ffn_dim=128, num_layers=4), "fused"),
    "fused-kv": (dict(batch_size=16, seq_len=100, d_model=64, num_heads=4, ffn_dim=64, num_layers=3), "fused"),
    "unfused": (dict(batch_size=4, seq_len=64, d_model=256, num_heads=4, ffn_dim=512, num_layers=2), "graph"),
}


def _pair(fields, route):
    cfg = TransformerConfig(causal=True, **fields)
    torch.manual_seed(0)
    on = UserOptimizedTransformer(cfg, route=route).cuda().eval()
    off = UserOptimizedTransformer(cfg, route=route, disable=("pdl",)).cuda().eval()
    off.load_state_dict(on.state_dict(), strict=True)
    return cfg, on, off


@pytest.mark.gpu
@pytest.mark.parametrize("case", sorted(GPU_CASES))
@pytest.mark.parametrize("mask_kind", ["none", "all-true", "padded"])
def test_pdl_changes_no_output_bit(case, mask_kind, monkeypatch):
    fields, route = GPU_CASES[case]
    if case == "fused-kv":
        launch = [{**e, "kv_precompute": True} for e in routing.POLICY["fused"]["launch"]]
        monkeypatch.setitem(routing.POLICY, "fused", {**routing.POLICY["fused"], "launch": launch})
    cfg, on, off = _pair(fields, route)
    B, S, d = cfg.batch_size, cfg.seq_len, cfg.d_model
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(B, S, d, device="cuda", generator=g)
    mask = None
    if mask_kind != "none":
        mask = torch.ones(B, S, dtype=torch.bool, device="cuda")
        if mask_kind == "padded":
            lengths = torch.randint(1, S + 1, (B,), device="cuda", generator=g)
            mask = torch.arange(S, device="cuda")[None, :] < lengths[:, None]
            mask[0, S // 3] = False  # a hole: no prefix
    with torch.no_grad():
        for _ in range(3):  # the first call, the copy-in graph, the direct graph (captured routes)
            y_on, y_off = on(x, mask), off(x, mask)
            assert on.last_route.pdl and not off.last_route.pdl, (on.last_route, off.last_route)
            assert torch.equal(y_on, y_off), f"{case} {mask_kind}: max |diff| {(y_on - y_off).abs().max().item()}"
        for model in (on, off):  # a weight edit between calls: the forward's first kernel reads the new weights
            model.layers[0].ffn_in.weight.mul_(0.5)
        assert torch.equal(on(x, mask), off(x, mask))
