"""Drop-in use: a foreign config object, the package's exports, weights written through .data, the
constructor's route against the environment, the fused route's precomputed keys and values."""

import dataclasses
from types import SimpleNamespace

import pytest
import torch
from model_helpers import (
    CFG_SEQ7,
    OFFICIAL,
    build_pair,
    cfg_of,
    check_official,
    make_inputs,
)
from shapewise import model
from shapewise.model import (
    BaselineTransformer,
    TransformerConfig,
    UserOptimizedTransformer,
    compare_outputs,
    routing,
)


@dataclasses.dataclass
class ForeignConfig:
    batch_size: int = 2
    seq_len: int = 7
    d_model: int = 48
    num_heads: int = 3
    ffn_dim: int = 80
    num_layers: int = 1
    causal: bool = True
    vocab: int = 123  # extra fields are ignored


@pytest.mark.parametrize("cfg_obj", [ForeignConfig(), SimpleNamespace(**{**vars(ForeignConfig()), "causal": False})],
                         ids=["dataclass", "namespace"])
def test_drop_in_foreign_config(cfg_obj):
    torch.manual_seed(1)
    ref = BaselineTransformer(cfg_obj).to("cpu", torch.float32).eval()
    opt = UserOptimizedTransformer(cfg_obj).to("cpu", torch.float32).eval()
    opt.load_state_dict(ref.state_dict(), strict=True)
    x = torch.randn(2, 7, 48)
    mask = torch.tensor([[True] * 7, [True] * 4 + [False] * 3])
    with torch.inference_mode():
        r = ref(x, mask)
        y = opt(x, mask)
    check_official(r, y, "drop-in")
    assert isinstance(opt.config, TransformerConfig) or hasattr(opt.config, "d_model")


def test_model_package_exports():
    for name in ("TransformerConfig", "BaselineTransformer", "UserOptimizedTransformer", "generate_random_case",
                 "compare_outputs", "TOLERANCES"):
        assert hasattr(model, name), name


@pytest.mark.parametrize("route", ["triton", "fused"])
def test_writes_through_data_are_seen(route):
    """`p.data.copy_(t)` after the first forward (how many users load weights): PyTorch does not count it on the
    parameter's version counter, the model's watched parameters do, so the next forward runs the new weights;
    `refresh_weights()` after it changes nothing."""
    cfg = cfg_of(CFG_SEQ7)
    ref, opt = build_pair(cfg, route)
    x, _ = make_inputs(cfg, "none")
    with torch.no_grad():
        opt(x)
        w = opt.layers[0].ffn_out.weight
        w.data.copy_(torch.randn_like(w))
        ref.load_state_dict(opt.state_dict(), strict=True)
        seen = opt(x)
        check_official(ref(x), seen, f"route={route} after a write through .data")
        opt.refresh_weights()
        assert torch.equal(opt(x), seen)


def test_a_data_tensor_kept_across_forwards_needs_refresh_weights():
    """The limit of that: a `.data` tensor taken before a forward and written after it is a write the model cannot
    see (docs: model/weights.py); refresh_weights() rebuilds the derived weights from it."""
    cfg = cfg_of(CFG_SEQ7)
    ref, opt = build_pair(cfg, "triton")
    x, _ = make_inputs(cfg, "none")
    with torch.no_grad():
        w = opt.layers[0].ffn_out.weight.data  # taken before the forward
        opt(x)
        w.copy_(torch.randn_like(w))
        ref.load_state_dict(opt.state_dict(), strict=True)
        stale = compare_outputs(ref(x), opt(x), rtol=OFFICIAL["rtol"], atol=OFFICIAL["atol"])
        assert stale.failed_elements > 0
        opt.refresh_weights()
        check_official(ref(x), opt(x), "after refresh_weights()")


def test_constructor_route_wins_over_env(monkeypatch):
    """SHAPEWISE_ROUTE applies to route="auto"; an explicit constructor route is not overridden."""
    monkeypatch.setenv("SHAPEWISE_ROUTE", "reference")
    cfg = cfg_of(CFG_SEQ7)
    assert UserOptimizedTransformer(cfg).route == "reference"
    assert UserOptimizedTransformer(cfg, route="sdpa").route == "sdpa"


@pytest.mark.parametrize("mask_kind", ["none", "holes"])
def test_fused_route_with_precomputed_keys_and_values(monkeypatch, mask_kind):
    """A policy entry with kv_precompute runs the fused route as _ln_kv_fwd + the layer kernel per layer: the
    whole model still matches the reference (official comparator), and the route says which ran."""

    launch = [{**e, "kv_precompute": True} for e in routing.POLICY["fused"]["launch"]]
    monkeypatch.setitem(routing.POLICY, "fused", {**routing.POLICY["fused"], "launch": launch})
    cfg = cfg_of(CFG_SEQ7)
    ref, opt = build_pair(cfg, "fused")
    x, mask = make_inputs(cfg, mask_kind)
    with torch.no_grad():
        out = opt(x, mask)
        assert opt.last_route.kv_precompute, str(opt.last_route)
        check_official(ref(x, mask), out, f"fused kv_precompute mask={mask_kind}")
