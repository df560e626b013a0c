"""Parameters and state: names, strict loading, weight edits after the first forward, output aliasing,
global flags."""

import copy

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
from shapewise.model import BaselineTransformer, UserOptimizedTransformer
from shapewise.model.weights import WatchedParameter


def expected_param_names(L):
    names = set()
    for i in range(L):
        for n in ("norm1", "norm2", "attention.q_proj", "attention.k_proj", "attention.v_proj", "attention.out_proj",
                  "ffn_in", "ffn_out"):
            names |= {f"layers.{i}.{n}.weight", f"layers.{i}.{n}.bias"}
    return names | {"final_norm.weight", "final_norm.bias"}


def test_state_dict_keys_and_strict_load():
    cfg = cfg_of(CFG_MAIN)
    ref = BaselineTransformer(cfg)
    opt = UserOptimizedTransformer(cfg)
    assert set(ref.state_dict().keys()) == expected_param_names(cfg.num_layers)
    assert list(opt.state_dict().keys()) == list(ref.state_dict().keys())
    for k, v in ref.state_dict().items():
        assert opt.state_dict()[k].shape == v.shape, k
    opt.load_state_dict(ref.state_dict(), strict=True)
    ref.load_state_dict(opt.state_dict(), strict=True)
    assert {n for n, _ in opt.named_parameters()} == expected_param_names(cfg.num_layers)


@pytest.mark.parametrize("route", CPU_ROUTES)
def test_in_place_weight_edit_after_first_forward(route):
    """Caches (packed qkv weights etc.) must notice an in-place edit of a parameter."""
    cfg = cfg_of(CFG_MAIN)
    ref, opt = build_pair(cfg, route)
    x, mask = make_inputs(cfg, "prefix")
    with torch.no_grad():
        first = opt(x, mask).clone()
        for name in ("layers.0.attention.k_proj.weight", "layers.1.norm2.weight", "layers.0.ffn_in.bias"):
            dict(opt.named_parameters())[name].mul_(1.5).add_(0.05)
        fresh = BaselineTransformer(cfg).eval()
        fresh.load_state_dict(opt.state_dict(), strict=True)
        second = opt(x, mask)
        check_official(fresh(x, mask), second, f"route={route} after in-place edit")
    assert not torch.allclose(first, second), "output did not change after the weights changed"


@pytest.mark.parametrize("route", CPU_ROUTES)
def test_load_state_dict_after_first_forward(route):
    cfg = cfg_of(CFG_SEQ7)
    ref, opt = build_pair(cfg, route)
    x, _ = make_inputs(cfg, "none")
    with torch.no_grad():
        opt(x)
        other = BaselineTransformer(cfg).eval()
        opt.load_state_dict(other.state_dict(), strict=True)
        check_official(other(x), opt(x), f"route={route} after load_state_dict")


@pytest.mark.parametrize("route", CPU_ROUTES)
def test_load_state_dict_assign_after_first_forward(route):
    """`load_state_dict(..., assign=True)` swaps in new Parameter objects (whose version counters may equal
    the old ones): the next forward must use the new weights."""
    cfg = cfg_of(CFG_SEQ7)
    ref, opt = build_pair(cfg, route)
    x, _ = make_inputs(cfg, "none")
    with torch.no_grad():
        opt(x)
        torch.manual_seed(123)
        other = BaselineTransformer(cfg).eval()
        opt.load_state_dict({k: v.clone() for k, v in other.state_dict().items()}, strict=True, assign=True)
        check_official(other(x), opt(x), f"route={route} after load_state_dict(assign=True)")


@pytest.mark.parametrize("route", CPU_ROUTES)
def test_parameter_data_swap_after_first_forward(route):
    """`param.data = new_tensor` (a common way to set weights) after the first forward."""
    cfg = cfg_of(CFG_SEQ7)
    ref, opt = build_pair(cfg, route)
    x, _ = make_inputs(cfg, "none")
    with torch.no_grad():
        opt(x)
        torch.manual_seed(321)
        for name, p in opt.named_parameters():
            if name.endswith("v_proj.weight") or name.endswith("ffn_out.weight"):
                p.data = torch.randn_like(p) * 0.2
        fresh = BaselineTransformer(cfg).eval()
        fresh.load_state_dict(opt.state_dict(), strict=True)
        check_official(fresh(x), opt(x), f"route={route} after param.data swap")
    held = opt._weights  # the weight check's aliases follow the parameters' storages: none holds a replaced one
    watched = [p.data_ptr() for p in opt.parameters() if isinstance(p, WatchedParameter)]
    if held.shared:  # one counter for every parameter: one alias reads it
        watched = watched[:1]
    assert [a.data_ptr() for a in held.aliases] == (watched if held.params else [])


@pytest.mark.parametrize("route", CPU_ROUTES)
def test_swap_tensors_then_refresh_weights(route):
    """`torch.utils.swap_tensors` on a parameter is an edit the weight check does not see (model/weights.py says
    so): after `refresh_weights()` the forward runs the swapped-in weights."""
    cfg = cfg_of(CFG_SEQ7)
    ref, opt = build_pair(cfg, route)
    x, _ = make_inputs(cfg, "none")
    with torch.no_grad():
        opt(x)
        torch.manual_seed(7)
        p = opt.layers[-1].ffn_in.weight
        torch.utils.swap_tensors(p, torch.nn.Parameter(torch.randn_like(p) * 0.2))
        opt.refresh_weights()
        fresh = BaselineTransformer(cfg).eval()
        fresh.load_state_dict(opt.state_dict(), strict=True)
        check_official(fresh(x), opt(x), f"route={route} after swap_tensors and refresh_weights")


@pytest.mark.parametrize("route", CPU_ROUTES)
def test_a_model_built_in_inference_mode_keeps_plain_data(route):
    """Parameters created under torch.inference_mode carry no version counter: `.data` reads and `p.data = t` work
    on them after the first forward as on the reference, and a swapped storage is seen by its address."""
    cfg = cfg_of(CFG_SEQ7)
    ref, _ = build_pair(cfg, route)
    x, _ = make_inputs(cfg, "none")
    with torch.inference_mode():  # its parameters' in-place loads too (PyTorch's rule for inference tensors)
        opt = UserOptimizedTransformer(cfg, route=route).eval()
        opt.load_state_dict(ref.state_dict(), strict=True)
        opt(x)
        w = opt.layers[0].ffn_out.weight
        assert w.data.shape == w.shape and type(w) is torch.nn.Parameter
        w.data = torch.randn_like(w) * 0.2
        fresh = BaselineTransformer(cfg).eval()
        fresh.load_state_dict(opt.state_dict(), strict=True)
        check_official(fresh(x), opt(x), f"route={route}, inference-mode parameters, after param.data swap")


@pytest.mark.parametrize("route", CPU_ROUTES)
def test_write_through_data_after_first_forward(route):
    """`m.layers[0].attention.k_proj.weight.data.copy_(w)` after the first forward: the next one runs the new
    weights, a copy of the model too; a `.data` read that writes nothing leaves the output as it was, and the
    parameters stay nn.Parameters with the same names, values and repr."""
    cfg = cfg_of(CFG_SEQ7)
    ref, opt = build_pair(cfg, route)
    x, mask = make_inputs(cfg, "prefix")
    with torch.no_grad():
        first = opt(x, mask).clone()
        k = opt.layers[0].attention.k_proj.weight
        assert k.data.abs().sum() > 0  # a read: the derived weights are built again, the output stays
        assert torch.equal(opt(x, mask), first)
        w = torch.randn_like(k)
        opt.layers[0].attention.k_proj.weight.data.copy_(w)
        fresh = BaselineTransformer(cfg).eval()
        fresh.load_state_dict(opt.state_dict(), strict=True)
        second = opt(x, mask)
        check_official(fresh(x, mask), second, f"route={route} after a write through .data")
        assert not torch.allclose(first, second), "output did not change after the weights changed"
        twin = copy.deepcopy(opt)
        twin(x, mask)
        v = twin.layers[0].ffn_in.bias
        v.data.copy_(torch.randn_like(v))
        fresh.load_state_dict(twin.state_dict(), strict=True)
        check_official(fresh(x, mask), twin(x, mask), f"route={route}, a deep copy, after a write through .data")
    assert isinstance(k, torch.nn.Parameter) and k.requires_grad
    assert repr(k) == repr(torch.nn.Parameter(k.detach().clone()))
    assert list(opt.state_dict()) == list(ref.state_dict())


@pytest.mark.parametrize("route", CPU_ROUTES)
def test_outputs_do_not_alias(route):
    cfg = cfg_of(CFG_SEQ7)
    _, opt = build_pair(cfg, route)
    x1, _ = make_inputs(cfg, "none", seed=1)
    x2, _ = make_inputs(cfg, "none", seed=2)
    with torch.no_grad():
        y1 = opt(x1)
        keep = y1.clone()
        x1_before = x1.clone()
        y2 = opt(x2)
    assert torch.equal(y1, keep), "output of call 1 changed by call 2"
    assert y1.data_ptr() != y2.data_ptr()
    assert torch.equal(x1, x1_before), "forward modified its input"


@pytest.mark.parametrize("route", CPU_ROUTES)
def test_global_flags_untouched(route):
    cfg = cfg_of(CFG_SEQ7)
    _, opt = build_pair(cfg, route)
    x, _ = make_inputs(cfg, "none")
    flags = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
             torch.get_float32_matmul_precision(), torch.is_grad_enabled())
    opt(x)
    assert flags == (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
                     torch.get_float32_matmul_precision(), torch.is_grad_enabled())


def _counter_moves(opt, edit) -> bool:
    """Whether `edit()` moves the model's weight identity as the per-call check reads it."""
    weights = opt._weights
    before = weights.now(opt)
    edit()
    return weights.now(opt) != before


def test_the_weight_check_reads_one_counter_and_every_seen_edit_moves_it():
    """Constructed, every parameter shares one version counter: with the derived tables built (every parameter
    watched) the check reads one integer, and each edit the weights module lists as seen moves it, also after a
    conversion."""
    cfg = cfg_of(CFG_MAIN)
    opt = UserOptimizedTransformer(cfg)
    from shapewise.model.weights import per_layer

    opt._weights.table(opt, "fp16", per_layer)
    assert opt._weights.shared and isinstance(opt._weights.now(opt), int)
    params = dict(opt.named_parameters())
    other = BaselineTransformer(cfg)
    with torch.no_grad():
        assert _counter_moves(opt, lambda: params["layers.1.ffn_out.bias"].mul_(2))
        assert _counter_moves(opt, lambda: params["final_norm.weight"].data.copy_(torch.ones(cfg.d_model)))
        assert _counter_moves(opt, lambda: setattr(params["layers.0.norm1.bias"], "data", torch.zeros(cfg.d_model)))
        assert _counter_moves(opt, lambda: opt.load_state_dict(other.state_dict()))
        assert not _counter_moves(opt, lambda: None)
        opt.to(torch.float64)  # a conversion swaps every storage and keeps the counter
        opt._weights.table(opt, "fp16", per_layer)
        assert opt._weights.shared and isinstance(opt._weights.now(opt), int)
        assert _counter_moves(opt, lambda: dict(opt.named_parameters())["layers.0.ffn_in.weight"].add_(1))
    assert all(p.data_ptr() != q.data_ptr() for p, q in zip(opt.parameters(), list(opt.parameters())[1:]))


@pytest.mark.parametrize("how", ["deepcopy", "assign"])
def test_parameters_that_do_not_share_the_counter_are_walked(how):
    """A deep copy, or `load_state_dict(assign=True)`, brings parameters with counters of their own: the check walks
    them one by one, and an edit of any one is still seen by the forward."""
    cfg = cfg_of(CFG_SEQ7)
    ref, opt = build_pair(cfg, "sdpa")
    x, _ = make_inputs(cfg, "none")
    from shapewise.model.weights import per_layer

    if how == "deepcopy":
        opt = copy.deepcopy(opt)
    else:
        opt.load_state_dict({k: v.clone() for k, v in ref.state_dict().items()}, strict=True, assign=True)
    opt._weights.table(opt, "fp16", per_layer)
    assert not opt._weights.shared and isinstance(opt._weights.now(opt), tuple)
    with torch.no_grad():
        assert _counter_moves(opt, lambda: dict(opt.named_parameters())["layers.0.attention.v_proj.bias"].add_(1))
