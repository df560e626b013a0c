"""The fp16 range check of UserOptimizedTransformer: inputs that are not float16 (float32, bfloat16) run fp16 operands
on the kernel routes only while every parameter lies within optimized.FP16_SAFE_ABS; beyond it bf16 operands, and
the route's reason names the parameter. Weight edits are seen on the next call, both ways. CPU: the triton route
under TRITON_INTERPRET=1 (tests/conftest.py sets it when there is no GPU)."""

import pytest
import torch
from model_helpers import CPU_ROUTES, build_pair, cfg_of, make_inputs
from shapewise.model import optimized
from shapewise.model.weights import DerivedWeights

TINY = (2, 7, 32, 2, 64, 2)  # B, S, d, heads, ffn, layers
BIG = "layers.1.ffn_in.weight"  # the parameter the tests push beyond the bound


def _model(dtype, **kw):
    if "triton" not in CPU_ROUTES:
        pytest.skip("the triton route needs TRITON_INTERPRET=1 on a CPU")
    cfg = cfg_of(TINY)
    _, opt = build_pair(cfg, "triton", **kw)
    opt = opt.to(dtype)
    x, mask = make_inputs(cfg, "prefix", dtype)
    return opt, x, mask


def _scale(model, factor):
    with torch.no_grad():
        dict(model.named_parameters())[BIG].mul_(factor)  # in place: the version counter moves


def _beyond(model):
    """The factor that lifts BIG's largest |value| to twice the bound (a power of two: exact in any dtype, and
    undone exactly by its inverse)."""
    peak = dict(model.named_parameters())[BIG].abs().max().item()
    return 2.0 ** (torch.tensor(2 * optimized.FP16_SAFE_ABS / peak).log2().ceil().item())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_weight_beyond_the_bound_gets_bf16_operands_and_back(dtype):
    opt, x, mask = _model(dtype)
    with torch.no_grad():
        y = opt(x, mask)
    assert opt.last_route.precision == "fp16" and y.dtype == dtype, str(opt.last_route)
    factor = _beyond(opt)
    _scale(opt, factor)
    with torch.no_grad():
        y = opt(x, mask)
    route = opt.last_route
    assert route.name == "triton" and route.precision == "bf16", str(route)
    assert BIG in route.reason and "FP16_SAFE_ABS" in route.reason, route.reason
    assert y.dtype == dtype and bool(torch.isfinite(y[mask]).all())
    _scale(opt, 1 / factor)  # restored: fp16 operands again
    with torch.no_grad():
        opt(x, mask)
    assert opt.last_route.precision == "fp16" and BIG not in opt.last_route.reason, str(opt.last_route)


def test_edits_through_data_are_seen_and_after_refresh_weights():
    """A write through `p.data` moves the range check like any other edit; refresh_weights() checks it again."""
    opt, x, mask = _model(torch.bfloat16)
    with torch.no_grad():
        opt(x, mask)
    assert opt.last_route.precision == "fp16"
    p = dict(opt.named_parameters())[BIG]
    p.data.mul_(_beyond(opt))
    with torch.no_grad():
        opt(x, mask)
    assert opt.last_route.precision == "bf16" and BIG in opt.last_route.reason, str(opt.last_route)
    opt.refresh_weights()
    with torch.no_grad():
        opt(x, mask)
    assert opt.last_route.precision == "bf16" and BIG in opt.last_route.reason, str(opt.last_route)


def test_range_is_measured_once_per_weight_version(monkeypatch):
    """The check reads the parameters (a host sync on a GPU) at route selection and after weight edits, never on a
    call that finds the weights unchanged."""
    opt, x, mask = _model(torch.bfloat16)
    calls = []
    measure = DerivedWeights.fp16_offender

    def counted(self, model, versions=None):
        calls.append(self.now(model) != (self.screen or (None,))[0])  # True: a measurement, not the cache
        return measure(self, model, versions)

    monkeypatch.setattr(DerivedWeights, "fp16_offender", counted)
    with torch.no_grad():
        for _ in range(3):
            opt(x, mask)
    assert sum(calls) == 1, calls
    _scale(opt, 1.0)  # a new version with the same values: measured again, the route kept
    route = opt.last_route
    with torch.no_grad():
        opt(x, mask)
        opt(x, mask)
    assert sum(calls) == 2 and opt.last_route == route, calls


def test_caller_precision_wins_and_the_ablation_keeps_fp32(monkeypatch):
    """precision= (float32 inputs) is the caller's choice, not range-checked; reduced_precision off keeps fp32
    operands; float16 inputs are never checked (their weights are fp16 already)."""
    opt, x, mask = _model(torch.float32, precision="fp16")
    _scale(opt, _beyond(opt))
    with torch.no_grad():
        opt(x, mask)
    assert opt.last_route.precision == "fp16" and "set by caller" in opt.last_route.reason, str(opt.last_route)
    opt, x, mask = _model(torch.float32, disable=("reduced_precision",))
    _scale(opt, _beyond(opt))
    with torch.no_grad():
        opt(x, mask)
    assert opt.last_route.precision == "fp32", str(opt.last_route)
    opt, x, mask = _model(torch.float16)
    monkeypatch.setattr(DerivedWeights, "fp16_offender", None)  # would fail if asked
    with torch.no_grad():
        opt(x, mask)
    assert opt.last_route.precision == "fp16"
