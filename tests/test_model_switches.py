"""Routes and ablation switches: forcing a route (argument and environment), refusals, last_route,
each switch off alone."""


import pytest
import torch
from model_helpers import (
    CFG_MAIN,
    CFG_SEQ7,
    CPU_ROUTES,
    build_pair,
    cfg_of,
    check_official,
    make_inputs,
)
from shapewise.kernels import PRECISIONS
from shapewise.model import UserOptimizedTransformer, routing

GPU_ONLY = [n for n in routing.ROUTES if n not in CPU_ROUTES]


@pytest.mark.parametrize("name", GPU_ONLY or ["<none>"])
def test_forced_gpu_route_on_cpu_raises(name):
    if name == "<none>":
        pytest.skip(f"every route in {routing.ROUTES} serves the CPU")
    cfg = cfg_of(CFG_SEQ7)
    _, opt = build_pair(cfg, name)
    x, _ = make_inputs(cfg, "none")
    with pytest.raises(routing.RouteUnavailable) as ei:
        opt(x)
    assert isinstance(ei.value, RuntimeError)
    assert name in str(ei.value), f"RouteUnavailable does not name {name!r}: {ei.value}"


def test_unknown_route_raises_value_error():
    cfg = cfg_of(CFG_SEQ7)
    with pytest.raises(ValueError) as ei:
        m = UserOptimizedTransformer(cfg, route="warp-speed")
        m(make_inputs(cfg, "none")[0])
    assert "warp-speed" in str(ei.value)


@pytest.mark.parametrize("route", CPU_ROUTES)
def test_env_var_forces_route(route, monkeypatch):
    monkeypatch.setenv("SHAPEWISE_ROUTE", route)
    cfg = cfg_of(CFG_SEQ7)
    ref, opt = build_pair(cfg, "auto")
    x, _ = make_inputs(cfg, "none")
    with torch.no_grad():
        y = opt(x)
    assert opt.last_route.name == route
    check_official(ref(x), y, f"SHAPEWISE_ROUTE={route}")


def test_env_var_unknown_route(monkeypatch):
    monkeypatch.setenv("SHAPEWISE_ROUTE", "warp-speed")
    cfg = cfg_of(CFG_SEQ7)
    with pytest.raises(ValueError) as ei:
        m = UserOptimizedTransformer(cfg)
        m(make_inputs(cfg, "none")[0])
    assert "warp-speed" in str(ei.value)


@pytest.mark.parametrize("name", GPU_ONLY or ["<none>"])
def test_env_var_gpu_route_on_cpu_raises(name, monkeypatch):
    if name == "<none>":
        pytest.skip(f"every route in {routing.ROUTES} serves the CPU")
    monkeypatch.setenv("SHAPEWISE_ROUTE", name)
    cfg = cfg_of(CFG_SEQ7)
    _, opt = build_pair(cfg, "auto")
    with pytest.raises(routing.RouteUnavailable) as ei:
        opt(make_inputs(cfg, "none")[0])
    assert name in str(ei.value)


def test_last_route_names_the_route():
    cfg = cfg_of(CFG_SEQ7)
    _, opt = build_pair(cfg, "auto")
    with torch.no_grad():
        opt(make_inputs(cfg, "none")[0])
    r = opt.last_route
    assert isinstance(r, routing.Route)
    assert r.name in str(r) and r.name in routing.ROUTES and r.name in CPU_ROUTES
    assert r.precision in PRECISIONS and r.reason
    d = r.as_dict()
    assert d["name"] == r.name and "precision" in d and "reason" in d
    import json

    json.dumps(d)


def _optimization_names():
    from shapewise.model import optimized

    return list(getattr(optimized, "OPTIMIZATIONS", ()))


KERNEL_ROUTES = [r for r in CPU_ROUTES if r not in ("reference", "sdpa")]  # the routes the switches act on


@pytest.mark.parametrize("route", KERNEL_ROUTES or ["<none>"])
@pytest.mark.parametrize("name", _optimization_names() or ["<none>"])
def test_each_ablation_switch_stays_correct(name, route):
    """Each optimization turned off alone still gives the reference's output, on each kernel route."""
    if name == "<none>" or route == "<none>":
        pytest.skip("model.optimized.OPTIMIZATIONS is empty or no kernel route serves the CPU")
    cfg = cfg_of(CFG_MAIN)
    ref, opt = build_pair(cfg, route, disable=(name,))
    x, mask = make_inputs(cfg, "holes")
    with torch.no_grad():
        try:
            y = opt(x, mask)
        except routing.RouteUnavailable as e:
            # a forced route may refuse what a switch takes away (e.g. one kernel per layer needs fp16/bf16
            # operands): the refusal must say which route
            assert route in str(e), f"RouteUnavailable does not name {route!r}: {e}"
            return
        check_official(ref(x, mask), y, f"route={route} disable={name}")
    assert opt.last_route.name == route


@pytest.mark.parametrize("route", KERNEL_ROUTES or ["<none>"])
def test_switches_a_route_does_not_use_change_nothing(route):
    """model.optimized.switches_used: turning off a switch it leaves out gives bit-identical outputs on the
    same route (which is why the ablation job records those as not applicable instead of timing them)."""
    from shapewise.model.optimized import OPTIMIZATIONS, switches_used

    if route == "<none>":
        pytest.skip("no kernel route serves the CPU")
    cfg = cfg_of(CFG_SEQ7)
    ref, opt = build_pair(cfg, route)
    x, mask = make_inputs(cfg, "holes")
    with torch.no_grad():
        y = opt(x, mask)
    used = switches_used(opt.last_route, x.dtype, x.device.type)
    assert "reduced_precision" in used and set(used) < set(OPTIMIZATIONS)
    for name in OPTIMIZATIONS:
        if name in used:
            continue
        _, other = build_pair(cfg, route, disable=(name,))
        with torch.no_grad():
            assert torch.equal(other(x, mask), y), f"route {route}: switching off unused {name} changed the output"
        assert other.last_route.name == opt.last_route.name


def test_switches_used_per_route():
    from shapewise.model.optimized import switches_used
    from shapewise.model.routing import Route

    f32 = torch.float32
    assert switches_used(Route("sdpa", "fp32", "r"), f32, "cuda") == ()
    assert switches_used(Route("fused", "fp16", "r"), f32, "cuda") == (
        "fused_layer", "cuda_graph", "reduced_precision", "direct_input")
    assert switches_used(Route("fused", "fp16", "r"), torch.float16, "cpu") == ("fused_layer",)
    assert switches_used(Route("graph", "fp16", "r"), f32, "cuda") == (
        "cuda_graph", "reduced_precision", "flash_attention", "fused_layernorm", "packed_qkv", "direct_input")
    assert switches_used(Route("triton", "fp16", "r", attention="sdpa"), f32, "cuda") == (
        "reduced_precision", "fused_layernorm", "packed_qkv")
    assert switches_used(Route("graph", "fp16", "r", split_layer=True), f32, "cuda") == (
        "cuda_graph", "reduced_precision", "flash_attention", "packed_qkv", "direct_input", "split_layer")
    assert switches_used(Route("triton", "bf16", "r", split_layer=True), torch.bfloat16, "cuda") == (
        "flash_attention", "packed_qkv", "split_layer")
    assert switches_used(Route("graph", "fp16", "r", split_layer=True, eager_tail=True), f32, "cuda") == (
        "cuda_graph", "reduced_precision", "flash_attention", "packed_qkv", "eager_tail", "direct_input",
        "split_layer")


def test_env_disable_unknown_name(monkeypatch):
    monkeypatch.setenv("SHAPEWISE_DISABLE", "no-such-optimization")
    cfg = cfg_of(CFG_SEQ7)
    with pytest.raises(ValueError) as ei:
        m = UserOptimizedTransformer(cfg)
        m(make_inputs(cfg, "none")[0])
    assert "no-such-optimization" in str(ei.value)
