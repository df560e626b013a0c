"""Bad inputs and configs raise errors that name the culprit; NaN propagates like the reference."""

import re
from types import SimpleNamespace

import pytest
import torch
from model_helpers import (
    CFG_MAIN,
    CFG_SEQ7,
    CPU_ROUTES,
    OFFICIAL,
    check_official,
    build_pair,
    cfg_of,
    make_inputs,
)
from shapewise.model import (
    BaselineTransformer,
    TransformerConfig,
    UserOptimizedTransformer,
)


def _bad_input_cases(cfg):
    B, S, d = cfg.batch_size, cfg.seq_len, cfg.d_model
    x = torch.randn(B, S, d)
    ok_mask = torch.ones(B, S, dtype=torch.bool)
    return {
        "x-rank2": ("x", (x[0], None)),
        "x-rank4": ("x", (x[None], None)),
        "x-width": ("x|d_model", (torch.randn(B, S, d + 1), None)),
        "x-int": ("x", (x.to(torch.int64), None)),
        "x-list": ("x", (x.tolist(), None)),
        "mask-shape": ("valid_token_mask", (x, ok_mask[:, :-1])),
        "mask-rank": ("valid_token_mask", (x, ok_mask[..., None])),
        "mask-dtype": ("valid_token_mask", (x, ok_mask.float())),
        "mask-device": ("valid_token_mask|device", (x, ok_mask.to("meta"))),
    }


@pytest.mark.parametrize("which", ["baseline", "optimized"])
@pytest.mark.parametrize("case", sorted(_bad_input_cases(cfg_of(CFG_SEQ7))))
def test_bad_inputs_raise_naming_the_culprit(which, case):
    cfg = cfg_of(CFG_SEQ7)
    name, (x, mask) = _bad_input_cases(cfg)[case]
    m = BaselineTransformer(cfg) if which == "baseline" else UserOptimizedTransformer(cfg)
    with pytest.raises((ValueError, TypeError)) as ei:
        m(x, mask)
    assert re.search(name, str(ei.value)), f"error does not name {name!r}: {ei.value}"


@pytest.mark.parametrize("field,value", [
    ("num_heads", 5),  # 64 % 5 != 0
    ("batch_size", 0), ("seq_len", -1), ("d_model", 0), ("num_heads", 0), ("ffn_dim", 0), ("num_layers", 0),
])
@pytest.mark.parametrize("which", ["config", "baseline", "optimized"])
def test_bad_config_raises_naming_the_field(field, value, which):
    fields = dict(zip(("batch_size", "seq_len", "d_model", "num_heads", "ffn_dim", "num_layers"), CFG_MAIN))
    fields[field] = value
    ns = SimpleNamespace(**fields, causal=True)
    with pytest.raises((ValueError, TypeError)) as ei:
        if which == "config":
            TransformerConfig(**vars(ns)).validate()
        elif which == "baseline":
            BaselineTransformer(ns)
        else:
            UserOptimizedTransformer(ns)
    assert field in str(ei.value), f"error does not name {field!r}: {ei.value}"


@pytest.mark.parametrize("route", CPU_ROUTES)
@pytest.mark.parametrize("mask_kind", ["none", "prefix", "holes"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_nan_propagates_like_reference(route, mask_kind, causal):
    """A NaN in one valid token of x: the reference's output is NaN exactly on the rows that attend to it
    (and finite elsewhere); the optimized model must give the same NaN pattern (no crash, no NaN hidden
    as a number, no NaN leaking into rows that cannot see the token)."""
    cfg = cfg_of(CFG_SEQ7, causal)
    ref, opt = build_pair(cfg, route)
    x, mask = make_inputs(cfg, mask_kind)
    if mask is not None:
        mask[0, 3] = True  # the poisoned token is valid
        mask[0, 5] = False
    x[0, 3, 5] = float("nan")
    with torch.no_grad():
        r = ref(x, mask)
        y = opt(x, mask)
    assert torch.isnan(r).any()
    assert torch.equal(torch.isnan(y), torch.isnan(r)), (
        f"NaN pattern differs: reference NaN rows {torch.isnan(r).any(-1).nonzero().tolist()}, "
        f"optimized {torch.isnan(y).any(-1).nonzero().tolist()}")
    fin = ~torch.isnan(r)
    torch.testing.assert_close(y[fin], r[fin], atol=OFFICIAL["atol"], rtol=OFFICIAL["rtol"])


@pytest.mark.parametrize("route", CPU_ROUTES)
def test_input_sliced_along_d_model(route):
    """x whose last dimension has a stride other than 1 (a view into a wider tensor) is a valid input on every
    route (forced ones included) and gives the contiguous input's result."""
    cfg = cfg_of(CFG_SEQ7)
    ref, opt = build_pair(cfg, route)
    x, mask = make_inputs(cfg, "prefix")
    wide = torch.zeros(*x.shape[:2], 2 * x.shape[2])
    wide[..., ::2] = x
    sliced = wide[..., ::2]
    assert sliced.stride(-1) == 2 and torch.equal(sliced, x)
    with torch.no_grad():
        assert torch.equal(opt(sliced, mask), opt(x, mask))
        check_official(ref(x, mask), opt(sliced, mask), f"route={route}, x sliced along d_model")


@pytest.mark.parametrize("route", CPU_ROUTES)
@pytest.mark.parametrize("x_dtype, model_dtype", [(torch.float64, torch.float32), (torch.bfloat16, torch.float32),
                                                  (torch.float32, torch.float16)])
def test_dtype_mix_is_one_clear_error_on_every_route(route, x_dtype, model_dtype):
    cfg = cfg_of(CFG_SEQ7)
    _, opt = build_pair(cfg, route)
    opt = opt.to(model_dtype)
    x, _ = make_inputs(cfg, "none")
    with pytest.raises(TypeError) as info:
        opt(x.to(x_dtype))
    message = str(info.value)
    assert str(x_dtype) in message and str(model_dtype) in message and "Supported: float32, float16 and bfloat16" in message


@pytest.mark.parametrize("x_dtype, model_dtype", [(torch.float64, torch.float32), (torch.bfloat16, torch.float32),
                                                  (torch.float32, torch.float16)])
def test_reference_names_a_dtype_mix_before_any_work(x_dtype, model_dtype, monkeypatch):
    """The reference refuses x in another dtype than its parameters by name (not "mixed dtype (CPU)" from inside
    LayerNorm), before any layer runs, with the optimized model's wording (one check, reference.py's)."""
    cfg = cfg_of(CFG_SEQ7)
    ref, _ = build_pair(cfg)
    ref = ref.to(model_dtype)
    x, _ = make_inputs(cfg, "none")
    monkeypatch.setattr(type(ref.layers[0]), "forward", lambda *a: pytest.fail("a layer ran before the check"))
    with pytest.raises(TypeError) as info:
        ref(x.to(x_dtype))
    assert str(info.value) == (f"BaselineTransformer: x is {x_dtype} but the model's parameters are {model_dtype}; "
                               f"pass x in the parameters' dtype or convert the model with .to(dtype)")


@pytest.mark.parametrize("route", CPU_ROUTES)
def test_dtype_mix_after_a_conversion_is_the_same_error(route):
    """The dtype is checked on a signature's first call: a model converted after serving float32 inputs refuses
    them on the next call (the conversion forgets what was planned)."""
    cfg = cfg_of(CFG_SEQ7)
    _, opt = build_pair(cfg, route)
    x, _ = make_inputs(cfg, "none")
    with torch.no_grad():
        opt(x)
        opt.to(torch.float16)
        with pytest.raises(TypeError, match="x is torch.float32 but the model's parameters are torch.float16"):
            opt(x)


@pytest.mark.parametrize("route", ["reference", "sdpa"])
def test_float64_model_on_the_eager_routes(route):
    """float64 x with float64 parameters: the reference and sdpa routes serve it (the Triton routes refuse by name).
    The contract's softmax is fp32 whatever the input dtype, so the routes agree to fp32 rounding, not fp64's."""
    cfg = cfg_of(CFG_SEQ7)
    ref, opt = build_pair(cfg, route)
    ref, opt = ref.double(), opt.double()
    x, mask = make_inputs(cfg, "holes")
    with torch.no_grad():
        torch.testing.assert_close(opt(x.double(), mask), ref(x.double(), mask), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("route", CPU_ROUTES)
def test_x_on_another_device_than_the_parameters_is_a_clear_error(route):
    """x on `meta` (or any device but the parameters') is refused before any route runs, naming both devices; a
    model on `meta` still serves `meta` inputs (shapes only), as the reference does."""
    cfg = cfg_of(CFG_SEQ7)
    _, opt = build_pair(cfg, route)
    x = torch.randn(cfg.batch_size, cfg.seq_len, cfg.d_model, device="meta")
    mask = torch.ones(cfg.batch_size, cfg.seq_len, dtype=torch.bool, device="meta")
    for args in ((x,), (x, mask)):
        with pytest.raises(ValueError, match=r"x is on meta .* parameters are on cpu"):
            opt(*args)
    assert opt.last_route is None and opt.last_memory_plan is None
    if route in ("reference", "sdpa"):
        meta = UserOptimizedTransformer(cfg, route=route).to("meta").eval()
        y = meta(x, mask)
        assert y.device.type == "meta" and y.shape == x.shape
        assert BaselineTransformer(cfg).to("meta")(x, mask).shape == y.shape


@pytest.mark.parametrize("model_device, x_device", [("cpu", "meta"), ("meta", "cpu")])
def test_reference_names_x_on_another_device_before_any_work(model_device, x_device, monkeypatch):
    """x on another device than the reference's parameters: one ValueError naming both devices, before any layer
    runs (not "Tensor on device cpu is not on the expected device meta!" from inside a matmul)."""
    cfg = cfg_of(CFG_SEQ7)
    ref = BaselineTransformer(cfg).to(model_device)
    x = torch.randn(cfg.batch_size, cfg.seq_len, cfg.d_model, device=x_device)
    monkeypatch.setattr(type(ref.layers[0]), "forward", lambda *a: pytest.fail("a layer ran before the check"))
    with pytest.raises(ValueError, match=rf"^BaselineTransformer: x is on {x_device}\b.* but the model's parameters "
                                         rf"are on {model_device}; pass x on {model_device}"):
        ref(x)
