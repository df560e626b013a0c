"""Autograd: a call with grad mode on and an x that requires grad, or on a training model forced to route `reference`,
runs the reference computation, differentiable, and says so in `last_route`; a training model's other calls with grad
mode on take the inference routes and their output's backward raises, naming the route; eval(), no_grad and
inference_mode calls keep the inference routes, whose output carries no gradient."""

import pytest
import torch
from model_helpers import CFG_SEQ7, CPU_ROUTES, build_pair, cfg_of, make_inputs
from shapewise.model import routing

AUTO_CPU_ROUTE = "sdpa"  # what `auto` picks on a CPU (routing.select_route), an inference route


def _pair64(mask_kind="prefix", route="auto"):
    """The reference and the optimized model on the same weights in float64 (gradients compared to fp64 rounding),
    both in training mode, and inputs. A prefix mask: every query sees a valid key (a query whose keys are all
    masked, as `holes` has under the causal mask, gets NaN gradients from the reference's softmax itself)."""
    cfg = cfg_of(CFG_SEQ7)
    ref, opt = build_pair(cfg, route)
    ref, opt = ref.double().train(), opt.double().train()
    x, mask = make_inputs(cfg, mask_kind, dtype=torch.float64)
    return ref, opt, x, mask


def _grads(model, x, mask, weight):
    """d(sum(out * weight))/dx and /d(every parameter), by name."""
    x = x.detach().clone().requires_grad_(x.requires_grad)
    out = model(x, mask)
    (out * weight).sum().backward()
    return out, x.grad, {name: p.grad for name, p in model.named_parameters()}


def test_auto_route_on_a_cpu_is_an_inference_route():
    cfg = cfg_of(CFG_SEQ7)
    x, _ = make_inputs(cfg, "none")
    route = routing.select_route(cfg, x.dtype, x.device)
    assert route.name == AUTO_CPU_ROUTE


@pytest.mark.parametrize("mask_kind", ["none", "prefix"])
@pytest.mark.parametrize("route, x_requires_grad", [("auto", True), ("reference", False), ("reference", True)],
                         ids=["auto-params+x", "reference-params", "reference-params+x"])
def test_gradients_equal_the_reference(route, x_requires_grad, mask_kind):
    ref, opt, x, mask = _pair64(mask_kind, route)
    x.requires_grad_(x_requires_grad)
    weight = torch.randn(x.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    want_out, want_dx, want = _grads(ref, x, mask, weight)
    out, dx, got = _grads(opt, x, mask, weight)
    assert out.grad_fn is not None
    got_route = opt.last_route
    assert got_route.name == "reference" and got_route.forced == (route == "reference"), str(got_route)
    assert "autograd: " in got_route.reason and ("x requires grad" if x_requires_grad else "training mode") in (
        got_route.reason), str(got_route)
    torch.testing.assert_close(out, want_out, atol=1e-12, rtol=1e-12)
    if x_requires_grad:
        torch.testing.assert_close(dx, want_dx, atol=1e-12, rtol=1e-12)
    assert set(got) == set(want)
    for name, g in got.items():
        assert g is not None, f"no gradient reached {name}"
        torch.testing.assert_close(g, want[name], atol=1e-12, rtol=1e-12, msg=lambda m: f"{name}: {m}")


def test_training_mode_takes_the_inference_route_and_its_backward_raises():
    """A training model, grad mode on, x not requiring grad: the route serves (as an official harness that calls
    neither eval() nor no_grad times it), and a backward through its output raises, naming the route."""
    ref, opt, x, mask = _pair64()
    for _ in range(2):  # the signature's first call, then the known call
        out = opt(x, mask)
        assert opt.last_route.name == AUTO_CPU_ROUTE and out.grad_fn is not None, str(opt.last_route)
        torch.testing.assert_close(out, ref(x, mask).detach(), atol=1e-6, rtol=1e-5)
        with pytest.raises(RuntimeError, match=f"inference route '{AUTO_CPU_ROUTE}', which records no gradient.*"
                                               "route='reference'.*model.eval"):
            out.sum().backward()
    assert all(p.grad is None for p in opt.parameters())


def test_x_requiring_grad_in_eval_mode_gets_its_gradient():
    ref, opt, x, mask = _pair64()
    ref.eval(), opt.eval()
    x.requires_grad_(True)
    weight = torch.randn(x.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    _, want_dx, _ = _grads(ref, x, mask, weight)
    out, dx, _ = _grads(opt, x, mask, weight)
    assert opt.last_route.name == "reference" and "x requires grad" in opt.last_route.reason, str(opt.last_route)
    torch.testing.assert_close(dx, want_dx, atol=1e-12, rtol=1e-12)


def test_eval_mode_without_an_input_requiring_grad_keeps_the_inference_route():
    """eval() means inference: grad mode on, parameters requiring grad, x not: the fast route, no gradient."""
    _, opt, x, mask = _pair64()
    opt.eval()
    assert all(p.requires_grad for p in opt.parameters())
    for _ in range(2):  # the signature's first call, then the known call
        out = opt(x, mask)
        assert opt.last_route.name == AUTO_CPU_ROUTE and out.grad_fn is None, str(opt.last_route)


@pytest.mark.parametrize("context", ["inference_mode", "no_grad"])
def test_training_mode_under_no_grad_or_inference_mode_keeps_the_inference_route(context):
    _, opt, x, mask = _pair64()
    x.requires_grad_(True)
    with getattr(torch, context)():
        out = opt(x, mask)
    assert opt.training and opt.last_route.name == AUTO_CPU_ROUTE and out.grad_fn is None, str(opt.last_route)


def test_known_call_made_without_grad_then_with_grad_records_gradients():
    """The known-call lookup (a signature seen before skips the checks) must not skip the gradient check."""
    ref, opt, x, mask = _pair64()
    with torch.no_grad():
        opt(x, mask)
        opt(x, mask)  # now a known call
    assert opt.last_route.name == AUTO_CPU_ROUTE and opt._known
    x.requires_grad_(True)
    weight = torch.ones(x.shape, dtype=torch.float64)
    _, want_dx, want = _grads(ref, x, mask, weight)
    out, dx, got = _grads(opt, x, mask, weight)
    assert out.grad_fn is not None and opt.last_route.name == "reference", str(opt.last_route)
    torch.testing.assert_close(dx, want_dx, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(got["final_norm.weight"], want["final_norm.weight"], atol=1e-12, rtol=1e-12)
    with torch.no_grad():  # and back: the inference route again
        assert opt(x, mask).grad_fn is None and opt.last_route.name == AUTO_CPU_ROUTE


def test_training_mode_with_frozen_parameters_leaves_the_output_unmarked():
    """Nothing requires grad: no gradient is missing, so the output carries none and nothing raises."""
    _, opt, x, mask = _pair64()
    for p in opt.parameters():
        p.requires_grad_(False)
    out = opt(x, mask)
    assert opt.training and opt.last_route.name == AUTO_CPU_ROUTE and out.grad_fn is None
    opt.layers[0].ffn_in.weight.requires_grad_(True)  # one trainable parameter: the backward refuses
    out = opt(x, mask)
    assert opt.last_route.name == AUTO_CPU_ROUTE and out.grad_fn is not None
    with pytest.raises(RuntimeError, match="records no gradient"):
        out.sum().backward()


@pytest.mark.parametrize("route", CPU_ROUTES)
def test_forced_route_and_gradients(route):
    """A forced `reference` route records gradients (it is the differentiable one); any other forced route refuses a
    call whose x requires grad by name, never replaced, and serves the same call under no_grad."""
    cfg = cfg_of(CFG_SEQ7)
    _, opt = build_pair(cfg, route)
    opt.train()
    x, mask = make_inputs(cfg, "holes")
    if route == "reference":
        out = opt(x, mask)
        assert out.grad_fn is not None and opt.last_route.forced and "autograd" in opt.last_route.reason
        return
    with pytest.raises(routing.RouteUnavailable) as info:
        opt(x.requires_grad_(True), mask)
    message = str(info.value)
    assert repr(route) in message and "records gradients" in message and "model.eval()" in message
    with torch.no_grad():
        opt(x, mask)
    assert opt.last_route.name == route


def test_bad_input_in_training_mode_is_named_before_any_route():
    _, opt, x, _ = _pair64()
    with pytest.raises(TypeError, match="x is torch.float32 but the model's parameters are torch.float64"):
        opt(x.float())
    with pytest.raises(ValueError, match="valid_token_mask"):
        opt(x, torch.ones(x.shape[0], dtype=torch.bool))
    assert opt.last_route is None


def test_a_training_loop_trains_as_the_reference_does():
    """Three SGD steps on the optimized model forced to route `reference`, after it served an inference call (its
    parameters then watched and sharing one version counter): the same weights as three steps on the reference."""
    ref, opt, x, mask = _pair64(route="reference")
    with torch.no_grad():
        opt(x, mask)
    target = torch.randn(x.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    for model in (ref, opt):
        sgd = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(3):
            sgd.zero_grad()
            ((model(x, mask) - target) ** 2).mean().backward()
            sgd.step()
    assert opt.last_route.name == "reference"
    for (name, p), q in zip(opt.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, atol=1e-12, rtol=1e-12, msg=lambda m: f"{name}: {m}")
    with torch.no_grad():  # the inference route sees the trained weights (its softmax in fp32, as the contract's)
        torch.testing.assert_close(opt(x, mask), ref(x, mask), atol=1e-6, rtol=1e-5)
